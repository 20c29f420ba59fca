"""compiled(): the one torch.compile call site, the persistent compile cache, the region registry.

The compile unit is a region (attention, dense MLP, MoE): a small pure function compiled with
fullgraph=True, so memory-policy hooks can sit between regions. Hyperparameters enter compiled
code as 0-D tensors, so changing them never recompiles.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fnmoe import _torch, caches

log = logging.getLogger("fnmoe")

_compiled: dict[Callable, Callable] = {}
_said: set[str] = set()
_flags_set = False


@caches.register
def clear() -> None:
    """Forget the compiled regions (each compiles again on next use) and the warnings said once."""
    _compiled.clear()
    _said.clear()


def set_compile_flags() -> None:
    """The dynamo and functorch flags every fnmoe compile needs; set once per process."""
    global _flags_set
    if _flags_set:
        return
    # The EP count exchange and routing counts read device scalars; capture them in-graph.
    _torch.dynamo_config.capture_scalar_outputs = True
    # Rows kept under a capacity factor come from nonzero: a size read from data. fullgraph traces
    # it in-graph anyway; set here, inspection (fullgraph=False) sees the graphs training compiles.
    _torch.dynamo_config.capture_dynamic_output_shape_ops = True
    # The MoE region's gathers are autograd.Functions; dynamo traces their forward and backward
    # into the graph the cache key hashes, so a warm start may reuse them (off by default in torch).
    _torch.functorch_config.autograd_cache_allow_custom_autograd_functions = True
    _flags_set = True


def compile_fn(fn: Callable, fullgraph: bool = True, dynamic: bool | None = None) -> Callable:
    """torch.compile(fn): the one call site. Inspection passes fullgraph=False to count breaks;
    dynamic=True traces sizes as symbols (one graph for every size)."""
    set_compile_flags()
    return torch.compile(fn, fullgraph=fullgraph, dynamic=dynamic)


def compiled(fn: Callable, dynamic: bool | None = None) -> Callable:
    """fn compiled once per process (fullgraph: a graph break is an error, not a slowdown)."""
    if fn not in _compiled:
        _compiled[fn] = compile_fn(fn, dynamic=dynamic)
    return _compiled[fn]


def size_hint(n, estimate) -> None:
    """Give inductor `estimate` (an int, or a size expression: its value when this graph is traced)
    as its guess of n, a size read from device data under compile (an unbacked SymInt); a hint
    never guards or recompiles. Without one inductor counts such sizes as 0 bytes, finds no data
    shared by two kernels over them and fuses none (the slabs' SwiGLU backward, for one, then runs
    as three loops through an fp32 buffer)."""
    if torch.compiler.is_compiling() and _torch.override_optimization_hint is not None:  # not in 2.11
        _torch.comptime(_hint_at_trace)  # runs while dynamo traces, with this frame's n and estimate


def _hint_at_trace(ctx) -> None:
    if ctx.get_local("n").is_python_constant():  # e.g. a size read after a graph break (fnmoe inspect)
        return
    n = ctx.get_local("n").as_fake()
    if not (isinstance(n, torch.SymInt) and n.node.expr.is_Symbol and free_unbacked_symbols(n.node.expr)):
        return  # known, or a sum of hinted sizes
    est = ctx.get_local("estimate")
    if est.is_python_constant():
        value = est.as_python_constant()
    else:  # a dynamic batch's size has a value now; an unbacked one may have hints for its parts
        node = est.as_fake().node
        value = node.hint if node.has_hint() else node.expr.xreplace(_hints(node))
    if getattr(value, "is_number", True):
        _torch.override_optimization_hint(n, int(value))


def hint_of(n: torch.SymInt) -> int | None:
    """The hint size_hint gave n, if any."""
    return _hints(n.node).get(n.node.expr)


def _hints(node) -> dict:
    return getattr(node.shape_env, "var_to_hint_override", {})  # torch 2.11's ShapeEnv has it too


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


def user_cache_dir() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR when someone chose it: importing dynamo sets it to
    inductor's own default (a temp directory), which must not hide compile_cache/."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return None if env is None or os.path.abspath(env) == os.path.abspath(_torch.inductor_default_cache_dir()) else env


def setup_cache(cache_dir: str = "") -> Path:
    """Point inductor's caches at cache_dir (a chosen TORCHINDUCTOR_CACHE_DIR wins)."""
    if user_cache_dir():
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    path = Path(cache_dir) if cache_dir else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def artifacts_path(cache_dir: Path, key: str) -> Path:
    """Where the portable cache artifacts of one (torch version, model config) live."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / "artifacts" / f"torch-{torch.__version__.replace('+', '_')}-{digest}.bin"


def load_artifacts(path: Path) -> bool:
    """Pre-populate inductor's caches from a previous run's artifacts (a warm start compiles nothing)."""
    if not path.is_file():
        return False
    torch.compiler.load_cache_artifacts(path.read_bytes())
    return True


def save_artifacts(path: Path) -> None:
    """Write the artifacts of everything compiled so far (atomically: a temp file of this process, then
    rename; the last writer wins, each file whole)."""
    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several processes (ranks) may save at once
    tmp.write_bytes(saved[0])
    tmp.replace(path)


def warm_start(cache_dir: str, key: str) -> Path:
    """Set up the compile cache and load the artifacts saved for key; returns where to save them."""
    path = artifacts_path(setup_cache(cache_dir), key)
    if load_artifacts(path):
        log.info("compile: loaded cache artifacts %s", path)
    return path


def cache_stats() -> dict[str, int]:
    """Inductor FX-graph cache hits and misses in this process (a miss is a real compilation), and
    AOT autograd cache hits and bypasses (a bypassed graph is traced through autograd again)."""
    counters = _torch.dynamo_counters()
    c, a = counters["inductor"], counters["aot_autograd"]
    return {"fxgraph_cache_hit": c["fxgraph_cache_hit"], "fxgraph_cache_miss": c["fxgraph_cache_miss"],
            "autograd_cache_hit": a["autograd_cache_hit"], "autograd_cache_bypass": a["autograd_cache_bypass"]}
