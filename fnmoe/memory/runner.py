"""The seam between the model and the memory policies: how hidden_states runs each block.

hidden_states calls `runner(i, fn, p, x_BLD, *rest)` for block i, where fn(p, x_BLD, *rest) is the
block (p its params, x_BLD its input), and the block runs each of its regions (attention, MoE,
dense MLP) through `runner.region(i, name, fn, compile, *args)`. A runner decides what the block
keeps for backward (fnmoe.memory.policies.Runner: recompute, offload, resharding); PLAIN runs everything as
it is, which is what a plain forward does.

Legend: B batch, L sequence, D model.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from fnmoe import compile as fcompile


class BlockRunner(Protocol):
    offloads: bool
    """blocks take their params already cast to the compute dtype: offload tells a block's params
    from its activations by their storages, and casts inside a compiled region would be saved
    (and copied to the host) as activations"""

    def __call__(self, i: int, fn: Callable, p: dict, x_BLD, *rest) -> Any:
        """Block i: fn(p, x_BLD, *rest) under this runner's policy for blocks."""

    def region(self, i: int, name: str, fn: Callable, compile: bool, *args) -> Any:
        """Region `name` of block i: fn(*args), compiled when compile, under its region policy."""

    def chunk_recompute(self, i: int) -> str | None:
        """How backward recomputes block i's MoE token chunks (fnmoe.moe_chunks): None when it keeps
        what they save; "keep" when it recomputes them, keeping the expert-parallel exchange's outputs
        (the recompute around the region replays them); "replay" when the chunks send their rows again."""


class Plain:
    """Every block and region as it is (regions compiled when asked)."""
    offloads = False

    def __call__(self, i: int, fn: Callable, p: dict, x_BLD, *rest):
        return fn(p, x_BLD, *rest)

    def region(self, i: int, name: str, fn: Callable, compile: bool, *args):
        return (fcompile.compiled(fn) if compile else fn)(*args)

    def chunk_recompute(self, i: int) -> str | None:
        return None


PLAIN: BlockRunner = Plain()
