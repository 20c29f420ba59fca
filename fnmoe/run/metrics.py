"""Expert-load statistics and the metrics.jsonl and TensorBoard writers (FLOPs and MFU are the
planner's: fnmoe.plan.flops).

Legend: L MoE layers (in expert_counts_NE), E experts.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch

from fnmoe.run.rundir import RunDirError, failure, open_file


def load_by_layer(expert_counts_NE: torch.Tensor | None) -> list[float] | None:
    """Per MoE layer, the busiest expert's load over the mean load (1.0 is perfectly balanced)."""
    if expert_counts_NE is None:
        return None
    c = expert_counts_NE.float()
    return (c.max(-1).values / c.mean(-1).clamp_min(1e-9)).tolist()


def load_max_over_mean(expert_counts_NE: torch.Tensor | None) -> float | None:
    """The worst MoE layer's load_by_layer value."""
    by_layer = load_by_layer(expert_counts_NE)
    return max(by_layer) if by_layer else None


def rank_load_max_over_mean(expert_counts_NE: torch.Tensor | None, ep: int) -> float | None:
    """The busiest expert-parallel rank's load over the mean, worst MoE layer: ep rank r holds experts
    [r·E/ep, (r+1)·E/ep), and the rows it receives in a dispatch are its experts' counts summed. This
    is what `--plan.imbalance` stands for (the busiest expert's load overstates it: a rank's other
    experts average it out). None without expert parallelism or MoE layers."""
    if expert_counts_NE is None or ep <= 1 or expert_counts_NE.shape[-1] % ep:
        return None
    c = expert_counts_NE.float().reshape(expert_counts_NE.shape[0], ep, -1).sum(-1)
    return (c.max(-1).values / c.mean(-1).clamp_min(1e-9)).max().item()


def strict_json(row: dict) -> dict:
    """row with every non-finite value (a float, or a list holding one) as None, their keys listed
    under "nonfinite": metrics.jsonl stays JSON, which has no NaN or Infinity, and its readers
    (fnmoe plot) take None for a value a row lacks."""
    bad = [key for key, value in row.items() if not _finite(value)]
    if not bad:
        return row
    return {**{key: None if key in bad else value for key, value in row.items()}, "nonfinite": bad}


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return not isinstance(value, list) or all(_finite(v) for v in value)


class JsonlWriter:
    """Appends one JSON object a line, fsynced when written (a crash loses nothing). A line is
    written whole or not at all: a write that fails part way (disk full, a file-size limit) is
    cut back to the last whole line and raised as a RunDirError naming the file."""

    def __init__(self, path: Path, fresh: bool):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise failure("opening", self.path, e) from None
        self.fd = open_file(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0), "opening")
        self.size = os.fstat(self.fd).st_size

    def write(self, row: dict) -> None:
        data = (json.dumps(strict_json(row), allow_nan=False) + "\n").encode()
        try:
            done = 0
            while done < len(data):  # os.write may write part of it
                done += os.write(self.fd, data[done:])
            os.fsync(self.fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.size)
            raise failure("writing", self.path, e) from None
        self.size += len(data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def drop_rows_after(path: Path, step: int) -> None:
    """Rewrite a metrics.jsonl without the rows of steps after `step` (resume events from after it
    included), atomically: a temp file, fsynced, renamed over it. A line torn by a crash mid-write
    is dropped too. No file: nothing to do. Neither file is read or written through a symlink
    (fnmoe.run.rundir.open_file)."""
    path = Path(path)
    try:
        _drop_rows_after(path, step)
    except OSError as e:
        raise failure("rewriting", path, e) from None


def _drop_rows_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = []
    with os.fdopen(open_file(path, os.O_RDONLY, "rewriting")) as f:
        lines = f.read().splitlines()
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", row.get("from_step", 0)) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "rewriting"), "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)  # the rename is durable once its directory is synced
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TensorBoardWriter:
    """Scalars of each metrics row and a histogram of tokens per expert for each MoE layer."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("train.tensorboard needs the tensorboard package: pip install tensorboard") from None
        self.w = SummaryWriter(str(log_dir))

    def write(self, row: dict, expert_counts_NE: torch.Tensor | None = None) -> None:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.w.add_scalar(key, value, row["step"])
        if expert_counts_NE is not None:
            for layer, counts_E in enumerate(expert_counts_NE.float()):
                # one sample per expert, weighted by its token count: the load distribution
                self.w.add_histogram(f"expert_load/moe_layer_{layer}", counts_E, row["step"])
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class MetricsWriter:
    """metrics.jsonl, plus its mirrors when asked (TensorBoardWriter, fnmoe.run.wandb_log.WandbWriter):
    one write per row for all. A failed metrics.jsonl write is kept in `error`, not raised, and the
    rows after it are not written: the loop stops the run at the step boundary, where it can still
    save a checkpoint."""

    def __init__(self, jsonl: JsonlWriter, *mirrors):
        self.jsonl, self.mirrors = jsonl, [m for m in mirrors if m is not None]
        self.error: RunDirError | None = None

    def write(self, row: dict, expert_counts_NE: torch.Tensor | None = None) -> None:
        if self.error is not None:
            return
        try:
            self.jsonl.write(row)
        except RunDirError as e:
            self.error = e
            return
        for mirror in self.mirrors:
            mirror.write(row, expert_counts_NE)

    def close(self) -> None:
        self.jsonl.close()
        for mirror in self.mirrors:
            mirror.close()
