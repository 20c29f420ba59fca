"""Writing checkpoints: files fsynced and checksummed as they are written, committed atomically by
rank 0 (index.json last, then a rename), pruned to the newest keep_last; `Saver` saves a run's
checkpoints, on a background thread where it can."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import itertools
import math
import os
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import Any

import torch

from fnmoe.run import faults
from fnmoe.run.rundir import RunDirError, linked_dir, open_file
from fnmoe.checkpoint.format import (CONFIG, FORMAT, INDEX, MESH_AXES, ST_DTYPES, TMP_PREFIX, VERSION,
                                     CheckpointError, list_checkpoints, read_index)
from fnmoe.checkpoint.procs import from_lead, gather_to_lead, rank_in_job
from fnmoe.checkpoint.shards import Snapshot, index_sections, snapshot, staged
from fnmoe.config import CheckpointConfig, RunConfig
from fnmoe.training.state import TrainState

log = logging.getLogger("fnmoe")


def _raw(t: torch.Tensor) -> memoryview:
    # a flat uint8 view shares the tensor's memory: nothing is copied on the way to the file
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_chunks(path: Path, chunks) -> dict[str, Any]:
    """Write the byte chunks to path, a new file, and fsync it; its size and sha256, hashed as the
    bytes go out. The checkpoints directory and path's own follow no symlink (its run directory is
    two levels up: <run-dir>/checkpoints/<temp directory>/<file>)."""
    h, size = hashlib.sha256(), 0
    with os.fdopen(open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "writing", path.parent.parent.parent),
                   "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            h.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": h.hexdigest()}


def _safetensors_chunks(tensors: dict[str, torch.Tensor]):
    """The safetensors encoding (u64 header size, JSON header, raw data in the host's byte order,
    little-endian wherever torch runs), streamed so a large shard is never held twice in memory."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # as tree_io's save_file writes
    offset = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    yield struct.pack("<Q", len(head))
    yield head
    for t in tensors.values():
        yield _raw(t)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _failure(path: Path, e: OSError | RunDirError) -> str:
    if isinstance(e, RunDirError):
        return str(e)
    hint = " (disk full or over a file-size limit)" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
    return f"writing {path} failed: {e.strerror or e}{hint}"


def _write_files(snap: Snapshot, tmp: Path) -> tuple[dict[str, dict], str | None]:
    """Write this process's files into tmp, each fsynced: ({name: index "files" entry}, None), or
    ({}, what failed)."""
    files, current = {}, tmp
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for name, tensors in snap.files.items():
            current = tmp / name
            files[name] = {"writer_rank": snap.writers[name], **_write_chunks(current, _safetensors_chunks(tensors))}
    except (OSError, RunDirError) as e:
        return {}, _failure(current, e)
    return files, None


def index_text(snap: Snapshot, entries: list[dict], files: dict[str, dict]) -> bytes:
    """index.json of a checkpoint: every rank's entries merged, with the files' sizes and digests."""
    index = {"format": FORMAT, "version": VERSION, "step": snap.step, "model": snap.model, **index_sections(entries),
             "files": files, "mesh": snap.mesh, "mesh_axes": list(MESH_AXES), "train": snap.train}
    return json.dumps(index).encode()


def index_only(state: TrainState, run: RunConfig, ranks) -> bytes:
    """The index.json a save of state by `ranks` writes, from the leaves' shapes and placements
    alone: no tensor is read or written (fnmoe.plan.rehearse, over fake tensors, at a full mesh's size).
    File digests are all-zero stand-ins of the right length."""
    snap, entries, files = None, [], {}
    for rank in ranks:
        part = snapshot(state, run, None, ranks=(rank,), stage=_shape_only)
        snap = snap or part
        entries.append(part.entries)
        for name, tensors in part.files.items():
            n = sum(math.prod(shape) * itemsize for shape, itemsize in tensors.values())
            files[name] = {"writer_rank": rank, "bytes": n, "sha256": "0" * 64}
    return index_text(snap, entries, files)


def _shape_only(t) -> tuple[torch.Size, int]:
    # what the index needs of a file's tensor (a ShapeOnly here): no tensor is made
    return t.shape, t.element_size()


def _commit(snap: Snapshot, parts: list[tuple[dict, dict, str | None]], tmp: Path, final: Path) -> str | None:
    """Rank 0's end of a save, once every rank's files are on disk (parts: each rank's (files, entries,
    error)): config.toml and index.json last, then tmp renamed to final. What failed, or None."""
    failed = [(rank, error) for rank, (_, _, error) in enumerate(parts) if error]
    if failed:
        rank, error = failed[0]
        return error if len(parts) == 1 else f"rank {rank}: {error}"
    files = {name: meta for part_files, _, _ in parts for name, meta in part_files.items()}
    current = tmp / CONFIG
    try:
        files[CONFIG] = {"writer_rank": 0, **_write_chunks(current, [snap.config_toml.encode()])}
        current = tmp / INDEX
        _write_chunks(current, [index_text(snap, [entries for _, entries, _ in parts], files)])
        _fsync_dir(tmp)
        current = final
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except (OSError, RunDirError) as e:
        return _failure(current, e)
    return None


def write(snap: Snapshot, root: Path, keep_last: int) -> Path:
    """Write the checkpoint as root/step_<N> atomically, then prune to the newest keep_last
    checkpoints. On several ranks every rank calls this at once with its own part (the protocol is
    in docs/architecture.md, "Checkpoints"); rank 0 commits and prunes.

    On any failure on any rank (a full disk, a file-size limit, Ctrl-C) the temp directory is removed
    and CheckpointError raised on every rank: no partial checkpoint is left, and the previous
    complete ones are untouched.
    """
    root = Path(root)
    rank, _ = rank_in_job()
    if root.is_symlink():  # before anything is made through it
        raise CheckpointError(f"could not save checkpoint step {snap.step}: {linked_dir(root)}")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{snap.step}"
    name = f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    if rank == 0:
        shutil.rmtree(root / name, ignore_errors=True)
    tmp = root / from_lead(name)  # after rank 0's cleanup: one directory for all ranks
    try:
        files, error = _write_files(snap, tmp)
        faults.save_delay()
        parts = gather_to_lead((files, snap.entries, error))  # returns once every rank's files are fsynced
        error = from_lead(_commit(snap, parts, tmp, final) if rank == 0 else None)
    except BaseException:
        if rank == 0:  # the one remover: another rank cannot know whether rank 0 is renaming tmp
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if error:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not save checkpoint step {snap.step}: {error}; removed the partial save, "
                              f"older checkpoints in {root} are untouched")
    if rank == 0:
        prune(root, keep_last)
    return final


def _sizes_match(ckpt: Path) -> bool:
    """The cheap part of `verify` (index readable, files present at their sizes): pruning uses it so
    that a save never rereads older checkpoints in full."""
    try:
        files = read_index(ckpt)["files"]
    except CheckpointError:
        return False
    return all((ckpt / n).is_file() and (ckpt / n).stat().st_size == m["bytes"] for n, m in files.items())


def prune(root: Path, keep_last: int) -> None:
    """Delete every checkpoint older than the newest keep_last ones that look complete."""
    found = list_checkpoints(root)
    kept = [step for step, path in found if _sizes_match(path)][:keep_last]
    if len(kept) < keep_last:
        return
    for step, path in found:
        if step < kept[-1]:
            shutil.rmtree(path, ignore_errors=True)


SET_ASIDE = "set_aside"
"""the folder under a run's checkpoints where those after its resume point are kept"""


def set_aside_after(root: Path, step: int) -> None:
    """Remove temp directories of interrupted saves, and move the checkpoints of steps after `step`
    into root/set_aside: the run continues from `step`, so they belong to an abandoned future (as
    its metrics rows do) and their names are about to be saved again, but they may be all that is
    left of a run a fault made unreadable, so they are never deleted."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(TMP_PREFIX):
            log.info("removing %s, left by a save that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)
    for s, p in list_checkpoints(root):
        if s > step:
            (root / SET_ASIDE).mkdir(exist_ok=True)
            dest = next(d for i in itertools.count() if not (d := root / SET_ASIDE / f"{p.name}{f'.{i}' if i else ''}")
                        .exists())
            log.warning("moving %s to %s: the run continues from step %d (delete it when it is not needed)", p, dest,
                        step)
            os.rename(p, dest)


class Saver:
    """Saves a run's checkpoints under root, synchronously or (cfg.async_save, one process only) from
    staged CPU copies on a background thread while training goes on; at most one write is in flight,
    and its error, if any, is raised by the next `save` or `join` in the training thread. On several
    ranks every rank saves, at the same steps."""

    def __init__(self, root: Path, cfg: CheckpointConfig, last_step: int = 0):
        self.root, self.cfg = Path(root), cfg
        self.last_step = last_step
        """the step of the newest checkpoint saved or resumed from"""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: Snapshot | None = None  # a background save's snapshot until it is staged
        self._staged: threading.Event | None = None
        self._background = cfg.async_save and rank_in_job()[1] == 1
        if cfg.async_save and not self._background:
            log.info("checkpoint.async_save applies to one process; on several ranks checkpoints are saved "
                     "synchronously")

    def save(self, state: TrainState, run: RunConfig, data: dict, blocking: bool = False) -> Path:
        """Save state as root/step_<N> (returned; with async_save and not blocking it is being written),
        data its data position (the loader's `position(state.step)`).
        A background save takes the tensors as they are (no copy here) and copies them to the CPU on
        its thread; `wait_staged` waits for those copies."""
        self.join()
        if self._background and not blocking:
            snap = snapshot(state, run, data, stage=lambda t: t.detach())
            after = torch.cuda.Event() if any(t.is_cuda for ts in snap.files.values() for t in ts.values()) else None
            if after is not None:
                after.record()
            self._pending, self._staged = snap, threading.Event()
            self._thread = threading.Thread(target=self._write_in_background, args=(after,), name="fnmoe-checkpoint")
            self._thread.start()
            path = self.root / f"step_{snap.step}"
        else:
            snap = snapshot(state, run, data)
            path = self._write(snap)
        self.last_step = snap.step  # not before: a save that Ctrl-C cut short saved nothing
        return path

    def wait_staged(self) -> None:
        """Wait until a background save holds its own CPU copies (usually long done): the training
        loop calls it after the step that follows a save, so the saved state's device memory is not
        held past that step (the step held it anyway, as its input)."""
        if self._staged is not None:
            self._staged.wait()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, snap: Snapshot) -> Path:
        t0 = time.perf_counter()
        path = write(snap, self.root, self.cfg.keep_last)
        mb = sum(t.numel() * t.element_size() for ts in snap.files.values() for t in ts.values()) / 2**20
        log.info("saved checkpoint %s (%.1f MB written by this process in %.2f s)", path, mb,
                 time.perf_counter() - t0)
        return path

    def _write_in_background(self, after) -> None:
        try:
            try:
                snap, self._pending = staged(self._pending, after), None  # the device tensors let go
            finally:
                self._staged.set()
            self._write(snap)
        except BaseException as e:  # handed to the training thread by join()
            self._pending, self._error = None, e
