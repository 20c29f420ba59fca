"""A run's guards: what it will write is writable before step 1, its starting weights are finite, and
steps skipped one after another stop it.

Preflight (`check_outputs`): every directory a run writes later (checkpoints on every rank,
TensorBoard logs, W&B files, profiler traces on every rank, the compile cache's artifacts) is
created if needed and a file is created and removed in it, before step 1: an unwritable
<run-dir>/checkpoints used to surface at the final save, after the whole run. One under the run
directory reached through a symbolic link (checkpoints/ -> elsewhere) is refused: a run writes only
inside its own directory (fnmoe.run.rundir.open_file). (config.toml,
metrics.jsonl and the lock are opened before step 1 anyway: fnmoe.training.loop, fnmoe.run.rundir.) What
rank 0 created only to test it is removed again, so a run that stops here leaves what it found.

Starting weights (`check_finite_start`): a NaN or inf in the weights a run starts from (a Hugging
Face import, a damaged checkpoint, an overflowing model.init_std) makes every step non-finite, and
every step is then skipped: refused before step 1 instead.

Skipped steps (`SkipCounter`): a step whose loss, gradients or update are not finite is skipped
(fnmoe.training.step: params and optimizer state stay as they were). Since the state does not change, the
next step repeats the same computation on the next batch: a cause in the data (one bad batch, a
rare spike) clears at once, a cause in the state or the config (NaN weights, `--optim.eps 0`, an
lr that overflows the update) never does. So `train.max_consecutive_skips` (default 10) skipped
steps in a row stop the run with an error; and a run whose every step was skipped ends with an
error, not "done".

Legend: no shape-suffixed tensors here.
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fnmoe.config import RunConfig
from fnmoe.parallel import dist as fdist
from fnmoe.run.rundir import RunDirError, first_link_below, linked_dir, os_reason
from fnmoe.tree import Tree, flatten_dict


class NonFiniteStart(ValueError):
    """The weights a run would start from hold NaN or inf. A ValueError: the CLI prints one line."""


class SkippedSteps(ValueError):
    """Too many steps in a row, or every step of the run, were skipped (non-finite)."""


# ---------------------------------------------------------------- preflight

def outputs(run: RunConfig, run_dir: Path, rank: int, artifacts: Path | None = None) -> list[tuple[str, Path]]:
    """(what, directory) of everything this rank writes after step 1 begins."""
    out = [("checkpoints", run_dir / "checkpoints")]  # every rank writes its shards there
    if run.profile.steps:
        out.append(("profiler traces (profile.steps)", run_dir / "profile"))
    if rank == 0:
        if run.train.tensorboard:
            out.append(("TensorBoard logs (train.tensorboard)", run_dir / "tensorboard"))
        if run.train.wandb:
            out.append(("W&B files (train.wandb)", run_dir / "wandb"))
        if artifacts is not None:
            out.append(("compile-cache artifacts (--compile-cache)", artifacts.parent))
    return out


def _writable(what: str, d: Path, created: list[Path]) -> str | None:
    """None when a file can be created in d (made with its parents if missing, each noted in
    created), else the problem in one line."""
    if d.exists() and not d.is_dir():
        return f"cannot write {what}: {d} is a file, not a directory"
    missing, p = [], d
    while not p.exists() and p != p.parent:
        if p.is_symlink():  # mkdir would say only "File exists"
            return (f"cannot write {what}: {p} is a dangling symbolic link to {p.parent / os.readlink(p)}, which "
                    "does not exist: create that directory or remove the link")
        missing.append(p)
        p = p.parent
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot write {what}: creating {d} failed: {os_reason(e)}"
    finally:
        created += [m for m in reversed(missing) if m.is_dir()]
    probe = d / f".fnmoe-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"fnmoe")
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as e:
        return f"cannot write {what}: creating a file in {d} failed: {os_reason(e)}"
    return None


def check_outputs(run: RunConfig, run_dir: Path, rank: int, artifacts: Path | None = None) -> str | None:
    """The first of this rank's outputs (`outputs`) it cannot write, as one line (None: all can be).
    Rank 0 removes the directories it made for the test (deepest first), so a run stopped before
    step 1 leaves the file system as it found it; other ranks test after rank 0 (the caller orders
    them) and leave theirs, which a save would make anyway."""
    created: list[Path] = []
    try:
        for what, d in outputs(run, run_dir, rank, artifacts):
            link = first_link_below(run_dir, d / "file")
            if link is not None and link.exists():  # a dangling one: _writable names its target
                return f"cannot write {what}: {linked_dir(link)}"
            error = _writable(what, d, created)
            if error:
                return error
        return None
    finally:
        if rank == 0:
            for d in reversed(created):
                with contextlib.suppress(OSError):
                    d.rmdir()


def preflight(run: RunConfig, run_dir: Path, rank: int, artifacts: Path | None = None) -> None:
    """check_outputs on every rank, rank 0 first; every rank raises the first error (RunDirError,
    naming the rank on a job of several) before step 1."""
    several = dist.is_initialized() and fdist.world() > 1 and not fdist.simulated()
    error = check_outputs(run, run_dir, 0, artifacts) if rank == 0 else None
    errors = [error]
    if several:
        errors = [None] * fdist.world()
        fdist.entering("all-gather of the output checks over every rank")
        dist.all_gather_object(errors, error)  # rank 0 tested (and tidied) before the others test
        if not any(errors) and rank != 0:
            error = check_outputs(run, run_dir, rank)
        dist.all_gather_object(errors, error)
    for r, e in enumerate(errors):
        if e:
            raise RunDirError(f"{f'rank {r}: ' if several else ''}{e}; stopped before step 1")


# ---------------------------------------------------------------- starting weights

def non_finite_leaves(params: Tree) -> list[str]:
    """Paths of the floating leaves holding a NaN or inf in any of the ranks here (a DTensor's local
    shard on each; in a simulation every simulated rank's)."""
    bad = []
    for path, t in flatten_dict(params).items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        if any(not bool(torch.isfinite(v).all()) for v in fdist.rank_values(local).values()):
            bad.append(path)
    return bad


def check_finite_start(params: Tree, source: str) -> None:
    """Raise NonFiniteStart on every rank when any rank's starting weights hold NaN or inf; source
    says where they came from."""
    bad = non_finite_leaves(params)
    if dist.is_initialized() and fdist.world() > 1 and not fdist.simulated():
        every: list = [None] * fdist.world()
        fdist.entering("all-gather of the non-finite starting weights over every rank")
        dist.all_gather_object(every, bad[:4])
        bad = list(dict.fromkeys(p for paths in every for p in paths))
    if bad:
        raise NonFiniteStart(f"refusing to train from {source}: it holds non-finite values (NaN or inf) in "
                             f"{', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}; every step would be skipped; "
                             "stopped before step 1")


def start_source(run: RunConfig, resumed_from: Path | None) -> str:
    """Where a run's starting weights come from, in words."""
    if resumed_from is not None:
        return f"checkpoint {resumed_from}"
    if run.train.init_from_hf:
        return f"the weights of train.init_from_hf={run.train.init_from_hf}"
    return f"the random init (model.init_std={run.model.init_std:g})"


# ---------------------------------------------------------------- skipped steps

class SkipCounter:
    """Counts the skipped steps of a run (every rank sees the same flags: they come from all-reduced
    values) and raises SkippedSteps at train.max_consecutive_skips in a row (0: never), and at the end
    when every step of the run was skipped."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.skipped, self.steps, self.why = limit, 0, 0, 0, ""

    def count(self, step: int, metrics: dict) -> None:
        self.steps += 1
        if not metrics["skipped"]:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.skipped += 1
        self.why = metrics.get("skipped_why", "non-finite loss or gradients")
        if self.limit and self.in_a_row >= self.limit:
            first = step - self.in_a_row + 1
            raise SkippedSteps(
                f"stopped after step {step}: {self.in_a_row} steps in a row were skipped ({first}..{step}, "
                f"{self.why}; train.max_consecutive_skips={self.limit}), {self.skipped} of the {self.steps} steps "
                f"this run took; {_hint(self.why)}; the weights are still those after step {first - 1}, and no "
                "checkpoint was saved for the skipped steps")

    def check_end(self, last: int) -> None:
        if self.steps and self.skipped == self.steps:
            raise SkippedSteps(
                f"every step of this run was skipped ({self.steps} of {self.steps}, steps {last - self.steps + 1}.."
                f"{last}, {self.why}): the weights never changed; {_hint(self.why)}; no checkpoint was saved")


def _hint(why: str) -> str:
    if why == "non-finite update":
        return "look at --optim.lr and --optim.eps (an eps of 0 divides by zero)"
    return "look at the starting weights, the data and --optim.lr"
