"""Stopping a run on request: SIGINT (Ctrl-C), SIGTERM (`timeout`, SLURM preemption, Kubernetes),
SIGHUP (a closed terminal or ssh session) and SIGUSR1 (SLURM's `--signal`, ahead of a time limit)
ask the run to stop after the step in progress, save a checkpoint and exit; a second signal
aborts, removing a save in progress. A signal within FOLLOW_UP_S of the first is the same request:
a launcher may pass one on twice (SLURM signals every process of a job step, and torchrun or
tools/slurm_train.sh forwards it again) or follow SIGINT with SIGTERM.

On several ranks the signal reaches each rank at its own moment (torchrun forwards what it gets
to every worker, each in its own session), so the ranks agree where to stop: at each step
boundary they all-reduce (MAX) one integer, 0 or the signal a rank got, and every rank stops at
the first boundary where any rank has one (`agreed`). The same integer carries a write failure of
rank 0's files (metrics.jsonl), which stops every rank there too. One 4-byte all-reduce a step,
after the host has read the step's loss anyway.

A completed stop is recorded (`record`): `<run-dir>/stopped.json`, and a key in the store of
torchrun's agent, which lives as long as that torchrun. A worker that torchrun restarts after the
stop finds it (`honoured`) and ends at once instead of undoing the stop; a new launch trains on.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from fnmoe.parallel import dist as fdist
from fnmoe.run import rundir

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
FOLLOW_UP_S = 2.0
"""a signal this soon after the first is the same request (a launcher's SIGINT then SIGTERM, or one
signal delivered twice: directly and forwarded), not a second one that aborts"""
STOPPED = "stopped.json"
"""in the run directory: the last stop a signal asked for and the run completed (`record`)"""
_STORE_KEY = "fnmoe/stopped"

log = logging.getLogger("fnmoe")
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
        if time.monotonic() - self._at < FOLLOW_UP_S:
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
    """SIGINT, SIGTERM, SIGHUP and SIGUSR1 set the Request while the body runs; the previous handlers
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


def under_torchrun() -> bool:
    """True in a worker torchrun started (TORCHELASTIC_RUN_ID), one process or many."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _agent_store():
    """A client of the store torchrun's agent keeps across its restarts, or None (not torchrun's,
    or the agent does not share its store: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    if not fdist.agent_store_shared():
        return None
    return fdist.agent_store(datetime.timedelta(seconds=10))


def record(run_dir: Path, signum: int, step: int, where: str) -> None:
    """Rank 0, once every rank has saved (or found saved) the stop's step: the stop, for a restart
    to find. Not written, a warning says so; the stop stands either way."""
    where = where.removesuffix("; continue with --resume auto")
    stopped = {"signal": name(signum), "step": step, "where": where, "time": time.time(),
               "torchrun_run": os.environ.get("TORCHELASTIC_RUN_ID"),
               "torchrun_attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    text = json.dumps(stopped)
    try:
        rundir.write_text(run_dir / STOPPED, text + "\n")
    except rundir.RunDirError as e:
        log.warning("%s; a restart by torchrun may not know the run stopped", e)
    if under_torchrun():
        try:
            store = _agent_store()
            if store is not None:
                store.set(_STORE_KEY, text)
        except (RuntimeError, ValueError) as e:  # the agent's store is gone: torchrun is ending too
            log.warning("could not tell torchrun's store the run stopped (%s)", str(e).splitlines()[0])


def honoured(run_dir: Path) -> dict | None:
    """Rank 0: the stop an earlier attempt of this torchrun job completed (a restart must not train
    past it), or None. Under the agent's shared store its key decides, which a new launch does not
    have; otherwise stopped.json of this TORCHELASTIC_RUN_ID on a restart (attempt > 0)."""
    if not under_torchrun():
        return None
    store = _agent_store()
    if store is not None:
        if not store.check([_STORE_KEY]):
            return None
        return json.loads(store.get(_STORE_KEY))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        stopped = json.loads((run_dir / STOPPED).read_text())
    except (OSError, ValueError):
        return None
    if (isinstance(stopped, dict) and stopped.get("torchrun_run") == os.environ["TORCHELASTIC_RUN_ID"]
            and isinstance(stopped.get("torchrun_attempt"), int) and attempt > stopped["torchrun_attempt"]):
        return stopped
    return None


LINGER_S = 10.0
"""how long a stopped worker stays when a rank of another node may yet die on its way out (`linger`)"""


def linger() -> None:
    """A worker whose stop is complete, under torchrun on several nodes with restarts left, stays
    LINGER_S before it ends. If a rank of another node dies on its way out, that node's agent starts a
    new rendezvous round, which needs every node's agent: an agent whose workers have all ended waits
    in its exit barrier instead, and the round waits torchrun's join timeout (600 s), then fails.
    While this node's workers run, its agent joins the round, and the restarted workers find the
    stop (`honoured`) and end at once (tests/test_restarts.py)."""
    env = os.environ
    restarts_left = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if under_torchrun() and int(env.get("GROUP_WORLD_SIZE", "1")) > 1 and restarts_left > 0:
        log.info("the stop is complete; staying %.0f s so that torchrun restarts every node together if a "
                 "rank dies on its way out", LINGER_S)
        time.sleep(LINGER_S)


def forget(run_dir: Path) -> None:
    """Rank 0, as a run starts training: an earlier run's stopped.json no longer says how it ends."""
    with contextlib.suppress(OSError):
        (run_dir / STOPPED).unlink()
