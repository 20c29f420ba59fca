"""Checks of command-line values the CLI subcommands share: a number in its range, an output
directory that can be written. ValueErrors, which fnmoe.cli reports as one line."""
from __future__ import annotations

import errno
import math
import os
from pathlib import Path


def check_range(value: float, flag: str, bounds) -> None:
    if isinstance(value, float) and not math.isfinite(value) or value not in bounds:  # an int may not fit a float
        raise ValueError(f"{flag} must be {bounds}, got {value}")


def out_dir(path: str, flag: str) -> None:
    """Stop before any work when an output directory cannot be written: it names a file, lies
    under one, or the directory it would be made in is not writable."""
    if not path:
        return
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {path} is a file; it must name a directory (new, or one to write into)")
    above = next(a for a in (out, *out.parents) if a.exists())
    if not above.is_dir():
        raise ValueError(f"{flag} {path}: cannot make a directory under {above}: {os.strerror(errno.ENOTDIR)}")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write in {above}: {os.strerror(errno.EACCES)}")
