"""config.json <-> ModelConfig for Qwen3-MoE, DeepSeek-V3 and Mixtral (see fnmoe/hf/__init__.py).

Reading accepts both config dialects and refuses, naming the option, anything fnmoe does not
implement; writing emits the transformers-5 dialect for the one architecture that represents a
ModelConfig exactly.

Legend: no tensors here; `hf` is a config.json dict.
"""
from __future__ import annotations

from typing import Any

import torch

from fnmoe.config import ModelConfig, MoEConfig, validate_model

MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3",
               "MixtralForCausalLM": "mixtral"}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


# ---------------------------------------------------------------- config.json -> ModelConfig

def _get(hf: dict, key: str, default: Any = ...) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise ValueError(f"config.json: missing '{key}'")
    return default


def _require(hf: dict, key: str, allowed: tuple, default: Any, where: str = "") -> None:
    value = hf.get(key, default)
    if value not in allowed:
        raise ValueError(f"config.json: unsupported option '{where}{key}'={value!r} (fnmoe supports {list(allowed)})")


def architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in MODEL_TYPES]
    if len(archs) != 1 or not known:
        raise ValueError(f"config.json: unknown 'architectures'={archs!r} (fnmoe loads one of {sorted(MODEL_TYPES)})")
    return known[0]


def _rope_fields(hf: dict, default_theta: float) -> dict[str, Any]:
    """ModelConfig's RoPE fields from either dialect."""
    params = hf.get("rope_parameters")
    where = "rope_parameters"
    if params is None:  # the hub dialect: top-level rope_theta, rope_scaling with "type"
        params = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", default_theta))
        where = "rope_scaling"
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        raise ValueError(f"config.json: unsupported option '{where}.{unknown[0]}'")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: unsupported option 'partial_rotary_factor'={hf['partial_rotary_factor']}")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(_get(params, "rope_theta", default_theta))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "yarn":
        raise ValueError(f"config.json: unsupported option '{where}.rope_type'={kind!r} (fnmoe supports default, yarn)")
    max_pos = _get(hf, "max_position_embeddings")
    orig = int(params.get("original_max_position_embeddings") or max_pos)
    return {"rope_theta": theta, "rope_scaling": "yarn",
            "yarn_factor": float(params.get("factor") or max_pos / orig),
            "yarn_original_max_seq_len": orig,
            "yarn_beta_fast": float(params.get("beta_fast") or 32),
            "yarn_beta_slow": float(params.get("beta_slow") or 1),
            "yarn_mscale": float(params.get("mscale") or 0),
            "yarn_mscale_all_dim": float(params.get("mscale_all_dim") or 0),
            "yarn_attention_factor": float(params.get("attention_factor") or 0),
            "yarn_truncate": bool(params.get("truncate", True))}


def _common_fields(hf: dict, default_theta: float) -> dict[str, Any]:
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "mlp_bias", (False,), False)
    return {"vocab_size": _get(hf, "vocab_size"), "dim": _get(hf, "hidden_size"),
            "n_layers": _get(hf, "num_hidden_layers"), "n_heads": _get(hf, "num_attention_heads"),
            "norm_eps": float(_get(hf, "rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(_get(hf, "tie_word_embeddings", False)),
            "max_seq_len": _get(hf, "max_position_embeddings"), "init_std": float(_get(hf, "initializer_range", 0.02)),
            **_rope_fields(hf, default_theta)}


def _gqa_fields(hf: dict) -> dict[str, Any]:
    dim, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    head_dim = _get(hf, "head_dim", dim // heads)
    return {"n_kv_heads": _get(hf, "num_key_value_heads", heads),
            "head_dim": 0 if dim % heads == 0 and head_dim == dim // heads else head_dim}


def _qwen3_config(hf: dict) -> ModelConfig:
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        raise ValueError(f"config.json: unsupported option 'use_sliding_window'=true "
                         f"(sliding_window={hf['sliding_window']})")
    n_experts = _get(hf, "num_experts", None) or _get(hf, "num_local_experts", 0)
    moe = MoEConfig(n_experts=n_experts, top_k=_get(hf, "num_experts_per_tok"),
                    expert_hidden=_get(hf, "moe_intermediate_size"),
                    norm_topk_prob=bool(_get(hf, "norm_topk_prob", False)),
                    first_k_dense=0, dense_layers=tuple(sorted(_get(hf, "mlp_only_layers", []))),
                    moe_every=_get(hf, "decoder_sparse_step", 1),
                    aux_loss_coeff=float(_get(hf, "router_aux_loss_coef", 0.001)))
    return ModelConfig(**_common_fields(hf, 10000.0), **_gqa_fields(hf), qk_norm=True,
                       ffn_hidden=_get(hf, "intermediate_size"), moe=moe)


def _mixtral_config(hf: dict) -> ModelConfig:
    if hf.get("sliding_window") is not None:
        raise ValueError(f"config.json: unsupported option 'sliding_window'={hf['sliding_window']}")
    _require(hf, "router_jitter_noise", (0, 0.0), 0.0)
    n_experts = _get(hf, "num_local_experts", None) or _get(hf, "num_experts")
    moe = MoEConfig(n_experts=n_experts, top_k=_get(hf, "num_experts_per_tok"),
                    expert_hidden=_get(hf, "intermediate_size"), norm_topk_prob=True, first_k_dense=0,
                    aux_loss_coeff=float(_get(hf, "router_aux_loss_coef", 0.001)))
    return ModelConfig(**_common_fields(hf, 1e6), **_gqa_fields(hf), ffn_hidden=_get(hf, "intermediate_size"), moe=moe)


def _deepseek_config(hf: dict) -> ModelConfig:
    heads = _get(hf, "num_attention_heads")
    if _get(hf, "num_key_value_heads", heads) != heads:
        raise ValueError(f"config.json: unsupported option 'num_key_value_heads'={hf['num_key_value_heads']} "
                         f"(MLA needs num_attention_heads={heads})")
    _require(hf, "scoring_func", ("sigmoid",), "sigmoid")
    _require(hf, "topk_method", ("noaux_tc",), "noaux_tc")
    _require(hf, "moe_layer_freq", (1,), 1)
    seq_aux = float(_get(hf, "aux_loss_alpha", 0.0)) if hf.get("seq_aux") else 0.0
    moe = MoEConfig(n_experts=_get(hf, "n_routed_experts"), top_k=_get(hf, "num_experts_per_tok"),
                    expert_hidden=_get(hf, "moe_intermediate_size"), n_shared_experts=_get(hf, "n_shared_experts", 0),
                    score_func="sigmoid", norm_topk_prob=bool(_get(hf, "norm_topk_prob", True)),
                    routed_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0)),
                    n_group=_get(hf, "n_group", 1), topk_group=_get(hf, "topk_group", 1), router_bias=True,
                    first_k_dense=_get(hf, "first_k_dense_replace", 0), aux_loss_coeff=0.0, seq_aux_loss_coeff=seq_aux)
    return ModelConfig(**_common_fields(hf, 10000.0), n_kv_heads=heads, attention="mla",
                       q_lora_rank=_get(hf, "q_lora_rank", 0), kv_lora_rank=_get(hf, "kv_lora_rank"),
                       qk_nope_head_dim=_get(hf, "qk_nope_head_dim"), qk_rope_head_dim=_get(hf, "qk_rope_head_dim"),
                       v_head_dim=_get(hf, "v_head_dim"), rope_interleave=bool(_get(hf, "rope_interleave", True)),
                       ffn_hidden=_get(hf, "intermediate_size"), moe=moe)


CONFIG_READERS = {"Qwen3MoeForCausalLM": _qwen3_config, "DeepseekV3ForCausalLM": _deepseek_config,
                  "MixtralForCausalLM": _mixtral_config}


def config_from_hf(hf: dict) -> tuple[ModelConfig, str]:
    """(ModelConfig, architecture) of a config.json dict; compute_dtype float32, compile off."""
    if not isinstance(hf, dict):
        raise ValueError(f"config.json: expected an object of fields, got {type(hf).__name__}")
    arch = architecture(hf)
    try:
        cfg = CONFIG_READERS[arch](hf)
    except (TypeError, AttributeError) as e:  # e.g. "hidden_size": "128"
        raise ValueError(f"config.json: a field has the wrong type ({e})") from None
    errors = validate_model(cfg)
    if errors:
        raise ValueError("config.json gives an invalid model:\n  " + "\n  ".join(errors))
    return cfg, arch


def fp8_block(hf: dict) -> tuple[int, int] | None:
    """The (rows, cols) block of block-FP8 weights, or None when the checkpoint is unquantized."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    _require(q, "quant_method", ("fp8",), None, "quantization_config.")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2):
        raise ValueError(f"config.json: unsupported option 'quantization_config.weight_block_size'={block!r} "
                         "(fnmoe dequantizes 2-D block FP8)")
    return int(block[0]), int(block[1])


# ---------------------------------------------------------------- ModelConfig -> config.json

def hf_architecture(cfg: ModelConfig) -> str:
    """The HF architecture that represents cfg exactly, or ValueError naming the option that none does."""
    m = cfg.moe
    if cfg.attention == "mla":
        dense = [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]
        checks = [(m.score_func == "sigmoid", "model.moe.score_func must be 'sigmoid'"),
                  (m.router_bias, "model.moe.router_bias must be true"),
                  (m.n_experts > 0, "model.moe.n_experts must be > 0"),
                  (dense == list(range(len(dense))),
                   "the dense layers must be the first ones (model.moe.dense_layers, moe_every)")]
        arch = "DeepseekV3ForCausalLM"
    elif cfg.qk_norm:
        checks = [(m.score_func == "softmax", "model.moe.score_func must be 'softmax'"),
                  (m.n_shared_experts == 0, "model.moe.n_shared_experts must be 0"),
                  (m.routed_scaling_factor == 1.0, "model.moe.routed_scaling_factor must be 1"),
                  (m.n_group == 1 and not m.router_bias, "no group-limited routing or router bias"),
                  (not cfg.rope_interleave, "model.rope_interleave must be false")]
        arch = "Qwen3MoeForCausalLM"
    else:
        checks = [(m.score_func == "softmax", "model.moe.score_func must be 'softmax'"),
                  (m.norm_topk_prob, "model.moe.norm_topk_prob must be true"),
                  (m.n_shared_experts == 0, "model.moe.n_shared_experts must be 0"),
                  (m.routed_scaling_factor == 1.0, "model.moe.routed_scaling_factor must be 1"),
                  (m.n_group == 1 and not m.router_bias, "no group-limited routing or router bias"),
                  (m.n_experts > 0 and all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)),
                   "every layer must be MoE (no dense layers)"),
                  (not cfg.rope_interleave, "model.rope_interleave must be false")]
        arch = "MixtralForCausalLM"
    failed = [msg for ok, msg in checks if not ok]
    if failed:
        raise ValueError(f"hf.save: this model is saved as {arch}, which needs: " + "; ".join(failed))
    return arch


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.yarn_factor,
            "original_max_position_embeddings": cfg.yarn_original_max_seq_len,
            "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
            "mscale": cfg.yarn_mscale or None, "mscale_all_dim": cfg.yarn_mscale_all_dim or None,
            "attention_factor": cfg.yarn_attention_factor or None, "truncate": cfg.yarn_truncate}


def config_to_hf(cfg: ModelConfig, arch: str, dtype: torch.dtype) -> dict[str, Any]:
    """config.json (transformers-5 dialect) for cfg saved as arch."""
    m = cfg.moe
    hf = {"architectures": [arch], "model_type": MODEL_TYPES[arch], "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
          "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
          "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std, "hidden_act": "silu",
          "rope_parameters": _rope_parameters(cfg), "num_experts_per_tok": m.top_k,
          "dtype": str(dtype).removeprefix("torch.")}
    if arch == "DeepseekV3ForCausalLM":
        hf |= {"num_key_value_heads": cfg.n_heads, "attention_bias": False, "intermediate_size": cfg.ffn_hidden,
               "moe_intermediate_size": m.expert_hidden, "n_routed_experts": m.n_experts,
               "n_shared_experts": m.n_shared_experts, "routed_scaling_factor": m.routed_scaling_factor,
               "n_group": m.n_group, "topk_group": m.topk_group, "norm_topk_prob": m.norm_topk_prob,
               "first_k_dense_replace": sum(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)),
               "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
               "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
               "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave, "num_nextn_predict_layers": 0}
        if m.seq_aux_loss_coeff:
            hf |= {"aux_loss_alpha": m.seq_aux_loss_coeff, "seq_aux": True}
        return hf
    hf |= {"num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim_, "router_aux_loss_coef": m.aux_loss_coeff}
    if arch == "Qwen3MoeForCausalLM":
        return hf | {"attention_bias": False, "intermediate_size": cfg.ffn_hidden,
                     "moe_intermediate_size": m.expert_hidden, "num_experts": m.n_experts,
                     "norm_topk_prob": m.norm_topk_prob, "decoder_sparse_step": m.moe_every,
                     "mlp_only_layers": sorted(set(range(m.first_k_dense)) | set(m.dense_layers)),
                     "use_sliding_window": False, "sliding_window": None}
    return hf | {"intermediate_size": m.expert_hidden, "num_local_experts": m.n_experts,
                 "sliding_window": None, "router_jitter_noise": 0.0}
