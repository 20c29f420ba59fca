"""clear_caches(): empty every module-level cache fnmoe keeps, each registered where it is defined.

A module that keeps a cache registers how to empty it next to it (equinox's `_caches.py`):

    @caches.register                      # an lru_cache / functools.cache: its cache_clear
    @functools.lru_cache(maxsize=4)
    def _epoch_permutation(...): ...

    caches.register(_submeshes.clear)     # any function of no arguments

so a new cache cannot be missed here, and this module imports none of them: clear_caches empties the
caches of the modules imported so far (one not imported has none). Each is rebuilt on next use: a
region compiles again, a policy wrapper, mesh lookup or epoch permutation is computed again, a
warning said once may be said again. Call it between runs (tests, notebooks, a process that trains
several models), not inside a step: a gathered weight tracked for regathering would then be kept for
backward instead.

Not caches, so not registered: fnmoe.kernels.gemm's build-and-load (its ops and their fake kernels
register once per process), the compile flags (set once per process), and memos of pure functions
of a frozen config that hold nothing else (params' config checks and leaf shapes, the planner's
formulas). torch's own compile caches are torch's (torch.compiler.reset).
"""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")

_clears: list[Callable[[], None]] = []


def register(cache: T) -> T:
    """Register a cache and return it (so it can decorate): a function wrapped by functools.lru_cache
    or functools.cache (its cache_clear is registered), or a function of no arguments that empties one.
    Registering the same one again does nothing."""
    clear = getattr(cache, "cache_clear", cache)
    if not callable(clear):
        raise TypeError(f"caches.register takes an lru_cache function or a function that empties a cache, "
                        f"got {cache!r}")
    if clear not in _clears:
        _clears.append(clear)
    return cache


def registered() -> tuple[Callable[[], None], ...]:
    """The registered clears, in the order of registration."""
    return tuple(_clears)


def clear_caches() -> None:
    """Empty every registered cache."""
    for clear in list(_clears):
        clear()
