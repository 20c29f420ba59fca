"""Host memory is a limit, not a hope: before step 1 a run whose offload pool would pass
plan.host_gb (the hardware profile's usable host memory a GPU, or the figure given) or what this
machine has available stops, naming the figures and the flags that change them.

The pool's bytes are fnmoe.plan.activations.pool_bytes (the planner's offload_host plus the pool's
margin) rounded up to its pinned segments: what the run would pin, not an estimate beside it. The
machine's side is /proc/meminfo's MemAvailable (else sysconf's available pages), shared by the
training processes of this host (torchrun's LOCAL_WORLD_SIZE) and the ranks each one runs (a
simulation's, which each pin a pool in one process).
"""
from __future__ import annotations

import os

from fnmoe.config import RunConfig
from fnmoe.config.hardware import hardware
from fnmoe.memory.host_pool import POOL_MARGIN
from fnmoe.parallel import dist as fdist
from fnmoe.plan.activations import activation_plan, pool_bytes

GB = 1e9  # plan.host_gb is in GB, as the planner's tables


class HostMemoryError(ValueError):
    """The offload pool would not fit the host memory a GPU has: raised before the first step."""


def available_bytes() -> int | None:
    """Host memory the kernel says can be allocated without swapping (MemAvailable), else the
    free pages sysconf reports; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    return f"{n / GB:.4g} GB"


def _sharers() -> int:
    """Pools this host will hold: its training processes times the ranks each runs."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if fdist.launched() else 1
    return local * len(fdist.ranks_here())


def _levers(run: RunConfig) -> str:
    """The flags that shrink what run offloads, the ones that apply to it."""
    mem = run.memory
    out = ["a smaller micro-batch (--train.batch-size, more --train.grad-accum)"]
    if mem.recompute != "full":
        out.append("--memory.recompute full (a block keeps its input and its exchange's outputs only)")
    elif mem.keep_exchange and run.mesh.ep > 1:
        out.append("--memory.no-keep-exchange (the exchange replayed in backward, not kept)")
    return ", ".join(out) + " or no --memory.offload"


def host_memory_error(run: RunConfig, available: int | None = None) -> str | None:
    """Why run's offload pool does not fit (None when it does, or nothing is offloaded); available:
    this host's free bytes (default available_bytes())."""
    asked = pool_bytes(run)
    if not asked:
        return None
    pinned = asked  # pool_bytes is what the pool pins: whole segments
    acts = activation_plan(run)
    margin = f", {_gb(acts['host_routed'])} of it sized by the routing x {POOL_MARGIN:g}" if acts["host_routed"] else ""
    need = (f"offload needs {_gb(pinned)} of host memory a GPU (its pool: the planned offload_host "
            f"{_gb(acts['host'])}{margin}, in pinned segments)")
    cut = f"offload less: {_levers(run)}; `fnmoe plan` shows offload_host"
    limit = hardware(run.plan).host_gb
    if pinned > limit * GB:
        given = "given" if run.plan.host_gb is not None else f"hardware profile {run.plan.hardware}"
        return (f"{need}, more than plan.host_gb = {limit:g} GB a GPU ({given}): if this machine's "
                f"GPUs have more host memory each, raise --plan.host-gb; else {cut}")
    available = available_bytes() if available is None else available
    n = _sharers()
    if available is not None and pinned * n > available:
        return (f"{need}, and this host has {_gb(available)} available (MemAvailable) for {n} "
                f"pool(s): {_gb(available / n)} a GPU; free host memory, run fewer ranks a host, "
                f"or {cut}")
    return None
