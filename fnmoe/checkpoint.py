"""Checkpoints: atomic, checksummed snapshots of a run in the native tree format, and resume.

A checkpoint is the directory `<run-dir>/checkpoints/step_<N>`:

  params-rank<R>.safetensors  the shards of params (buffers included) that rank R wrote, keys = dotted paths
  state-rank<R>.safetensors   rank R's shards of optimizer state (keys `opt_state.<path>`) and its RNG
                              states (`rng.rank<R>.<name>`)
  config.toml                 the resolved config of the run that saved it
  index.json                  written last; describes everything above

index.json extends the native tree format's (fnmoe/tree_io.py: "model", and "tensors" keyed by
param path with "file", "dtype", "shape") with shards, checksums, optimizer and training state:

  {"format": "fnmoe-checkpoint", "version": 1, "step": N, "model": {ModelConfig fields},
   "tensors" | "opt_state" | "rng": {PATH: ENTRY},    params | optimizer state | RNG states
   "files": {NAME: {"writer_rank": R, "bytes": SIZE, "sha256": HEX}},
   "mesh": {"fsdp": F, "ep": E}, "mesh_axes": ["fsdp", "ep"],
   "train": {"step": N, "schedule": {...}, "data": {"step", "epoch", "samples_seen", "seed",
             "corpus_fingerprint"}}}
  ENTRY = {"dtype": "float32", "shape": GLOBAL_SHAPE, "placement": {MESH_AXIS: PLACEMENT},
           "shards": [{"file": NAME, "key": KEY_IN_FILE, "offset": START_PER_DIM, "shape": SHARD_SHAPE}],
           "file": NAME}                               the last only when one shard is the whole tensor

A tensor is its shards put at their offsets in its global shape, so a reader on any mesh can
assemble or re-slice it. `placement` records how the writer's mesh held it, as DTensor prints
placements, keyed by the axes of the mesh the leaf lived on: {"dp": "Shard(dim=0)"} for a dense
leaf (the flattened fsdp x ep axis), {"fsdp": "_StridedShard(dim=0, sf=2)", "ep": "Shard(dim=0)"}
for an expert stack, {"fsdp": "Replicate()", "ep": "Replicate()"} for plain tensors; RNG states
are "rank-local". Expert stacks keep the expert dim first: a shard's offset[0] + k is the global
id of its k-th expert, never a rank-local one. Checksums are taken of the bytes as they are written.

Saving on several ranks (`write`; all ranks share one filesystem): each rank writes only its own
shards (DTensor.to_local() at the global offset of its slice); a shard that several ranks hold
(plain tensors: buffers, step counts, hyperparameters) is written once, by the lowest of them, and
each rank writes its own RNG states. Every rank writes into one temp directory beside the
checkpoints (named by rank 0) and fsyncs its files; rank 0 gathers the ranks' file checksums and
index entries, which also tells it every file is on disk, writes config.toml and index.json last,
fsyncs the directory, renames it to step_<N> and prunes to checkpoint.keep_last. A failure on any
rank (a full disk, a file-size limit) removes the temp directory and raises CheckpointError on every
rank; a rank that dies leaves the others at the gather until --dist.timeout-s. Either way no
index.json is written: resume ignores the directory and the next run removes it. A single process
is the same protocol with one rank. `checkpoint.async_save` writes on a background thread in a
single process; on several ranks saves are synchronous (a thread's collectives could interleave
with the training step's).

Loading (`load_state`) works on any mesh, whatever mesh saved: each rank reads, with safetensors
get_slice, only the parts of the shards that overlap its own slice of each leaf, and builds its
DTensors with the current mesh's placements (fnmoe.sharding). Optimizer state shaped like a param
is placed like it; 0-D state (step counts) is replicated. A rank restores its own RNG states when
the checkpoint has them (rank 0 names the ranks that have none, once). The data loader needs only
the step (Loader.batch_at is pure), so resharding with the same global batch neither repeats nor
skips samples. `verify` can split the files among ranks; resume combines their verdicts, so every
rank resumes from the same checkpoint.

Meshes can also be simulated in one process (fnmoe.dist.simulate): that process writes and reads
every simulated rank's shards.

Legend: no shape-suffixed tensors here; params and states are handled leaf by leaf by dotted path.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from fnmoe import dist as fdist
from fnmoe import optim, sharding
from fnmoe.config import CheckpointConfig, RunConfig, load_config, to_dict, to_toml
from fnmoe.data import Loader
from fnmoe.params import init_params, shape_mismatches
from fnmoe.train import TrainState
from fnmoe.tree import Tree, flatten_dict, tree_flatten_with_paths, unflatten_dict

log = logging.getLogger("fnmoe")

FORMAT, VERSION = "fnmoe-checkpoint", 1
INDEX, CONFIG = "index.json", "config.toml"
SECTIONS = ("tensors", "opt_state", "rng")
"""index.json's sections of tensor entries: params (named as in the tree format), optimizer state, RNG"""
MESH_AXES = ("fsdp", "ep")
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"step_(\d+)")
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}
# model fields that pick kernels, not the params: they may change on resume like optimizer settings
RUNTIME_MODEL_FIELDS = ("model.compute_dtype", "model.compile", "model.moe.impl", "model.attention_impl")
# test hook (tests/test_checkpoint.py): seconds a save waits between its data files and its
# index.json, so a test can kill the process while the save is half written
SAVE_DELAY_ENV = "FNMOE_TEST_SAVE_DELAY_S"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or incompatible with the run, or could not be written."""


# ---------------------------------------------------------------- the processes that save together

def _job() -> tuple[int, int]:
    """(this process's rank, the number of processes) that save and load a checkpoint together; a
    simulation of ranks is one process."""
    return fdist.rank(), 1 if fdist.simulated() else fdist.world()


def _gather_to_lead(obj: Any) -> list | None:
    """Every process's obj in rank order on rank 0, None on the others."""
    rank, world = _job()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _from_lead(obj: Any) -> Any:
    """Rank 0's obj, on every process."""
    if _job()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _first_error(error: str | None) -> str | None:
    """The first of every process's error (None for none): every process gets the same verdict."""
    world = _job()[1]
    if world == 1:
        return error
    errors = [None] * world
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


# ---------------------------------------------------------------- snapshots (what a save writes)

@dataclass(frozen=True)
class Snapshot:
    """This process's part of a checkpoint, every tensor on the CPU, ready to be written by `write`."""

    step: int
    files: dict[str, dict[str, torch.Tensor]]
    """file name -> {key in the file: tensor}"""
    writers: dict[str, int]
    """file name -> the rank whose shards it holds"""
    entries: dict[str, dict[str, dict]]
    """index.json's sections of tensor entries (SECTIONS), with only the shards in `files`"""
    train: dict[str, Any]
    """index.json's "train" section"""
    config_toml: str
    model: dict[str, Any]
    """the ModelConfig as a dict, as the tree format's index.json has it"""
    mesh: dict[str, int]


def loader_state(loader: Loader, step: int) -> dict[str, Any]:
    """The data position after `step` optimizer steps; Loader.batch_at is a pure function of the
    step, so this (with the seed and corpus fingerprint to check against) is all resume needs."""
    seen = step * loader.batch_size
    return {"step": step, "epoch": seen // loader.n_samples, "samples_seen": seen, "seed": loader.seed,
            "corpus_fingerprint": loader.data.fingerprint}


def rng_states(rank: int = 0) -> dict[str, torch.Tensor]:
    states = {f"rank{rank}.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states |= {f"rank{rank}.cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return states


def _flat_opt_state(opt_state: Tree) -> dict[str, torch.Tensor]:
    paths, leaves, _ = tree_flatten_with_paths(opt_state)
    if len(set(paths)) != len(paths):
        repeated = sorted({p for p in paths if paths.count(p) > 1})
        raise CheckpointError(f"optimizer state has repeated leaf paths: {repeated}")
    bad = [p for p, x in zip(paths, leaves) if not isinstance(x, torch.Tensor)]
    if bad:
        raise CheckpointError(f"optimizer state leaves that are not tensors cannot be saved: {bad[:5]}")
    return dict(zip(paths, leaves))


def _whole(shape) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _placement(t: torch.Tensor) -> dict[str, str]:
    if isinstance(t, DTensor):
        return dict(zip(t.device_mesh.mesh_dim_names, map(repr, t.placements)))
    return dict.fromkeys(MESH_AXES, "Replicate()")


def _stored(t: torch.Tensor, rank: int) -> tuple[tuple[slice, ...], bool]:
    """(rank's slice of t, whether rank writes it): each slice once, by the lowest rank holding it."""
    if isinstance(t, DTensor):
        return sharding.stored_slice(t, rank)
    return _whole(t.shape), rank == 0


def _rank_part(leaves: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]], rank: int,
               stage: Callable) -> tuple[dict, dict]:
    """(files, entries) of what `rank` writes; leaves: {section: {path: (leaf, rank's local value)}}."""
    names = {"tensors": f"params-rank{rank:05d}.safetensors", "opt_state": f"state-rank{rank:05d}.safetensors"}
    names["rng"], prefixes = names["opt_state"], {"tensors": "", "opt_state": "opt_state.", "rng": "rng."}
    files: dict[str, dict[str, torch.Tensor]] = {}
    entries: dict[str, dict[str, dict]] = {section: {} for section in SECTIONS}
    for section, section_leaves in leaves.items():
        for path, (t, value) in section_leaves.items():
            if t.dtype not in ST_DTYPES:
                raise CheckpointError(f"{section} leaf '{path}' has dtype {t.dtype}, which safetensors cannot store")
            idx, writes = (_whole(t.shape), True) if section == "rng" else _stored(t, rank)
            # a slice that is empty here (torch.chunk leaves trailing ranks none) is skipped
            writes = writes and (value.numel() > 0 or math.prod(t.shape) == 0)
            if writes or rank == 0:  # rank 0 lists every leaf, even one it holds nothing of
                entries[section][path] = {
                    "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                    "placement": "rank-local" if section == "rng" else _placement(t), "shards": []}
            if writes:
                key = prefixes[section] + path
                files.setdefault(names[section], {})[key] = stage(value)
                entries[section][path]["shards"].append({"file": names[section], "key": key,
                                                         "offset": [s.start for s in idx], "shape": list(value.shape)})
    return files, entries


def _merge(parts: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """index.json's tensor sections from every rank's entries: an entry's shards are all ranks' shards."""
    out: dict[str, dict[str, dict]] = {section: {} for section in SECTIONS}
    for part in parts:
        for section, entries in part.items():
            for path, e in entries.items():
                out[section].setdefault(path, {**e, "shards": []})["shards"] += e["shards"]
    for entries in out.values():
        for e in entries.values():
            if len(e["shards"]) == 1 and e["shards"][0]["shape"] == e["shape"]:
                e["file"] = e["shards"][0]["file"]
    return out


def snapshot(state: TrainState, run: RunConfig, loader: Loader, copy: bool = False) -> Snapshot:
    """This process's part of the checkpoint of `state`: the shards its rank writes (every simulated
    rank's in a simulation). copy=True stages fresh CPU copies (for a write that runs while training
    goes on), else CPU tensors are shared, not copied."""
    stage = (lambda t: t.detach().to("cpu", copy=True)) if copy else (lambda t: t.detach().cpu())
    flat = {"tensors": flatten_dict(state.params), "opt_state": _flat_opt_state(state.opt_state)}
    local = {section: {path: fdist.rank_values(t.to_local() if isinstance(t, DTensor) else t)
                       for path, t in leaves.items()} for section, leaves in flat.items()}
    files: dict[str, dict[str, torch.Tensor]] = {}
    writers: dict[str, int] = {}
    parts = []
    for rank in fdist.ranks_here():
        with fdist.unsimulated():
            leaves = {section: {path: (t, local[section][path][rank]) for path, t in section_leaves.items()}
                      for section, section_leaves in flat.items()}
            leaves["rng"] = {path: (t, t) for path, t in rng_states(rank).items()}
            rank_files, entries = _rank_part(leaves, rank, stage)
        files |= rank_files
        writers |= dict.fromkeys(rank_files, rank)
        parts.append(entries)
    schedule = {"name": run.optim.schedule, "position": state.step, "total_steps": run.train.steps,
                "warmup_steps": run.optim.warmup_steps}
    return Snapshot(state.step, files, writers, _merge(parts),
                    {"step": state.step, "schedule": schedule, "data": loader_state(loader, state.step)},
                    to_toml(run), to_dict(run.model), {a: getattr(run.mesh, a) for a in MESH_AXES})


# ---------------------------------------------------------------- writing

def _raw(t: torch.Tensor) -> memoryview:
    # a flat uint8 view shares the tensor's memory: nothing is copied on the way to the file
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_chunks(path: Path, chunks) -> dict[str, Any]:
    """Write the byte chunks to path and fsync it; its size and sha256, hashed as the bytes go out."""
    h, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
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


def _failure(path: Path, e: OSError) -> str:
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
    except OSError as e:
        return {}, _failure(current, e)
    return files, None


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
        index = {"format": FORMAT, "version": VERSION, "step": snap.step, "model": snap.model,
                 **_merge([entries for _, entries, _ in parts]), "files": files, "mesh": snap.mesh,
                 "mesh_axes": list(MESH_AXES), "train": snap.train}
        current = tmp / INDEX
        _write_chunks(current, [json.dumps(index).encode()])
        _fsync_dir(tmp)
        current = final
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except OSError as e:
        return _failure(current, e)
    return None


def write(snap: Snapshot, root: Path, keep_last: int) -> Path:
    """Write the checkpoint as root/step_<N> atomically, then prune to the newest keep_last
    checkpoints. On several ranks every rank calls this at once with its own part (the protocol is
    in the module docstring); rank 0 commits and prunes.

    On any failure on any rank (a full disk, a file-size limit, Ctrl-C) the temp directory is removed
    and CheckpointError raised on every rank: no partial checkpoint is left, and the previous
    complete ones are untouched.
    """
    root = Path(root)
    rank, _ = _job()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{snap.step}"
    name = f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    if rank == 0:
        shutil.rmtree(root / name, ignore_errors=True)
    tmp = root / _from_lead(name)  # after rank 0's cleanup: one directory for all ranks
    try:
        files, error = _write_files(snap, tmp)
        time.sleep(float(os.environ.get(SAVE_DELAY_ENV, 0)))
        parts = _gather_to_lead((files, snap.entries, error))  # returns once every rank's files are fsynced
        error = _from_lead(_commit(snap, parts, tmp, final) if rank == 0 else None)
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


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step_<N> directory under root, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


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


def discard_after(root: Path, step: int) -> None:
    """Remove temp directories of interrupted saves and the checkpoints of steps after `step`: the
    run continues from `step`, so later ones belong to an abandoned future, as metrics rows do."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(TMP_PREFIX):
            log.info("removing %s, left by a save that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)
    for s, p in list_checkpoints(root):
        if s > step:
            log.warning("removing %s: the run continues from step %d", p, step)
            shutil.rmtree(p, ignore_errors=True)


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
        self._background = cfg.async_save and _job()[1] == 1
        if cfg.async_save and not self._background:
            log.info("checkpoint.async_save applies to one process; on several ranks checkpoints are saved "
                     "synchronously")

    def save(self, state: TrainState, run: RunConfig, loader: Loader, blocking: bool = False) -> Path:
        """Save state as root/step_<N> (returned; with async_save and not blocking it is being written)."""
        self.join()
        background = self._background and not blocking
        snap = snapshot(state, run, loader, copy=background)
        if background:
            self._thread = threading.Thread(target=self._write_in_background, args=(snap,), name="fnmoe-checkpoint")
            self._thread.start()
            path = self.root / f"step_{snap.step}"
        else:
            path = self._write(snap)
        self.last_step = snap.step  # not before: a save that Ctrl-C cut short saved nothing
        return path

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

    def _write_in_background(self, snap: Snapshot) -> None:
        try:
            self._write(snap)
        except BaseException as e:  # handed to the training thread by join()
            self._error = e


# ---------------------------------------------------------------- reading and verifying

def read_index(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / INDEX
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {ckpt} is not a complete fnmoe checkpoint "
                              "(checkpoints are <run-dir>/checkpoints/step_<N>)")
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an fnmoe checkpoint index of version {VERSION}")
    return index


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _check_shards(ckpt: Path, index: dict, names: set[str]) -> None:
    """Every shard of every tensor lies inside the global shape, and those in the files `names` are
    there with the index's dtype and shape."""
    by_file: dict[str, list[tuple[str, str, dict]]] = {}
    for section in SECTIONS:
        for path, e in index[section].items():
            for shard in e["shards"]:
                by_file.setdefault(shard["file"], []).append((f"{section} '{path}'", e["dtype"], shard))
                inside = all(0 <= o and o + n <= g for o, n, g in zip(shard["offset"], shard["shape"], e["shape"]))
                if len(shard["offset"]) != len(e["shape"]) or not inside:
                    raise CheckpointError(f"{ckpt / INDEX}: a shard of {section} '{path}' lies outside its "
                                          f"shape {e['shape']}")
    for name, shards in by_file.items():
        if name not in index["files"]:
            raise CheckpointError(f"{ckpt / INDEX}: tensors refer to {name}, which is not among its files")
        if name not in names:
            continue
        try:
            with safe_open(ckpt / name, framework="pt") as f:
                keys = set(f.keys())
                for what, dtype, shard in shards:
                    if shard["key"] not in keys:
                        raise CheckpointError(f"{ckpt / name}: has no tensor '{shard['key']}' ({what})")
                    s = f.get_slice(shard["key"])
                    want = ST_DTYPES[getattr(torch, dtype)]
                    if list(s.get_shape()) != shard["shape"] or s.get_dtype() != want:
                        raise CheckpointError(f"{ckpt / name}: '{shard['key']}' is {s.get_dtype()} {s.get_shape()}, "
                                              f"index.json says {want} {shard['shape']}")
        except (OSError, SafetensorError) as e:  # a header that does not parse
            raise CheckpointError(f"{ckpt / name}: unreadable safetensors file ({e})") from None


def verify(ckpt: Path, part: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Check the files of a checkpoint against its index.json (size, sha256; the tensors' keys,
    dtypes and shapes) and return the index; raise CheckpointError naming the first bad file.
    part=(i, n) checks only every n-th file from the i-th, so n ranks can share the reading."""
    ckpt = Path(ckpt)
    index = read_index(ckpt)
    try:
        names = sorted(index["files"])[part[0]::part[1]]
        for name in names:
            path, meta = ckpt / name, index["files"][name]
            if not path.is_file():
                raise CheckpointError(f"{path} is missing (listed in {ckpt / INDEX})")
            if path.stat().st_size != meta["bytes"]:
                raise CheckpointError(f"{path} has {path.stat().st_size} bytes, {ckpt / INDEX} says "
                                      f"{meta['bytes']} (truncated or overwritten)")
            if _sha256(path) != meta["sha256"]:
                raise CheckpointError(f"{path} does not match its sha256 checksum in {ckpt / INDEX} (corrupt)")
        _check_shards(ckpt, index, set(names))
    except (KeyError, TypeError, AttributeError) as e:  # valid JSON of the wrong shape
        raise CheckpointError(f"{ckpt / INDEX} is malformed ({type(e).__name__}: {e})") from None
    return index


def _verify_together(ckpt: Path) -> dict[str, Any]:
    """verify(ckpt) with the files shared among the job's processes; every process gets the same
    verdict, so all resume from the same checkpoint or all fail."""
    try:
        index, error = verify(ckpt, _job()), None
    except CheckpointError as e:
        index, error = None, str(e)
    error = _first_error(error)
    if error:
        raise CheckpointError(error)
    return index


def find_latest(root: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint under root and its verified index; None if there is none.
    Corrupt or partial ones are passed over with a warning naming the bad file."""
    for _, path in list_checkpoints(root):
        try:
            return path, _verify_together(path)
        except CheckpointError as e:
            if _job()[0] == 0:  # every rank has the same verdict
                log.warning("skipping checkpoint %s: %s; falling back to an older one", path.name, e)
    return None


@contextlib.contextmanager
def _opened(ckpt: Path):
    """A function file name -> that safetensors file of ckpt, opened once; all closed on exit."""
    with contextlib.ExitStack() as stack:
        files: dict[str, Any] = {}

        def get(name: str):
            if name not in files:
                files[name] = stack.enter_context(safe_open(ckpt / name, framework="pt"))
            return files[name]
        yield get


def _read_region(get: Callable, entry: dict, idx: tuple[slice, ...], what: str) -> torch.Tensor:
    """The part idx (a slice per dim) of a saved tensor, read from the shards that overlap it, each
    only where it overlaps (safetensors get_slice reads no more of the file)."""
    with fdist.unsimulated():  # one plain value, the same on every simulated rank
        out = torch.empty([s.stop - s.start for s in idx], dtype=getattr(torch, entry["dtype"]))
        covered = 0
        for shard in entry["shards"]:
            lo = [max(s.start, o) for s, o in zip(idx, shard["offset"])]
            hi = [min(s.stop, o + n) for s, o, n in zip(idx, shard["offset"], shard["shape"])]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, shard["offset"]))
            out[tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, idx))] = \
                get(shard["file"]).get_slice(shard["key"])[src]
            covered += math.prod(b - a for a, b in zip(lo, hi))
    if covered != out.numel():
        raise CheckpointError(f"{what}: its shards cover {covered} of the {out.numel()} values of {list(idx)}")
    return out


def _read_section(ckpt: Path, index: dict, section: str) -> dict[str, torch.Tensor]:
    """{path: tensor} of one section of a verified checkpoint, each assembled from its shards."""
    with _opened(ckpt) as get:
        return {path: _read_region(get, e, _whole(e["shape"]), f"{ckpt}: {section} '{path}'")
                for path, e in index[section].items()}


def saved_config(ckpt: Path) -> RunConfig:
    """The RunConfig a checkpoint was saved with (validated when it was written)."""
    path = Path(ckpt) / CONFIG
    try:
        return load_config(path, validate_config=False)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_params(ckpt: str | Path) -> tuple[RunConfig, Tree]:
    """(the saved RunConfig, the params tree) of a checkpoint, verified first (for export, eval)."""
    ckpt = Path(ckpt)
    index = verify(ckpt)
    run, params = saved_config(ckpt), unflatten_dict(_read_section(ckpt, index, "tensors"))
    diff = shape_mismatches(params, run.model)
    if diff:
        raise CheckpointError(f"{ckpt}: its tensors do not fit the model of its {CONFIG}: {'; '.join(diff)}")
    return run, params


# ---------------------------------------------------------------- resume

def _flat_diff(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _flat_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((prefix + key, a, b))
    return sorted(out)


def check_resume_config(saved: RunConfig, run: RunConfig, ckpt: Path, step: int) -> None:
    """Refuse a resume that changes the model's shape (listing the fields); warn about other changes
    (optimizer, schedule, step count, mesh, ...), which apply from the resume point on."""
    diffs = [d for d in _flat_diff(to_dict(saved), to_dict(run)) if d[0] != "resume"]
    shown = lambda ds: ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in ds)  # noqa: E731
    model = [d for d in diffs if d[0].startswith("model.") and d[0] not in RUNTIME_MODEL_FIELDS]
    if model:
        raise CheckpointError(f"cannot resume from {ckpt}: model fields differ from the checkpoint's: "
                              f"{shown(model)}; use the checkpoint's values (its {CONFIG}) or start a new run")
    if diffs and _job()[0] == 0:  # every rank finds the same: rank 0 says it
        log.warning("resuming from %s with settings that differ from the checkpoint's: %s; the new values "
                    "apply after step %d", ckpt, shown(diffs), step)


Reader = Callable[[str, tuple[slice, ...]], torch.Tensor]
"""(path, slice) -> that slice of a saved tensor of one section"""


def _restore_params(template: Tree, entries: dict[str, dict], read: Reader, mesh, ckpt: Path) -> Tree:
    """The saved params in the structure of `template` (meta tensors): whole, or on a mesh each
    rank's slices placed by the rules."""
    paths, leaves, rebuild = tree_flatten_with_paths(template)
    if set(paths) != entries.keys():
        missing, extra = sorted(set(paths) - entries.keys()), sorted(entries.keys() - set(paths))
        raise CheckpointError(f"{ckpt}: params differ from the model's: missing {missing[:5]}, unexpected {extra[:5]}")
    bad = [p for p, x in zip(paths, leaves) if entries[p]["shape"] != list(x.shape)]
    if bad:
        raise CheckpointError(f"{ckpt}: params of the wrong shape for the model: {bad[:5]}")
    dtypes = dict(zip(paths, (x.dtype for x in leaves)))
    if mesh is None:
        return rebuild([read(p, _whole(x.shape)).to(x.dtype) for p, x in zip(paths, leaves)])
    return sharding.distribute(template, mesh, lambda path, idx: read(path, idx).to(dtypes[path]))


def _restore_opt_state(template: Tree, entries: dict[str, dict], read: Reader, ckpt: Path) -> Tree:
    """The saved optimizer state in the structure of `template` (tx.init of the run's optimizer on
    the restored params): a leaf that is a DTensor there is read rank by rank as it is placed.

    0-D float64 leaves are hyperparameters (optim.py keeps lr, betas, eps, weight decay, momentum and
    clip norm so), taken from the template: a changed optim setting applies on resume. A state of
    another structure (another optimizer) is replaced by the fresh template, with a warning.
    """
    paths, leaves, rebuild = tree_flatten_with_paths(template)
    same = set(paths) == entries.keys() and all(
        entries[p]["shape"] == list(x.shape) and entries[p]["dtype"] == str(x.dtype).removeprefix("torch.")
        for p, x in zip(paths, leaves))
    if not same:
        log.warning("the optimizer state in %s does not fit the configured optimizer; starting it fresh "
                    "(moments and step counts from zero, so the lr schedule starts over)", ckpt)
        return template

    def leaf(path: str, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 0 and x.dtype == torch.float64:
            return x
        if isinstance(x, DTensor):
            return sharding.distribute_like(x, lambda idx: read(path, idx))
        return read(path, _whole(x.shape)).to(x.device)
    return rebuild([leaf(p, x) for p, x in zip(paths, leaves)])


def _restore_rng(entries: dict[str, dict], read: Reader) -> None:
    """Set this rank's RNG states to the saved ones; ranks the saving mesh did not have keep their
    seeded state, and rank 0 says so once."""
    rank, world = _job()
    saved_world = len({k.split(".")[0] for k in entries})  # every saving rank wrote its own states
    if rank == 0 and world > saved_world:
        log.warning("the checkpoint has the RNG states of %d ranks: ranks %d..%d keep their seeded state",
                    saved_world, saved_world, world - 1)
    prefix = f"rank{rank}."
    saved = {k.removeprefix(prefix) for k in entries if k.startswith(prefix)}
    here = {k.removeprefix(prefix) for k in rng_states(rank)}
    if saved and saved != here:
        log.warning("the checkpoint has RNG states %s, this process %s; the others keep their seeded state",
                    sorted(saved), sorted(here))
    for name in saved & here:
        state = read(prefix + name, _whole(entries[prefix + name]["shape"]))
        if name == "torch_cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, int(name.removeprefix("cuda")))


def load_state(ckpt: Path, index: dict, run: RunConfig, tx: optim.GradientTransformation,
               loader: Loader, mesh=None) -> TrainState:
    """The TrainState saved in ckpt (index: from verify(ckpt)) for `run` on `mesh` (None: one
    process), whatever mesh saved it, and this rank's RNG states restored.

    Raises CheckpointError if the model's shape changed; warns when other settings or the data did.
    """
    ckpt = Path(ckpt)
    check_resume_config(saved_config(ckpt), run, ckpt, index["step"])
    data = index["train"]["data"]
    if data["corpus_fingerprint"] != loader.data.fingerprint and _job()[0] == 0:
        log.warning("the data differ from the checkpoint's (corpus fingerprint %s, now %s): samples after step "
                    "%d are not those the saved run would have seen", data["corpus_fingerprint"],
                    loader.data.fingerprint, index["step"])
    with _opened(ckpt) as get:
        def reader(section: str) -> Reader:
            return lambda path, idx: _read_region(get, index[section][path], idx, f"{ckpt}: {section} '{path}'")
        params = _restore_params(init_params(run.model, device="meta"), index["tensors"], reader("tensors"), mesh,
                                 ckpt)
        opt_state = _restore_opt_state(tx.init(params), index["opt_state"], reader("opt_state"), ckpt)
        _restore_rng(index["rng"], reader("rng"))
    return TrainState(params, opt_state, index["step"])


def resume_point(resume: str, root: Path) -> tuple[Path, dict] | None:
    """The checkpoint `--resume` names, with its verified index: none -> None, auto -> the newest
    complete one under root (None if there is none), else the directory PATH. On several ranks every
    rank calls this, and all get the same answer."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(root)
    return Path(resume), _verify_together(Path(resume))
