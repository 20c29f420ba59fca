"""How fnmoe runs torch's CPU threads: OpenMP threads spin briefly, then sleep.

Legend: no tensors here.

torch's CPU ops run on OpenMP (GNU libgomp in the Linux wheels). Between parallel regions a waiting
libgomp thread spins GOMP_SPINCOUNT turns (300,000 by default, ~3 ms by libgomp's own estimate)
before it sleeps: the fastest when the cores are the run's alone, ruinous when other processes share
them, as each spinning thread holds a core the thread it waits for needs. fnmoe sets
GOMP_SPINCOUNT=1000 (~10 us): long enough to catch the next region of a run of small ops, short
enough to give a shared core back. Measured with `python tools/bench_threads.py` on a 2-core AMD EPYC
(the numbers and their loads: README "Threads"): with one to four busy processes beside the run,
libgomp's default ran 12-25x slower than this; passive waiting (OMP_WAIT_POLICY=PASSIVE) holds up
best under load (9-27% over this) but gives up 28% of a quiet machine's speed, where this keeps
93%. One thread was slower than either, and fewer threads chosen from the machine's load would make
a run's numerics depend on it (reductions split by thread); the wait changes no result.

libgomp reads its variables once, when torch loads it, so the choice is made while the fnmoe package
loads (fnmoe/__init__.py calls `before_torch` before anything imports torch), for the `fnmoe`
command and a program that imports fnmoe as a library alike (the same speed from Python as from
the command: a library user's own loop on a 2-core machine at load 4-5 took 15.4 s with libgomp's default against
4.3 s, identical losses).
A program that imported torch before fnmoe is too late for it: fnmoe then says once how to get it
(import fnmoe first, or set GOMP_SPINCOUNT before Python starts). A user's OMP_WAIT_POLICY or
GOMP_SPINCOUNT is kept (OMP_WAIT_POLICY=PASSIVE is the choice for a machine that stays busy). Other
OpenMP runtimes (LLVM's libomp, Intel's) ignore GOMP_SPINCOUNT. This module imports nothing (torch
only inside `describe`).
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # a user who sets either has chosen how threads wait
DEFAULT = {"GOMP_SPINCOUNT": "1000"}  # spin ~10 us, then sleep


def wait_settings(environ: Mapping[str, str], torch_loaded: bool) -> dict[str, str]:
    """The OpenMP variables fnmoe sets (DEFAULT), or none: the environment sets one of WAIT_VARS (the
    user's choice), or torch, hence libgomp, is loaded already (it has read them)."""
    if torch_loaded or any(var in environ for var in WAIT_VARS):
        return {}
    return dict(DEFAULT)


def too_late(environ: Mapping[str, str], torch_loaded: bool, cores: int) -> str | None:
    """What to do, when torch loaded before fnmoe could set the wait and the user chose none on a
    machine of several cores; else None."""
    if not torch_loaded or cores < 2 or any(var in environ for var in WAIT_VARS):
        return None
    return ("fnmoe: torch was imported before fnmoe, so OpenMP's threads keep libgomp's default wait (each spins "
            "~3 ms for the next parallel region: several times slower while other work shares the cores); "
            "import fnmoe before torch, or set GOMP_SPINCOUNT=1000 (what `fnmoe train` uses) or "
            "OMP_WAIT_POLICY=PASSIVE in the environment before Python starts")


def before_torch() -> str | None:
    """Set fnmoe's OpenMP waiting in this process's environment (before torch loads); where torch
    loaded first, what to do instead (too_late)."""
    loaded = "torch" in sys.modules
    os.environ.update(wait_settings(os.environ, loaded))
    return too_late(os.environ, loaded, os.cpu_count() or 1)


def passive(environ: Mapping[str, str] | None = None) -> bool:
    """Whether OpenMP's threads sleep at once here (OMP_WAIT_POLICY=PASSIVE or GOMP_SPINCOUNT=0)."""
    env = os.environ if environ is None else environ
    return env.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" or env.get("GOMP_SPINCOUNT", "").strip() == "0"


def describe(environ: Mapping[str, str] | None = None) -> str:
    """The run's threading as one log line: intra-op threads and how OpenMP's wait."""
    import torch

    env = os.environ if environ is None else environ
    policy, spin = env.get("OMP_WAIT_POLICY", "").upper(), env.get("GOMP_SPINCOUNT")
    if passive(env):
        wait = "waiting threads sleep at once (passive: the best while other work keeps the cores busy)"
    elif policy == "ACTIVE" and spin is None:
        wait = "waiting threads spin (OMP_WAIT_POLICY=ACTIVE: many times slower when other work shares the cores)"
    elif spin is not None and not policy:
        wait = f"waiting threads spin {spin} turns, then sleep (GOMP_SPINCOUNT={spin})"
    else:
        got = ", ".join(f"{var}={env[var]}" for var in WAIT_VARS if var in env) or "libgomp's default"
        wait = f"waiting threads as {got} says"
    return f"threads: {torch.get_num_threads()} intra-op (--train.threads); {wait}"
