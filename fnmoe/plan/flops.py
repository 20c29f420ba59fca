"""Parameter counts, FLOPs per token and MFU (docs/design.md §7).

FLOPs/token = 6·N_active + 3·n_layers·S·H·(d_qk + d_v): N_active counts every matrix a token
multiplies (the output head included, the embedding lookup not; K of E routed experts); the second
term is causal attention's score and value matmuls, forward and backward.
"""
from __future__ import annotations

import math

from fnmoe.config import ModelConfig
from fnmoe.models.params import leaf_inits
from fnmoe.tree import flatten_dict, leaf_kind


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total params, params active per token excluding the embedding lookup); buffers (the
    router bias) are state, not params."""
    total = active = 0
    for path, init in flatten_dict(leaf_inits(cfg)).items():
        if leaf_kind(path) == "buffer":
            continue
        n = math.prod(init.shape)
        total += n
        if path.startswith("embed.") and not cfg.tie_embeddings:
            continue
        if leaf_kind(path) == "expert":
            n = n * cfg.moe.top_k // cfg.moe.n_experts
        active += n
    return total, active


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    _, active = param_counts(cfg)
    return 6.0 * active + 3.0 * cfg.n_layers * seq_len * cfg.n_heads * (cfg.qk_head_dim_ + cfg.v_head_dim_)


def mfu(flops_per_tok: float, tokens_per_s: float, peak_tflops: float) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None where the peak is unknown."""
    return flops_per_tok * tokens_per_s / (peak_tflops * 1e12) if peak_tflops > 0 else None
