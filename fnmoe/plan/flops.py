"""Parameter counts, FLOPs per token and MFU (docs/design.md §7).

FLOPs/token = 6·N_active + 3·n_layers·S·H·(d_qk + d_v): N_active counts every matrix a token
multiplies (the output head included, the embedding lookup not; K of E routed experts); the second
term is causal attention's score and value matmuls, forward and backward.
"""
from __future__ import annotations

import math
from functools import lru_cache

from fnmoe.config import REGIONS, ModelConfig, RunConfig
from fnmoe.models.params import leaf_inits
from fnmoe.plan.state import leaf_shapes
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


def region_flops(run: RunConfig) -> dict:
    """Forward FLOPs per token of every region kind summed over layers: {attention (its GEMMs),
    attention_core (q·k and p·v), moe, mlp}; recompute repeats a region's forward in backward."""
    return dict(_region_flops(run.model, run.data.seq_len))


@lru_cache(maxsize=64)
def _region_flops(cfg: ModelConfig, seq_len: int) -> tuple:
    out = {"attention": 0.0, "attention_core": 0.0, "moe": 0.0, "mlp": 0.0}
    for path, shape in leaf_shapes(cfg):
        parts = path.split(".")
        if parts[0] != "layers" or len(shape) < 2:
            continue
        n = math.prod(shape) * (cfg.moe.top_k / cfg.moe.n_experts if leaf_kind(path) == "expert" else 1)
        out["attention" if parts[2] == "attn" else parts[2]] += 2.0 * n
    out["attention_core"] = 1.0 * cfg.n_layers * seq_len * cfg.n_heads * (cfg.qk_head_dim_ + cfg.v_head_dim_)
    return tuple(out.items())


def recompute_flops(run: RunConfig) -> tuple[float, float]:
    """(GEMM, attention-core) FLOPs per token recomputed in backward: every region under full
    recompute, the regions whose policy is 'full' otherwise; selective recompute redoes norms and
    pointwise ops only, which the model counts as free."""
    f, mem = region_flops(run), run.memory
    if mem.recompute == "full":
        return f["attention"] + f["moe"] + f["mlp"], f["attention_core"]
    gemm = sum(f[r] for r in REGIONS if getattr(mem, r) == "full")
    return gemm, f["attention_core"] if mem.attention == "full" else 0.0
