"""fnmoe leaf paths <-> Hugging Face tensor keys, per architecture, and the HF shape behind a leaf.

Leaf names carry params.py's shape suffixes (legend there); HF tensors are named by key.
"""
from __future__ import annotations

import re

import torch

from fnmoe.config import ModelConfig
from fnmoe.models.params import leaf_inits
from fnmoe.tree import flatten_dict

LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
ERNIE = "Ernie4_5_MoeForCausalLM"

# fnmoe leaf name -> HF module name
GQA_NAMES = {"w_q_DN": "q_proj", "w_k_DM": "k_proj", "w_v_DM": "v_proj", "w_o_ND": "o_proj",
             "q_norm_A": "q_norm", "k_norm_A": "k_norm"}
MLA_NAMES = {"w_q_DN": "q_proj", "w_q_a_DQ": "q_a_proj", "q_a_norm_Q": "q_a_layernorm", "w_q_b_QN": "q_b_proj",
             "w_kv_a_DW": "kv_a_proj_with_mqa", "kv_a_norm_C": "kv_a_layernorm", "w_kv_b_CX": "kv_b_proj",
             "w_o_YD": "o_proj"}
MLP_NAMES = {"w_gate_DF": "gate_proj", "w_up_DF": "up_proj", "w_down_FD": "down_proj"}
EXPERT_NAMES = {"w_gate_EDF": "gate_proj", "w_up_EDF": "up_proj", "w_down_EFD": "down_proj"}
MIXTRAL_EXPERT_NAMES = {"w_gate_EDF": "w1", "w_up_EDF": "w3", "w_down_EFD": "w2"}


def key_map(cfg: ModelConfig, arch: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """fnmoe path -> (how, HF keys) for every leaf of cfg's tree, in tree order. how: 'copy'
    (same layout), 'linear' (HF [out, in] is the transpose), 'rope' (the transpose, each head's
    rows in interleaved-RoPE order: rope_rows), 'row' (HF [1, n] holds the leaf [n]) or 'experts'
    (one HF [out, in] key per expert, global id order)."""
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
        if arch == ERNIE:  # the hub's key (transformers renames it to mlp.gate.moe_statics.*), [1, E]
            return "row", (f"model.layers.{parts[2]}.mlp.moe_statics.e_score_correction_bias",)
        return "copy", (f"model.layers.{parts[2]}.mlp.gate.e_score_correction_bias",)
    layer, group, name = f"model.layers.{parts[1]}.", parts[2], parts[-1]
    if group in ("attn_norm", "mlp_norm"):
        return "copy", (layer + ("input_layernorm" if group == "attn_norm" else "post_attention_layernorm")
                        + ".weight",)
    if group == "attn":
        names = MLA_NAMES if cfg.attention == "mla" else GQA_NAMES
        if arch == ERNIE and name in ("w_q_DN", "w_k_DM") and not cfg.rope_interleave:
            how = "rope"
        return how, (f"{layer}self_attn.{names[name]}.weight",)
    if group == "mlp":
        return how, (f"{layer}mlp.{MLP_NAMES[name]}.weight",)
    moe = layer + ("block_sparse_moe." if arch == "MixtralForCausalLM" else "mlp.")
    if name == "w_router_DE":
        return how, (moe + "gate.weight",)
    if parts[3] == "shared":
        return how, (f"{moe}shared_experts.{MLP_NAMES[name]}.weight",)
    expert = (MIXTRAL_EXPERT_NAMES if arch == "MixtralForCausalLM" else EXPERT_NAMES)[name]
    return "experts", tuple(f"{moe}experts.{j}.{expert}.weight" for j in range(cfg.moe.n_experts))


def hf_shape_of(how: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of each HF tensor behind a leaf of this shape."""
    return {"copy": shape, "linear": shape[::-1], "rope": shape[::-1], "row": (1, *shape),
            "experts": shape[:0:-1]}[how]


def rope_rows(n_out: int, head_dim: int) -> torch.Tensor:
    """int64 [n_out]: HF row j of a query/key projection of interleaved RoPE (Ernie 4.5, which
    rotates the pairs (2i, 2i+1) of a head) is fnmoe's output column rope_rows[j] of half-split RoPE
    (pairs (i, i + A/2)): 2i <- i, 2i+1 <- i + A/2 within each head. Queries and keys permuted
    alike keep their dot products, so the logits are the same."""
    half = head_dim // 2
    within_A = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    return (torch.arange(n_out // head_dim)[:, None] * head_dim + within_A).flatten()


def mtp_keys(keys: list[str], hf: dict, arch: str, n_layers: int) -> list[str]:
    """Keys of DeepSeek's multi-token-prediction layers, n_layers .. n_layers + num_nextn_predict_layers - 1."""
    n_mtp = (hf.get("num_nextn_predict_layers") or 0) if arch == "DeepseekV3ForCausalLM" else 0
    return [k for k in keys if (m := LAYER_KEY.match(k)) and n_layers <= int(m.group(1)) < n_layers + n_mtp]
