"""MoE block: route -> permute -> expert_mlp -> unpermute, plus shared experts; the router-bias rule.

Legend: B batch, L sequence, T tokens (B·L), D model, F expert hidden, E experts, K top-k,
R routed rows (T·K; per sequence L·K), N MoE layers,
C rows per expert slab (padded path), P slab slots (E·C), Z the experts and the empty slots' bin (E + 1).
Expert weights are stacked [E, in, out]. Dropless by default: every token reaches its K experts, so R is
fixed and no shape depends on routing (a compiled region never recompiles as counts change); with
model.moe.capacity_factor rows over an expert's capacity are dropped (`over_capacity`), as are empty slots.

Expert GEMM paths (`expert_gemm` picks one): grouped runs all experts as one ragged grouped GEMM:
torch's grouped_mm (`_torch.grouped_mm`) on CUDA (bf16, dims aligned to 16 bytes), fnmoe.kernels.gemm's op on CPU (any
float dtype; one parallel region, no padding). Padded puts each expert's rows in a slab of C rows, C the
step's largest count rounded up to 16 (P = E·C slots), and runs batched matmuls: CPU's path when
fnmoe.kernels.gemm cannot build (torch's CPU `_grouped_mm` wakes the threads once per expert: slower
than either). The loop path runs one matmul per expert and is the reference.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from fnmoe import _torch
from fnmoe.kernels import fp8_gemm
from fnmoe.kernels import gemm as cpu_gemm
from fnmoe.compile import size_hint
from fnmoe.config import ModelConfig
from fnmoe.models.routing import Router, may_leave_empty, route, spare_slots

_grouped_mm = _torch.grouped_mm  # None on a torch without it


class _RepeatRows(torch.autograd.Function):
    """x_RD = x_TD[order_R // K]: each token K times, in expert order. Its backward gathers the
    rows back into token order and sums each token's K, where indexing's would scatter-add.
    vmap batches it through its ops (generate_vmap_rule). No custom jvp: dynamo does not trace an
    autograd.Function that has one, and forward AD runs the dense path (fnmoe.models.transforms)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x_TD, order_R, inverse_R, K: int):
        return x_TD.index_select(0, order_R // K)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])
        ctx.K = inputs[3]

    @staticmethod
    def backward(ctx, g_RD):
        (inverse_R,) = ctx.saved_tensors
        T = inverse_R.shape[0] // ctx.K
        return sum_k(g_RD.index_select(0, inverse_R).view(T, ctx.K, -1)), None, None, None


def sum_k(y_TKD: torch.Tensor) -> torch.Tensor:
    """y_TKD.sum(1). Compiled, as K adds along D accumulated in fp32: for a reduction over K,
    inductor's CPU code vectorizes the K axis, one gathered index per lane for every element
    (at K=8 the MoE backward's slowest kernel, far slower than the adds)."""
    if not torch.compiler.is_compiling():
        return y_TKD.sum(1)
    acc_TD = y_TKD[:, 0].float()
    for k in range(1, y_TKD.shape[1]):
        acc_TD = acc_TD + y_TKD[:, k].float()
    return acc_TD.to(y_TKD.dtype)


class _GatherRows(torch.autograd.Function):
    """x[index] for an index map that reads each row of x exactly once (a permutation, or rows into
    padded slots and back), given `back`, the map of the other direction: the backward is the
    gather g[back], deterministic and without the scatter-add indexing's backward would run.
    With zero (back_zero), an index equal to the row count reads a zero row (an empty slot).
    vmap batches it through its ops (generate_vmap_rule); no custom jvp (as _RepeatRows)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, index, back, zero: bool, back_zero: bool):
        return _rows(x, index, zero)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])
        ctx.back_zero = inputs[4]

    @staticmethod
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        return _rows(g, back, ctx.back_zero), None, None, None, None


def _rows(x: torch.Tensor, index: torch.Tensor, zero: bool) -> torch.Tensor:
    """x[index]; with zero, index == len(x) reads a zero row."""
    if zero:
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return x.index_select(0, index)


def permute(x_TD: torch.Tensor, idx_TK: torch.Tensor, n_experts: int):
    """Rows grouped by expert: (x_RD, counts_E int64, order_R, inverse_R) with
    x_RD = x_TD[order_R // K] and inverse_R the inverse permutation of order_R."""
    K = idx_TK.shape[1]
    flat_R = idx_TK.reshape(-1)
    order_R = torch.argsort(flat_R, stable=True)
    inverse_R = torch.argsort(order_R)  # a permutation's inverse, without an in-place write
    return _RepeatRows.apply(x_TD, order_R, inverse_R, K), expert_counts(idx_TK, n_experts), order_R, inverse_R


def expert_counts(idx_TK: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows routed to each expert, int64 [E]; empty slots (index E: routing.spare_slots) count for none."""
    flat_R = idx_TK.reshape(-1)
    counts_E = torch.zeros(n_experts + 1, dtype=torch.int64, device=idx_TK.device)
    return counts_E.scatter_add(0, flat_R, torch.ones_like(flat_R))[:n_experts]


def over_capacity(counts_E: torch.Tensor, capacity: int, n_rows: int,
                  before_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows each expert keeps, indices of the kept rows) when each expert takes at most capacity of
    the n_rows rows; rows are sorted by expert, and within an expert in token order, so the first ones stay
    (rows past counts_E's sum are empty slots, routing.spare_slots': none stays). before_E: rows each
    expert took before these (earlier token chunks), counted against its capacity."""
    E = counts_E.shape[0]
    counts_Z = torch.cat([counts_E, (n_rows - counts_E.sum()).view(1)])  # the experts, then the empty slots
    start_Z = torch.cumsum(counts_Z, 0) - counts_Z
    expert_R = torch.repeat_interleave(torch.arange(E + 1, device=counts_E.device), counts_Z, output_size=n_rows)
    rank_R = torch.arange(expert_R.shape[0], device=counts_E.device) - start_Z[expert_R]
    if before_E is not None:
        rank_R = rank_R + F.pad(before_E, (0, 1))[expert_R]
    kept_R = ((rank_R < capacity) & (expert_R < E)).nonzero().squeeze(1)
    size_hint(kept_R.shape[0], torch.sym_min(capacity * E, n_rows))  # every expert full
    if before_E is None:
        return counts_E.clamp(max=capacity), kept_R
    return (before_E + counts_E).clamp(max=capacity) - before_E.clamp(max=capacity), kept_R


def kept_TK(idx_TK: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """over_capacity's choice as a bool [T, K] mask in token order, with no data-dependent shape
    (what torch.func's vmap takes): a row stays while it is among the first `capacity` rows of its
    expert, counted in token order."""
    hit_RE = idx_TK.reshape(-1, 1) == torch.arange(n_experts, device=idx_TK.device)
    rank_R = (hit_RE.cumsum(0) * hit_RE).sum(-1) - 1
    return (rank_R < capacity).view(idx_TK.shape)


def unpermute(y_RD: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """Combine each token's K expert outputs, weighted; gathers both ways (deterministic)."""
    T, K = w_TK.shape
    y_TKD = _GatherRows.apply(y_RD, inverse_R, order_R, False, False).view(T, K, -1)
    return torch.bmm(w_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)


def grouped_ok(x: torch.Tensor, *dims: int) -> bool:
    """torch's grouped_mm needs bf16 (under compile) and 16-byte-aligned row strides."""
    return (_grouped_mm is not None and x.dtype == torch.bfloat16
            and all(d * x.element_size() % 16 == 0 for d in dims))


EXPERT_STACKS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")

PAD_ROWS = 16  # slab rows are a multiple of this (at least this): aligned GEMMs, and C > 1 for inductor


def padded_slots(counts_E: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(slot_R, src_P, C) for rows sorted by expert and slabs of C rows per expert (P = E·C slots):
    row r goes to slot e·C + (its rank within expert e); src_P is the row each slot holds, n_rows
    for an empty slot. C is read on the host (under compile an unbacked size: one graph for every
    routing)."""
    C = ((counts_E.max() + PAD_ROWS - 1) // PAD_ROWS * PAD_ROWS).clamp(min=PAD_ROWS).item()
    _torch.check(C >= PAD_ROWS)
    E = counts_E.shape[0]
    size_hint(C, (n_rows + E * PAD_ROWS - 1) // (E * PAD_ROWS) * PAD_ROWS + PAD_ROWS)  # balanced: mean + a block
    end_E = torch.cumsum(counts_E, 0)
    start_E = end_E - counts_E
    r_R = torch.arange(n_rows, device=counts_E.device)
    expert_R = torch.searchsorted(end_E, r_R, right=True)
    p_P = torch.arange(counts_E.shape[0] * C, device=counts_E.device)
    expert_P, rank_P = p_P // C, p_P % C
    src_P = torch.where(rank_P < counts_E[expert_P], start_E[expert_P] + rank_P, n_rows)
    return expert_R * C + r_R - start_E[expert_R], src_P, C


def padded_expert_mlp(x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E) -> torch.Tensor:
    """expert_mlp as batched matmuls over [E, C] slabs of rows (empty slots are zero rows whose
    outputs are never read)."""
    (R, D), E = x_RD.shape, counts_E.shape[0]
    slot_R, src_P, C = padded_slots(counts_E, R)
    x_ECD = _GatherRows.apply(x_RD, src_P, slot_R, True, False).view(E, C, D)  # empty slots zero
    h_ECF = F.silu(torch.bmm(x_ECD, w_gate_EDF)) * torch.bmm(x_ECD, w_up_EDF)
    return _GatherRows.apply(torch.bmm(h_ECF, w_down_EFD).view(E * C, D), slot_R, src_P, False, True)


def dense_expert_mlp(x_TD, gate_TE, w_gate_EDF, w_up_EDF, w_down_EFD) -> torch.Tensor:
    """Every expert's SwiGLU of every token, summed with the routing weights gate_TE (zero for
    experts a token does not reach): E/K times the routed FLOPs, [T, E, F] in memory, and no ragged
    group or host read, so torch.func's vmap and forward AD take it (moe.impl="dense")."""
    h_TEF = F.silu(torch.einsum("td,edf->tef", x_TD, w_gate_EDF)) * torch.einsum("td,edf->tef", x_TD, w_up_EDF)
    return (gate_TE.to(h_TEF.dtype)[:, :, None] * h_TEF).flatten(1) @ w_down_EFD.flatten(0, 1)


def expert_mlp(x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E, gemm: str) -> torch.Tensor:
    """SwiGLU of each row with its expert's weights; rows are sorted by expert. gemm: "grouped",
    "padded" or "loop" (see expert_gemm); all three GEMMs in fp8 under mesh.expert_gemm_dtype float8_e4m3fn
    (fnmoe.kernels.fp8_gemm, whatever gemm)."""
    if fp8_gemm.active():
        return fp8_gemm.expert_mlp(x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E)
    if gemm == "grouped":
        if x_RD.device.type == "cpu":
            end_E = torch.cumsum(counts_E, 0)
            h_RF = F.silu(cpu_gemm.grouped_mm(x_RD, w_gate_EDF, end_E)) * cpu_gemm.grouped_mm(x_RD, w_up_EDF, end_E)
            return cpu_gemm.grouped_mm(h_RF, w_down_EFD, end_E)
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
        h_RF = F.silu(_grouped_mm(x_RD, w_gate_EDF, offs=offs_E)) * _grouped_mm(x_RD, w_up_EDF, offs=offs_E)
        return _grouped_mm(h_RF, w_down_EFD, offs=offs_E)
    if gemm == "padded":
        return padded_expert_mlp(x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E)
    if gemm != "loop":
        raise ValueError(f"unknown expert GEMM path gemm={gemm!r}: expert_mlp takes 'grouped', 'padded' or 'loop'")
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):  # host sync: the reference path only
        xe = x_RD[start:start + n]
        outs.append((F.silu(xe @ w_gate_EDF[e]) * (xe @ w_up_EDF[e])) @ w_down_EFD[e])
        start += n
    return torch.cat(outs) if outs else x_RD[:0]


def swiglu(p: dict, x_TD: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU MLP; p holds w_gate_DF, w_up_DF, w_down_FD."""
    return (F.silu(x_TD @ p["w_gate_DF"]) * (x_TD @ p["w_up_DF"])) @ p["w_down_FD"]


def expert_gemm(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """The expert GEMM path for compute in dtype on device: model.moe.impl, and for "auto" grouped
    where it runs (CPU: fnmoe.kernels.gemm built; CUDA: grouped_ok), else padded where grouped_ok holds
    (bf16, aligned dims), else the loop."""
    impl = cfg.moe.impl
    if impl in ("loop", "padded", "dense"):
        return impl
    aligned = grouped_ok(torch.empty(0, dtype=dtype), cfg.dim, cfg.moe.expert_hidden)
    ok = cpu_gemm.available() if torch.device(device).type == "cpu" else aligned
    if impl == "grouped" and not ok:
        raise ValueError(
            "model.moe.impl='grouped' needs, on CPU, fnmoe's grouped GEMM extension (it did not build: see "
            "the warning), elsewhere bfloat16 compute and model.dim="
            f"{cfg.dim}, model.moe.expert_hidden={cfg.moe.expert_hidden} multiples of 8 (16-byte rows)")
    if ok:
        return "grouped"
    return "padded" if aligned else "loop"


def balance_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss E·Σ_e f_e·P_e (1.0 when perfectly balanced):
    f_e the fraction of routed rows sent to e, P_e the mean router probability of e."""
    T, E = probs_TE.shape
    return E * (counts_E.to(probs_TE.dtype) / (T * top_k) * probs_TE.mean(0)).sum()


def balance_loss_part(probs_sum_NE: torch.Tensor, counts_NE: torch.Tensor, n_tokens: int, top_k: int):
    """This rank's part of the Switch loss of a batch spread over ranks, mean over N MoE layers:
    E·Σ_e f_e·(Σ_t p_te over this rank's tokens)/T, with f_e and T from the whole batch (counts_NE
    summed over ranks, n_tokens = T). The loss is not a mean over tokens, but this part is linear
    in the rank's probabilities, so the parts sum to the whole batch's loss and gradient."""
    E = probs_sum_NE.shape[-1]
    f_NE = counts_NE.to(probs_sum_NE.dtype) / (n_tokens * top_k)
    return (E * f_NE * probs_sum_NE / n_tokens).sum(-1).mean()


def seq_balance_loss(probs_BLE: torch.Tensor, idx_BLK: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the Switch loss of each sequence, averaged over
    sequences (probs are normalised over experts; 1.0 when every sequence is balanced)."""
    B, L, E = probs_BLE.shape
    K = idx_BLK.shape[-1]
    counts_BE = torch.zeros(B, E + 1, dtype=probs_BLE.dtype, device=probs_BLE.device)  # + empty slots' bin
    ones_BR = torch.ones(B, L * K, dtype=probs_BLE.dtype, device=probs_BLE.device)
    counts_BE = counts_BE.scatter_add(1, idx_BLK.reshape(B, L * K), ones_BR)[:, :E]
    return (E * counts_BE / (L * K) * probs_BLE.mean(1)).sum(-1).mean()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2; keeps logits small."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


GEMMS = ("grouped", "padded", "loop", "dense")
"""the expert GEMM paths moe_block takes (expert_gemm picks one from model.moe.impl)"""


def moe_block(p: dict, x_BLD: torch.Tensor, cfg: ModelConfig, gemm: str, routed: Callable | None = None,
              router: Router | None = None, layer: int | None = None):
    """(out_BLD, stats): routed experts (+ shared experts) for every token. p holds w_router_DE,
    the expert stacks, optionally shared.* and router_bias_E, and with expert parallelism ep
    (a fnmoe.models.seams.Exchange: the stacks then hold that ep rank's experts; FSDP's params source
    adds it, fnmoe.parallel.fsdp). stats: counts_E,
    balance_loss, probs_sum_E (the Switch loss's parts, for data parallelism), dropped (rows over
    capacity), router_logits_TE (fp32, with its graph), and seq_balance_loss / z_loss when their coefficients
    are non-zero. router (fnmoe.models.routing.Router) routes, given layer and p["router"] if it names them;
    None: the built-in of model.moe.score_func. routed(p, x_TD, w_TK, idx_TK, cfg, gemm, empty) -> (out_TD,
    counts_E, kept_E), the shared experts included, runs the experts in place of the unchunked sparse path
    (empty: idx_TK may hold empty slots): transformer passes moe_chunks.chunked for model.moe.token_chunks > 1."""
    if gemm not in GEMMS:
        raise ValueError(f"unknown expert GEMM path gemm={gemm!r}: one of {', '.join(map(repr, GEMMS))}")
    B, L, D = x_BLD.shape
    x_TD = x_BLD.reshape(B * L, D)
    w_TK, idx_TK, probs_TE, logits_TE, empty = route_slots(p, x_TD, cfg, router, layer)
    if gemm == "dense":
        out_TD, counts_E, kept_E = _dense_routed(p, x_TD, w_TK, idx_TK, cfg)
    elif routed is not None:
        out_TD, counts_E, kept_E = routed(p, x_TD, w_TK, idx_TK, cfg, gemm, empty)
    else:
        out_TD, counts_E, kept_E = _sparse_routed(p, x_TD, w_TK, idx_TK, cfg, gemm, empty)
    if "shared" in p and (gemm == "dense" or routed is None):
        out_TD = out_TD + swiglu(p["shared"], x_TD)
    return out_TD.view(B, L, D), moe_stats(cfg, probs_TE, logits_TE, idx_TK, counts_E, kept_E, B)


def route_slots(p: dict, x_TD, cfg: ModelConfig, router: Router | None, layer: int | None):
    """route's four, a user's router's empty slots moved past the last expert (spare_slots), and empty."""
    w_TK, idx_TK, probs_TE, logits_TE = route(x_TD, p["w_router_DE"], cfg, p.get("router_bias_E"), router,
                                              layer=layer, params=p.get("router"))
    if may_leave_empty(router):
        return *spare_slots(w_TK, idx_TK, cfg.moe.n_experts), probs_TE, logits_TE, True
    return w_TK, idx_TK, probs_TE, logits_TE, False


def moe_stats(cfg: ModelConfig, probs_TE, logits_TE, idx_TK, counts_E, kept_E, B: int) -> dict:
    """moe_block's stats (B sequences of its T tokens)."""
    m = cfg.moe
    stats = {"counts_E": counts_E, "balance_loss": balance_loss(probs_TE, counts_E, m.top_k),
             "probs_sum_E": probs_TE.sum(0), "dropped": (counts_E - kept_E).sum(),
             "router_logits_TE": logits_TE}  # with its graph: a user's loss may take it (hidden_states drops it else)
    if m.seq_aux_loss_coeff:
        stats["seq_balance_loss"] = seq_balance_loss(probs_TE.view(B, -1, m.n_experts), idx_TK.view(B, -1, m.top_k))
    if m.z_loss_coeff:
        stats["z_loss"] = z_loss(logits_TE)
    return stats


def expert_capacity(cfg: ModelConfig, n_rows: int) -> int:
    return math.ceil(cfg.moe.capacity_factor * n_rows / cfg.moe.n_experts)


class Rows(NamedTuple):
    """A set of tokens' routed rows sorted by expert (`sorted_rows`), those over capacity left out."""
    x_RD: torch.Tensor            # the rows that reach their experts
    counts_E: torch.Tensor        # rows routed to each expert
    kept_E: torch.Tensor          # rows each expert takes (counts_E without a capacity)
    order_R: torch.Tensor         # permute's order and inverse, over all routed rows
    inverse_R: torch.Tensor
    keep_R: torch.Tensor | None   # which of them reach their experts (None: all)


def sorted_rows(x_TD, idx_TK, cfg: ModelConfig, n_rows: int | None = None, before_E=None, empty=False) -> Rows:
    """x_TD's routed rows sorted by expert; under a capacity of n_rows (default: these tokens' rows)
    each expert takes its first rows in token order, after the before_E it took already. empty:
    idx_TK may hold empty slots, left out as rows over capacity are."""
    x_RD, counts_E, order_R, inverse_R = permute(x_TD, idx_TK, cfg.moe.n_experts)
    kept_E, keep_R = counts_E, None
    if cfg.moe.capacity_factor or empty:
        capacity = expert_capacity(cfg, n_rows or x_RD.shape[0]) if cfg.moe.capacity_factor else x_RD.shape[0]
        kept_E, keep_R = over_capacity(counts_E, capacity, x_RD.shape[0], before_E)
        x_RD = x_RD[keep_R]
    return Rows(x_RD, counts_E, kept_E, order_R, inverse_R, keep_R)


def combined(rows: Rows, y_RD: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """Each token's experts' outputs (y_RD, one per row of rows.x_RD) summed with its weights."""
    if rows.keep_R is not None:  # dropped rows add nothing to their token's output
        y_RD = y_RD.new_zeros(rows.order_R.shape[0], y_RD.shape[1]).index_put((rows.keep_R,), y_RD)
    return unpermute(y_RD, rows.order_R, rows.inverse_R, w_TK)


def _sparse_routed(p: dict, x_TD, w_TK, idx_TK, cfg: ModelConfig, gemm: str, empty: bool = False):
    """(routed experts' output_TD, counts_E, kept_E): each row through its expert only."""
    rows = sorted_rows(x_TD, idx_TK, cfg, empty=empty)
    if "ep" in p:  # expert parallel: the stacks hold this ep rank's experts only
        y_RD = p["ep"].experts(expert_mlp, rows.x_RD, rows.kept_E, p["w_gate_EDF"], p["w_up_EDF"], p["w_down_EFD"],
                               gemm)
    else:
        y_RD = expert_mlp(rows.x_RD, p["w_gate_EDF"], p["w_up_EDF"], p["w_down_EFD"], rows.kept_E, gemm)
    return combined(rows, y_RD, w_TK), rows.counts_E, rows.kept_E


def _dense_routed(p: dict, x_TD, w_TK, idx_TK, cfg: ModelConfig):
    """_sparse_routed through dense_expert_mlp: the same output and counts, no shape or host read
    that depends on the routing."""
    if "ep" in p:
        raise ValueError("model.moe.impl='dense' runs every expert on every token: it takes no expert "
                         "parallelism (mesh.ep > 1)")
    E = cfg.moe.n_experts
    counts_E = expert_counts(idx_TK, E)
    if cfg.moe.capacity_factor:
        keep_TK = kept_TK(idx_TK, E, expert_capacity(cfg, idx_TK.numel()))
        w_TK = w_TK * keep_TK
        kept_E = expert_counts(idx_TK.masked_fill(~keep_TK, E), E)  # dropped rows go to the spare bin
    else:
        kept_E = counts_E
    gate_TE = (w_TK[:, :, None] * (idx_TK[:, :, None] == torch.arange(E, device=idx_TK.device))).sum(1)
    return dense_expert_mlp(x_TD, gate_TE, p["w_gate_EDF"], p["w_up_EDF"], p["w_down_EFD"]), counts_E, kept_E


def update_router_bias(params: dict, counts_NE: torch.Tensor | None, cfg: ModelConfig) -> dict:
    """DeepSeek-V3's aux-loss-free balancing, once per optimizer step: each MoE layer's
    bias += bias_update_coeff * sign(mean count - count), from the step's token counts (row n of
    counts_NE is the n-th MoE layer). A new tree; params is not changed. No-op when the coeff is 0."""
    coeff = cfg.moe.bias_update_coeff
    if not coeff or counts_NE is None:
        return params
    moe_layers = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    layers = dict(params["buffers"]["layers"])
    for counts_E, i in zip(counts_NE, moe_layers, strict=True):
        buf = layers[str(i)]["moe"]
        c_E = counts_E.to(torch.float64)
        bias_E = buf["router_bias_E"] + coeff * torch.sign(c_E.mean() - c_E).to(buf["router_bias_E"].dtype)
        layers[str(i)] = dict(layers[str(i)], moe=dict(buf, router_bias_E=bias_E))
    return dict(params, buffers=dict(params["buffers"], layers=layers))
