"""Activation memory policies: how a block's saved tensors are kept for backward.

`none` keeps everything; `full` recomputes the whole block in backward (torch.utils.checkpoint,
non-reentrant), keeping only its input. Routing is recomputed from the same inputs and weights,
so it cannot change; the expert counts a block returns are read from the forward only.
"""
from __future__ import annotations

from typing import Callable

from torch.utils.checkpoint import checkpoint

from fnmoe.config import MemoryConfig


def _recompute(fn: Callable, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def block_runner(mem: MemoryConfig) -> Callable | None:
    """The block_fn for model.hidden_states under this policy (None: plain call)."""
    return {"none": None, "full": _recompute}[mem.recompute]
