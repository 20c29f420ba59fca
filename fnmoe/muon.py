"""Muon: momentum, then Newton-Schulz orthogonalisation of every weight matrix (DESIGN.md §5).

torch.optim.Muon is the reference: for a weight W_IO (y = x @ W) we give the update that
torch.optim.Muon gives its [out, in] parameter W_IO.T, transposed back. Momentum buffers and
Newton-Schulz outputs are bitwise equal to torch's. The step itself is optax's chain
(s*O, + wd*W, * -lr, then W + update) where torch folds lr*s into one scalar and updates W
in place (W*(1 - lr*wd), then a fused multiply-add); the roundings differ, so params agree
to ~1 ulp per step (checked at 1e-6 relative), not bitwise.

Legend: B matrices batched into one Newton-Schulz call (leading dims of all leaves of one
matrix shape, flattened together), I in, O out (weights are [*, I, O]), R <= C the rows
and columns of the wide view that Newton-Schulz iterates on. QK-clip: L layers, H query heads,
N query and M key features, X latent key/value features (attention.py), 1 a broadcast dim.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from fnmoe.config import ModelConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic: maximal slope at zero, converges to singular values in about [0.7, 1.2]"""
AdjustLR = Literal["original", "match_rms_adamw", "spectral"]


def newton_schulz(G_BIO: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise each matrix [I, O] of G (any leading dims) in bf16.

    Works on torch's [out, in] view G.mT, made wide (transposed when out > in) as
    torch.optim.Muon does, with the same addmm-form updates in baddbmm, so each matrix
    comes out bitwise equal to torch's `_zeropower_via_newtonschulz(G.mT).mT`. The
    iteration runs in four buffers allocated once (fresh large tensors are costly on CPU).
    """
    a, b, c = NS_COEFFICIENTS
    I, O = G_BIO.shape[-2:]
    tall = O > I  # torch's view [O, I] has more rows than columns
    G_BRC = G_BIO.reshape(-1, I, O)
    X_BRC = (G_BRC if tall else G_BRC.mT).to(torch.bfloat16, memory_format=torch.contiguous_format, copy=True)
    # Frobenius norm >= spectral norm, so this puts every singular value in [0, 1]
    X_BRC.div_(X_BRC.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    Y_BRC = torch.empty_like(X_BRC)
    A_BRR = X_BRC.new_empty(X_BRC.shape[0], X_BRC.shape[1], X_BRC.shape[1])
    B_BRR = torch.empty_like(A_BRR)
    for _ in range(steps):
        torch.bmm(X_BRC, X_BRC.mT, out=A_BRR)
        torch.baddbmm(A_BRR, A_BRR, A_BRR, beta=b, alpha=c, out=B_BRR)
        torch.baddbmm(X_BRC, B_BRR, X_BRC, beta=a, out=Y_BRC)
        X_BRC, Y_BRC = Y_BRC, X_BRC
    return (X_BRC if tall else X_BRC.mT).reshape(G_BIO.shape)


def lr_scale(I: int, O: int, adjust_lr: AdjustLR) -> float:
    """The per-matrix lr factor s, from torch's [rows=out, cols=in] view."""
    if adjust_lr == "original":
        return math.sqrt(max(1.0, O / I))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(O, I))
    if adjust_lr == "spectral":
        return math.sqrt(O / I)
    raise ValueError(f"adjust_lr must be 'original', 'match_rms_adamw' or 'spectral', got {adjust_lr!r}")


def _orthogonalize(U_leaves: list[Tensor], steps: int, eps: float) -> list[Tensor]:
    """newton_schulz on every leaf, with one batched call per (matrix shape, device)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, U in enumerate(U_leaves):
        groups[(*U.shape[-2:], U.device)].append(i)
    out: list[Tensor | None] = [None] * len(U_leaves)
    for (I, O, device), idx in groups.items():
        sizes = [U_leaves[i].numel() // (I * O) for i in idx]
        U_BIO = torch.empty(sum(sizes), I, O, dtype=torch.bfloat16, device=device)
        for i, U_part in zip(idx, U_BIO.split(sizes)):
            U_part.copy_(U_leaves[i].reshape(-1, I, O))
        for i, O_part in zip(idx, newton_schulz(U_BIO, steps, eps).split(sizes)):
            out[i] = O_part.reshape(U_leaves[i].shape)
    return out


class ScaleByMuonState(NamedTuple):
    momentum: Tensor
    mu: Tree
    """momentum buffers M, one per leaf, in momentum_dtype"""


def scale_by_muon(momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                  adjust_lr: AdjustLR = "match_rms_adamw", eps: float = 1e-7,
                  momentum_dtype: torch.dtype = torch.float32) -> GradientTransformation:
    """s * NS(U) per matrix: M = lerp(M, G, 1-mu); U = lerp(G, M, mu) (Nesterov) or M.

    Leaves need >= 2 dims: the last two are [in, out], leading dims are a batch (experts).
    Follow with add_decayed_weights and scale_by_learning_rate for the full Muon step.
    """
    lr_scale(1, 1, adjust_lr)  # fail at construction on an unknown name

    def update(updates: Tree, state: ScaleByMuonState, params: Tree = None) -> tuple[Tree, ScaleByMuonState]:
        paths, G_leaves, rebuild = tree_flatten_with_paths(updates)
        for path, G in zip(paths, G_leaves):
            if G.ndim < 2:
                raise ValueError(f"muon: leaf '{path}' has shape {tuple(G.shape)}; Muon needs >= 2 dims "
                                 "(label it 'adamw')")
        mu = state.momentum
        # the same lerps as torch.optim.Muon, so the buffers are bitwise equal
        M_leaves = [M.lerp(G.to(M.dtype), 1 - mu) for G, M in zip(G_leaves, _leaves(state.mu), strict=True)]
        U_leaves = [G.lerp(M.to(G.dtype), mu) for G, M in zip(G_leaves, M_leaves)] if nesterov else M_leaves
        O_leaves = _orthogonalize(U_leaves, ns_steps, eps)
        # back to the update dtype before scaling: scaling bf16 O would round it again (~1e-4 off torch)
        out = [O.to(G.dtype, copy=True).mul_(lr_scale(*G.shape[-2:], adjust_lr)) for G, O in zip(G_leaves, O_leaves)]
        return rebuild(out), ScaleByMuonState(mu, rebuild(M_leaves))

    def init(params: Tree) -> ScaleByMuonState:
        return ScaleByMuonState(_scalar(momentum, _device(params)),
                                tree_map(lambda p: torch.zeros_like(p, dtype=momentum_dtype), params))
    return GradientTransformation(init, update)


def muon(lr: ScalarOrSchedule, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
         ns_steps: int = 5, adjust_lr: AdjustLR = "match_rms_adamw", adamw_lr: ScalarOrSchedule | None = None,
         adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
         adamw_weight_decay: float | None = None, labels: PerLeaf | None = None,
         momentum_dtype: torch.dtype = torch.float32) -> GradientTransformation:
    """Muon on matrices, AdamW on the rest, buffers frozen (labels: `default_labels`, or `labels=`).

    Muon leaves: W <- W(1 - lr*wd) - lr*s*NS(U), the decay with the unadjusted lr. AdamW
    leaves: lr adamw_lr (None: lr), decay adamw_weight_decay (None: weight_decay) on
    matrices only. Set hyperparameters between steps with optim.set_hyperparams.
    """
    return partition({
        "muon": chain(scale_by_muon(momentum, nesterov, ns_steps, adjust_lr, momentum_dtype=momentum_dtype),
                      add_decayed_weights(weight_decay),
                      scale_by_learning_rate(lr)),
        "adamw": adamw(lr if adamw_lr is None else adamw_lr, *adamw_betas, adamw_eps,
                       weight_decay if adamw_weight_decay is None else adamw_weight_decay, mask=decay_mask),
        "frozen": set_to_zero(),
    }, default_labels if labels is None else labels)


QK_CLIP_ALPHA = 0.5
"""MuonClip's split of gamma between a head's queries (gamma^alpha) and keys (gamma^(1-alpha))"""


def _scale_columns(w_IO: Tensor, s_O: Tensor) -> Tensor:
    # a factor of exactly 1 leaves a column bitwise unchanged
    return (w_IO * s_O.to(w_IO.dtype)).requires_grad_(w_IO.requires_grad)


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
    q_N = torch.cat([root_H1.expand(-1, J), gamma_H1.expand(-1, P)], dim=1).flatten()
    kv_X = torch.cat([root_H1.expand(-1, J), torch.ones_like(gamma_H1).expand(-1, U)], dim=1).flatten()
    q_key = "w_q_DN" if "w_q_DN" in p else "w_q_b_QN"
    return {**p, q_key: _scale_columns(p[q_key], q_N), "w_kv_b_CX": _scale_columns(p["w_kv_b_CX"], kv_X)}


@torch.no_grad()
def qk_clip(params: Tree, max_logits_LH: Tensor, cfg: ModelConfig, tau: float | Tensor) -> Tree:
    """MuonClip (Kimi K2): new params where every head whose recorded max logit exceeds tau has its
    query/key weights rescaled by gamma = tau / max_logit, which brings that logit down to tau.

    max_logits_LH per layer and query head (aux of the forward with record_max_logits). Other heads
    get a factor of exactly 1, so their weights are bitwise unchanged; so are all other leaves.
    """
    gamma_LH = torch.where(max_logits_LH > tau, tau / max_logits_LH, 1.0)
    clip = _clip_mla if cfg.attention == "mla" else _clip_gqa
    layers = {i: {**layer, "attn": clip(layer["attn"], gamma_LH[int(i)], cfg)} for i, layer in params["layers"].items()}
    return {**params, "layers": layers}


# At the bottom, mirroring the import of muon at the bottom of optim.py: the names are only
# used inside functions, so either module can be imported first without a circular-import error.
from fnmoe.optim import (GradientTransformation, PerLeaf, ScalarOrSchedule, Tree, _device, _leaves,  # noqa: E402
                         _scalar, adamw, add_decayed_weights, chain, decay_mask, default_labels, partition,
                         scale_by_learning_rate, set_to_zero, tree_flatten_with_paths, tree_map)
