"""The run directory: one run at a time (a lock), and its files written with errors that name the
path and the operating system's reason.

The lock is `<run-dir>/fnmoe.lock`, a JSON object naming its holder (pid, host, start time), held
by `flock` while the run lives. The kernel releases a flock however its process ends (kill -9
included), so a lock file whose flock is free was left by a run that ended without removing it:
the next run takes it over with a warning naming that holder. Where the file system has no flock,
the file's content decides: a holder on this host whose process is gone is stale; any other is
taken to be running. A second run is refused with a RunDirError naming the holder.

Every file the run writes in its directory is opened by `open_file`, the package's one way to open
a file for writing inside a run: it follows no symlink at any level under the run directory (a
link planted there, metrics.jsonl or checkpoints/ -> somewhere else, would have the run write over
what it names) and writes into no file with more than one hard link (which shares its bytes with a
file elsewhere, where O_NOFOLLOW does not look): a file opened to be rewritten whole is a new file
(what stood at its name is unlinked, never truncated), and one opened to be written in place (the
lock) with other links is refused. Either refusal is a RunDirError naming the path.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("fnmoe")

LOCK = "fnmoe.lock"
CONSOLE = "console.log"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirError(ValueError):
    """A file of the run directory could not be created or written, or another run holds the
    directory. A ValueError, so that the CLI prints it as one line (exit 2)."""


def os_reason(e: OSError) -> str:
    """The OS's words for e, with what to look at where they are terse."""
    hint = " (disk full or over a file-size limit)" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
    return f"{e.strerror or e}{hint}"


def failure(what: str, path: Path, e: OSError) -> RunDirError:
    return RunDirError(f"{what} {path} failed: {os_reason(e)}")


def make_dir(path: Path) -> bool:
    """Create the run directory (and its parents); True if it was created here."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"the run directory {path} is a file; choose another --train.run-dir")
    try:
        path.mkdir(parents=True)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        raise failure("creating the run directory", path, e) from None


def first_link_below(root: Path, path: Path) -> Path | None:
    """The first directory between root (itself allowed to be a link: a run directory on another
    disk) and path that is a symbolic link, or None."""
    try:
        parts = Path(path).parent.relative_to(root).parts
    except ValueError:
        return None
    p = Path(root)
    for part in parts:
        p = p / part
        if p.is_symlink():
            return p
    return None


def linked_dir(p: Path) -> str:
    return (f"{p} is a symbolic link (to {os.readlink(p)}), and a run writes only inside its own directory; remove "
            "the link (for a run on another disk, point --train.run-dir there)")


def no_link_below(root: Path, path: Path, what: str) -> None:
    """Refuse (RunDirError) where a directory between root and path is a symbolic link."""
    link = first_link_below(root, path)
    if link is not None:
        raise RunDirError(f"{what} {path} refused: {linked_dir(link)}")


def open_file(path: Path, flags: int, what: str, root: Path | None = None) -> int:
    """os.open(path, flags) of a file in the run directory root (default: path's directory),
    refused with a RunDirError (naming what was being done) where path or a directory between root
    and it is a symlink, or, opened for writing in place, where path has other hard links. With
    O_TRUNC the file is a new one: whatever regular file stood at path is unlinked first."""
    path = Path(path)
    no_link_below(root if root is not None else path.parent, path, what)
    writing = flags & (os.O_WRONLY | os.O_RDWR)
    try:
        if writing and flags & os.O_TRUNC:
            if path.is_symlink():
                raise OSError(errno.ELOOP, "a symbolic link")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a hard link's other names keep their bytes
            flags = (flags & ~os.O_TRUNC) | os.O_CREAT | os.O_EXCL
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP and path.is_symlink():  # ELOOP is also a loop of links further up
            raise RunDirError(f"{what} {path} refused: it is a symbolic link, and a run writes only its own files; "
                              "remove the link") from None
        raise failure(what, path, e) from None
    links = os.fstat(fd).st_nlink if writing else 1
    if links > 1:
        os.close(fd)
        raise RunDirError(f"{what} {path} refused: it has {links} hard links, so writing it would change a file "
                          "outside the run too; remove it (or give it a copy of its own)")
    return fd


def write_text(path: Path, text: str) -> None:
    """path's new content, whole or not at all: a temp file renamed over it (which replaces a
    symlink at path rather than writing through it)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "writing")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise failure("writing", path, e) from None


class ConsoleLog(logging.Handler):
    """A copy of the run's log lines (the fnmoe logger's: header, progress, evals, warnings, the last
    line), as the console shows them, for <run-dir>/console.log: held in memory from when the run
    takes its directory until `start_console_log` (the run's outputs opened: its checks passed),
    then appended to the file, a resumed run's after the earlier ones. A run refused before then (a
    resume that changes the model, another batch size) leaves the file as it was."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self.held: list[str] = []
        self.file = None

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record) + "\n"
        if self.file is None:
            self.held.append(line)
            return
        try:
            self.file.write(line)
        except (OSError, ValueError):
            self.handleError(record)


def console_log() -> ConsoleLog:
    """Attach a ConsoleLog to the fnmoe logger (rank 0, once it holds the run directory); detach it
    with `close_console_log`."""
    handler = ConsoleLog()
    log.addHandler(handler)
    return handler


def start_console_log(run_dir: Path) -> None:
    """Open <run-dir>/console.log (by open_file: no symlink followed) for the attached ConsoleLog and
    write what it held; nothing where none is attached (a rank other than 0)."""
    for handler in log.handlers:
        if isinstance(handler, ConsoleLog) and handler.file is None:
            fd = open_file(run_dir / CONSOLE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, "writing")
            handler.file = open(fd, "a", buffering=1, encoding="utf-8")
            handler.file.writelines(handler.held)
            handler.held = []


def close_console_log(handler: ConsoleLog) -> None:
    log.removeHandler(handler)
    handler.close()
    if handler.file is not None:
        handler.file.close()


def _start_ticks(pid: int) -> str | None:
    """When process pid started (clock ticks since boot), which tells a reused pid apart; None
    where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces


def _running_here(holder: dict) -> bool:
    """Whether the holder's process runs on this host (the same pid started at the same time)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return holder.get("start") in (None, _start_ticks(pid))


def describe(holder: dict) -> str:
    started = holder.get("time")
    when = time.strftime(", started %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(
        started, (int, float)) else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"


class Lock:
    """A held run-directory lock; `release` removes it (every exit path of the run calls it)."""

    def __init__(self, path: Path, fd: int, created_dir: bool):
        self.path, self._fd, self._created_dir = path, fd, created_dir

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:  # still ours
                self.path.unlink()
        os.close(self._fd)
        self._fd = -1
        if self._created_dir:  # a run that failed before writing anything leaves no directory
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


def _read(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _try_flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise


def acquire(run_dir: Path) -> Lock:
    """Create run_dir if needed and take its lock, or raise RunDirError naming the run holding it."""
    created = make_dir(run_dir)
    path = run_dir / LOCK
    for _ in range(10):  # again only when a holder removed the file between our open and flock
        fd = open_file(path, os.O_RDWR | os.O_CREAT, "creating the lock file")
        try:
            locked = _try_flock(fd)
        except OSError as e:
            os.close(fd)
            raise failure("creating the lock file", path, e) from None
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                os.close(fd)
                continue
        except FileNotFoundError:
            os.close(fd)
            continue
        holder = _read(fd)
        if locked is False or (locked is None and holder and (holder.get("host") != socket.gethostname()
                                                               or _running_here(holder))):
            os.close(fd)
            raise RunDirError(f"{run_dir} is in use by another run ({describe(holder)}; lock file {path}): "
                              "wait for it to end or choose another --train.run-dir")
        if holder:
            log.warning("taking over %s: its holder (%s) ended without releasing it", path, describe(holder))
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_ticks(os.getpid()),
                "time": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(mine).encode(), 0)
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            raise failure("writing the lock file", path, e) from None
        return Lock(path, fd, created)
    raise RunDirError(f"could not take the lock {path}: it kept being replaced")
