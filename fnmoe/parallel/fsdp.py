"""FSDP as the model's params source (fnmoe.models.seams.ParamsSource): sharded params gathered one block
at a time, each block's gathers issued while the block before computes, and tracked for resharding.

Forward issues layer i+1's gathers before block i computes (`outside`), and block i+1 waits for them
where it starts, inside its runner (`inside`; fnmoe.parallel.gather), so a runner that recomputes
block i in backward gathers it again there, and issues the gathers of the layer before it, which
backward recomputes next. Resharding (fnmoe.parallel.reshard) notes the gathered weights, to gather
again what backward needs instead of keeping it.

`params_source(params)` is the one rule: GATHER for sharded (DTensor) leaves, else fnmoe.models.seams.CAST.
Gathered MoE params whose expert stacks are split over ep ranks carry the expert-parallel exchange
over that axis as "ep" (fnmoe.models.seams.Exchange; fnmoe.parallel.dispatch.exchange).

Legend: no shape-suffixed tensors here; weights are handled leaf by leaf.
"""
from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from fnmoe import _torch
from fnmoe.parallel import dispatch
from fnmoe.parallel import gather as fgather
from fnmoe.parallel import reshard
from fnmoe.models.seams import CAST, LayerFeed, ParamsSource
from fnmoe.tree import Tree


class Prefetching:
    """GATHER's feed of one forward: the layers' stored params gathered with one block of lookahead."""

    def __init__(self, layers: list[dict], dtype: torch.dtype):
        self.dtype, self.layers, self.issued = dtype, layers, {}
        self.issue(0)

    def issue(self, i: int) -> None:
        if 0 <= i < len(self.layers) and i not in self.issued:
            self.issued[i] = fgather.issue(self.layers[i], self.dtype)  # in the blocks' compute dtype

    def outside(self, i: int) -> dict:
        self.issue(i + 1)  # block i+1's gather runs while block i computes
        return self.layers[i]

    def inside(self, stored: dict, i: int) -> dict:
        self.issue(i)
        issued = self.issued.pop(i)
        if _torch.in_backward():
            self.issue(i - 1)
        p = _with_exchange(stored, fgather.finish(issued, stored))
        dtype = self.dtype
        reshard.track(p, stored, lambda: functools.partial(fgather.finish, fgather.issue(stored, dtype), stored), i)
        return p


class Gather:
    """The params source of sharded params: fnmoe.parallel.gather's all-gathers in the compute dtype."""

    def __call__(self, tree: Tree, dtype: torch.dtype) -> Tree:
        return _with_exchange(tree, fgather.gather(tree, dtype))

    def layers(self, layers: list[dict], dtype: torch.dtype, cast_inside: bool) -> LayerFeed:
        return Prefetching(layers, dtype)  # the gathers cast: nothing is left to cast inside


GATHER: ParamsSource = Gather()


def _with_exchange(stored: Tree, gathered: Tree) -> Tree:
    """gathered, with the exchange over the ep axis (fnmoe.models.seams.Exchange) as "ep" beside
    expert stacks sharded over more than one ep rank: the model sends their rows through it."""
    if not isinstance(stored, dict):
        return gathered
    out = {k: _with_exchange(stored[k], v) for k, v in gathered.items()}
    w = stored.get("w_gate_EDF")
    if isinstance(w, DTensor) and w.device_mesh.ndim == 2 and w.device_mesh.size(1) > 1:
        out["ep"] = dispatch.exchange(w.device_mesh.get_group("ep"))
    return out


def params_source(params: Tree) -> ParamsSource:
    """GATHER when params are sharded (DTensor leaves), else CAST."""
    return GATHER if isinstance(params["embed"]["w_VD"], DTensor) else CAST
