"""Expert-parallel token exchange on the "ep" axis, and the functional collectives it rests on.

Legend: R routed rows (sorted by global expert), E experts, X local experts (E/ep), S ep ranks,
D model, N token chunks of a MoE layer (fnmoe.models.moe_chunks).

An ep rank owns experts [r*X, (r+1)*X). After `permute` a rank's rows are sorted by global
expert, so the rows for ep rank s are one contiguous run. The exchange:
  1. count exchange: an all-to-all of counts_E seen as [S, X] (with token chunks, [N, S, X]: every
     chunk's at once) tells each rank how many rows of each of its experts every peer sends (the
     one host sync of an MoE layer: the splits);
  2. dispatch (`send`, `received`): an all-to-all of uneven splits (autograd: its backward is the
     reverse exchange), issued apart from its wait so that token chunks overlap it with compute;
  3. `local_experts`: the received rows, grouped by source rank then expert, are regrouped by local
     expert and run by the expert GEMM path (grouped, padded or the loop), then put back in arrival order;
  4. `combine`: the reverse all-to-all returns every row to the rank and position it came from.
`arrived` puts an exchange's output kept from the forward back on a recompute's graph: its backward
is the exchange's, and nothing is sent forward again.

The model runs these through `Exchange` (fnmoe.models.seams.Exchange), bound to the ep group: FSDP's
params source puts `exchange(group)` in a MoE layer's gathered params as "ep" (fnmoe.parallel.fsdp),
so the model imports nothing from here.

The functional collectives (a private torch API) come from fnmoe._torch.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from fnmoe import _torch, caches
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import gather
from fnmoe._torch import funcol
from fnmoe.compile import size_hint


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """t summed over group (no autograd)."""
    return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))


def all_to_all(t: torch.Tensor, output_split_sizes: list, input_split_sizes: list, group) -> torch.Tensor:
    """t's 1-D pieces (input_split_sizes, by destination rank) exchanged over group (no autograd)."""
    fdist.entering("all-to-all of Muon's whole matrices")  # its one caller
    return funcol.wait_tensor(funcol.all_to_all_single(t, output_split_sizes, input_split_sizes, group))


def exchange_chunk_counts(counts_NE: torch.Tensor, group) -> torch.Tensor:
    """[N, S, X] rows this rank will receive from each of N token chunks: entry (n, s, x) is what
    rank s sends to local expert x, for every chunk in one all-to-all."""
    N, S = counts_NE.shape[0], group.size()
    by_rank_SNX = counts_NE.view(N, S, -1).transpose(0, 1).contiguous()  # all-to-all pieces go by destination
    fdist.entering("MoE count all-to-all over ep")
    recv = funcol.wait_tensor(funcol.all_to_all_single(by_rank_SNX.view(-1), None, None, group))
    return recv.view(S, N, -1).transpose(0, 1)


# fnmoe.plan.rehearse's routing table, for fake tensors whose counts hold no values: (rows, S) -> splits
_pinned: list = [None]


@contextlib.contextmanager
def pinned_splits(fn: Callable[[int, int], tuple[list[int], list[int]]]) -> Iterator[None]:
    """In the body every exchange sends and receives fn(rows sent, ep ranks) = (send, recv) rows per
    ep rank, instead of the splits its counts give."""
    _pinned[0] = fn
    try:
        yield
    finally:
        _pinned[0] = None


def chunk_splits(counts_NE: torch.Tensor, recv_NSX: torch.Tensor, rows_N: list[int]) -> list[tuple[list, list]]:
    """(send, recv): the rows each token chunk sends to and receives from each ep rank, given what
    it sends each expert (counts_NE), receives (recv_NSX, exchange_chunk_counts') and its rows_N."""
    N, S, X = recv_NSX.shape
    if _pinned[0] is not None:
        return [_pinned[0](n, S) for n in rows_N]
    # one host sync for all: uneven splits must be known on the host
    flat = torch.cat([counts_NE.view(N, S, X).sum(2), recv_NSX.sum(2)], 1).tolist()
    return [(row[:S], row[S:]) for row in flat]


@dataclass(eq=False)
class Sent:
    """One chunk's rows on their way to the ep ranks owning their experts: the dispatch all-to-all,
    issued and not yet waited for (`received` waits), and the splits its combine sends back by."""
    rows: torch.Tensor     # what arrives here, by (source rank, local expert): waited for by `received`
    recv_SX: torch.Tensor  # rows for each local expert from each source rank
    send: list             # rows sent to each ep rank
    recv: list             # rows received from each
    group: object
    n_rows: int            # rows sent


def send(x_RD: torch.Tensor, recv_SX: torch.Tensor, splits: tuple[list, list], group) -> Sent:
    """Issue the dispatch of x_RD (rows sorted by global expert) by splits = (send, recv); no wait."""
    send_S, recv_S = splits
    for n in send_S + recv_S:
        size_hint(n, x_RD.shape[0] // group.size())  # balanced routing's splits
    fdist.entering("MoE dispatch all-to-all over ep")
    rows = funcol.all_to_all_single_autograd(x_RD, recv_S, send_S, group)
    return Sent(rows, recv_SX, send_S, recv_S, group, x_RD.shape[0])


def received(sent: Sent) -> torch.Tensor:
    """The dispatched rows that arrived here, waited for."""
    x_recv = funcol.wait_tensor(sent.rows)
    size_hint(x_recv.shape[0], sent.n_rows)
    return fdist.entering_in_backward(x_recv, "MoE dispatch all-to-all over ep (backward)")


def local_experts(expert_mlp, x_recv: torch.Tensor, recv_SX: torch.Tensor, w_gate_XDF: torch.Tensor,
                  w_up_XDF: torch.Tensor, w_down_XFD: torch.Tensor, gemm: str) -> torch.Tensor:
    """expert_mlp of the received rows, in their arrival order."""
    S, X = recv_SX.shape
    # arrival order is (source rank, local expert); the GEMM wants rows grouped by local expert
    expert_of_row = torch.repeat_interleave(torch.arange(X, device=x_recv.device).repeat(S), recv_SX.reshape(-1),
                                            output_size=x_recv.shape[0])
    order = torch.argsort(expert_of_row, stable=True)
    inverse = torch.argsort(order)  # a permutation's inverse
    return expert_mlp(x_recv[order], w_gate_XDF, w_up_XDF, w_down_XFD, recv_SX.sum(0), gemm)[inverse]


def combine(y_recv: torch.Tensor, sent: Sent) -> torch.Tensor:
    """The experts' rows sent back where sent's rows came from: in their order, on their rank."""
    return returned(send_back(y_recv, sent), sent)


def send_back(y_recv: torch.Tensor, sent: Sent) -> torch.Tensor:
    """Issue `combine`'s all-to-all; no wait (`returned` waits)."""
    fdist.entering("MoE combine all-to-all over ep")
    return funcol.all_to_all_single_autograd(y_recv, sent.send, sent.recv, sent.group)


def returned(back: torch.Tensor, sent: Sent) -> torch.Tensor:
    """The rows `send_back` returned, waited for."""
    y_RD = funcol.wait_tensor(back)
    _torch.check(y_RD.shape[0] == sent.n_rows)  # every row sent comes back
    return fdist.entering_in_backward(y_RD, "MoE combine all-to-all over ep (backward)")


def grad_to_experts(g_RD: torch.Tensor, sent: Sent) -> torch.Tensor:
    """The combine's backward issued by hand (fnmoe.models.moe_steps.Split), no wait (`waited`): the
    gradient of the rows it returned, sent back to the ep ranks whose experts computed them."""
    fdist.entering("MoE combine all-to-all over ep (backward)")
    return funcol.all_to_all_single(g_RD.contiguous(), sent.recv, sent.send, sent.group)


def grad_to_tokens(g_recv: torch.Tensor, sent: Sent) -> torch.Tensor:
    """The dispatch's backward issued by hand, no wait: the gradient of the rows the experts received,
    sent back to the ranks that sent them."""
    fdist.entering("MoE dispatch all-to-all over ep (backward)")
    return funcol.all_to_all_single(g_recv.contiguous(), sent.send, sent.recv, sent.group)


def waited(t: torch.Tensor) -> torch.Tensor:
    """An all-to-all issued by grad_to_experts or grad_to_tokens, waited for."""
    return funcol.wait_tensor(t)


def in_flight(t: torch.Tensor, group) -> Iterator[None]:
    """Where a chunk's steps (fnmoe.models.block_chunks) let another chunk compute while t's exchange
    travels: yields once. On a group that takes one collective in flight at a time (gloo,
    fnmoe.parallel.gather.is_serial), t is waited for first."""
    if gather.is_serial(group):
        funcol.wait_tensor(t)
    yield


class _Arrived(torch.autograd.Function):
    """An all-to-all of x whose output `out` is known (kept from the forward): out, on the graph
    with the exchange's backward (the gradient sent back by the splits reversed)."""

    @staticmethod
    def forward(ctx, x, out, send_S, recv_S, group, what):
        ctx.send_S, ctx.recv_S, ctx.group, ctx.what = send_S, recv_S, group, what
        return out

    @staticmethod
    def backward(ctx, g):
        fdist.entering(f"{ctx.what} (backward)")
        g_x = funcol.wait_tensor(funcol.all_to_all_single(g.contiguous(), ctx.send_S, ctx.recv_S, ctx.group))
        return g_x, None, None, None, None, None


def arrived(x: torch.Tensor, out: torch.Tensor, send_S: list, recv_S: list, group, what: str) -> torch.Tensor:
    """out, the kept result of x's all-to-all by (send_S, recv_S), as if x had been sent again: a
    recompute's exchange, which sends nothing forward and the gradient backward."""
    return _Arrived.apply(x, out, send_S, recv_S, group, what)


def ep_expert_mlp(expert_mlp, x_RD: torch.Tensor, counts_E: torch.Tensor, w_gate_XDF: torch.Tensor,
                  w_up_XDF: torch.Tensor, w_down_XFD: torch.Tensor, group, gemm: str) -> torch.Tensor:
    """expert_mlp for rows sorted by global expert, run by the ep ranks owning the experts; the
    result is in x_RD's order, on this rank."""
    sent = dispatched(x_RD, counts_E, w_gate_XDF.shape[0], group)
    y_recv = local_experts(expert_mlp, received(sent), sent.recv_SX, w_gate_XDF, w_up_XDF, w_down_XFD, gemm)
    return combine(y_recv, sent)


def dispatched(x_RD: torch.Tensor, counts_E: torch.Tensor, n_local: int, group) -> Sent:
    """The dispatch of rows sorted by global expert (counts_E rows each) to the ep ranks owning
    their experts (n_local a rank), issued after the count exchange that sets its splits."""
    S = group.size()
    if counts_E.numel() != S * n_local:
        raise ValueError(f"expert parallelism: {counts_E.numel()} experts != {S} ep ranks x {n_local} local experts")
    recv_NSX = exchange_chunk_counts(counts_E.view(1, -1), group)
    return send(x_RD, recv_NSX[0], chunk_splits(counts_E.view(1, -1), recv_NSX, [x_RD.shape[0]])[0], group)


class Exchange:
    """fnmoe.models.seams.Exchange on one ep group: each method is this module's function of its name
    (`experts`: ep_expert_mlp; `chunk_counts`: exchange_chunk_counts) on the group, looked up when
    called, so that a test may replace one."""

    def __init__(self, group):
        self.group = group

    def experts(self, expert_mlp, x_RD, counts_E, w_gate_XDF, w_up_XDF, w_down_XFD, gemm: str) -> torch.Tensor:
        return ep_expert_mlp(expert_mlp, x_RD, counts_E, w_gate_XDF, w_up_XDF, w_down_XFD, self.group, gemm)

    def dispatched(self, x_RD, counts_E, n_local: int) -> Sent:
        return dispatched(x_RD, counts_E, n_local, self.group)

    def chunk_counts(self, counts_NE) -> torch.Tensor:
        return exchange_chunk_counts(counts_NE, self.group)

    def chunk_splits(self, counts_NE, recv_NSX, rows_N: list[int]) -> list[tuple[list, list]]:
        return chunk_splits(counts_NE, recv_NSX, rows_N)

    def send(self, x_RD, recv_SX, splits: tuple[list, list]) -> Sent:
        return send(x_RD, recv_SX, splits, self.group)

    def received(self, sent: Sent) -> torch.Tensor:
        return received(sent)

    def local_experts(self, expert_mlp, x_recv, recv_SX, w_gate_XDF, w_up_XDF, w_down_XFD, gemm: str) -> torch.Tensor:
        return local_experts(expert_mlp, x_recv, recv_SX, w_gate_XDF, w_up_XDF, w_down_XFD, gemm)

    def send_back(self, y_recv, sent: Sent) -> torch.Tensor:
        return send_back(y_recv, sent)

    def returned(self, back, sent: Sent) -> torch.Tensor:
        return returned(back, sent)

    def combine(self, y_recv, sent: Sent) -> torch.Tensor:
        return combine(y_recv, sent)

    def arrived(self, x, out, send_S: list, recv_S: list, what: str) -> torch.Tensor:
        return arrived(x, out, send_S, recv_S, self.group, what)

    def grad_to_experts(self, g_RD, sent: Sent) -> torch.Tensor:
        return grad_to_experts(g_RD, sent)

    def grad_to_tokens(self, g_recv, sent: Sent) -> torch.Tensor:
        return grad_to_tokens(g_recv, sent)

    def waited(self, t: torch.Tensor) -> torch.Tensor:
        return waited(t)

    def in_flight(self, t: torch.Tensor) -> Iterator[None]:
        return in_flight(t, self.group)


@caches.register
@functools.lru_cache(maxsize=None)  # one a group: a compiled region sees the same object every step
def exchange(group) -> Exchange:
    """The Exchange on group (an ep group; kept alive here)."""
    return Exchange(group)
