"""Expert-parallel token exchange on the "ep" axis, and the functional collectives it rests on.

Legend: R routed rows (sorted by global expert), E experts, X local experts (E/ep), S ep ranks,
D model.

An ep rank owns experts [r*X, (r+1)*X). After `permute` a rank's rows are sorted by global
expert, so the rows for ep rank s are one contiguous run. The exchange:
  1. count exchange: an all-to-all of counts_E seen as [S, X] tells each rank how many rows of
     each of its experts every peer sends (the one host sync of an MoE layer: the splits);
  2. dispatch: an all-to-all of uneven splits (autograd: its backward is the reverse exchange);
  3. the received rows, grouped by source rank then expert, are regrouped by local expert and
     run by the expert GEMM path (grouped, padded or the loop), then put back in arrival order;
  4. combine: the reverse all-to-all returns every row to the rank and position it came from.

The functional collectives (a private torch API) come from fnmoe._torch.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from fnmoe import _torch
from fnmoe.parallel import dist as fdist
from fnmoe._torch import funcol
from fnmoe.compile import size_hint


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """t summed over group (no autograd)."""
    return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))


def all_to_all(t: torch.Tensor, output_split_sizes: list, input_split_sizes: list, group) -> torch.Tensor:
    """t's 1-D pieces (input_split_sizes, by destination rank) exchanged over group (no autograd)."""
    fdist.entering("all-to-all of Muon's whole matrices")  # its one caller
    return funcol.wait_tensor(funcol.all_to_all_single(t, output_split_sizes, input_split_sizes, group))


def exchange_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """[S, X] rows this rank will receive: entry (s, x) is what rank s sends to local expert x."""
    S = group.size()
    fdist.entering("MoE count all-to-all over ep")
    recv = funcol.wait_tensor(funcol.all_to_all_single(counts_E.contiguous(), None, None, group))
    return recv.view(S, -1)


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


def _splits(counts_E: torch.Tensor, recv_SX: torch.Tensor, S: int, X: int, n_rows: int):
    if _pinned[0] is not None:
        return _pinned[0](n_rows, S)
    # one host sync for both: uneven splits must be known on the host
    splits = torch.cat([counts_E.view(S, X).sum(1), recv_SX.sum(1)]).tolist()
    return splits[:S], splits[S:]


def ep_expert_mlp(expert_mlp, x_RD: torch.Tensor, counts_E: torch.Tensor, w_gate_XDF: torch.Tensor,
                  w_up_XDF: torch.Tensor, w_down_XFD: torch.Tensor, group, gemm: str) -> torch.Tensor:
    """expert_mlp for rows sorted by global expert, run by the ep ranks owning the experts; the
    result is in x_RD's order, on this rank."""
    S, X = group.size(), w_gate_XDF.shape[0]
    if counts_E.numel() != S * X:
        raise ValueError(f"expert parallelism: {counts_E.numel()} experts != {S} ep ranks x {X} local experts")
    recv_SX = exchange_counts(counts_E, group)
    send, recv = _splits(counts_E, recv_SX, S, X, x_RD.shape[0])
    for n in send + recv:
        size_hint(n, x_RD.shape[0] // S)  # balanced routing's splits
    fdist.entering("MoE dispatch all-to-all over ep")
    x_recv = funcol.wait_tensor(funcol.all_to_all_single_autograd(x_RD, recv, send, group))
    x_recv = fdist.entering_in_backward(x_recv, "MoE dispatch all-to-all over ep (backward)")
    size_hint(x_recv.shape[0], x_RD.shape[0])
    # arrival order is (source rank, local expert); the GEMM wants rows grouped by local expert
    expert_of_row = torch.repeat_interleave(torch.arange(X, device=x_RD.device).repeat(S), recv_SX.reshape(-1),
                                            output_size=x_recv.shape[0])
    order = torch.argsort(expert_of_row, stable=True)
    inverse = torch.argsort(order)  # a permutation's inverse
    y_sorted = expert_mlp(x_recv[order], w_gate_XDF, w_up_XDF, w_down_XFD, recv_SX.sum(0), gemm)
    y_recv = y_sorted[inverse]
    fdist.entering("MoE combine all-to-all over ep")
    y_RD = funcol.wait_tensor(funcol.all_to_all_single_autograd(y_recv, send, recv, group))
    _torch.check(y_RD.shape[0] == x_RD.shape[0])  # every row sent comes back
    return fdist.entering_in_backward(y_RD, "MoE combine all-to-all over ep (backward)")
