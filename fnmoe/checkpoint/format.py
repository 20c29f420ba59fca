"""The on-disk format of a checkpoint (the one specification of it): files, index.json, dtypes.

A checkpoint is the directory `<run-dir>/checkpoints/step_<N>`:

  params-rank<R>.safetensors  the shards of params (buffers included) that rank R wrote, keys = dotted paths
  state-rank<R>.safetensors   rank R's shards of optimizer state (keys `opt_state.<path>`) and its RNG
                              states (`rng.rank<R>.<name>`)
  config.toml                 the resolved config of the run that saved it
  index.json                  written last; describes everything above

index.json extends the native tree format's (fnmoe/tree_io.py: "model", and "tensors" keyed by
param path with "file", "dtype", "shape") with shards, checksums, optimizer and training state:

  {"format": "fnmoe-checkpoint", "version": 2, "step": N, "model": {ModelConfig fields},
   "tensors" | "opt_state" | "rng": {PATH: ENTRY},    params | optimizer state | RNG states
   "files": {NAME: {"writer_rank": R, "bytes": SIZE, "sha256": HEX}},
   "mesh": {"fsdp": F, "ep": E}, "mesh_axes": ["fsdp", "ep"],
   "train": {"step": N, "schedule": {...}, "data": {"step", "epoch", "samples_seen", "seed",
             "corpus_fingerprint"}}}
  ENTRY = {"dtype": "float32", "shape": GLOBAL_SHAPE, "placement": {MESH_AXIS: PLACEMENT},
           "shards": [{"file": NAME, "key": KEY_IN_FILE, "offset": START_PER_DIM, "shape": SHARD_SHAPE}],
           "file": NAME}                               the last only when one shard is the whole tensor

A shard is either one part, {"file", "key", "offset", "shape"} as above, or (version 2) a grid of
parts that differ only in their writer's rank and offset, each step linear:
  {"file": "params-rank{rank}.safetensors", "key": KEY, "offset": FIRST_OFFSET, "shape": SHARD_SHAPE,
   "rank": FIRST_RANK, "grid": [{"count": N, "rank_step": DR, "offset_step": [DO per dim]}, ...]}
standing for the parts at rank = FIRST_RANK + sum(i_k * DR_k), offset = FIRST_OFFSET + sum(i_k * DO_k)
for every 0 <= i_k < N_k, in the file named with {rank} replaced by that rank in 5 digits. The
first grid row is the innermost. A save of n ranks lists an expert stack in one or a few grids,
so index.json does not grow with the world (version 1 listed every rank's part: 97 MB at 384
ranks). Readers take both versions; `parts` expands either.

A tensor is its shards put at their offsets in its global shape, so a reader on any mesh can
assemble or re-slice it. `placement` records how the writer's mesh held it, as DTensor prints
placements, keyed by the axes of the mesh the leaf lived on: {"dp": "Shard(dim=0)"} for a dense
leaf (the flattened fsdp x ep axis), {"fsdp": "_StridedShard(dim=0, sf=2)", "ep": "Shard(dim=0)"}
for an expert stack, {"fsdp": "Replicate()", "ep": "Replicate()"} for plain tensors; RNG states
are "rank-local". Expert stacks keep the expert dim first: a shard's offset[0] + k is the global
id of its k-th expert, never a rank-local one. Checksums are taken of the bytes as they are written.
The index is a contract its readers check (read_index, and tiling_problem in `verify`) before they
size a loop or a buffer by it: its file names are plain names in its directory, its step (and
train.step) the N of a directory named step_<N>, each tensor's parts no more than its files and its
values no more than their bytes, and the parts tile each tensor: inside its shape, each value in
exactly one part (else a reader returns memory it never wrote).
A directory without index.json (a save in progress or cut short, `.tmp-*` beside the checkpoints)
is not a checkpoint.

How the ranks write and read these files together (one temp directory, rank 0 commits, any mesh
loads any checkpoint) is described in docs/architecture.md, section "Checkpoints".
"""
from __future__ import annotations

import heapq
import itertools
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from fnmoe.config import types
from fnmoe.parallel.sharding import MESH_AXES  # index.json's mesh sizes are the mesh's axes
from fnmoe.tree_io import plain_name

FORMAT, VERSION = "fnmoe-checkpoint", 2
READABLE = (1, 2)
"""the versions of index.json this reader takes (1: every part listed; 2: grids of parts)"""
INDEX, CONFIG = "index.json", "config.toml"
SECTIONS = ("tensors", "opt_state", "rng")
"""index.json's sections of tensor entries: params (named as in the tree format), optimizer state, RNG"""
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"step_(\d+)")
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in ST_DTYPES}
"""index.json's dtype names -> torch dtypes"""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or incompatible with the run, or could not be written."""


def whole_slices(shape) -> tuple[slice, ...]:
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
    """The index.json of ckpt, checked to be of this format and version, its fields of their types
    (INDEX_TYPES), its file names plain names in ckpt, its step ckpt's, and its numbers of parts and
    values bounded by its files (the files are not read; how the parts tile each tensor is
    `tiling_problem`'s)."""
    path = Path(ckpt) / INDEX
    if not Path(ckpt).is_dir():
        raise CheckpointError(f"{ckpt} {'is not a directory' if Path(ckpt).exists() else 'does not exist'}")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {ckpt} is not a complete fnmoe checkpoint "
                              "(checkpoints are <run-dir>/checkpoints/step_<N>)")
    index = types.read_json(path, CheckpointError)
    if index.get("format") != FORMAT or index.get("version") not in READABLE:
        raise CheckpointError(f"{path} is not an fnmoe checkpoint index of version {' or '.join(map(str, READABLE))}")
    problem = type_problem(index, INDEX_TYPES, "") or _grid_problem(index) or _name_problem(index) or \
        _step_problem(index, ckpt) or _size_problem(index)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return index


_GRID = {"rank": int, "grid": [{"count": int, "rank_step": int, "offset_step": [int]}]}


def _grid_problem(index: dict) -> str | None:
    """The first grid shard (version 2) whose grid fields are not as _GRID says, or whose file name
    has no {rank}; None if none."""
    for section in SECTIONS:
        for path, e in index[section].items():
            for i, shard in enumerate(e["shards"]):
                if "grid" not in shard:
                    continue
                where = f"{section}['{path}'].shards[{i}]"
                problem = type_problem(shard, _GRID, where)
                if problem or "{rank}" not in shard["file"]:
                    return problem or f"{where}.file = {shard['file']!r} has no {{rank}} in it"
                if any(len(row["offset_step"]) != len(shard["offset"]) or row["count"] < 1 for row in shard["grid"]):
                    return f"{where}.grid: a row's count is below 1 or its offset_step is not one step per dim"
    return None


def _name_problem(index: dict) -> str | None:
    """The first file name, among the files or the shards', that is not a plain name in the checkpoint's
    directory (a {rank} in it stands for digits); None if none."""
    bad = next((name for name in index["files"] if not plain_name(name)), None)
    if bad is not None:
        return f"files[{bad!r}] is not a file name in the checkpoint's directory"
    for section in SECTIONS:
        for path, e in index[section].items():
            for i, shard in enumerate(e["shards"]):
                if not plain_name(shard["file"]):
                    return (f"{section}['{path}'].shards[{i}].file = {shard['file']!r} is not a file name in the "
                            "checkpoint's directory")
    return None


def _step_problem(index: dict, ckpt: Path) -> str | None:
    """Where the index's step disagrees with train.step or with the N of a directory named step_N
    (another name is a copy, taken at its word): a resume continues from the index's step and sets
    aside the checkpoints after it, which would take this one."""
    named = STEP_DIR.fullmatch(Path(os.path.abspath(ckpt)).name)
    if named and int(named[1]) != index["step"]:
        return f"step = {index['step']} differs from the step of its directory, {named[0]}"
    if index["train"]["step"] != index["step"]:
        return f"train.step = {index['train']['step']} differs from step = {index['step']}"
    return None


def _part_count(shards: list[dict], most: int) -> int:
    """How many parts the shards stand for, counted no further than most + 1 (a grid's counts are
    never multiplied out past it)."""
    n = 0
    for shard in shards:
        k = 1
        for row in shard.get("grid", ()):
            k = min(k * row["count"], most + 1)
        n = min(n + k, most + 1)
    return n


def _size_problem(index: dict) -> str | None:
    """The first entry with a dtype not of ST_DTYPES, a negative size, more parts than the checkpoint
    has files (each part is in its writer's file) or more bytes than they hold; None if none. Every
    loop over parts and every buffer a reader makes is bounded by the files before it is made."""
    files = index["files"]
    held = sum(meta["bytes"] for meta in files.values())
    for section in SECTIONS:
        for path, e in index[section].items():
            where = f"{section}['{path}']"
            if e["dtype"] not in DTYPES:
                return f"{where}.dtype = {e['dtype']!r} is not one of {', '.join(DTYPES)}"
            if any(n < 0 for n in e["shape"]):
                return f"{where}.shape = {e['shape']} has a negative size"
            if _part_count(e["shards"], len(files)) > len(files):
                return f"{where}.shards stand for more parts than the {len(files)} files of the checkpoint"
            if math.prod(e["shape"]) * DTYPES[e["dtype"]].itemsize > held:
                return f"{where}.shape = {e['shape']} is more {e['dtype']} values than its files' {held} bytes hold"
    return None


def overlap(boxes: list[dict]) -> tuple[dict, dict] | None:
    """Two of the boxes ({"offset", "shape"}, of one tensor's dims) that share a value, or None. A
    sweep along the dim where their offsets differ most compares each box only with those still open
    where it starts: none for parts split along one dim, so 384 ranks' parts cost a sort."""
    boxes = [b for b in boxes if all(b["shape"])]  # an empty box shares nothing
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0]["shape"])
    if ndim == 0:  # each holds the one value
        return boxes[0], boxes[1]
    d = max(range(ndim), key=lambda k: len({b["offset"][k] for b in boxes}))
    open_ends: list[tuple[int, int]] = []  # a heap of (end along d, box) of the boxes passed
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i]["offset"][d]):
        b = boxes[i]
        while open_ends and open_ends[0][0] <= b["offset"][d]:
            heapq.heappop(open_ends)
        for _, j in open_ends:
            c = boxes[j]
            if all(co < bo + bn and bo < co + cn
                   for co, cn, bo, bn in zip(c["offset"], c["shape"], b["offset"], b["shape"])):
                return c, b
        heapq.heappush(open_ends, (b["offset"][d] + b["shape"][d], i))
    return None


def cover_problem(boxes: list[dict], n: int) -> str | None:
    """Why boxes ({"file", "offset", "shape"}, each inside a region of n values) do not hold each value of
    the region exactly once (a reader would leave the others as the memory it got); None if they do."""
    pair = overlap(boxes)
    if pair:
        a, b = pair
        return f"overlap: the parts in {a['file']} at {a['offset']} and in {b['file']} at {b['offset']}"
    covered = sum(math.prod(b["shape"]) for b in boxes)
    return None if covered == n else f"hold {covered} of its {n} values"


def tiling_problem(index: dict, section: str, path: str) -> str | None:
    """Why the parts of an entry of an index from read_index do not tile its tensor (each part in a
    listed file and inside the shape, each value in exactly one part); None if they do."""
    e, where = index[section][path], f"the shards of {section} '{path}'"
    boxes = []
    for part in parts(e["shards"]):
        name, offset, shape = part["file"], part["offset"], part["shape"]
        if name not in index["files"]:
            return f"{where} name {name}, which is not among its files"
        inside = all(0 <= o and 0 <= k and o + k <= n for o, k, n in zip(offset, shape, e["shape"]))
        if not (len(offset) == len(shape) == len(e["shape"]) and inside):
            return f"{where} lie outside its shape {e['shape']}: the part in {name} at {offset} of shape {shape}"
        boxes.append(part)
    problem = cover_problem(boxes, math.prod(e["shape"]))
    return f"{where} {problem}" if problem else None


def parts(shards: list[dict]):
    """The parts {"file", "key", "offset", "shape"} the shards of an index entry stand for, grids
    expanded (lazily: a reader near one part looks at the others' offsets only)."""
    for shard in shards:
        if "grid" not in shard:
            yield shard
            continue
        rows = shard["grid"][::-1]  # outermost first: product steps the last fastest
        for steps in itertools.product(*(range(row["count"]) for row in rows)):
            rank = shard["rank"] + sum(i * row["rank_step"] for i, row in zip(steps, rows))
            offset = [o + sum(i * row["offset_step"][d] for i, row in zip(steps, rows))
                      for d, o in enumerate(shard["offset"])]
            yield {"file": shard["file"].replace("{rank}", f"{rank:05d}"), "key": shard["key"],
                   "offset": offset, "shape": shard["shape"]}


def _runs(groups: list[dict]) -> list[dict]:
    """Consecutive groups alike but for rank and offset, at linear steps, merged into one with an
    outer grid row."""
    out: list[dict] = []
    for g in groups:
        last = out[-1] if out else None
        alike = last is not None and all(last[k] == g[k] for k in ("file", "key", "shape")) and \
            last["grid"][:-1 if last["merged"] else None] == g["grid"]
        if alike:
            step = [g["rank"] - last["rank"], [b - a for a, b in zip(last["offset"], g["offset"])]]
            if not last["merged"]:
                if step[0] > 0:
                    last["grid"].append({"count": 2, "rank_step": step[0], "offset_step": step[1]})
                    last["merged"] = True
                    continue
            else:
                row, n = last["grid"][-1], last["grid"][-1]["count"]
                if step == [n * row["rank_step"], [n * d for d in row["offset_step"]]]:
                    row["count"] += 1
                    continue
        out.append({**g, "grid": list(g["grid"]), "merged": False})
    for g in out:
        del g["merged"]
    return out


def compact(shards: list[dict]) -> list[dict]:
    """An entry's parts (each with its writer's "rank", in rank order) as version 2 shards: grids of
    up to two levels where the parts step linearly, single parts elsewhere (`parts` undoes it)."""
    groups = [{**s, "file": s["file"].replace(f"{s['rank']:05d}", "{rank}", 1), "grid": []} for s in shards]
    out = []
    for g in _runs(_runs(groups)):
        if g["grid"]:
            out.append(g)
        else:  # one part: as version 1 writes it
            out.append({k: v for k, v in g.items() if k not in ("rank", "grid")} |
                       {"file": g["file"].replace("{rank}", f"{g['rank']:05d}")})
    return out
