"""Stopping a run on request: SIGINT (Ctrl-C), SIGTERM (`timeout`, SLURM preemption, Kubernetes)
and SIGUSR1 (SLURM's `--signal`, ahead of a time limit) ask the run to stop after the step in
progress, save a checkpoint and exit; a second signal aborts, removing a save in progress.

On several ranks the signal reaches each rank at its own moment (torchrun forwards what it gets
to every worker, each in its own session), so the ranks agree where to stop: at each step
boundary they all-reduce (MAX) one integer, 0 or the signal a rank got, and every rank stops at
the first boundary where any rank has one (`agreed`). The same integer carries a write failure of
rank 0's files (metrics.jsonl), which stops every rank there too. One 4-byte all-reduce a step,
after the host has read the step's loss anyway.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator

import torch
import torch.distributed as dist

from fnmoe.parallel import dist as fdist

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
FOLLOW_UP_S = 2.0
"""a different signal this soon after the first is the same request (a launcher's SIGINT then
SIGTERM), not a second one that aborts"""
WRITE_FAILED = 1 << 10
"""the agreed value when a rank could not write its files: above every signal number"""


class Aborted(BaseException):
    """A second signal while stopping. A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on the way keeps it from ending the run; a save it cuts short removes its
    temp directory (checkpoint.write)."""


class Request:
    """What the signals asked of this process: `signum`, the first one (None: none yet), and
    `aborted_by`, a second one. Set by the handler in the main thread, read at step boundaries."""

    def __init__(self, speak: bool):
        self.signum: int | None = None
        self.aborted_by: int | None = None
        self._at = 0.0
        self._speak = speak

    def handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self._at = signum, time.monotonic()
            # a plain write: the logging module's locks may be held by the code this interrupts
            self._say(f"fnmoe: {name(signum)}: stopping after this step to save a checkpoint "
                      "(a second signal aborts)\n")
            return
        if signum != self.signum and time.monotonic() - self._at < FOLLOW_UP_S:
            return
        self.aborted_by = signum
        raise Aborted(f"{name(signum)} while stopping: aborted")

    def _say(self, text: str) -> None:
        if self._speak:
            with contextlib.suppress(OSError):
                os.write(2, text.encode())


def name(signum: int) -> str:
    if signum == WRITE_FAILED:
        return "a write failure"
    return signal.Signals(signum).name


@contextlib.contextmanager
def on_signals(speak: bool) -> Iterator[Request]:
    """SIGINT, SIGTERM and SIGUSR1 set the Request while the body runs; the previous handlers
    are restored after it. Only the main thread can take signals: elsewhere the Request stays
    unset and Ctrl-C raises KeyboardInterrupt as usual."""
    request = Request(speak)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    before = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, request.handle)
    try:
        yield request
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def agreed(request: Request, write_failed: bool = False) -> int:
    """At a step boundary: 0 to go on, else why every rank stops here (the largest of the ranks'
    signal numbers, or WRITE_FAILED). The same answer on every rank, from one all-reduce."""
    mine = WRITE_FAILED if write_failed else (request.signum or 0)
    if fdist.world() == 1 or fdist.simulated():
        return mine
    fdist.entering("all-reduce of the stop flag over every rank")
    # NCCL reduces device tensors only; gloo host ones (no copy to and from a GPU)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([mine], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
