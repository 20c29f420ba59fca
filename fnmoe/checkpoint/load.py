"""Reading checkpoints: `verify` (sizes, sha256, safetensors headers against index.json), the parts
of saved tensors a reader needs (read region by region from the shards that overlap them), and
`load_params` for export and evaluation."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from fnmoe.parallel import dist as fdist
from fnmoe.checkpoint.format import (CONFIG, INDEX, SECTIONS, ST_DTYPES, CheckpointError, cover_problem, parts,
                                     read_index, tiling_problem, whole_slices)
from fnmoe.checkpoint.procs import first_error, rank_in_job
from fnmoe.config import RunConfig, config_from_tables, drop_unknown, read_toml
from fnmoe.models.params import current_path, shape_mismatches
from fnmoe.tree_io import plain_name
from fnmoe.tree import Tree, unflatten_dict

log = logging.getLogger("fnmoe")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _check_tiling(ckpt: Path, index: dict, part: tuple[int, int]) -> None:
    """The parts of every part[1]-th tensor from the part[0]-th tile it (format.tiling_problem), so
    that the job's processes share the work."""
    entries = [(section, path) for section in SECTIONS for path in index[section]]
    for section, path in entries[part[0]::part[1]]:
        problem = tiling_problem(index, section, path)
        if problem:
            raise CheckpointError(f"{ckpt / INDEX}: {problem}")


def _check_shards(ckpt: Path, index: dict, names: set[str]) -> None:
    """The parts in the files `names` are there with the index's dtype and shape."""
    by_file: dict[str, list[tuple[str, str, dict]]] = {}
    for section in SECTIONS:
        for path, e in index[section].items():
            for shard in parts(e["shards"]):
                by_file.setdefault(shard["file"], []).append((f"{section} '{path}'", e["dtype"], shard))
    for name, shards in by_file.items():
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


def _check_model(ckpt: Path, index: dict) -> None:
    """What a resume reads beyond the files, checked without reading a tensor: its config.toml reads,
    and the params index.json lists are the leaves of that config's model, each of its shape. A
    CheckpointError naming the first that is not."""
    run = saved_config(ckpt, say_unknown=False)
    meta = unflatten_dict({current_path(p): torch.empty(e["shape"], device="meta")
                           for p, e in index["tensors"].items()})
    diff = shape_mismatches(meta, run.model)
    if diff:
        raise CheckpointError(f"{ckpt / INDEX}: its params do not fit the model of its {CONFIG}: {'; '.join(diff)}")


def verify(ckpt: Path, part: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Check the index.json of a checkpoint (read_index), its files against it (size, sha256; the
    tensors' keys, dtypes and shapes), and what a resume needs of it (_check_model: its config.toml,
    the params of that model; _check_tiling: every tensor tiled by its parts), and return the index;
    raise CheckpointError naming the first problem. part=(i, n) checks only every n-th file and
    tensor from the i-th, so n ranks can share the work."""
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
        _check_model(ckpt, index)
        _check_tiling(ckpt, index, part)
    except (KeyError, TypeError, AttributeError) as e:  # valid JSON of the wrong shape
        raise CheckpointError(f"{ckpt / INDEX} is malformed ({type(e).__name__}: {e})") from None
    return index


def verify_together(ckpt: Path) -> dict[str, Any]:
    """verify(ckpt) with the files shared among the job's processes; every process gets the same
    verdict, so all resume from the same checkpoint or all fail."""
    try:
        index, error = verify(ckpt, rank_in_job()), None
    except CheckpointError as e:
        index, error = None, str(e)
    error = first_error(error)
    if error:
        raise CheckpointError(error)
    return index


def check_finite(ckpt: Path, index: dict) -> None:
    """Raise CheckpointError when the params of a verified checkpoint hold NaN or inf (a run would
    refuse to start from them: fnmoe.run.guards); reads every param once."""
    bad = [path for path, t in _read_section(ckpt, index, "tensors").items()
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"{ckpt}: its params hold non-finite values (NaN or inf) in {len(bad)} leaves, e.g. "
                              f"{bad[:3]}: a run cannot resume from it")


@contextlib.contextmanager
def opened_files(ckpt: Path):
    """A function file name -> that safetensors file of ckpt, opened once; all closed on exit."""
    with contextlib.ExitStack() as stack:
        files: dict[str, Any] = {}

        def get(name: str):
            if not plain_name(name):  # the index a caller passed may not be read_index's
                raise CheckpointError(f"{ckpt}: {name!r} is not a file name in it")
            if name not in files:
                files[name] = stack.enter_context(safe_open(ckpt / name, framework="pt"))
            return files[name]
        yield get


def read_region(get: Callable, entry: dict, idx: tuple[slice, ...], what: str) -> torch.Tensor:
    """The part idx (a slice per dim) of a saved tensor, read from the parts that overlap it, each
    only where it overlaps (safetensors get_slice reads no more of the file); refused before anything
    is allocated unless those overlaps hold each of its values exactly once."""
    pieces = []  # each part's overlap with idx, in the tensor's coordinates; "from": that part's offset
    for part in parts(entry["shards"]):
        lo = [max(s.start, o) for s, o in zip(idx, part["offset"])]
        hi = [min(s.stop, o + n) for s, o, n in zip(idx, part["offset"], part["shape"])]
        if all(a < b for a, b in zip(lo, hi)):
            pieces.append({**part, "offset": lo, "shape": [b - a for a, b in zip(lo, hi)], "from": part["offset"]})
    problem = cover_problem(pieces, math.prod(s.stop - s.start for s in idx))
    if problem:
        raise CheckpointError(f"{what}: its shards {problem} (reading {list(idx)})")
    with fdist.unsimulated():  # one plain value, the same on every simulated rank
        out = torch.empty([s.stop - s.start for s in idx], dtype=getattr(torch, entry["dtype"]))
        for p in pieces:
            src = tuple(slice(a - o, a - o + n) for a, o, n in zip(p["offset"], p["from"], p["shape"]))
            dst = tuple(slice(a - s.start, a - s.start + n) for a, s, n in zip(p["offset"], idx, p["shape"]))
            out[dst] = get(p["file"]).get_slice(p["key"])[src]
    return out


def _read_section(ckpt: Path, index: dict, section: str) -> dict[str, torch.Tensor]:
    """{path: tensor} of one section of a verified checkpoint, each assembled from its shards."""
    with opened_files(ckpt) as get:
        return {path: read_region(get, e, whole_slices(e["shape"]), f"{ckpt}: {section} '{path}'")
                for path, e in index[section].items()}


def saved_config(ckpt: Path, say_unknown: bool = True) -> RunConfig:
    """The RunConfig a checkpoint was saved with (validated when it was written; each value's type
    is checked as it is read). Fields this release does not know (a newer release wrote it) are
    ignored outside the model, with a warning when say_unknown (verify, which a load follows, does
    not say it again); in the model they could change its shape or numerics, so the checkpoint is
    refused naming them."""
    path = Path(ckpt) / CONFIG
    try:
        tables, unknown = drop_unknown(RunConfig, read_toml(path))
        model = [k for k in unknown if k.startswith("model.")]
        if model:
            raise CheckpointError(f"{path}: model fields this fnmoe does not know: {', '.join(model)} (a newer "
                                  "release wrote it?); read it with that release")
        if unknown and say_unknown and rank_in_job()[0] == 0:
            log.warning("%s: ignoring fields this fnmoe does not know, none of the model's: %s", path,
                        ", ".join(unknown))
        return config_from_tables(tables, path, validate_config=False)
    except (FileNotFoundError, ValueError) as e:  # each names the file
        raise CheckpointError(str(e)) from None



def load_params(ckpt: str | Path) -> tuple[RunConfig, Tree]:
    """(the saved RunConfig, the params tree) of a checkpoint, verified first (for export, eval)."""
    ckpt = Path(ckpt)
    index = verify(ckpt)
    tensors = {current_path(p): t for p, t in _read_section(ckpt, index, "tensors").items()}
    run, params = saved_config(ckpt), unflatten_dict(tensors)
    diff = shape_mismatches(params, run.model)
    if diff:
        raise CheckpointError(f"{ckpt}: its tensors do not fit the model of its {CONFIG}: {'; '.join(diff)}")
    return run, params
