"""The on-disk format of a checkpoint (the one specification of it): files, index.json, dtypes.

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
A directory without index.json (a save in progress or cut short, `.tmp-*` beside the checkpoints)
is not a checkpoint.

How the ranks write and read these files together (one temp directory, rank 0 commits, any mesh
loads any checkpoint) is described in docs/architecture.md, section "Checkpoints".
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from fnmoe.config import types
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


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or incompatible with the run, or could not be written."""


def _whole(shape) -> tuple[slice, ...]:
    """The slices (one per dim) of a whole tensor of this shape."""
    return tuple(slice(0, n) for n in shape)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step_<N> directory under root, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


_ENTRY = {"dtype": str, "shape": [int], "shards": [{"file": str, "key": str, "offset": [int], "shape": [int]}]}
INDEX_TYPES = {"step": int, "model": dict, "files": {str: {"writer_rank": int, "bytes": int, "sha256": str}},
               **{section: {str: _ENTRY} for section in SECTIONS}, "mesh": {a: int for a in MESH_AXES},
               "train": {"step": int, "schedule": dict, "data": {"step": int, "epoch": int, "samples_seen": int,
                                                                  "seed": int, "corpus_fingerprint": str}}}
"""The types of index.json's fields, as its writer makes them: a type; [spec] a list of such; a dict of
field -> spec an object with those fields (others allowed); {str: spec} an object of any keys."""


def type_problem(value: Any, spec: Any, where: str) -> str | None:
    """The first field of value that is not as spec says (INDEX_TYPES), named by its path; None if none."""
    if isinstance(spec, list):
        if not isinstance(value, list):
            return f"{where} = {types.show(value)} is {types.kind(value)}, expected a list"
        return next(filter(None, (type_problem(v, spec[0], f"{where}[{i}]") for i, v in enumerate(value))), None)
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where} = {types.show(value)} is {types.kind(value)}, expected an object"
        if list(spec) == [str]:
            return next(filter(None, (type_problem(v, spec[str], f"{where}['{k}']") for k, v in value.items())), None)
        missing = [k for k in spec if k not in value]
        if missing:
            return f"{where or 'the index'} has no field '{missing[0]}'"
        return next(filter(None, (type_problem(value[k], sub, f"{where}.{k}" if where else k)
                                  for k, sub in spec.items())), None)
    problems = types.type_errors(value, spec, where)
    return problems[0] if problems else None


def read_index(ckpt: Path) -> dict[str, Any]:
    """The index.json of ckpt, checked to be of this format and version and its fields of their types
    (INDEX_TYPES; the files are not checked)."""
    path = Path(ckpt) / INDEX
    if not Path(ckpt).is_dir():
        raise CheckpointError(f"{ckpt} {'is not a directory' if Path(ckpt).exists() else 'does not exist'}")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {ckpt} is not a complete fnmoe checkpoint "
                              "(checkpoints are <run-dir>/checkpoints/step_<N>)")
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an fnmoe checkpoint index of version {VERSION}")
    problem = type_problem(index, INDEX_TYPES, "")
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return index
