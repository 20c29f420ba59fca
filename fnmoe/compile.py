"""compiled(): the one torch.compile call site, the persistent compile cache, the region registry.

The compile unit is a region (attention, dense MLP, MoE): a small pure function compiled with
fullgraph=True, so memory-policy hooks can sit between regions. Hyperparameters enter compiled
code as 0-D tensors, so changing them never recompiles.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("fnmoe")

_compiled: dict[Callable, Callable] = {}
_said: set[str] = set()


def compiled(fn: Callable) -> Callable:
    """fn compiled once per process (fullgraph: a graph break is an error, not a slowdown)."""
    if fn not in _compiled:
        # The EP count exchange and routing counts read device scalars; capture them in-graph.
        torch._dynamo.config.capture_scalar_outputs = True
        _compiled[fn] = torch.compile(fn, fullgraph=True)
    return _compiled[fn]


def say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)


def default_cache_dir() -> Path:
    """The checkout's compile_cache/ when run from a checkout, else a per-user cache directory."""
    checkout = Path(__file__).resolve().parent.parent / "compile_cache"
    if checkout.is_dir():
        return checkout
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fnmoe" / "compile"


def setup_cache(cache_dir: str = "") -> Path:
    """Point inductor's caches at cache_dir (TORCHINDUCTOR_CACHE_DIR, when set, wins)."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    path = Path(cache_dir) if cache_dir else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path
