"""What the log says about a run's length: the steps a token budget makes, a warmup clamped to
the run (fnmoe.optim.schedules.warmup_of), and at the end the steps this process ran."""
from __future__ import annotations

import logging

from fnmoe import optim
from fnmoe.config import RunConfig

log = logging.getLogger("fnmoe")


def log_length(run: RunConfig) -> None:
    """How train.tokens set the steps, and a warning when the warmup was clamped to the run (rank 0 calls it)."""
    t = run.train
    if t.tokens:
        log.info("train.tokens=%d: %d steps of %d x %d tokens (%d tokens)", t.tokens, t.steps, t.batch_size,
                 run.data.seq_len, t.steps * t.batch_size * run.data.seq_len)
    note = optim.warmup_of(run.optim, t.steps)[1]
    if note:
        log.warning(note)


def steps_done(first: int, last: int, seconds: float) -> str:
    """This process's steps and time, apart from the run's (a resumed run began before it)."""
    if first == 1:
        return f"{last} steps in {seconds:.1f} s"
    return f"the run is at step {last}; this process ran steps {first}..{last} ({last - first + 1}) in {seconds:.1f} s"
