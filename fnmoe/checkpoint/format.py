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


def read_index(ckpt: Path) -> dict[str, Any]:
    """The index.json of ckpt, checked to be of this format and version (the files are not checked)."""
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
