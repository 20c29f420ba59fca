"""A wait on the kernel-build lock held by a stopped (SIGSTOP, not dead) builder (issue 56, item 3):
the waiter names the holder (pid, host, since) within a few seconds and again periodically, gives
up after FNMOE_BUILD_LOCK_WAIT_S with an error naming it, and ends on SIGTERM or SIGINT even under a
handler that only notes the signal (a training run's): before, it waited in silence for ever."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnmoe.kernels import gemm

ROOT = Path(__file__).resolve().parent.parent

HOLD = """import sys, time
from pathlib import Path
from fnmoe.kernels import gemm
with gemm.build_lock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""

WAIT = """import logging, signal, sys, time
from pathlib import Path
from fnmoe.kernels import gemm
from fnmoe.kernels import lock_wait
logging.basicConfig(level=logging.INFO, format="%(message)s")
lock_wait.SAY_EVERY_S = 1.0  # the repeat, quicker than a real wait's 30 s
signal.signal(signal.SIGTERM, lambda *a: None)  # as a run's stop request notes a signal and goes on
signal.signal(signal.SIGINT, lambda *a: None)
print("waiting", flush=True)
try:
    with gemm.build_lock(Path(sys.argv[1])):
        print("got it", flush=True)
except (lock_wait.LockWaitError, lock_wait.LockWaitStopped) as e:
    print(f"{type(e).__name__}: {e}", flush=True)
    sys.exit(3)
"""


def _env(**more) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **more)


@pytest.fixture
def stopped_holder(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(build)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        holder.send_signal(signal.SIGSTOP)
        yield build, holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=30)


def _said(err: str, build: Path, pid: int) -> list[str]:
    head = (f"waiting for the kernel-build lock {build / gemm.LOCK}: held by pid {pid} on host {socket.gethostname()} "
            "since ")
    return [line for line in err.splitlines() if line.startswith(head) and f"(a stopped process: it holds the lock "
            f"until `kill -CONT {pid}` or its end)" in line]


@pytest.mark.launch
def test_a_wait_on_a_stopped_builder_is_said_and_gives_up_after_its_bound(stopped_holder):
    build, pid = stopped_holder
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", WAIT, str(build)], env=_env(FNMOE_BUILD_LOCK_WAIT_S="5"),
                       capture_output=True, text=True, timeout=40)
    assert r.returncode == 3, r.stdout + r.stderr
    assert len(_said(r.stderr, build, pid)) >= 2, r.stderr  # after 2 s, and again
    assert r.stdout.splitlines()[-1].startswith(
        f"LockWaitError: gave up waiting for the kernel-build lock {build / gemm.LOCK} after 5 s "
        f"(FNMOE_BUILD_LOCK_WAIT_S=5): held by pid {pid} on host "), r.stdout
    assert time.monotonic() - t0 < 30


@pytest.mark.launch
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_wait_on_a_stopped_builder_ends_on_sigterm_or_sigint(stopped_holder, sig):
    build, pid = stopped_holder
    waiter = subprocess.Popen([sys.executable, "-c", WAIT, str(build)], env=_env(FNMOE_BUILD_LOCK_WAIT_S="600"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout.readline() == "waiting\n"
        time.sleep(1.0)
        waiter.send_signal(sig)
        out, err = waiter.communicate(timeout=20)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate(timeout=30)
    assert waiter.returncode == 3, out + err
    assert out.splitlines()[-1].startswith(f"LockWaitStopped: {sig.name} while waiting for the kernel-build lock "
                                           f"{build / gemm.LOCK}, held by pid {pid}"), out


@pytest.mark.launch
def test_a_free_lock_is_taken_at_once_and_names_its_holder(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    r = subprocess.run([sys.executable, "-c", WAIT, str(build)], env=_env(), capture_output=True, text=True,
                       timeout=40)
    assert r.returncode == 0 and r.stdout == "waiting\ngot it\n" and "waiting for" not in r.stderr, r.stderr
    assert f'"host": "{socket.gethostname()}"' in (build / gemm.LOCK).read_text()
