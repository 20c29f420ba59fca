"""Resharding after forward: a block's gathered weights are not kept for backward.

With FSDP each block gathers its weights for compute (fnmoe.parallel.gather). The matmuls of the block save
those gathered weights for their backward; keeping them would hold every block's full weights from
forward to backward. Instead `track` notes which tensors are gathered weights, and saved-tensor
hooks (`hooks`) replace each saved gathered weight (or a view of one) by a handle that backward
unpacks from the block's weights gathered again; the forward's gathered tensors are then freed as
soon as the block's forward ends. Gradients still flow through the forward's gather, whose backward
reduce-scatters them.

Backward gathers a block again as a whole (one coalesced all-gather per group) when it first needs
one of its weights, and then starts the gathers of the block before it (the one backward reaches
next, if it saved gathered weights), so those run while this block's backward computes: forward's
prefetch, in reverse. A leaf's copy is let go once backward has unpacked it for the last time.

Hooks, not a checkpoint of the block: the block's other saved tensors stay visible to offload's
hooks, which these wrap (`hooks(inner)`), and nothing but the weights is computed twice.

Legend: no shape-suffixed tensors here; weights are handled leaf by leaf.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from fnmoe import caches
from fnmoe._torch import in_backward, outside_checkpoint_log, view_base
from fnmoe.tree import Tree, flatten_dict, tree_map


@dataclass(eq=False)
class _Block:
    """One block's gathered weights, to gather again in backward. It lives while any of its
    entries does."""
    start: Callable[[], Callable[[], Tree]]  # issues the block's gathers; returns what waits for them
    before: weakref.ref | None = None        # the block tracked before it in this forward (layer i-1)
    saved: bool = False                      # whether backward holds handles to its weights
    waiting: Callable[[], Tree] | None = None
    again: dict[str, torch.Tensor] | None = None  # path -> the leaf gathered again, until an entry takes it

    def issue(self) -> None:
        if self.waiting is None and self.again is None:
            self.waiting = self.start()

    def take(self, path: str) -> torch.Tensor:
        if self.again is None:
            self.issue()
            with torch.no_grad():
                self.again = {k: v for k, v in flatten_dict(self.waiting()).items() if isinstance(v, torch.Tensor)}
            self.waiting = None
            # the block backward reaches next; every rank must decide alike, so by what it saved
            # (a block that saved weights lives until its backward), not by what is still alive
            before = self.before() if self.before is not None else None
            if before is not None and before.saved:
                before.issue()
        return self.again.pop(path)


_last: weakref.ref | None = None
"""the block tracked last"""


@dataclass(eq=False)
class _Gathered:
    """How to gather one leaf again. It lives while the forward's gathered tensor does (which holds
    it) and while backward still has handles to it, so a regathered copy is shared by every saved
    view of the leaf and freed once the last backward node that needs it has run."""
    tensor: weakref.ref                 # the forward's gathered weight
    block: _Block
    path: str
    again: torch.Tensor | None = None   # the regathered copy, taken by the first unpack


_tracked: weakref.WeakValueDictionary[int, _Gathered] = weakref.WeakValueDictionary()


def track(gathered: Tree, stored: Tree, start: Callable[[], Callable[[], Tree]], layer: int) -> None:
    """Note gathered's leaves (gathered from stored's leaf at the same path) as layer `layer`'s
    gathered weights, which backward gathers again by start() (issues the block's gathers,
    returning what waits for them: the gathered tree) instead of keeping them. A block recomputed
    in backward is not tracked: its recompute's graph is used at once."""
    global _last
    if in_backward():
        return
    stored_flat = flatten_dict(stored)
    block = _Block(start, _last if layer > 0 else None)
    _last = weakref.ref(block)
    for path, t in flatten_dict(gathered).items():
        if isinstance(t, torch.Tensor) and t is not stored_flat.get(path):
            entry = _Gathered(weakref.ref(t), block, path)
            t._fnmoe_gathered = entry  # the entry lives as long as the gathered tensor
            _tracked[id(t)] = entry
            if view_base(t) is not None:  # a view's views name the root as their base
                _tracked[id(view_base(t))] = entry


@dataclass(eq=False)
class _Regather:
    """What a saved gathered weight (or a view of it) is replaced by until backward needs it."""
    entry: _Gathered
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the gathered tensor's


def _source(t: torch.Tensor) -> tuple[_Gathered, torch.Tensor] | None:
    """(entry, gathered tensor) when t is a tracked gathered weight or a view of one (whose _base
    is the gathered tensor or, when that is a view itself, its root)."""
    for cand in (t, view_base(t)):
        entry = _tracked.get(id(cand)) if cand is not None else None
        gathered = entry.tensor() if entry is not None else None
        if gathered is not None and (gathered is cand or view_base(gathered) is cand):
            return entry, gathered
    return None


def is_gathered(t: torch.Tensor) -> bool:
    """Whether t is a gathered weight (or a view of one) of a block in this forward."""
    return _source(t) is not None


def _pack(t: torch.Tensor, inner: Callable | None):
    found = _source(t)
    if found is not None and found[1].is_contiguous():
        entry, base = found
        entry.block.saved = True
        return _Regather(entry, t.size(), t.stride(), t.storage_offset() - base.storage_offset())
    return inner(t) if inner else t


def _unpack(handle, inner: Callable | None):
    if not isinstance(handle, _Regather):
        return inner(handle) if inner else handle
    entry = handle.entry
    if entry.again is None:
        entry.again = entry.block.take(entry.path).contiguous()
    return entry.again.as_strided(handle.size, handle.stride, entry.again.storage_offset() + handle.offset)


@dataclass(eq=False)
class _Ref:
    """A gathered weight handed to a recomputed region: the forward's tensor while it lives, else
    gathered again (as a saved one would be)."""
    tensor: weakref.ref
    handle: _Regather
    requires_grad: bool

    def get(self) -> torch.Tensor:
        t = self.tensor()
        if t is not None:
            return t
        # the region's input, not its work: outside the checkpoint's op log (torch 2.13 refuses an op
        # the forward did not run), and without a graph (the recompute only refills the forward's
        # saved tensors; the forward's graph carries the gradient to the shards), a leaf for which
        # autograd saves what it did in the forward
        with outside_checkpoint_log(), torch.no_grad():
            again = _unpack(self.handle, None)
        return again.detach().requires_grad_(self.requires_grad)


def weak_args(args: tuple) -> tuple | None:
    """args with each gathered weight in them a _Ref, or None when they hold none. A checkpointed
    region keeps its inputs for the recompute (torch's non-reentrant checkpoint holds them in a
    closure, where no saved-tensor hook sees them): a gathered weight among them lived until the
    region's backward, the whole layer's weights on every rank (found by --memory.report of a
    per-region policy on a 2x2 mesh: kept above none's saved)."""
    found = []

    def weak(t):
        handle = _pack(t, None) if isinstance(t, torch.Tensor) else t
        if not isinstance(handle, _Regather):
            return t
        found.append(t)
        return _Ref(weakref.ref(t), handle, t.requires_grad)
    out = tree_map(weak, args)
    return out if found else None


def strong_args(args: tuple) -> tuple:
    """weak_args undone: each _Ref the forward's tensor, or in backward's recompute gathered again."""
    return tree_map(lambda x: x.get() if isinstance(x, _Ref) else x, args)


@caches.register
def clear() -> None:
    """Forget every tracked gathered weight (the forward of a block in flight then keeps its own)."""
    global _last
    _tracked.clear()
    _last = None


def hooks(inner: tuple[Callable, Callable] | None = None):
    """saved_tensors_hooks that regather tracked gathered weights and hand every other saved tensor
    to inner's (pack, unpack) (e.g. offload's), or keep it."""
    pack, unpack = inner or (None, None)
    return torch.autograd.graph.saved_tensors_hooks(lambda t: _pack(t, pack), lambda h: _unpack(h, unpack))

