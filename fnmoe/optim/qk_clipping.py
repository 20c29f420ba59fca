"""QK-clip (the clip of Kimi K2's MuonClip): after an optimizer step, rescale the query and key
weights of every attention head whose largest attention logit exceeded tau (docs/design.md §5).

It is a function of the params and the logits the forward recorded, not a gradient transform:
it runs after any optimizer's step (Muon or AdamW), and on plain or DTensor params alike, since
it only scales whole columns by factors every rank knows.

Legend: N layers, H query heads, I in and O out of any weight [I, O] (y = x @ w), 1 a broadcast
dim; as in attention.py: D model, A head dim, J no-RoPE and P RoPE dims of a head, U value head
dim, Q q-lora and C kv-lora rank, X latent key/value features. Weights keep their tree names
(w_q_DN: N query features there, as in params.py).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from fnmoe.config import ModelConfig
from fnmoe.optim.base import Tree

QK_CLIP_ALPHA = 0.5
"""MuonClip's split of gamma between a head's queries (gamma^alpha) and keys (gamma^(1-alpha))"""


def _scale_columns(w_IO: Tensor, s_O: Tensor) -> Tensor:
    # a factor of exactly 1 leaves a column bitwise unchanged
    s_O = s_O.to(w_IO.dtype)
    if isinstance(w_IO, DTensor):  # the same factors on every rank: each scales the columns of its shard
        s_O = DTensor.from_local(s_O, w_IO.device_mesh, [Replicate()] * w_IO.device_mesh.ndim)
    return (w_IO * s_O).requires_grad_(w_IO.requires_grad)


def _clip_gqa(p: dict, gamma_H: Tensor, cfg: ModelConfig) -> dict:
    """Queries by gamma^alpha and keys by gamma^(1-alpha) where each kv head serves one query head;
    where kv heads are shared, queries alone by gamma (scaling a shared key would clip its other heads)."""
    A = cfg.head_dim_
    if cfg.n_kv_heads != cfg.n_heads:
        return {**p, "w_q_DN": _scale_columns(p["w_q_DN"], gamma_H.repeat_interleave(A))}
    return {**p, "w_q_DN": _scale_columns(p["w_q_DN"], gamma_H.pow(QK_CLIP_ALPHA).repeat_interleave(A)),
            "w_k_DM": _scale_columns(p["w_k_DM"], gamma_H.pow(1 - QK_CLIP_ALPHA).repeat_interleave(A))}


def _clip_mla(p: dict, gamma_H: Tensor, cfg: ModelConfig) -> dict:
    """q_nope and k_nope by sqrt(gamma), q_rope by gamma; the rope key, shared by all heads, is untouched.
    Columns per head: queries [nope J | rope P] of w_q_DN or w_q_b_QN, latent [k_nope J | v U] of w_kv_b_CX."""
    J, P, U = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    root_H1, gamma_H1 = gamma_H.sqrt()[:, None], gamma_H[:, None]
    q_O = torch.cat([root_H1.expand(-1, J), gamma_H1.expand(-1, P)], dim=1).flatten()
    kv_X = torch.cat([root_H1.expand(-1, J), torch.ones_like(gamma_H1).expand(-1, U)], dim=1).flatten()
    q_key = "w_q_DN" if "w_q_DN" in p else "w_q_b_QN"
    return {**p, q_key: _scale_columns(p[q_key], q_O), "w_kv_b_CX": _scale_columns(p["w_kv_b_CX"], kv_X)}


@torch.no_grad()
def qk_clip(params: Tree, max_logits_NH: Tensor, cfg: ModelConfig, tau: float | Tensor) -> Tree:
    """MuonClip (Kimi K2): new params where every head whose recorded max logit exceeds tau has its
    query/key weights rescaled by gamma = tau / max_logit, which brings that logit down to tau.

    max_logits_NH per layer and query head (aux of the forward with record_max_logits). Other heads
    get a factor of exactly 1, so their weights are bitwise unchanged; so are all other leaves.
    """
    gamma_NH = torch.where(max_logits_NH > tau, tau / max_logits_NH, 1.0)
    clip = _clip_mla if cfg.attention == "mla" else _clip_gqa
    layers = {i: {**layer, "attn": clip(layer["attn"], gamma_NH[int(i)], cfg)} for i, layer in params["layers"].items()}
    return {**params, "layers": layers}
