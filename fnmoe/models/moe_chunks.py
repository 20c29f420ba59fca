"""Token chunks of a MoE layer (model.moe.token_chunks = N): its T tokens run in N chunks of T/N.

Legend: T tokens (a chunk's T/N where said), D model, E experts, K top-k, R routed rows (T·K), N chunks,
S ep ranks, X local experts (E/S), Z the experts and the empty slots' bin (E + 1).

fnmoe.models.transformer hands `chunked` to fnmoe.models.moe.moe_block, which routes all T tokens at once (one router
matmul, so the choices are the unchunked ones: a chunk's own matmul could round differently and flip
a near-tie) and stats them as unchunked; then `chunked` runs each
chunk's rows through permute -> (dispatch) -> experts -> (combine) -> unpermute, plus the shared
experts, so the exchange's buffers and the GEMMs' transients are a chunk's. The block's gathered
weights serve every chunk (gradient accumulation would gather them once per micro-batch). Under a
capacity each expert keeps its first rows in token order counted over all chunks, as unchunked.

Expert parallel: one count exchange for all chunks (the layer's one host sync), then chunk c+1's
dispatch is issued before chunk c's experts run and waited for after them, before chunk c's combine:
so at most one all-to-all is in flight on the ep group (gloo's rule, fnmoe.parallel.gather). The
exchange is the one the layer's params carry (p["ep"], a fnmoe.models.seams.Exchange).

Recompute (`recompute` from the block runner, when the block or its MoE region is recomputed in
backward): `_Chunks` runs the chunks without autograd and saves their inputs (and with "keep" the
exchange's outputs); its backward recomputes and differentiates one chunk at a time, the last first,
so only one chunk's saved tensors are alive at once. The checkpoint around it (the block's or the
region's) reaches this layer again in backward only to reproduce what _Chunks saved: there it runs
no expert (`_Run.forward` without experts), and with "keep" replays the exchange from what that
checkpoint kept (fnmoe.memory.policies.EXCHANGE_OPS). With "replay" each chunk's backward sends its
rows again (6 exchange passes a layer instead of 4).
"""
from __future__ import annotations

import torch

from fnmoe import _torch
from fnmoe.models import moe as fmoe
from fnmoe.config import ModelConfig


def chunked(p: dict, x_TD: torch.Tensor, w_TK: torch.Tensor, idx_TK: torch.Tensor, cfg: ModelConfig, gemm: str,
            empty: bool = False, recompute: str | None = None):
    """(routed + shared experts' output_TD, counts_E, kept_E) over cfg.moe.token_chunks chunks of the
    tokens. empty: idx_TK may hold empty slots (fnmoe.models.routing.spare_slots'); recompute: None
    (autograd keeps every chunk's saved tensors), "keep" or "replay" (see the module docstring)."""
    N, T = cfg.moe.token_chunks, x_TD.shape[0]
    if T % N:
        raise ValueError(f"model.moe.token_chunks={N} must divide the tokens of a MoE layer on a rank, "
                         f"{T} here (micro-batch x sequence length)")
    run, weights = _Run(p, idx_TK, cfg, gemm, recompute == "keep", empty), _weights(p)
    if recompute is None or not torch.is_grad_enabled():
        out_TD = torch.cat(run.forward(x_TD, w_TK, idx_TK, weights)[0])
    else:
        out_TD = _Chunks.apply(run, x_TD, w_TK, idx_TK, *weights.values())
    return out_TD, run.counts_E, run.kept_NE.sum(0)


def _weights(p: dict) -> dict[str, torch.Tensor]:
    """The chunks' weights by path: the expert stacks and the shared experts'."""
    out = {k: p[k] for k in fmoe.EXPERT_STACKS}
    out.update({f"shared.{k}": v for k, v in p.get("shared", {}).items()})
    return out


def _unflat(weights: dict[str, torch.Tensor]) -> dict:
    p, shared = {}, {}
    for k, v in weights.items():
        (shared if k.startswith("shared.") else p)[k.removeprefix("shared.")] = v
    return dict(p, shared=shared) if shared else p


class _Run:
    """What every chunk of one MoE layer shares: the chunks, their counts and, under expert
    parallelism, their splits (from one count exchange)."""

    def __init__(self, p: dict, idx_TK: torch.Tensor, cfg: ModelConfig, gemm: str, keep: bool, empty: bool = False):
        m = cfg.moe
        N, T = m.token_chunks, idx_TK.shape[0]
        self.cfg, self.gemm, self.keep, self.empty, self.N, self.n_rows = cfg, gemm, keep, empty, N, idx_TK.numel()
        self.names = list(_weights(p))
        self.slices = [slice(c * T // N, (c + 1) * T // N) for c in range(N)]
        idx_NR = idx_TK.reshape(N, -1)
        counts_NZ = idx_NR.new_zeros(N, m.n_experts + 1).scatter_add(1, idx_NR, torch.ones_like(idx_NR))
        counts_NE = counts_NZ[:, :-1].contiguous()
        self.counts_E = counts_NE.sum(0)
        self.kept_NE, self.before_NE = counts_NE, [None] * N
        if m.capacity_factor:  # each expert's first rows over all chunks stay
            capacity = fmoe.expert_capacity(cfg, self.n_rows)
            end_NE = counts_NE.cumsum(0)
            self.before_NE = end_NE - counts_NE
            self.kept_NE = end_NE.clamp(max=capacity) - self.before_NE.clamp(max=capacity)
        self.ep = p.get("ep")
        if self.ep is not None:
            self.recv_NSX = self.ep.chunk_counts(self.kept_NE)
            # fnmoe.plan.rehearse pins the splits by the rows a chunk sends (fake tensors hold no counts)
            self.splits = self.ep.chunk_splits(self.kept_NE, self.recv_NSX, [idx_NR.shape[1]] * N)

    def rows(self, c: int, x_TD, idx_TK) -> fmoe.Rows:
        """Chunk c's rows (x_TD, idx_TK its tokens') sorted by expert."""
        return fmoe.sorted_rows(x_TD, idx_TK, self.cfg, self.n_rows, self.before_NE[c], self.empty)

    def out(self, rows: fmoe.Rows, y_RD, w_TK, x_TD, p: dict) -> torch.Tensor:
        out_TD = fmoe.combined(rows, y_RD, w_TK)
        return out_TD + fmoe.swiglu(p["shared"], x_TD) if "shared" in p else out_TD

    def forward(self, x_TD, w_TK, idx_TK, weights: dict, experts: bool = True):
        """(each chunk's output_TD, with self.keep each chunk's (dispatched, combined) rows under
        expert parallelism). Without experts (the recompute around _Chunks) only the exchange runs:
        replayed there, it needs no real input to send back."""
        p, s, ep = _unflat(weights), self.slices, self.ep
        if ep is None:
            return [self.chunk(c, x_TD[s[c]], w_TK[s[c]], idx_TK[s[c]], p) for c in range(self.N)], []
        outs, kept = [], []
        rows = self.rows(0, x_TD[s[0]], idx_TK[s[0]])
        sent = ep.send(rows.x_RD, self.recv_NSX[0], self.splits[0])
        got, rows = ep.received(sent), rows._replace(x_RD=None)  # sent: its buffer can go
        for c in range(self.N):
            nxt = None
            if c + 1 < self.N:  # chunk c+1's rows travel while chunk c's experts run
                rows_next = self.rows(c + 1, x_TD[s[c + 1]], idx_TK[s[c + 1]])
                nxt = ep.send(rows_next.x_RD, self.recv_NSX[c + 1], self.splits[c + 1])
            y_recv = ep.local_experts(fmoe.expert_mlp, got, sent.recv_SX, p["w_gate_EDF"], p["w_up_EDF"],
                                      p["w_down_EFD"], self.gemm) if experts else got
            got_next = None
            if nxt is not None:  # waited for before the combine: one all-to-all in flight on the group
                got_next, rows_next = ep.received(nxt), rows_next._replace(x_RD=None)
            y_RD = ep.combine(y_recv, sent)
            if self.keep:  # what _Chunks saves
                kept.append((got, y_RD))
            if experts:
                outs.append(self.out(rows, y_RD, w_TK[s[c]], x_TD[s[c]], p))
            if nxt is not None:
                rows, sent, got = rows_next, nxt, got_next
        return outs, kept

    def chunk(self, c: int, x_TD, w_TK, idx_TK, p: dict, kept: tuple | None = None) -> torch.Tensor:
        """Chunk c's output_TD on its own (x_TD, w_TK, idx_TK its tokens'): without expert
        parallelism, or as _Chunks' backward recomputes it (kept: its exchange's outputs, else it
        sends its rows again)."""
        rows, ep = self.rows(c, x_TD, idx_TK), self.ep
        stacks = (p["w_gate_EDF"], p["w_up_EDF"], p["w_down_EFD"])
        if ep is None:
            return self.out(rows, fmoe.expert_mlp(rows.x_RD, *stacks, self.kept_NE[c], self.gemm), w_TK, x_TD, p)
        send_S, recv_S = self.splits[c]
        if kept is None:
            sent = ep.send(rows.x_RD, self.recv_NSX[c], self.splits[c])
            got = ep.received(sent)
        else:  # what the forward sent and got back, on this graph with the exchange's backward
            got = ep.arrived(rows.x_RD, kept[0], send_S, recv_S, "MoE dispatch all-to-all over ep")
        y_recv = ep.local_experts(fmoe.expert_mlp, got, self.recv_NSX[c], *stacks, self.gemm)
        if kept is None:
            y_RD = ep.combine(y_recv, sent)
        else:
            y_RD = ep.arrived(y_recv, kept[1], recv_S, send_S, "MoE combine all-to-all over ep")
        return self.out(rows, y_RD, w_TK, x_TD, p)


class _Chunks(torch.autograd.Function):
    """The chunks of a recomputed MoE layer: forward without autograd, saving the inputs (and with
    run.keep the exchange's outputs); backward recomputes and differentiates one chunk at a time."""

    @staticmethod
    def forward(ctx, run: _Run, x_TD, w_TK, idx_TK, *weights):
        ctx.run, ctx.names = run, run.names
        named = dict(zip(ctx.names, weights))
        if _torch.in_backward():
            # the recompute around us, reproducing what we saved: nothing after this layer in its
            # block saves a tensor made from our output, so the experts need not run, and the
            # output is a stand-in (detach: an op selective checkpointing's log ignores, where a new
            # op would fail its check against the forward's ops)
            _, kept = run.forward(x_TD, w_TK, idx_TK, named, experts=False) if run.keep else (None, [])
            out_TD = x_TD.detach()
        else:
            outs, kept = run.forward(x_TD, w_TK, idx_TK, named)
            out_TD = torch.cat(outs)
        ctx.save_for_backward(x_TD, w_TK, idx_TK, *weights, *(t for pair in kept for t in pair))
        return out_TD

    @staticmethod
    def backward(ctx, g_TD):
        run, n, needs = ctx.run, len(ctx.names), ctx.needs_input_grad
        x_TD, w_TK, idx_TK, *rest = ctx.saved_tensors
        weights = {k: w.detach().requires_grad_(need) for k, w, need in zip(ctx.names, rest[:n], needs[4:])}
        kept = [None] * run.N
        if run.keep and run.ep is not None:
            kept = [(rest[n + 2 * c], rest[n + 2 * c + 1]) for c in range(run.N)]
        del rest
        g_x, g_w = [], []
        for c in reversed(range(run.N)):
            s = run.slices[c]
            x_c = x_TD[s].detach().requires_grad_(needs[1])
            w_c = w_TK[s].detach().requires_grad_(needs[2])
            with torch.enable_grad():
                out_c = run.chunk(c, x_c, w_c, idx_TK[s], _unflat(weights), kept[c])
            kept[c] = None  # a chunk's exchange outputs go once its backward is done
            # into the leaves' .grad: each weight's gradient is added in place as its node finishes (all
            # of a chunk's weight gradients at once beside the sums would hold them twice)
            inputs = [t for t in (x_c, w_c, *weights.values()) if t.requires_grad]
            torch.autograd.backward(out_c, g_TD[s], inputs=inputs)
            g_x.insert(0, x_c.grad)
            g_w.insert(0, w_c.grad)
        return (None, torch.cat(g_x) if needs[1] else None, torch.cat(g_w) if needs[2] else None, None,
                *(w.grad for w in weights.values()))
