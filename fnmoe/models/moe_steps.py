"""A MoE layer under expert parallelism as steps, for whole-block chunks (fnmoe.models.block_chunks):
its forward yields while its exchanges travel, and its recompute cuts the graph at them so that its
backward runs in pieces, each exchange's gradient travelling while other work computes.

Legend: B batch, L sequence, D model, T tokens (B·L), K top-k, E experts, R routed rows sorted by
global expert (this rank's), V rows received from the ep ranks (for this rank's experts).

The split backward (`Split.backward`) of a chunk's MoE part, the combine's and the dispatch's all-to-all
issued by hand and waited for later:
  1. the gradient of the combine's output (the block's output back through the weighting and the
     gather); its all-to-all back to the experts issued; a yield (block_chunks recomputes the chunk
     before meanwhile: its experts compute while the gradient travels);
  2. waited; the experts' input gradient with their weight gradients put off (fnmoe.kernels.wgrad);
     the dispatch's all-to-all of it issued; the weight gradients computed while it travels; a yield;
  3. waited; the rest in one pass from the block's output, its statistics and the sent rows (given
     their gradient), into the block's input leaf and the weights, as one pass without the cuts.
Every value is the one pass's: the same ops on the same operands, gradients summed in its order
(tested to the bit against the block without steps).
"""
from __future__ import annotations

import copy

import torch

from fnmoe import compile as fcompile
from fnmoe.config import ModelConfig
from fnmoe.kernels import wgrad
from fnmoe.models.moe import Rows, combined, expert_mlp, moe_stats, route_slots, sorted_rows, swiglu
from fnmoe.models.routing import Router


def moe_steps(p: dict, x_BLD: torch.Tensor, cfg: ModelConfig, gemm: str, router: Router | None = None,
              compile: bool = False, layer: int | None = None, split: bool = False):
    """moe_block on its sparse path under expert parallelism (p["ep"]), as steps: a generator
    that yields while its dispatch travels and again while its combine does (Exchange.in_flight), and
    returns moe_block's (out_BLD, stats), computed by the same ops in the same order.
    fnmoe.models.block_chunks runs two block chunks' steps at a time; compile: their pieces compiled.
    split (a recompute for backward): the graph cut at both exchanges; returns (out_BLD, stats, Split)."""
    B, L, D = x_BLD.shape
    x_TD, ep = x_BLD.reshape(B * L, D), p["ep"]
    fn = fcompile.compiled if compile else (lambda f: f)
    w_TK, idx_TK, probs_TE, logits_TE, rows = fn(_routed_rows)(p, x_TD, cfg, router, layer)
    sent = ep.dispatched(rows.x_RD, rows.kept_E, p["w_gate_EDF"].shape[0])
    cut = Split(ep, sent, _Root(rows.x_RD)) if split else None
    rows = rows._replace(x_RD=None)  # sent: its buffer can go
    yield from ep.in_flight(sent.rows)
    x_recv = ep.received(sent)
    y_recv = fn(ep.local_experts)(expert_mlp, cut.received.tap(x_recv) if cut else x_recv, sent.recv_SX,
                                  p["w_gate_EDF"], p["w_up_EDF"], p["w_down_EFD"], gemm)
    if cut:
        cut.experts, y_recv = _Root(y_recv), y_recv.detach()
    back = ep.send_back(y_recv, sent)
    yield from ep.in_flight(back)
    y_RD = ep.returned(back, sent)
    out_TD = fn(_output)(p, x_TD, rows, cut.returned.tap(y_RD) if cut else y_RD, w_TK)
    stats = moe_stats(cfg, probs_TE, logits_TE, idx_TK, rows.counts_E, rows.kept_E, B)
    return (out_TD.view(B, L, D), stats, cut) if cut else (out_TD.view(B, L, D), stats)


def _routed_rows(p: dict, x_TD, cfg: ModelConfig, router: Router | None, layer: int | None = None):
    """(w_TK, idx_TK, probs_TE, logits_TE, the sorted rows): moe_block's first piece on its sparse path."""
    w_TK, idx_TK, probs_TE, logits_TE, empty = route_slots(p, x_TD, cfg, router, layer)
    return w_TK, idx_TK, probs_TE, logits_TE, sorted_rows(x_TD, idx_TK, cfg, empty=empty)


def _output(p: dict, x_TD, rows: Rows, y_RD, w_TK) -> torch.Tensor:
    """The routed rows combined, plus the shared experts: moe_block's last piece on its sparse path."""
    out_TD = combined(rows, y_RD, w_TK)
    return out_TD + swiglu(p["shared"], x_TD) if "shared" in p else out_TD


class Split:
    """Where a recomputed chunk's MoE part is cut: the rows it sent (a root their gradient is put in),
    the rows its experts received (a tap), the experts' output (a root) and the rows the combine
    returned (a tap)."""

    def __init__(self, ep, sent, rows_root: "_Root"):
        # the splits only: the received rows' buffer (sent.rows) must go with the recompute's step
        self.ep, self.sent, self.sent_root = ep, copy.copy(sent), rows_root
        self.sent.rows = None
        self.received, self.returned = _Tap(), _Tap()
        self.experts: _Root | None = None

    def backward(self, outs: list, gs: list, inputs: tuple):
        """The MoE part's backward from outs (the block's output first, then its statistics) given
        gs, into inputs' .grad (the block input's leaf, the weights), as steps (the module docstring)."""
        ep, sent = self.ep, self.sent
        backward_into(outs[:1], gs[:1], (self.returned.leaf,), retain_graph=True)
        travelling = ep.grad_to_experts(self.returned.take(), sent)
        yield from ep.in_flight(travelling)
        self.experts.put(ep.waited(travelling))
        del travelling  # the gradient's buffer is the experts' backward's now: it frees it as it goes
        with wgrad.deferred() as later:
            self.experts.backward((self.received.leaf, *inputs))
        travelling = ep.grad_to_tokens(self.received.take(), sent)
        wgrad.flush(later)
        yield from ep.in_flight(travelling)
        root = self.sent_root.put(ep.waited(travelling))
        del travelling
        if root.requires_grad:
            outs, gs = [*outs, root], [*gs, root.new_empty(0)]
        backward_into(outs, gs, inputs)


def backward_into(outs: list, gs: list, inputs: tuple, retain_graph: bool = False) -> None:
    """autograd's backward from outs given gs into the inputs that take a gradient (none: nothing)."""
    inputs = [t for t in inputs if t.requires_grad]
    if inputs:
        torch.autograd.backward(outs, gs, inputs=inputs, retain_graph=retain_graph)


class _Root:
    """A tensor's stand-in on the graph (0 elements, so the tensor itself can go): a backward from
    it gives the tensor the gradient `put` in. (The gradient waits in a box of its own: the node
    holding the root itself would make a cycle with its output, which only the garbage collector
    frees, the recompute's graph with it.)"""

    def __init__(self, t: torch.Tensor):
        self.box: list = [None]
        self.out = _Put.apply(t, self.box)

    def put(self, g: torch.Tensor) -> torch.Tensor:
        self.box[0] = g
        return self.out

    def backward(self, inputs: tuple) -> None:
        """The tensor's graph given the gradient put in, into inputs' .grad."""
        if self.out.requires_grad:
            backward_into([self.out], [self.out.new_empty(0)], inputs)
        self.box[0] = None


class _Put(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, box: list):
        ctx.box = box
        return t.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        g, ctx.box[0] = ctx.box[0], None
        return g, None


class _Tap:
    """A cut: `tap(t)` is t off the graph before it, and a backward through it keeps t's gradient
    (`take`) and goes no further. Its leaf (0 elements) names the tap in a backward's inputs."""

    def __init__(self):
        self.leaf = torch.zeros(0, requires_grad=True)
        self.g: torch.Tensor | None = None

    def tap(self, t: torch.Tensor) -> torch.Tensor:
        return _Cut.apply(t.detach(), self.leaf, self)

    def take(self) -> torch.Tensor:
        g, self.g = self.g, None
        return g


class _Cut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, leaf, tap: _Tap):
        ctx.tap = tap
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        ctx.tap.g = g
        return None, torch.zeros(0), None
