"""Checkpoints: atomic, checksummed snapshots of a run in the native tree format, and resume.

A checkpoint is the directory `<run-dir>/checkpoints/step_<N>`:

  params-rank<R>.safetensors  rank R's params (buffers included) under their dotted paths
  state-rank<R>.safetensors   rank R's optimizer state (keys `opt_state.<path>`) and RNG states (`rng.<name>`)
  config.toml                 the resolved config of the run that saved it
  index.json                  written last; describes everything above

index.json extends the native tree format's (fnmoe/tree_io.py: "model", and "tensors" keyed by
param path with "file", "dtype", "shape") with shards, checksums, optimizer and training state:

  {"format": "fnmoe-checkpoint", "version": 1, "step": N, "model": {ModelConfig fields},
   "tensors" | "opt_state" | "rng": {PATH: ENTRY},    params | optimizer state | RNG states
   "files": {NAME: {"writer_rank": R, "bytes": SIZE, "sha256": HEX}},
   "mesh": {"fsdp": 1, "ep": 1}, "mesh_axes": ["fsdp", "ep"],
   "train": {"step": N, "schedule": {...}, "data": {"step", "epoch", "samples_seen", "seed",
             "corpus_fingerprint"}}}
  ENTRY = {"dtype": "float32", "shape": GLOBAL_SHAPE, "placement": ["Replicate()", "Replicate()"],
           "shards": [{"file": NAME, "key": KEY_IN_FILE, "offset": START_PER_DIM, "shape": SHARD_SHAPE}],
           "file": NAME}                               the last only when one file holds it whole

A tensor is its shards put at their offsets in its global shape, so a reader on any mesh can
assemble or re-slice it; `placement` (one entry per mesh axis, as DTensor prints them) records how
the writer's mesh held it. Expert stacks keep the expert dim first: a shard's offset[0] + k is the
global id of its k-th expert, never a rank-local one. RNG states belong to one rank ("rank-local").
Checksums are taken of the bytes as they are written.

Saving is atomic: the files go into a temp directory beside the checkpoints, each fsynced, index.json
last; then the directory is fsynced and renamed to step_<N>. A checkpoint is complete when its
index.json lists files that exist with the right sizes and checksums (`verify`). A killed save leaves
only a temp directory, which resume ignores and the next run removes.

Legend: no shape-suffixed tensors here; params and states are handled leaf by leaf by dotted path.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fnmoe import optim
from fnmoe.config import CheckpointConfig, RunConfig, load_config, to_dict, to_toml
from fnmoe.data import Loader
from fnmoe.model import init_params
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
RUNTIME_MODEL_FIELDS = ("model.compute_dtype", "model.compile", "model.moe.impl")
# test hook (tests/test_checkpoint.py): seconds a save waits between its data files and its
# index.json, so a test can kill the process while the save is half written
SAVE_DELAY_ENV = "FNMOE_TEST_SAVE_DELAY_S"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or incompatible with the run, or could not be written."""


# ---------------------------------------------------------------- snapshots (what a save writes)

@dataclass(frozen=True)
class Snapshot:
    """A checkpoint's contents with every tensor on the CPU, ready to be written by `write`."""

    step: int
    files: dict[str, dict[str, torch.Tensor]]
    """file name -> {key in the file: tensor}"""
    entries: dict[str, dict[str, dict]]
    """index.json's sections of tensor entries (SECTIONS)"""
    train: dict[str, Any]
    """index.json's "train" section"""
    config_toml: str
    model: dict[str, Any]
    """the ModelConfig as a dict, as the tree format's index.json has it"""
    mesh: dict[str, int]
    rank: int = 0


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


def snapshot(state: TrainState, run: RunConfig, loader: Loader, copy: bool = False, rank: int = 0) -> Snapshot:
    """The checkpoint of `state`; copy=True stages fresh CPU copies (for a write that runs while
    training goes on), else CPU tensors are shared, not copied."""
    stage = (lambda t: t.detach().to("cpu", copy=True)) if copy else (lambda t: t.detach().cpu())
    params_file, state_file = f"params-rank{rank:05d}.safetensors", f"state-rank{rank:05d}.safetensors"
    sections = {"tensors": (params_file, "", flatten_dict(state.params)),
                "opt_state": (state_file, "opt_state.", _flat_opt_state(state.opt_state)),
                "rng": (state_file, "rng.", rng_states(rank))}
    files: dict[str, dict[str, torch.Tensor]] = {params_file: {}, state_file: {}}
    entries: dict[str, dict[str, dict]] = {}
    for section, (fname, prefix, flat) in sections.items():
        entries[section] = {}
        for path, t in flat.items():
            if t.dtype not in ST_DTYPES:
                raise CheckpointError(f"{section} leaf '{path}' has dtype {t.dtype}, which safetensors cannot store")
            files[fname][prefix + path] = stage(t)
            shape = list(t.shape)
            # one process holds every tensor whole: one shard at offset 0
            entries[section][path] = {
                "dtype": str(t.dtype).removeprefix("torch."), "shape": shape,
                "placement": "rank-local" if section == "rng" else ["Replicate()"] * len(MESH_AXES),
                "shards": [{"file": fname, "key": prefix + path, "offset": [0] * len(shape), "shape": shape}],
                "file": fname}
    schedule = {"name": run.optim.schedule, "position": state.step, "total_steps": run.train.steps,
                "warmup_steps": run.optim.warmup_steps}
    return Snapshot(state.step, files, entries, {"step": state.step, "schedule": schedule,
                                                  "data": loader_state(loader, state.step)},
                    to_toml(run), to_dict(run.model), {a: getattr(run.mesh, a) for a in MESH_AXES}, rank)


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


def write(snap: Snapshot, root: Path, keep_last: int) -> Path:
    """Write snap as root/step_<N> atomically, then prune to the newest keep_last checkpoints.

    On any failure (a full disk, a file-size limit, Ctrl-C) the temp directory is removed: no
    partial checkpoint is left, and the previous complete ones are untouched.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{snap.step}"
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    current = tmp
    try:
        tmp.mkdir()
        files = {}
        for name, tensors in snap.files.items():
            current = tmp / name
            files[name] = {"writer_rank": snap.rank, **_write_chunks(current, _safetensors_chunks(tensors))}
        time.sleep(float(os.environ.get(SAVE_DELAY_ENV, 0)))
        current = tmp / CONFIG
        files[CONFIG] = {"writer_rank": snap.rank, **_write_chunks(current, [snap.config_toml.encode()])}
        index = {"format": FORMAT, "version": VERSION, "step": snap.step, "model": snap.model, **snap.entries,
                 "files": files, "mesh": snap.mesh, "mesh_axes": list(MESH_AXES), "train": snap.train}
        current = tmp / INDEX
        _write_chunks(current, [json.dumps(index).encode()])
        _fsync_dir(tmp)
        current = final
        os.rename(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        hint = " (disk full or over a file-size limit)" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
        raise CheckpointError(f"could not save checkpoint step {snap.step}: writing {current} failed: "
                              f"{e.strerror or e}{hint}; removed the partial save, older checkpoints in "
                              f"{root} are untouched") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    """Saves a run's checkpoints under root, synchronously or (cfg.async_save) from staged CPU
    copies on a background thread while training goes on; at most one write is in flight, and its
    error, if any, is raised by the next `save` or `join` in the training thread."""

    def __init__(self, root: Path, cfg: CheckpointConfig, last_step: int = 0):
        self.root, self.cfg = Path(root), cfg
        self.last_step = last_step
        """the step of the newest checkpoint saved or resumed from"""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: TrainState, run: RunConfig, loader: Loader, blocking: bool = False) -> Path:
        """Save state as root/step_<N> (returned; with async_save and not blocking it is being written)."""
        self.join()
        background = self.cfg.async_save and not blocking
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
        log.info("saved checkpoint %s (%.1f MB in %.2f s)", path, mb, time.perf_counter() - t0)
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


def _check_shards(ckpt: Path, index: dict) -> None:
    """Every shard of every tensor is in its file with the index's dtype and shape, inside the global shape."""
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


def verify(ckpt: Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its index.json (size, sha256; the tensors' keys,
    dtypes and shapes) and return the index; raise CheckpointError naming the first bad file."""
    ckpt = Path(ckpt)
    index = read_index(ckpt)
    try:
        for name, meta in index["files"].items():
            path = ckpt / name
            if not path.is_file():
                raise CheckpointError(f"{path} is missing (listed in {ckpt / INDEX})")
            if path.stat().st_size != meta["bytes"]:
                raise CheckpointError(f"{path} has {path.stat().st_size} bytes, {ckpt / INDEX} says "
                                      f"{meta['bytes']} (truncated or overwritten)")
            if _sha256(path) != meta["sha256"]:
                raise CheckpointError(f"{path} does not match its sha256 checksum in {ckpt / INDEX} (corrupt)")
        _check_shards(ckpt, index)
    except (KeyError, TypeError, AttributeError) as e:  # valid JSON of the wrong shape
        raise CheckpointError(f"{ckpt / INDEX} is malformed ({type(e).__name__}: {e})") from None
    return index


def find_latest(root: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint under root and its verified index; None if there is none.
    Corrupt or partial ones are passed over with a warning naming the bad file."""
    for _, path in list_checkpoints(root):
        try:
            return path, verify(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s; falling back to an older one", path.name, e)
    return None


def _read_section(ckpt: Path, index: dict, section: str) -> dict[str, torch.Tensor]:
    """{path: tensor} of one section of a verified checkpoint, each assembled from its shards."""
    out = {}
    with contextlib.ExitStack() as stack:
        files: dict[str, Any] = {}
        for path, e in index[section].items():
            t = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
            for shard in e["shards"]:
                if shard["file"] not in files:
                    files[shard["file"]] = stack.enter_context(safe_open(ckpt / shard["file"], framework="pt"))
                region = tuple(slice(o, o + n) for o, n in zip(shard["offset"], shard["shape"]))
                t[region] = files[shard["file"]].get_tensor(shard["key"])
            out[path] = t
    return out


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
    return saved_config(ckpt), unflatten_dict(_read_section(ckpt, index, "tensors"))


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
    if diffs:
        log.warning("resuming from %s with settings that differ from the checkpoint's: %s; the new values "
                    "apply after step %d", ckpt, shown(diffs), step)


def _restore_params(template: Tree, flat: dict[str, torch.Tensor], ckpt: Path) -> Tree:
    paths, leaves, rebuild = tree_flatten_with_paths(template)
    if set(paths) != flat.keys():
        missing, extra = sorted(set(paths) - flat.keys()), sorted(flat.keys() - set(paths))
        raise CheckpointError(f"{ckpt}: params differ from the model's: missing {missing[:5]}, unexpected {extra[:5]}")
    bad = [p for p, x in zip(paths, leaves) if flat[p].shape != x.shape]
    if bad:
        raise CheckpointError(f"{ckpt}: params of the wrong shape for the model: {bad[:5]}")
    return rebuild([flat[p].to(x.dtype) for p, x in zip(paths, leaves)])


def _restore_opt_state(template: Tree, flat: dict[str, torch.Tensor], ckpt: Path) -> Tree:
    """The saved optimizer state in the structure of `template` (tx.init of the run's optimizer).

    0-D float64 leaves are hyperparameters (optim.py keeps lr, betas, eps, weight decay, momentum and
    clip norm so), taken from the template: a changed optim setting applies on resume. A state of
    another structure (another optimizer) is replaced by the fresh template, with a warning.
    """
    paths, leaves, rebuild = tree_flatten_with_paths(template)
    same = set(paths) == flat.keys() and all(
        flat[p].shape == x.shape and flat[p].dtype == x.dtype for p, x in zip(paths, leaves))
    if not same:
        log.warning("the optimizer state in %s does not fit the configured optimizer; starting it fresh "
                    "(moments and step counts from zero, so the lr schedule starts over)", ckpt)
        return template
    hyper = lambda x: x.ndim == 0 and x.dtype == torch.float64  # noqa: E731
    return rebuild([x if hyper(x) else flat[p].to(x.device) for p, x in zip(paths, leaves)])


def _restore_rng(states: dict[str, torch.Tensor], rank: int = 0) -> None:
    prefix = f"rank{rank}."
    saved = {k.removeprefix(prefix): v for k, v in states.items() if k.startswith(prefix)}
    here = {k.removeprefix(prefix) for k in rng_states(rank)}
    if saved.keys() != here:
        log.warning("the checkpoint has RNG states %s, this process %s; the others keep their seeded state",
                    sorted(saved), sorted(here))
    for name in saved.keys() & here:
        if name == "torch_cpu":
            torch.set_rng_state(saved[name])
        else:
            torch.cuda.set_rng_state(saved[name], int(name.removeprefix("cuda")))


def load_state(ckpt: Path, index: dict, run: RunConfig, tx: optim.GradientTransformation,
               loader: Loader) -> TrainState:
    """The TrainState saved in ckpt (index: from verify(ckpt)) for `run`, and the RNG states restored.

    Raises CheckpointError if the model's shape changed; warns when other settings or the data did.
    """
    ckpt = Path(ckpt)
    check_resume_config(saved_config(ckpt), run, ckpt, index["step"])
    data = index["train"]["data"]
    if data["corpus_fingerprint"] != loader.data.fingerprint:
        log.warning("the data differ from the checkpoint's (corpus fingerprint %s, now %s): samples after step "
                    "%d are not those the saved run would have seen", data["corpus_fingerprint"],
                    loader.data.fingerprint, index["step"])
    params = _restore_params(init_params(run.model, device="meta"), _read_section(ckpt, index, "tensors"), ckpt)
    opt_state = _restore_opt_state(tx.init(params), _read_section(ckpt, index, "opt_state"), ckpt)
    _restore_rng(_read_section(ckpt, index, "rng"))
    return TrainState(params, opt_state, index["step"])


def resume_point(resume: str, root: Path) -> tuple[Path, dict] | None:
    """The checkpoint `--resume` names, with its verified index: none -> None, auto -> the newest
    complete one under root (None if there is none), else the directory PATH."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(root)
    return Path(resume), verify(Path(resume))

