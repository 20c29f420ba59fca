"""Attention: RoPE and GQA (optional per-head q/k RMSNorm) through SDPA.

Legend: B batch, L sequence, D model, H heads, G kv heads, A head dim, N = H·A, M = G·A.
Weights are [in, out] (y = x @ w).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fnmoe.config import ModelConfig


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 at least (fp64 stays fp64 for gradient checks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back before the weight (the Hugging Face / Llama convention)."""
    x32 = upcast(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * w.to(x.dtype)


def rope_tables(positions_L: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, A] in fp32 for half-split RoPE (rotate_half pairs i with i + A/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang_LP = positions_L.double()[:, None] * inv_freq.to(positions_L.device)[None, :]
    ang_LA = torch.cat([ang_LP, ang_LP], dim=-1)
    return ang_LA.cos().float(), ang_LA.sin().float()


def apply_rope(x_BLHA: torch.Tensor, cos_LA: torch.Tensor, sin_LA: torch.Tensor) -> torch.Tensor:
    half = x_BLHA.shape[-1] // 2
    rot = torch.cat([-x_BLHA[..., half:], x_BLHA[..., :half]], dim=-1)
    cos, sin = cos_LA[:, None, :].to(x_BLHA.dtype), sin_LA[:, None, :].to(x_BLHA.dtype)
    return x_BLHA * cos + rot * sin


def gqa(p: dict, x_BLD: torch.Tensor, cos_LA: torch.Tensor, sin_LA: torch.Tensor,
        cfg: ModelConfig) -> torch.Tensor:
    """Causal grouped-query attention; p holds w_q_DN, w_k_DM, w_v_DM, w_o_ND (+ q_norm_A, k_norm_A)."""
    B, L, _ = x_BLD.shape
    H, G, A = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim_
    q_BLHA = (x_BLD @ p["w_q_DN"]).view(B, L, H, A)
    k_BLGA = (x_BLD @ p["w_k_DM"]).view(B, L, G, A)
    v_BLGA = (x_BLD @ p["w_v_DM"]).view(B, L, G, A)
    if cfg.qk_norm:
        q_BLHA = rms_norm(q_BLHA, p["q_norm_A"], cfg.norm_eps)
        k_BLGA = rms_norm(k_BLGA, p["k_norm_A"], cfg.norm_eps)
    q_BLHA = apply_rope(q_BLHA, cos_LA, sin_LA)
    k_BLGA = apply_rope(k_BLGA, cos_LA, sin_LA)
    o_BHLA = F.scaled_dot_product_attention(
        q_BLHA.transpose(1, 2), k_BLGA.transpose(1, 2), v_BLGA.transpose(1, 2),
        is_causal=True, enable_gqa=H != G)
    return o_BHLA.transpose(1, 2).reshape(B, L, H * A) @ p["w_o_ND"]
