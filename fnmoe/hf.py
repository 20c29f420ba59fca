"""Hugging Face checkpoints <-> fnmoe: `load(dir) -> (ModelConfig, params)`, `save(dir, params, cfg)`.

A Hugging Face checkpoint is a directory with config.json and safetensors weights, one file
(model.safetensors) or several named by model.safetensors.index.json. Files are memory-mapped
(safetensors.safe_open): a tensor is read when its leaf is built.

Architectures (dispatched on config.json's `architectures`, never `model_type`):
  Qwen3MoeForCausalLM     GQA with q/k RMSNorm, softmax router; dense layers from mlp_only_layers
                          and decoder_sparse_step
  DeepseekV3ForCausalLM   MLA, sigmoid router with the score-correction bias and group-limited
                          routing, shared experts, the first first_k_dense_replace layers dense
                          (Kimi-K2 uses this architecture too)
  MixtralForCausalLM      GQA, softmax top-k renormalised, every layer MoE

Both config dialects are read: transformers-5 `rope_parameters`, and the top-level `rope_theta`
and `rope_scaling` (with `type`) of published hub checkpoints; `save` writes the former.

Weights: HF linear weights are [out, in] and are transposed to fnmoe's [in, out]; per-expert
weights `experts.<j>.*` are stacked by global expert id j into [E, in, out];
`e_score_correction_bias` goes to buffers.layers.<i>.moe.router_bias_E. Block-FP8 weights
(`quantization_config.weight_block_size`, `<key>_scale_inv` per block) are dequantized on load.
DeepSeek's multi-token-prediction layers (num_hidden_layers .. + num_nextn_predict_layers - 1)
are skipped with a logged line. Every leaf is fp32 (the master-param dtype).

Strict: an unknown architecture, a missing or unexpected tensor, a shape mismatch or an
option fnmoe does not implement raises ValueError naming the key; nothing loads partially.

Training-only knobs: `router_aux_loss_coef` (Qwen3, Mixtral) maps to model.moe.aux_loss_coeff and
DeepSeek's `aux_loss_alpha` with `seq_aux` to model.moe.seq_aux_loss_coeff; the others
(z-loss, the router-bias update rate) have no config.json field and load as 0 / are not saved.

Legend: no shape-suffixed tensors here; leaves are handled by dotted path, HF tensors by key.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fnmoe.config import ModelConfig, MoEConfig, validate_model
from fnmoe.params import leaf_inits
from fnmoe.sharding import distribute
from fnmoe.tree import Tree, flatten_dict, unflatten_dict
from fnmoe.tree_io import new_dir

log = logging.getLogger("fnmoe")

MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3",
               "MixtralForCausalLM": "mixtral"}
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}

# fnmoe leaf name -> HF module name
GQA_NAMES = {"w_q_DN": "q_proj", "w_k_DM": "k_proj", "w_v_DM": "v_proj", "w_o_ND": "o_proj",
             "q_norm_A": "q_norm", "k_norm_A": "k_norm"}
MLA_NAMES = {"w_q_DN": "q_proj", "w_q_a_DQ": "q_a_proj", "q_a_norm_Q": "q_a_layernorm", "w_q_b_QN": "q_b_proj",
             "w_kv_a_DW": "kv_a_proj_with_mqa", "kv_a_norm_C": "kv_a_layernorm", "w_kv_b_CX": "kv_b_proj",
             "w_o_YD": "o_proj"}
MLP_NAMES = {"w_gate_DF": "gate_proj", "w_up_DF": "up_proj", "w_down_FD": "down_proj"}
EXPERT_NAMES = {"w_gate_EDF": "gate_proj", "w_up_EDF": "up_proj", "w_down_EFD": "down_proj"}
MIXTRAL_EXPERT_NAMES = {"w_gate_EDF": "w1", "w_up_EDF": "w3", "w_down_EFD": "w2"}


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
            "yarn_beta_fast": float(params.get("beta_fast") or 32), "yarn_beta_slow": float(params.get("beta_slow") or 1),
            "yarn_mscale": float(params.get("mscale") or 0), "yarn_mscale_all_dim": float(params.get("mscale_all_dim") or 0),
            "yarn_attention_factor": float(params.get("attention_factor") or 0),
            "yarn_truncate": bool(params.get("truncate", True))}


def _common_fields(hf: dict, default_theta: float) -> dict[str, Any]:
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "mlp_bias", (False,), False)
    return {"vocab_size": _get(hf, "vocab_size"), "dim": _get(hf, "hidden_size"),
            "n_layers": _get(hf, "num_hidden_layers"), "n_heads": _get(hf, "num_attention_heads"),
            "norm_eps": float(_get(hf, "rms_norm_eps", 1e-6)), "tie_embeddings": bool(_get(hf, "tie_word_embeddings", False)),
            "max_seq_len": _get(hf, "max_position_embeddings"), "init_std": float(_get(hf, "initializer_range", 0.02)),
            **_rope_fields(hf, default_theta)}


def _gqa_fields(hf: dict) -> dict[str, Any]:
    dim, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    head_dim = _get(hf, "head_dim", dim // heads)
    return {"n_kv_heads": _get(hf, "num_key_value_heads", heads),
            "head_dim": 0 if dim % heads == 0 and head_dim == dim // heads else head_dim}


def _qwen3_config(hf: dict) -> ModelConfig:
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        raise ValueError(f"config.json: unsupported option 'use_sliding_window'=true (sliding_window={hf['sliding_window']})")
    n_experts = _get(hf, "num_experts", None) or _get(hf, "num_local_experts", 0)
    moe = MoEConfig(n_experts=n_experts, top_k=_get(hf, "num_experts_per_tok"),
                    expert_hidden=_get(hf, "moe_intermediate_size"), norm_topk_prob=bool(_get(hf, "norm_topk_prob", False)),
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


# ---------------------------------------------------------------- fnmoe leaf <-> HF keys

def key_map(cfg: ModelConfig, arch: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """fnmoe path -> (how, HF keys) for every leaf of cfg's tree, in tree order. how: 'copy'
    (same layout), 'linear' (HF [out, in] is the transpose) or 'experts' (one HF [out, in] key
    per expert, global id order)."""
    out = {}
    for path, init in flatten_dict(leaf_inits(cfg)).items():
        out[path] = _source(path, len(init.shape), cfg, arch)
    return out


def _source(path: str, ndim: int, cfg: ModelConfig, arch: str) -> tuple[str, tuple[str, ...]]:
    how = "copy" if ndim == 1 else "linear"
    fixed = {"embed.w_VD": ("copy", "model.embed_tokens.weight"), "final_norm.w_D": ("copy", "model.norm.weight"),
             "head.w_DV": ("linear", "lm_head.weight")}
    if path in fixed:
        return fixed[path][0], (fixed[path][1],)
    parts = path.split(".")
    if parts[0] == "buffers":  # buffers.layers.<i>.moe.router_bias_E
        return "copy", (f"model.layers.{parts[2]}.mlp.gate.e_score_correction_bias",)
    layer, group, name = f"model.layers.{parts[1]}.", parts[2], parts[-1]
    if group in ("attn_norm", "mlp_norm"):
        return "copy", (layer + ("input_layernorm" if group == "attn_norm" else "post_attention_layernorm") + ".weight",)
    if group == "attn":
        names = MLA_NAMES if cfg.attention == "mla" else GQA_NAMES
        return how, (f"{layer}self_attn.{names[name]}.weight",)
    if group == "mlp":
        return how, (f"{layer}mlp.{MLP_NAMES[name]}.weight",)
    moe = layer + ("block_sparse_moe." if arch == "MixtralForCausalLM" else "mlp.")
    if name == "router_DE":
        return how, (moe + "gate.weight",)
    if parts[3] == "shared":
        return how, (f"{moe}shared_experts.{MLP_NAMES[name]}.weight",)
    expert = (MIXTRAL_EXPERT_NAMES if arch == "MixtralForCausalLM" else EXPERT_NAMES)[name]
    return "experts", tuple(f"{moe}experts.{j}.{expert}.weight" for j in range(cfg.moe.n_experts))


def _hf_shape(how: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of each HF tensor behind a leaf of this shape."""
    return {"copy": shape, "linear": shape[::-1], "experts": shape[:0:-1]}[how]


# ---------------------------------------------------------------- load

def _open(hf_dir: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """HF key -> the open (memory-mapped) safetensors file holding it."""
    if (hf_dir / INDEX).is_file():
        weight_map = read_json(hf_dir / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{hf_dir / INDEX}: no 'weight_map' of tensor names to files")
        files = {name: _safe_open(hf_dir / name, stack) for name in sorted(set(weight_map.values()))}
        return {key: files[name] for key, name in weight_map.items()}
    if (hf_dir / SINGLE).is_file():
        f = _safe_open(hf_dir / SINGLE, stack)
        return {key: f for key in f.keys()}
    raise FileNotFoundError(f"{hf_dir}: neither {SINGLE} nor {INDEX} found")


def _safe_open(path: Path, stack: contextlib.ExitStack):
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (listed in {INDEX})")
    try:
        return stack.enter_context(safe_open(path, framework="pt"))
    except SafetensorError as e:  # a truncated or foreign file: its message names no file
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None


def read_json(path: Path) -> dict:
    """A JSON object from path, or a ValueError naming the file."""
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-FP8 [out, in] weights times their per-block scales (ceil(out/b0), ceil(in/b1)), fp32."""
    b0, b1 = block
    scale = scale_inv.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    return w.float() * scale[:w.shape[0], :w.shape[1]]


class _Reader:
    """Reads HF tensors by key with shape checks and FP8 dequantization; records what it used."""

    def __init__(self, files: dict[str, Any], block: tuple[int, int] | None):
        self.files, self.block, self.used = files, block, set()

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.files:
            raise ValueError(f"missing tensor '{key}'")
        return tuple(self.files[key].get_slice(key).get_shape())

    def read(self, key: str, want: tuple[int, ...], index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The tensor (its slice at index: only those bytes are read, but for block-FP8 tensors,
        which are dequantized whole first) in fp32."""
        if self.shape(key) != want:
            raise ValueError(f"tensor '{key}' has shape {list(self.shape(key))}, expected {list(want)}")
        self.used.add(key)
        if key + "_scale_inv" in self.files:
            return self._dequantized(key, want)[index]
        t = self.files[key].get_slice(key)[index] if index else self.files[key].get_tensor(key)
        if t.dtype in FP8_DTYPES:
            raise ValueError(f"tensor '{key}' is {t.dtype} without '{key}_scale_inv'")
        return t.float()

    def _dequantized(self, key: str, want: tuple[int, ...]) -> torch.Tensor:
        scale_key = key + "_scale_inv"
        if self.block is None:
            raise ValueError(f"tensor '{scale_key}' needs quantization_config.weight_block_size in config.json")
        b0, b1 = self.block
        want_s = (math.ceil(want[0] / b0), math.ceil(want[1] / b1))
        if self.shape(scale_key) != want_s:
            raise ValueError(f"tensor '{scale_key}' has shape {list(self.shape(scale_key))}, expected {list(want_s)}")
        self.used.add(scale_key)
        return dequantize_fp8(self.files[key].get_tensor(key), self.files[scale_key].get_tensor(scale_key), self.block)


def _leaf(reader: _Reader, how: str, keys: tuple[str, ...], shape: tuple[int, ...],
          index: tuple[slice, ...] = ()) -> torch.Tensor:
    """The leaf, or its slice at index (one slice per leading dim), reading only that slice's bytes
    (an HF [out, in] matrix is the transpose of the leaf's, so the index is reversed for it)."""
    hf_shape = _hf_shape(how, shape)
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if how == "copy":
        return reader.read(keys[0], hf_shape, index)
    if how == "linear":
        return reader.read(keys[0], hf_shape, index[::-1]).T.contiguous()
    experts = range(*index[0].indices(shape[0]))
    reader.used.update(keys)  # the experts this rank skips, other ranks read
    return torch.stack([reader.read(keys[j], hf_shape, index[:0:-1]).T for j in experts]) if experts else \
        torch.empty(0, *[len(range(*i.indices(n))) for i, n in zip(index[1:], shape[1:])])


def _mtp_keys(keys: list[str], hf: dict, arch: str, n_layers: int) -> list[str]:
    """Keys of DeepSeek's multi-token-prediction layers, n_layers .. n_layers + num_nextn_predict_layers - 1."""
    n_mtp = (hf.get("num_nextn_predict_layers") or 0) if arch == "DeepseekV3ForCausalLM" else 0
    return [k for k in keys if (m := LAYER_KEY.match(k)) and n_layers <= int(m.group(1)) < n_layers + n_mtp]


def load(hf_dir: str | Path, mesh=None) -> tuple[ModelConfig, Tree]:
    """(ModelConfig, fp32 params tree) of a Hugging Face checkpoint directory; with a mesh, this
    rank's shards (DTensor leaves laid out by fnmoe.sharding), each rank reading only the experts
    it holds (dense matrices are read whole, one at a time, and sliced)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json (not a Hugging Face checkpoint directory)")
    hf = read_json(hf_dir / "config.json")
    cfg, arch = config_from_hf(hf)
    inits = flatten_dict(leaf_inits(cfg))
    with contextlib.ExitStack() as stack:
        reader = _Reader(_open(hf_dir, stack), fp8_block(hf))
        keys = key_map(cfg, arch)
        if mesh is None:
            flat = {path: _leaf(reader, how, k, inits[path].shape) for path, (how, k) in keys.items()}
        else:
            flat = flatten_dict(distribute(unflatten_dict(inits), mesh,
                                           lambda path, idx: _leaf(reader, *keys[path], inits[path].shape, idx)))
        skipped = _mtp_keys(list(reader.files), hf, arch, cfg.n_layers)
        unexpected = sorted(set(reader.files) - reader.used - set(skipped))
        if cfg.tie_embeddings and "lm_head.weight" in unexpected:  # a redundant copy some exporters write
            unexpected.remove("lm_head.weight")
            log.info("hf.load: tied embeddings; ignoring lm_head.weight")
    if unexpected:
        raise ValueError(f"unexpected tensor '{unexpected[0]}' ({len(unexpected)} in all) for {arch}")
    if skipped:
        layers = sorted({int(LAYER_KEY.match(k).group(1)) for k in skipped})
        log.info("hf.load: skipped %d tensors of multi-token-prediction layers %s (fnmoe has no MTP head)",
                 len(skipped), layers)
    return cfg, unflatten_dict(flat)


# ---------------------------------------------------------------- save

def hf_architecture(cfg: ModelConfig) -> str:
    """The HF architecture that represents cfg exactly, or ValueError naming the option that none does."""
    m = cfg.moe
    if cfg.attention == "mla":
        dense = [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]
        checks = [(m.score_func == "sigmoid", "model.moe.score_func must be 'sigmoid'"),
                  (m.router_bias, "model.moe.router_bias must be true"),
                  (m.n_experts > 0, "model.moe.n_experts must be > 0"),
                  (dense == list(range(len(dense))), "the dense layers must be the first ones (model.moe.dense_layers, moe_every)")]
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


def _hf_tensors(params: Tree, cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    flat = flatten_dict(params)
    kmap = key_map(cfg, arch)
    extra = sorted(set(flat) - set(kmap))
    if extra:
        raise ValueError(f"hf.save: leaf '{extra[0]}' is not part of the model that cfg describes")
    inits = flatten_dict(leaf_inits(cfg))
    out = {}
    for path, (how, keys) in kmap.items():
        if path not in flat:
            raise ValueError(f"hf.save: params lack leaf '{path}'")
        t = flat[path].detach().cpu()
        if tuple(t.shape) != inits[path].shape:
            raise ValueError(f"hf.save: leaf '{path}' has shape {list(t.shape)}, expected {list(inits[path].shape)}")
        if how == "experts":
            out |= {key: t[j].T.contiguous() for j, key in enumerate(keys)}
        else:
            out[keys[0]] = (t.T if how == "linear" else t).contiguous()
    return out


def save(hf_dir: str | Path, params: Tree, cfg: ModelConfig, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write params as a Hugging Face checkpoint (config.json + safetensors, sharded with an index
    above max_shard_bytes) that transformers loads, into a new or empty directory; weights keep
    the params' dtype."""
    arch = hf_architecture(cfg)
    tensors = _hf_tensors(params, cfg, arch)
    with new_dir(hf_dir) as tmp:  # stale shards or an index in hf_dir would mix with ours: new or empty
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE, metadata={"format": "pt"})
        else:
            names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
            for name, shard in zip(names, shards):
                save_file(shard, tmp / name, metadata={"format": "pt"})
            weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        dtype = flatten_dict(params)["embed.w_VD"].dtype
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, arch, dtype), indent=1) + "\n")
    return Path(hf_dir)
