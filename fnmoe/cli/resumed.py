"""`fnmoe train --resume auto|PATH` continues the run: the config the checkpoint was saved with
(its config.toml: the preset and the flags the run started with) is the base of every flag, as
TorchTitan's TOML is, so a resume that repeats none of the run's flags trains on the run's data,
model and schedule. A flag given on this command line, or --config FILE, still wins; the resume
names each change (fnmoe.checkpoint.resume.check_resume_config).

Read before torch loads (the config tables only); a checkpoint that cannot be read here leaves the
base as it was, and the loop's resume names what is wrong with it.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path

from fnmoe.config import RunConfig
from fnmoe.config.toml import config_from_tables, drop_unknown, read_toml

log = logging.getLogger("fnmoe")

STEP_DIR = re.compile(r"step_(\d+)")  # fnmoe.checkpoint.format's names, without loading torch


def _given(argv: list[str]) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default="")
    pre.add_argument("--resume", default="none")
    pre.add_argument("--train.run-dir", "--train.run_dir", dest="run_dir", default="")
    return pre.parse_known_args(argv)[0]


def _read(ckpt: Path) -> RunConfig | None:
    try:
        tables, _ = drop_unknown(RunConfig, read_toml(ckpt / "config.toml"))
        return config_from_tables(tables, ckpt / "config.toml", validate_config=False)
    except (OSError, ValueError):
        return None


def saved_run(argv: list[str]) -> tuple[Path, RunConfig] | None:
    """(the checkpoint, its saved config) that `--resume` on argv continues: PATH, or for auto the
    newest step_<N> under the run directory (--train.run-dir, else runs/<preset name>) whose
    config.toml reads; None for --resume none, a --config FILE (its values are the base then), or
    no readable checkpoint (a fresh start)."""
    given = _given(argv)
    if given.resume == "none" or given.config or "-h" in argv or "--help" in argv:
        return None
    if given.resume != "auto":
        ckpt = Path(given.resume)
        saved = _read(ckpt)
        return None if saved is None else (ckpt, _in(saved, ckpt.parent.parent if ckpt.parent.name == "checkpoints"
                                                     else None))
    root = Path(given.run_dir or Path("runs") / "tiny") / "checkpoints"  # the default run's, as run_dir_of says
    steps = sorted(((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
                    if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))), reverse=True)
    for _, ckpt in steps:
        saved = _read(ckpt)
        if saved is not None:
            return ckpt, _in(saved, root.parent)
    return None


def _in(saved: RunConfig, run_dir: Path | None) -> RunConfig:
    """saved, its run directory the one its checkpoint is in (a run directory moved or copied since it
    was saved continues where it is now, not where it was); run_dir None: as saved."""
    was = Path(saved.train.run_dir or Path("runs") / saved.name)
    if run_dir is None or was.resolve() == run_dir.resolve():
        return saved
    return dataclasses.replace(saved, train=dataclasses.replace(saved.train, run_dir=str(run_dir)))

