"""FSDP's collectives for compute: a block's sharded leaves all-gathered in the compute dtype, and
their gradients reduce-scattered back, each issued apart from its wait, so that communication runs
while blocks compute.

`issue(tree, dtype)` starts the gathers and returns at once (on gloo a worker thread sends, on NCCL
a stream): one coalesced all-gather per process group (dense leaves over dp, expert stacks over
fsdp), each leaf into its own output. `finish(issued, tree)` waits for each where the block needs
it and puts it on the autograd graph. `gather` is the two back to back. fnmoe.models.transformer issues block
i+1's gathers before block i computes, and in backward a recomputed block i issues block i-1's;
fnmoe.parallel.reshard does the same for the weights backward gathers again.

The graph's backward reduce-scatters the gradient (summed) to the leaf's shard and does not
wait: the gradient it returns waits for the collective at its first use (torch's
AsyncCollectiveTensor: autograd summing a leaf's two gradients, the optimizer), and every
reduce-scatter is waited for where the backward pass ends. So block i's reduce-scatters run while
block i-1's backward computes.

The reduce-scatter sends float32, or with `--mesh.reduce-dtype bfloat16` (`reducing`) bf16: half
the bytes, the ranks' sum taken in bf16. The shard's gradient is float32 to its readers (the master
params' dtype, so a tied leaf's two gradients and the micro-batches are summed in float32), but a
bf16 result is kept as it arrived (`_torch.cast_on_use`: a float32 tensor holding the bf16 values,
cast at its first use; a cast where backward returns it would wait for the collective there):
backward waits for it and does not cast it, the gradient norm reads the bf16 values
(`_torch.as_arrived`), and the donated update casts each leaf's into a copy of its own
(fnmoe.optim.in_place). So with one micro-batch a rank's gradients take 2 bytes an element, not 4,
at backward's peak and through the update, with the values a cast at once would give.

NCCL runs a group's collectives in issue order on its stream, and a wait holds back only the
compute stream, so any number may be in flight. On gloo at most one is in flight per process group:
issuing there first waits for the one in flight. Two collectives in flight on one gloo group
corrupted the heap (reproduced: a 2x2 gloo launch with a gather per leaf in flight aborted in malloc
in 3 of 5 runs, none with one in flight per group). gloo's order is the same code with a wait at
issue; tests/test_sharding.py records both orders.

Every phase is a functional collective's op (`all_gather_into_tensor_coalesced`,
`reduce_scatter_tensor`, `wait_tensor`), the same on gloo, NCCL, the fake group of `fnmoe
rehearse` and a simulation's LocalTensorMode, so the meters and the tests see the code a GPU runs.

With `--mesh.expert-gather-dtype float8_e4m3fn` (`expert_dtype`) the expert stacks' gathers send
each rank's shard in e4m3 with a float32 scale per 128x128 block (fnmoe.parallel.fp8: quantised
once a step, sent as bytes in a call of their own) and `finish` dequantises them to the compute
dtype; dense leaves still travel in the compute dtype. The gradient goes back as from any gather
(straight-through: the same reduce-scatter to the float32 master shard).

A shard follows torch.chunk (DTensor's Shard): the leading ranks hold ceil(n / w) rows, the last
the rest, trailing ranks maybe none. Every rank sends ceil(n / w) rows (padded) and the first n of
the gathered rows are the leaf.

Legend: no shape-suffixed tensors here; weights are handled leaf by leaf.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from fnmoe import _torch, caches
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import fp8
from fnmoe.tree import Tree, map_with_path, tree_flatten


@dataclass(eq=False)
class Issued:
    """One leaf's all-gather in flight: its result once waited, and how to send its gradient back."""
    local: torch.Tensor        # this rank's shard (on the autograd graph: to_local of the leaf)
    out: list[torch.Tensor] | None   # the gathered rows, [w * rows, ...] along dim 0, until waited for
    send: list[torch.Tensor] | None  # what this rank sends, until then: the rows, or fp8.pack's (q, scales)
    dim: int                   # the dim the leaf is split along
    n: int                     # the leaf's size along dim (expert stacks: this ep rank's experts)
    group: object              # the process group gathered over
    path: str                  # the leaf's path and the axis, for a failure's message
    axis: str
    block: object = None       # the issue() call it came from: a block's gathers share it
    reduce: torch.dtype = torch.float32  # the dtype its gradient is reduce-scattered in
    dequantise: torch.dtype | None = None  # with an fp8 send: the compute dtype it is dequantised to


def _padded(x: torch.Tensor, dim: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype with dim moved first and padded with zeros to `rows` rows, contiguous, as a
    collective sends it: one copy at most (a full gradient in fp32 is the backward's largest)."""
    x = x.movedim(dim, 0)
    if x.shape[0] == rows:
        return x.to(dtype).contiguous()
    out = x.new_zeros((rows, *x.shape[1:]), dtype=dtype)
    out[:x.shape[0]] = x
    return out


def _prepare(path: str, t: torch.Tensor, dtype: torch.dtype):
    """What t's all-gather sends (an Issued, not yet issued), or t in dtype when it is not sharded here."""
    if not isinstance(t, DTensor):
        return t.to(dtype)
    if t.device_mesh.ndim == 1:  # dense: whole on every rank, over dp (fsdp x ep)
        (placement,), group, n, axis = t.placements, t.device_mesh.get_group(), None, "dp"
    else:  # an expert stack: this ep rank's experts, gathered over fsdp alone
        placement, group, axis = t.placements[0], t.device_mesh.get_group("fsdp"), "fsdp"
        n = t.shape[0] // t.device_mesh.size(1) if getattr(placement, "dim", None) == 0 else None
    local = t.to_local()
    if isinstance(placement, Replicate):
        return local.to(dtype)
    dim, w = placement.dim, group.size()
    n = n if n is not None else t.shape[dim]
    if axis == "fsdp" and _expert_dtype is not None:
        send = list(fp8.payload(t, local, dim, math.ceil(n / w)))
        return Issued(local, None, send, dim, n, group, path, axis, dequantise=dtype)
    with torch.no_grad():
        send = _padded(local.detach(), dim, math.ceil(n / w), dtype)
    return Issued(local, None, [send], dim, n, group, path, axis)


_reduce_dtype = torch.float32
"""the dtype gathers issued now reduce-scatter their gradients in (`reducing`)"""


@contextlib.contextmanager
def reducing(dtype: torch.dtype):
    """Gathers issued inside reduce-scatter their gradients in dtype (mesh.reduce_dtype). Each
    gather keeps the dtype it was issued under, so a backward outside still sends what its forward
    chose; fnmoe.training.step enters it around a micro-batch's forward and backward (a recompute in
    backward issues its gathers again)."""
    global _reduce_dtype
    before, _reduce_dtype = _reduce_dtype, dtype
    try:
        yield
    finally:
        _reduce_dtype = before


_expert_dtype: torch.dtype | None = None
"""the dtype gathers issued now send expert stacks in, when not the compute dtype (`expert_dtype`)"""


@contextlib.contextmanager
def expert_dtype(dtype: torch.dtype | None):
    """Gathers issued inside send expert stacks in dtype (mesh.expert_gather_dtype: fp8.E4M3, or None:
    the compute dtype). As `reducing`, fnmoe.training.step enters it around a micro-batch's forward and
    backward, so backward's regathers send what the forward's did."""
    if dtype not in (None, fp8.E4M3):
        raise ValueError(f"expert stacks are gathered in the compute dtype or float8_e4m3fn, not {dtype}")
    global _expert_dtype
    before, _expert_dtype = _expert_dtype, dtype
    try:
        yield
    finally:
        _expert_dtype = before


_in_flight: dict[str, list[weakref.ref]] = {}
"""serial process group name -> the outputs of the collectives issued on it and not yet waited for"""


@dataclass(eq=False)
class _Scatter:
    """A reduce-scatter in flight: its output (the gradient is a view of it) and its input, which
    the collective reads until it is waited for (NCCL keeps it until then)."""
    block: object  # the gather call whose gradient it sends back
    out: torch.Tensor
    send: torch.Tensor
    cast: torch.Tensor | None = None  # the gradient, when it is cast from the collective's dtype on use


_scattering: list[_Scatter] = []
"""the reduce-scatters issued and not yet waited for here, in issue order"""
_backward_end_queued: set[int] = set()
"""graph tasks whose end waits for their reduce-scatters"""


def is_serial(group) -> bool:
    """Whether group takes one collective in flight at a time (gloo; see the module docstring)."""
    return dist.get_backend(group) == "gloo"


def _wait(group_name: str) -> None:
    for ref in _in_flight.pop(group_name, ()):
        if (out := ref()) is not None:
            _torch.c10d_ops.wait_tensor(out)  # a second wait of one output does nothing


def _wait_scatters() -> None:
    for s in _scattering:
        # waited for, not cast: a bf16 gradient stays bf16 (half the bytes) until its first use
        _torch.c10d_ops.wait_tensor(s.out)
    _scattering.clear()


def wait_all() -> None:
    """Wait for every collective issued here and not yet waited for (where a backward ends)."""
    _wait_scatters()
    for name in list(_in_flight):
        _wait(name)


@caches.register
def clear() -> None:
    """Forget the collectives noted in flight, unwaited (their process groups may be gone)."""
    _in_flight.clear()
    _scattering.clear()
    _backward_end_queued.clear()


def _issue_on(group, start: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """start()'s collectives on group, after the one in flight there where the group is serial."""
    serial = is_serial(group)
    if serial:
        _wait(group.group_name)
    with torch.no_grad():
        outs = start()
    if serial:
        _in_flight[group.group_name] = [weakref.ref(t) for t in outs]
    return outs


def _start(xs: list[Issued]) -> None:
    """The coalesced all-gathers of xs (all on one group): one a dtype sent (gloo's coalesced
    all-gather of mixed dtypes returns garbage), in the order their first leaves come."""
    group = xs[0].group
    axis = "dp (fsdp x ep)" if xs[0].axis == "dp" else xs[0].axis
    by_dtype: dict[torch.dtype, list[tuple[Issued, torch.Tensor]]] = {}
    for x in xs:
        x.out = []
        for t in x.send:
            by_dtype.setdefault(t.dtype, []).append((x, t))
    for pairs in by_dtype.values():
        paths = ",".join(dict.fromkeys(x.path for x, _ in pairs))
        fdist.entering(f"all-gather of {paths} over {axis}")
        outs = _issue_on(group, lambda: _torch.c10d_ops.all_gather_into_tensor_coalesced(
            [t for _, t in pairs], group.size(), group.group_name))
        for (x, _), out in zip(pairs, outs):
            x.out.append(out)


def _reduce_scatter(send: torch.Tensor, group, block: object, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """send summed over group, this rank's first `rows` rows moved to dim and in dtype, issued now.
    It is waited for (and cast, when send is in another dtype) at its first use (autograd summing a
    leaf's gradients, the optimizer), where the next block's reduce-scatters start (so one block's
    run while the block before computes, and their inputs are let go then), or where the backward
    ends, whichever comes first."""
    task = _torch.graph_task()
    if task not in _backward_end_queued:
        _backward_end_queued.add(task)
        _torch.at_backward_end(lambda: (_backward_end_queued.discard(task), wait_all()))
    if _scattering and _scattering[-1].block is not block:
        _wait_scatters()
    w = group.size()
    (mine,) = _issue_on(group, lambda: [_torch.c10d_ops.reduce_scatter_tensor(send, "sum", w, group.group_name)])
    _scattering.append(scatter := _Scatter(block, mine, send))
    if mine.dtype == dtype:
        return _torch.wait_on_use(mine)[:rows].movedim(0, dim)
    # not .to(dtype): autograd would run that cast here, and wait for the collective there
    scatter.cast = _torch.cast_on_use(mine[:rows].movedim(0, dim), dtype)
    return scatter.cast


class _Gathered(torch.autograd.Function):
    """The waited all-gather of a shard, on the graph: backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, issued: Issued) -> torch.Tensor:
        # the graph keeps what backward needs, not the gathered tensor (resharding drops that)
        ctx.dim, ctx.n, ctx.group, ctx.rows, ctx.dtype = issued.dim, issued.n, issued.group, \
            local.shape[issued.dim], local.dtype
        ctx.block, ctx.reduce = issued.block, issued.reduce
        ctx.what = f"reduce-scatter of {issued.path}'s gradient over {issued.axis} (backward)"
        outs = [_torch.c10d_ops.wait_tensor(out) for out in issued.out]
        issued.out = issued.send = None
        if issued.dequantise is not None:
            return fp8.unpack(*outs, ctx.group.size(), issued.dim, issued.n, issued.dequantise)
        # contiguous, as resharding needs to regather it in backward instead of keeping it
        return outs[0][:issued.n].movedim(0, issued.dim).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        fdist.entering(ctx.what)
        w = ctx.group.size()
        send = _padded(grad, ctx.dim, w * math.ceil(ctx.n / w), ctx.reduce)
        return _reduce_scatter(send, ctx.group, ctx.block, ctx.rows, ctx.dim, ctx.dtype), None


def _finish_leaf(x):
    return _Gathered.apply(x.local, x) if isinstance(x, Issued) else x


def issue(tree: Tree, dtype: torch.dtype) -> Tree:
    """Start gathering a subtree's leaves in dtype (Issued leaves; plain leaves cast at once)."""
    prepared = map_with_path(lambda path, t: _prepare(path, t, dtype), tree)
    by_group: dict[str, list[Issued]] = {}
    block = object()
    for x in tree_flatten(prepared)[0]:
        if isinstance(x, Issued):
            x.block, x.reduce = block, _reduce_dtype
            by_group.setdefault(x.group.group_name, []).append(x)
    for xs in by_group.values():
        _start(xs)
    return prepared


def finish(issued: Tree, tree: Tree) -> Tree:
    """The gathered leaves of `issue(tree, ...)`, waited for."""
    return map_with_path(lambda path, x: _finish_leaf(x), issued)


def gather(tree: Tree, dtype: torch.dtype) -> Tree:
    """A subtree's leaves as plain compute-dtype tensors (expert stacks: this ep rank's experts)."""
    return finish(issue(tree, dtype), tree)
