"""Waiting for a flock another process holds, never silently and never without end: the one way the
package waits on a lock (the kernel-build lock, fnmoe.kernels.gemm.build_lock; a run directory's
lock is refused at once instead, fnmoe.run.rundir).

The holder writes who it is into the lock file (`claim`: pid, host, start time). A waiter polls
the lock and says who holds it after SAY_AFTER_S, then again every SAY_EVERY_S, with "stopped"
where the holder is a stopped process here (SIGSTOP, Ctrl-Z): such a holder never lets go, and
only `kill -CONT` lets it go on. A waiter gives up after the bound its caller documents (an
environment variable, seconds; LockWaitError names the holder and the variable), and SIGTERM or
SIGINT end the wait at once (LockWaitStopped, a KeyboardInterrupt: no `except Exception` on the
way keeps it waiting) even where a handler that only records the signal is installed (a training
run's), since such a handler would otherwise leave a blocking flock waiting for ever.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

log = logging.getLogger("fnmoe")

SAY_AFTER_S = 2.0
SAY_EVERY_S = 30.0
POLL_S = 0.1


class LockWaitError(RuntimeError):
    """A lock was not free within the wait's bound."""


class LockWaitStopped(KeyboardInterrupt):
    """SIGTERM or SIGINT while waiting for a lock."""


def claim(fd: int) -> None:
    """Write this process into the lock file fd, whose flock it holds, for waiters to name."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    with contextlib.suppress(OSError):  # naming the holder is a courtesy; the flock is the lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)


def holder(fd: int) -> str:
    """Who holds the lock of fd, in words, from what it wrote there."""
    try:
        h = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        h = {}
    if not isinstance(h, dict) or not h.get("pid"):
        return "another process (it wrote no name into the lock file)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["time"])) if isinstance(
        h.get("time"), (int, float)) else "?"
    words = f"pid {h['pid']} on host {h.get('host', '?')} since {since}"
    if h.get("host") == socket.gethostname() and _state(h["pid"]) == "T":
        words += f" (a stopped process: it holds the lock until `kill -CONT {h['pid']}` or its end)"
    return words


def _state(pid) -> str:
    try:
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return "?"


def wait_flock(fd: int, path: Path, what: str, bound_env: str, default_s: float) -> None:
    """Take the flock on fd (an OSError where the file system has none), waiting as the module
    says: at most os.environ[bound_env] seconds (default_s unset)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    bound = _bound(bound_env, default_s)
    got: list[int] = []
    with _ending_on_signals(got):
        t0 = time.monotonic()
        next_say = t0 + SAY_AFTER_S
        while True:
            if got:
                raise LockWaitStopped(f"{_name(got[0])} while waiting for {what} {path}, held by {holder(fd)}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            now = time.monotonic()
            if now - t0 >= bound:
                raise LockWaitError(f"gave up waiting for {what} {path} after {now - t0:.0f} s "
                                    f"({bound_env}={bound:g}): held by {holder(fd)}; end that process or wait longer")
            if now >= next_say:
                log.warning("waiting for %s %s: held by %s (%.0f s so far; giving up after %g s, %s)", what, path,
                            holder(fd), now - t0, bound, bound_env)
                next_say = now + SAY_EVERY_S
            time.sleep(POLL_S)


def _bound(env: str, default_s: float) -> float:
    raw = os.environ.get(env, "")
    try:
        value = float(raw) if raw else default_s
    except ValueError:
        raise LockWaitError(f"{env}={raw!r} is not a number of seconds") from None
    if not value >= 0:
        raise LockWaitError(f"{env}={raw!r} must be a number of seconds >= 0")
    return value


def _name(signum: int) -> str:
    return signal.Signals(signum).name


@contextlib.contextmanager
def _ending_on_signals(got: list[int]):
    """SIGTERM and SIGINT noted in got while the body waits (main thread only; elsewhere the bound
    ends the wait); the handlers before are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
