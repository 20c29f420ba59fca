"""MoE block: route -> permute -> expert_mlp -> unpermute, plus shared experts.

Legend: T tokens (B·L), D model, F expert hidden, E experts, K top-k, R routed rows (T·K).
Expert weights are stacked [E, in, out]. Dropless: every token reaches its K experts, so R is
fixed and no shape depends on routing (a compiled region never recompiles as counts change).

The grouped path runs all experts as one `torch._grouped_mm` (bf16, dims aligned to 16 bytes);
the loop path (fp32, or unaligned dims) runs one matmul per expert and is the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fnmoe.attention import upcast
from fnmoe.config import ModelConfig

try:  # private torch API, imported here only
    _grouped_mm = torch._grouped_mm
except AttributeError:  # pragma: no cover - torch without grouped GEMM
    _grouped_mm = None


def route(x_TD: torch.Tensor, router_DE: torch.Tensor, cfg: ModelConfig):
    """Softmax top-k router in fp32: (weights_TK fp32, idx_TK, probs_TE)."""
    m = cfg.moe
    probs_TE = torch.softmax(upcast(x_TD) @ upcast(router_DE), dim=-1)
    w_TK, idx_TK = torch.topk(probs_TE, m.top_k, dim=-1)
    if m.norm_topk_prob:
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    return w_TK * m.routed_scaling_factor, idx_TK, probs_TE


def permute(x_TD: torch.Tensor, idx_TK: torch.Tensor, n_experts: int):
    """Rows grouped by expert: (x_RD, counts_E int64, order_R) with x_RD = x_TD[order_R // K]."""
    K = idx_TK.shape[1]
    flat_R = idx_TK.reshape(-1)
    order_R = torch.argsort(flat_R, stable=True)
    counts_E = torch.zeros(n_experts, dtype=torch.int64, device=x_TD.device)
    counts_E = counts_E.scatter_add(0, flat_R, torch.ones_like(flat_R))
    return x_TD[order_R // K], counts_E, order_R


def unpermute(y_RD: torch.Tensor, order_R: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """Combine each token's K expert outputs, weighted; a gather (deterministic), not a scatter."""
    T, K = w_TK.shape
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    y_TKD = y_RD[inverse_R].view(T, K, -1)
    return torch.bmm(w_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)


def grouped_ok(x: torch.Tensor, *dims: int) -> bool:
    """torch._grouped_mm needs bf16 (under compile) and 16-byte-aligned row strides."""
    return (_grouped_mm is not None and x.dtype == torch.bfloat16
            and all(d * x.element_size() % 16 == 0 for d in dims))


def expert_mlp(x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E, grouped: bool) -> torch.Tensor:
    """SwiGLU of each row with its expert's weights; rows are sorted by expert."""
    if grouped:
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
        h_RF = F.silu(_grouped_mm(x_RD, w_gate_EDF, offs=offs_E)) * _grouped_mm(x_RD, w_up_EDF, offs=offs_E)
        return _grouped_mm(h_RF, w_down_EFD, offs=offs_E)
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):  # host sync: the reference path only
        xe = x_RD[start:start + n]
        outs.append((F.silu(xe @ w_gate_EDF[e]) * (xe @ w_up_EDF[e])) @ w_down_EFD[e])
        start += n
    return torch.cat(outs) if outs else x_RD[:0]


def swiglu(p: dict, x_TD: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU MLP; p holds w_gate_DF, w_up_DF, w_down_FD."""
    return (F.silu(x_TD @ p["w_gate_DF"]) * (x_TD @ p["w_up_DF"])) @ p["w_down_FD"]


def use_grouped(cfg: ModelConfig, dtype: torch.dtype) -> bool:
    impl = cfg.moe.impl
    if impl == "loop":
        return False
    probe = torch.empty(0, dtype=dtype)
    ok = grouped_ok(probe, cfg.dim, cfg.moe.expert_hidden)
    if impl == "grouped" and not ok:
        raise ValueError(
            f"model.moe.impl='grouped' needs bfloat16 compute and model.dim={cfg.dim}, "
            f"model.moe.expert_hidden={cfg.moe.expert_hidden} multiples of 8 (16-byte rows)")
    return ok


def balance_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss E·Σ_e f_e·P_e (1.0 when perfectly balanced):
    f_e the fraction of routed rows sent to e, P_e the mean router probability of e."""
    T, E = probs_TE.shape
    return E * (counts_E.to(probs_TE.dtype) / (T * top_k) * probs_TE.mean(0)).sum()


def moe_block(p: dict, x_BLD: torch.Tensor, cfg: ModelConfig, grouped: bool):
    """(out_BLD, (counts_E, balance loss)): routed experts (+ shared experts) for every token."""
    B, L, D = x_BLD.shape
    x_TD = x_BLD.reshape(B * L, D)
    w_TK, idx_TK, probs_TE = route(x_TD, p["router_DE"], cfg)
    x_RD, counts_E, order_R = permute(x_TD, idx_TK, cfg.moe.n_experts)
    y_RD = expert_mlp(x_RD, p["w_gate_EDF"], p["w_up_EDF"], p["w_down_EFD"], counts_E, grouped)
    out_TD = unpermute(y_RD, order_R, w_TK)
    if "shared" in p:
        out_TD = out_TD + swiglu(p["shared"], x_TD)
    return out_TD.view(B, L, D), (counts_E, balance_loss(probs_TE, counts_E, cfg.moe.top_k))
