"""Weight gradients put off (DeepSeek's DualPipe, Megatron's "weight-gradient store"): inside
`deferred()`, the experts' grouped GEMMs (fnmoe.kernels.gemm, fnmoe.kernels.fp8_gemm) compute their
input gradient in backward and keep the weight-gradient GEMM for later, so that what waits for the
input gradient (the dispatch's backward all-to-all: fnmoe.models.moe_steps.Split) travels while the
weight gradients are computed. `flush` then runs them, each added into its weight's .grad as autograd
would have: a leaf's gradients of one backward pass summed first, in the order they were put off,
then added to what .grad holds (autograd's input buffer, then its AccumulateGrad), so the gradients
are bitwise those of one pass.

Only a weight that is a leaf is put off (a block chunk's recompute takes its weights as leaves); any
other weight's gradient is computed at once, as outside `deferred()`. A compiled region's backward is
traced ahead, outside `deferred()`: its weight gradients run with its input gradients.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Iterator

import torch

from fnmoe import _torch

_store: list | None = None
"""[(weight leaf, weight-gradient thunk)] while deferred() runs, else None"""


@contextlib.contextmanager
def deferred() -> Iterator[list]:
    """Inside, the experts' GEMMs put their weight gradients off into the list yielded (`flush` runs them)."""
    global _store
    before, _store = _store, []
    try:
        yield _store
    finally:
        _store = before


def weight_grad(w: torch.Tensor | None, fn: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """fn() (the gradient of the GEMM's weight w), or None with fn put off where deferred() runs and
    w is a leaf (`leaf`'s; None there: not a leaf, computed at once)."""
    if _store is None or w is None:
        return fn()
    if _torch.backward_reaches(w):  # a pass whose inputs= leave w out takes no gradient of it
        _store.append((w, fn))
    return None


def leaf(w: torch.Tensor) -> torch.Tensor | None:
    """w where a GEMM may put its gradient off (a leaf that takes a gradient, outside a compiled
    region's trace), else None."""
    return w if w.is_leaf and w.requires_grad and not torch.compiler.is_compiling() else None


def flush(store: list) -> None:
    """Run the weight gradients put off, each added into its leaf's .grad as soon as the leaf's last
    one is computed (a leaf's summed in order first; see the module docstring): a stack's new gradient
    at a time beside the sums, as in one autograd pass. The store is emptied."""
    left = collections.Counter(id(w) for w, _ in store)
    parts: dict[int, torch.Tensor] = {}
    work = list(store)
    store.clear()
    with torch.no_grad():
        for w, fn in work:
            g = fn()
            if id(w) in parts:
                g = parts.pop(id(w)) + g
            left[id(w)] -= 1
            if left[id(w)]:
                parts[id(w)] = g
            elif w.grad is None:
                w.grad = g
            else:
                w.grad.add_(g)
            del g
