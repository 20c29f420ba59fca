"""Fault injection for tests: the one place production code reads the FNMOE_TEST_* variables.

Tests set these environment variables on the processes they start to make a rank crash, hang or
save slowly at a chosen point; unset (as in every real run) each hook does nothing.
"""
from __future__ import annotations

import logging
import os
import signal
import time

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


def save_delay() -> None:
    """Wait SAVE_DELAY_ENV seconds, so a test can kill the process while a save is half written."""
    time.sleep(float(os.environ.get(SAVE_DELAY_ENV, 0)))


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
