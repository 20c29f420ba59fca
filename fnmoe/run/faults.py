"""Fault injection for tests: the one place production code reads the FNMOE_TEST_* variables.

Tests set these environment variables on the processes they start to make a rank crash, hang or
save slowly at a chosen point; unset (as in every real run) each hook does nothing.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable

log = logging.getLogger("fnmoe")

SAVE_DELAY_ENV = "FNMOE_TEST_SAVE_DELAY_S"
"""seconds a checkpoint save waits between its data files and its index.json (tests/test_checkpoint.py)"""
KILL_AT_STEP_ENV = "FNMOE_TEST_KILL_AT_STEP"
"""SIGKILL the process after this step on torchrun's first attempt (tests/test_checkpoint.py)"""
KILL_RANK_ENV = "FNMOE_TEST_KILL_RANK"
"""with KILL_AT_STEP_ENV, only this rank dies (tests/test_sharding.py: one rank lost under torchrun)"""
STOP_AT_STEP_ENV = "FNMOE_TEST_STOP_AT_STEP"
"""with STOP_RANK_ENV, that rank stops itself (SIGSTOP) as this step starts (tests/test_failures.py)"""
STOP_RANK_ENV = "FNMOE_TEST_STOP_RANK"
SIGNAL_AT_STEP_ENV = "FNMOE_TEST_SIGNAL_AT_STEP"
"""after this step, rank SIGNAL_RANK_ENV (default 0) sends the signal SIGNAL_ENV names (default SIGINT)
to SIGNAL_TO_ENV ("self", the default, or "parent": torchrun's agent, which forwards it to every
worker) and waits until it arrives, so the run stops after exactly this step (tests/test_signals.py)"""
SIGNAL_ENV = "FNMOE_TEST_SIGNAL"
SIGNAL_TO_ENV = "FNMOE_TEST_SIGNAL_TO"
SIGNAL_RANK_ENV = "FNMOE_TEST_SIGNAL_RANK"
PART_DELAY_ENV = "FNMOE_TEST_PART_DELAY_S"
"""seconds `fnmoe prepare`'s workers wait before tokenising each part, so a test can stop it midway"""
CRASH_AFTER_STOP_ENV = "FNMOE_TEST_CRASH_AFTER_STOP_RANK"
"""this rank dies (SIGKILL) once a signal's stop is complete, on torchrun's first attempt: a crash on the
way out that makes torchrun restart a stopped run (tests/test_process_tree.py)"""


def save_delay() -> None:
    """Wait SAVE_DELAY_ENV seconds, so a test can kill the process while a save is half written."""
    time.sleep(float(os.environ.get(SAVE_DELAY_ENV, 0)))


def part_delay() -> None:
    """Wait PART_DELAY_ENV seconds (a prepare worker, before each part)."""
    time.sleep(float(os.environ.get(PART_DELAY_ENV, 0)))


def before_step(step: int, rank: int) -> None:
    """Hangs like a stuck worker (SIGSTOP: no exit, no closed socket) as step FNMOE_TEST_STOP_AT_STEP
    starts on rank FNMOE_TEST_STOP_RANK, so the other ranks wait inside that step's first collective."""
    if os.environ.get(STOP_AT_STEP_ENV) == str(step) and os.environ.get(STOP_RANK_ENV) == str(rank):
        log.warning("test hook: rank %d (pid %d) stops itself at step %d", rank, os.getpid(), step)
        os.kill(os.getpid(), signal.SIGSTOP)


def after_step(step: int, rank: int) -> None:
    """Dies like a crashed worker (SIGKILL, no cleanup) after step FNMOE_TEST_KILL_AT_STEP, on the
    first attempt only (torchrun sets TORCHELASTIC_RESTART_COUNT), so a restart can resume; with
    FNMOE_TEST_KILL_RANK set, only that rank dies."""
    if (os.environ.get(KILL_AT_STEP_ENV) == str(step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and os.environ.get(KILL_RANK_ENV, str(rank)) == str(rank)):
        os.kill(os.getpid(), signal.SIGKILL)


def signal_after(step: int, rank: int, arrived: Callable[[], bool]) -> None:
    """Sends the signal FNMOE_TEST_SIGNAL after step FNMOE_TEST_SIGNAL_AT_STEP (see SIGNAL_AT_STEP_ENV)
    and waits, up to 30 s, until `arrived()`: the other ranks wait meanwhile at the step boundary's
    stop flag, so every rank stops after this step whatever the signal's delay."""
    if os.environ.get(SIGNAL_AT_STEP_ENV) != str(step) or os.environ.get(SIGNAL_RANK_ENV, "0") != str(rank):
        return
    sig = signal.Signals[os.environ.get(SIGNAL_ENV, "SIGINT")]
    target = os.getppid() if os.environ.get(SIGNAL_TO_ENV) == "parent" else os.getpid()
    log.warning("test hook: rank %d sends %s to pid %d after step %d", rank, sig.name, target, step)
    os.kill(target, sig)
    deadline = time.monotonic() + 30
    while not arrived() and time.monotonic() < deadline:
        time.sleep(0.01)


def after_stop(rank: int) -> None:
    """Dies like a worker that crashes on its way out (SIGKILL) after a signal's stop was saved and
    recorded, on rank CRASH_AFTER_STOP_ENV, on torchrun's first attempt only."""
    if (os.environ.get(CRASH_AFTER_STOP_ENV) == str(rank)
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        log.warning("test hook: rank %d (pid %d) dies after the stop", rank, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
