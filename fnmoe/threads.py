"""How the `fnmoe` command runs torch's CPU threads: OpenMP threads that wait passively.

Legend: no tensors here.

torch's CPU ops run on OpenMP (GNU libgomp in the PyPI wheels). Between parallel regions libgomp's
threads spin by default (GOMP_SPINCOUNT 300,000 turns before they sleep): free when the cores are
the run's alone, ruinous when other processes share them, as each spinning thread holds a core the
thread it waits for needs. `python tools/bench_threads.py` measures it (README "Threads"): on a
shared 2-core machine passive waiting (OMP_WAIT_POLICY=PASSIVE) ran the tiny default model 4x
faster than spinning, as fast as one thread, and within a few percent of spinning when the
cores were free. Fewer threads would have served too, but chosen from the machine's load they
would make a run's numerics depend on it (reductions split by thread); the wait policy changes
no result.

libgomp reads its variables once, when torch loads it, so the choice is made while the fnmoe
package loads (fnmoe/__init__.py calls `before_torch` before anything imports torch), and only for
the `fnmoe` command (`fnmoe ...`, `python -m fnmoe ...`, torchrun's `-m fnmoe` workers): a program
that imports fnmoe as a library keeps its own OpenMP settings. A user's OMP_WAIT_POLICY or
GOMP_SPINCOUNT is kept. This module imports nothing (torch only inside `describe`).
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # a user who sets either has chosen how threads wait
DEFAULT_POLICY = "PASSIVE"


def is_command(argv0: str) -> bool:
    """Whether a process whose sys.argv[0] is argv0 while the fnmoe package loads is the fnmoe
    command: the console script, or `python -m fnmoe` (argv[0] is "-m" while -m finds its module)."""
    return argv0 == "-m" or os.path.basename(argv0) in ("fnmoe", "fnmoe.exe")


def wait_policy(environ: Mapping[str, str], torch_loaded: bool, command: bool) -> str | None:
    """The OMP_WAIT_POLICY the fnmoe command sets, or None to set nothing: the environment sets one of
    WAIT_VARS (the user's choice), or torch, hence libgomp, is loaded already (it has read them)."""
    if not command or torch_loaded or any(var in environ for var in WAIT_VARS):
        return None
    return DEFAULT_POLICY


def before_torch() -> None:
    """Set the command's wait policy in this process's environment (before torch loads)."""
    policy = wait_policy(os.environ, "torch" in sys.modules, is_command(sys.argv[0]))
    if policy:
        os.environ["OMP_WAIT_POLICY"] = policy


def describe(environ: Mapping[str, str] | None = None) -> str:
    """The run's threading as one log line: intra-op threads and how OpenMP's wait."""
    import torch

    env = os.environ if environ is None else environ
    policy, spin = env.get("OMP_WAIT_POLICY", "").upper(), env.get("GOMP_SPINCOUNT")
    if policy == "PASSIVE" and spin is None:
        wait = "waiting threads sleep (OMP_WAIT_POLICY=PASSIVE: other work on the cores slows this run least)"
    elif policy == "ACTIVE" and spin is None:
        wait = "waiting threads spin (OMP_WAIT_POLICY=ACTIVE: many times slower when other work shares the cores)"
    else:
        got = ", ".join(f"{var}={env[var]}" for var in WAIT_VARS if var in env) or "libgomp's default"
        wait = f"waiting threads as {got} says"
    return f"threads: {torch.get_num_threads()} intra-op (--train.threads); {wait}"
