"""config.json <-> ModelConfig for Qwen3-MoE, DeepSeek-V3, Mixtral and Ernie 4.5 MoE (see fnmoe/hf/__init__.py).

Reading accepts both config dialects and refuses, naming the option, anything fnmoe does not
implement; writing emits the transformers-5 dialect for the one architecture that represents a
ModelConfig exactly.

Legend: no tensors here; `hf` is a config.json dict.
"""
from __future__ import annotations

from typing import Any

import torch

from fnmoe.config import ModelConfig, MoEConfig, types, validate_model

MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3",
               "MixtralForCausalLM": "mixtral", "Ernie4_5_MoeForCausalLM": "ernie4_5_moe"}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


# ---------------------------------------------------------------- config.json -> ModelConfig
# Every field is read through _get with the type fnmoe needs, so a value of another type is one
# error naming the field, the value and the type (config_from_hf adds the file) rather than a
# TypeError deep inside. Floats take ints (JSON writes 10000 for 1e4); ints take no floats.

def _get(hf: dict, key: str, default: Any = ..., kind: Any = int, where: str = "") -> Any:
    """hf[key] checked to be of type kind (a float as float); default when absent or null."""
    if key not in hf or hf[key] is None:
        if default is ...:
            raise ValueError(f"missing '{where}{key}'")
        return default
    problems = types.type_errors(hf[key], kind, f"{where}{key}")
    if problems:
        raise ValueError(problems[0])
    return float(hf[key]) if kind is float else hf[key]


def _table(hf: dict, key: str) -> dict | None:
    """A nested object of config.json (rope_scaling, quantization_config), or None when absent."""
    return _get(hf, key, None, dict)


def _require(hf: dict, key: str, allowed: tuple, default: Any, where: str = "") -> None:
    """hf[key] (default when absent) is of the allowed values' type and one of them."""
    value = _get(hf, key, default, type(allowed[0]), where)
    if value not in allowed:
        raise ValueError(f"unsupported option '{where}{key}'={value!r} (fnmoe supports {list(allowed)})")


def architecture(hf: dict) -> str:
    archs = _get(hf, "architectures", [], tuple[str, ...])
    known = [a for a in archs if a in MODEL_TYPES]
    if len(archs) != 1 or not known:
        raise ValueError(f"unknown 'architectures'={archs!r} (fnmoe loads one of {sorted(MODEL_TYPES)})")
    return known[0]


def _rope_fields(hf: dict, default_theta: float) -> dict[str, Any]:
    """ModelConfig's RoPE fields from either dialect."""
    params = _table(hf, "rope_parameters")
    where = "rope_parameters."
    if params is None:  # the hub dialect: top-level rope_theta, rope_scaling with "type"
        params = dict(_table(hf, "rope_scaling") or {}, rope_theta=_get(hf, "rope_theta", default_theta, float))
        where = "rope_scaling."
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        raise ValueError(f"unsupported option '{where}{unknown[0]}'")
    if _get(hf, "partial_rotary_factor", 1.0, float) != 1.0:
        raise ValueError(f"unsupported option 'partial_rotary_factor'={hf['partial_rotary_factor']}")
    kind = _get(params, "rope_type", None, str, where) or _get(params, "type", "default", str, where)
    theta = _get(params, "rope_theta", default_theta, float, where)
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "yarn":
        raise ValueError(f"unsupported option '{where}rope_type'={kind!r} (fnmoe supports default, yarn)")
    max_pos = _get(hf, "max_position_embeddings")
    orig = _get(params, "original_max_position_embeddings", 0, int, where) or max_pos

    def num(key: str, default: float) -> float:  # 0 and null mean the default, as transformers reads them
        return _get(params, key, 0.0, float, where) or default
    return {"rope_theta": theta, "rope_scaling": "yarn", "yarn_factor": num("factor", max_pos / orig),
            "yarn_original_max_seq_len": orig, "yarn_beta_fast": num("beta_fast", 32.0),
            "yarn_beta_slow": num("beta_slow", 1.0), "yarn_mscale": num("mscale", 0.0),
            "yarn_mscale_all_dim": num("mscale_all_dim", 0.0), "yarn_attention_factor": num("attention_factor", 0.0),
            "yarn_truncate": _get(params, "truncate", True, bool, where)}


def _common_fields(hf: dict, default_theta: float) -> dict[str, Any]:
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "mlp_bias", (False,), False)
    return {"vocab_size": _get(hf, "vocab_size"), "dim": _get(hf, "hidden_size"),
            "n_layers": _get(hf, "num_hidden_layers"), "n_heads": _get(hf, "num_attention_heads"),
            "norm_eps": _get(hf, "rms_norm_eps", 1e-6, float),
            "tie_embeddings": _get(hf, "tie_word_embeddings", False, bool),
            "max_seq_len": _get(hf, "max_position_embeddings"), "init_std": _get(hf, "initializer_range", 0.02, float),
            **_rope_fields(hf, default_theta)}


def _gqa_fields(hf: dict) -> dict[str, Any]:
    dim, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    head_dim = _get(hf, "head_dim", dim // heads if heads > 0 else 0)
    return {"n_kv_heads": _get(hf, "num_key_value_heads", heads),
            "head_dim": 0 if heads > 0 and dim % heads == 0 and head_dim == dim // heads else head_dim}


def _qwen3_config(hf: dict) -> ModelConfig:
    if _get(hf, "use_sliding_window", False, bool) and _get(hf, "sliding_window", None) is not None:
        raise ValueError(f"unsupported option 'use_sliding_window'=true (sliding_window={hf['sliding_window']})")
    n_experts = _get(hf, "num_experts", None) or _get(hf, "num_local_experts", 0)
    moe = MoEConfig(n_experts=n_experts, top_k=_get(hf, "num_experts_per_tok"),
                    expert_hidden=_get(hf, "moe_intermediate_size"),
                    norm_topk_prob=_get(hf, "norm_topk_prob", False, bool),
                    first_k_dense=0, dense_layers=tuple(sorted(_get(hf, "mlp_only_layers", [], tuple[int, ...]))),
                    moe_every=_get(hf, "decoder_sparse_step", 1),
                    aux_loss_coeff=_get(hf, "router_aux_loss_coef", 0.001, float))
    return ModelConfig(**_common_fields(hf, 10000.0), **_gqa_fields(hf), qk_norm=True,
                       ffn_hidden=_get(hf, "intermediate_size"), moe=moe)


def _mixtral_config(hf: dict) -> ModelConfig:
    if _get(hf, "sliding_window", None) is not None:
        raise ValueError(f"unsupported option 'sliding_window'={hf['sliding_window']}")
    _require(hf, "router_jitter_noise", (0.0,), 0.0)
    n_experts = _get(hf, "num_local_experts", None) or _get(hf, "num_experts")
    moe = MoEConfig(n_experts=n_experts, top_k=_get(hf, "num_experts_per_tok"),
                    expert_hidden=_get(hf, "intermediate_size"), norm_topk_prob=True, first_k_dense=0,
                    aux_loss_coeff=_get(hf, "router_aux_loss_coef", 0.001, float))
    return ModelConfig(**_common_fields(hf, 1e6), **_gqa_fields(hf), ffn_hidden=_get(hf, "intermediate_size"), moe=moe)


def _deepseek_config(hf: dict) -> ModelConfig:
    heads = _get(hf, "num_attention_heads")
    if _get(hf, "num_key_value_heads", heads) != heads:
        raise ValueError(f"unsupported option 'num_key_value_heads'={hf['num_key_value_heads']} "
                         f"(MLA needs num_attention_heads={heads})")
    _require(hf, "scoring_func", ("sigmoid",), "sigmoid")
    _require(hf, "topk_method", ("noaux_tc",), "noaux_tc")
    _require(hf, "moe_layer_freq", (1,), 1)
    _get(hf, "num_nextn_predict_layers", 0)  # read by keys.py: its MTP layers are skipped
    seq_aux = _get(hf, "aux_loss_alpha", 0.0, float) if _get(hf, "seq_aux", False, bool) else 0.0
    moe = MoEConfig(n_experts=_get(hf, "n_routed_experts"), top_k=_get(hf, "num_experts_per_tok"),
                    expert_hidden=_get(hf, "moe_intermediate_size"), n_shared_experts=_get(hf, "n_shared_experts", 0),
                    score_func="sigmoid", norm_topk_prob=_get(hf, "norm_topk_prob", True, bool),
                    routed_scaling_factor=_get(hf, "routed_scaling_factor", 1.0, float),
                    n_group=_get(hf, "n_group", 1), topk_group=_get(hf, "topk_group", 1), router_bias=True,
                    first_k_dense=_get(hf, "first_k_dense_replace", 0), aux_loss_coeff=0.0, seq_aux_loss_coeff=seq_aux)
    return ModelConfig(**_common_fields(hf, 10000.0), n_kv_heads=heads, attention="mla",
                       q_lora_rank=_get(hf, "q_lora_rank", 0), kv_lora_rank=_get(hf, "kv_lora_rank"),
                       qk_nope_head_dim=_get(hf, "qk_nope_head_dim"), qk_rope_head_dim=_get(hf, "qk_rope_head_dim"),
                       v_head_dim=_get(hf, "v_head_dim"), rope_interleave=_get(hf, "rope_interleave", True, bool),
                       ffn_hidden=_get(hf, "intermediate_size"), moe=moe)


def _ernie_config(hf: dict) -> ModelConfig:
    """Ernie 4.5 MoE: GQA without q/k norm, interleaved RoPE (read as half-split: keys.rope_rows),
    softmax top-k renormalised, the top k chosen on the scores plus moe_statics' bias (the router
    bias; io.load drops an all-zero one), layers start..end with (i + 1) % interval == 0 MoE."""
    _require(hf, "use_bias", (False,), False)
    n_layers = _get(hf, "num_hidden_layers")
    start, interval = _get(hf, "moe_layer_start_index", 1), _get(hf, "moe_layer_interval", 1)
    end = _get(hf, "moe_layer_end_index", -1)
    end = n_layers - 1 if end == -1 else end
    if interval < 1 or start < 0:
        raise ValueError(f"unsupported option 'moe_layer_interval'={interval} or 'moe_layer_start_index'={start}")
    moe = MoEConfig(n_experts=_get(hf, "moe_num_experts", None) or _get(hf, "num_experts", 0),
                    top_k=_get(hf, "moe_k", None) or _get(hf, "num_experts_per_tok"),
                    expert_hidden=_get(hf, "moe_intermediate_size"),
                    n_shared_experts=_get(hf, "moe_num_shared_experts", 0), norm_topk_prob=True, router_bias=True,
                    first_k_dense=min(start, n_layers), moe_every=interval,
                    dense_layers=tuple(i for i in range(max(end + 1, start), n_layers) if (i + 1) % interval == 0),
                    aux_loss_coeff=_get(hf, "router_aux_loss_coef", 0.001, float))
    _get(hf, "moe_norm_min", 1e-12, float)  # clamps the renormalising sum of softmax scores: never reached
    return ModelConfig(**_common_fields(hf, 500000.0), **_gqa_fields(hf), ffn_hidden=_get(hf, "intermediate_size"),
                       moe=moe)


CONFIG_READERS = {"Qwen3MoeForCausalLM": _qwen3_config, "DeepseekV3ForCausalLM": _deepseek_config,
                  "MixtralForCausalLM": _mixtral_config, "Ernie4_5_MoeForCausalLM": _ernie_config}


def config_from_hf(hf: dict, source: str = "config.json") -> tuple[ModelConfig, str]:
    """(ModelConfig, architecture) of a config.json dict read from source; compute_dtype float32,
    compile off. Errors name source and the field."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: expected an object of fields, got {type(hf).__name__}")
    try:
        arch = architecture(hf)
        cfg = CONFIG_READERS[arch](hf)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    errors = validate_model(cfg)
    if errors:
        raise ValueError(f"{source} gives an invalid model:\n  " + "\n  ".join(errors))
    return cfg, arch


def fp8_block(hf: dict, source: str = "config.json") -> tuple[int, int] | None:
    """The (rows, cols) block of block-FP8 weights, or None when the checkpoint is unquantized."""
    try:
        q = _table(hf, "quantization_config")
        if q is None:
            return None
        _require(q, "quant_method", ("fp8",), None, "quantization_config.")
        block = _get(q, "weight_block_size", [], tuple[int, ...], "quantization_config.")
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if len(block) != 2:
        raise ValueError(f"{source}: unsupported option 'quantization_config.weight_block_size'={block!r} "
                         "(fnmoe dequantizes 2-D block FP8)")
    return block[0], block[1]


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
    else:  # GQA without q/k norm: Mixtral where it fits (every layer MoE), else Ernie 4.5 MoE
        checks = [(m.score_func == "softmax", "model.moe.score_func must be 'softmax'"),
                  (m.norm_topk_prob, "model.moe.norm_topk_prob must be true"),
                  (m.n_shared_experts == 0, "model.moe.n_shared_experts must be 0"),
                  (m.routed_scaling_factor == 1.0, "model.moe.routed_scaling_factor must be 1"),
                  (m.n_group == 1 and not m.router_bias, "no group-limited routing or router bias"),
                  (m.n_experts > 0 and all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)),
                   "every layer must be MoE (no dense layers)"),
                  (not cfg.rope_interleave, "model.rope_interleave must be false")]
        arch = "MixtralForCausalLM"
        if not all(ok for ok, _ in checks):
            checks = [(m.score_func == "softmax", "model.moe.score_func must be 'softmax'"),
                      (m.norm_topk_prob, "model.moe.norm_topk_prob must be true"),
                      (m.routed_scaling_factor == 1.0, "model.moe.routed_scaling_factor must be 1"),
                      (m.n_group == 1, "no group-limited routing (model.moe.n_group must be 1)"),
                      (m.n_experts > 0, "model.moe.n_experts must be > 0"),
                      (_ernie_moe_layers(cfg) is not None, "the MoE layers must be every model.moe.moe_every-th "
                       "layer from one index to another (model.moe.first_k_dense, dense_layers)")]
            arch = "Ernie4_5_MoeForCausalLM"
    failed = [msg for ok, msg in checks if not ok]
    if failed:
        also = " (or MixtralForCausalLM, with every layer MoE)" if arch == "Ernie4_5_MoeForCausalLM" else ""
        raise ValueError(f"hf.save: this model is saved as {arch}{also}, which needs: " + "; ".join(failed))
    return arch


def _ernie_moe_layers(cfg: ModelConfig) -> tuple[int, int, int] | None:
    """(moe_layer_start_index, moe_layer_end_index, moe_layer_interval) of Ernie 4.5 that make
    exactly cfg's MoE layers, or None when no triple does."""
    moe = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    if not moe:
        return None
    start, end, every = moe[0], moe[-1], cfg.moe.moe_every
    same = moe == [i for i in range(start, end + 1) if (i + 1) % every == 0]
    return (start, end, every) if same else None


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
    if arch == "Ernie4_5_MoeForCausalLM":
        start, end, every = _ernie_moe_layers(cfg)
        del hf["num_experts_per_tok"]  # Ernie's own names (transformers maps the generic ones to them too)
        return hf | {"use_bias": False, "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": m.expert_hidden,
                     "moe_k": m.top_k, "moe_num_experts": m.n_experts, "moe_num_shared_experts": m.n_shared_experts,
                     "moe_layer_start_index": start, "moe_layer_end_index": end, "moe_layer_interval": every,
                     "moe_norm_min": 1e-12}
    if arch == "Qwen3MoeForCausalLM":
        return hf | {"attention_bias": False, "intermediate_size": cfg.ffn_hidden,
                     "moe_intermediate_size": m.expert_hidden, "num_experts": m.n_experts,
                     "norm_topk_prob": m.norm_topk_prob, "decoder_sparse_step": m.moe_every,
                     "mlp_only_layers": sorted(set(range(m.first_k_dense)) | set(m.dense_layers)),
                     "use_sliding_window": False, "sliding_window": None}
    return hf | {"intermediate_size": m.expert_hidden, "num_local_experts": m.n_experts,
                 "sliding_window": None, "router_jitter_noise": 0.0}
