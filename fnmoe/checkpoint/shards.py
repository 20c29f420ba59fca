"""What a save writes: each rank's shards of params, optimizer state and RNG states with their
index entries, staged on the CPU as a `Snapshot`."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.checkpoint.format import MESH_AXES, SECTIONS, ST_DTYPES, CheckpointError, whole_slices, compact
from fnmoe.config import RunConfig, to_dict, to_toml
from fnmoe.training.state import TrainState
from fnmoe.tree import Tree, flatten_dict, tree_flatten_with_paths


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


def _placement(t: torch.Tensor) -> dict[str, str]:
    if isinstance(t, DTensor):
        return dict(zip(t.device_mesh.mesh_dim_names, map(repr, t.placements)))
    return dict.fromkeys(MESH_AXES, "Replicate()")


def _stored(t: torch.Tensor, rank: int) -> tuple[tuple[slice, ...], bool]:
    """(rank's slice of t, whether rank writes it): each slice once, by the lowest rank holding it."""
    if isinstance(t, DTensor):
        return sharding.stored_slice(t, rank)
    return whole_slices(t.shape), rank == 0


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
            idx, writes = (whole_slices(t.shape), True) if section == "rng" else _stored(t, rank)
            # a slice that is empty here (torch.chunk leaves trailing ranks none) is skipped
            writes = writes and (value.numel() > 0 or math.prod(t.shape) == 0)
            if writes or rank == 0:  # rank 0 lists every leaf, even one it holds nothing of
                entries[section][path] = {
                    "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                    "placement": "rank-local" if section == "rng" else _placement(t), "shards": []}
            if writes:
                key = prefixes[section] + path
                files.setdefault(names[section], {})[key] = stage(value)
                entries[section][path]["shards"].append({"file": names[section], "key": key, "rank": rank,
                                                         "offset": [s.start for s in idx], "shape": list(value.shape)})
    return files, entries


def _merge(parts: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """The tensor sections of several ranks' entries: an entry's parts are all ranks' parts."""
    out: dict[str, dict[str, dict]] = {section: {} for section in SECTIONS}
    for part in parts:
        for section, entries in part.items():
            for path, e in entries.items():
                out[section].setdefault(path, {**e, "shards": []})["shards"] += e["shards"]
    return out


def index_sections(parts: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """index.json's tensor sections from every rank's entries (in rank order): each entry's parts in
    grids where they step linearly (format.compact), and its file where one part is all of it."""
    out = _merge(parts)
    for entries in out.values():
        for e in entries.values():
            e["shards"] = compact(sorted(e["shards"], key=lambda part: part["rank"]))
            if len(e["shards"]) == 1 and "grid" not in e["shards"][0] and e["shards"][0]["shape"] == e["shape"]:
                e["file"] = e["shards"][0]["file"]
    return out


@dataclass(frozen=True)
class ShapeOnly:
    """What the index reads of a tensor, and no tensor: fnmoe.plan.rehearse lists 384 ranks' parts of
    thousands of leaves under fake tensors, where each meta tensor made cost ~0.4 ms."""
    shape: torch.Size
    dtype: torch.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


def _stored_part(t: torch.Tensor, rank: int) -> ShapeOnly:
    """A shape-only stand-in of the part of t that rank stores."""
    idx, _ = _stored(t, rank)
    return ShapeOnly(torch.Size(len(range(*s.indices(n))) for s, n in zip(idx, t.shape)), t.dtype)


def _refuse_non_finite(params: dict[str, dict[int, torch.Tensor]], step: int) -> None:
    """Raise on every rank if any rank holds a non-finite parameter value: a checkpoint never
    stores a broken model (training skips such steps; this catches params that arrived broken)."""
    bad = [path for path, by_rank in params.items()
           if any(v.is_floating_point() and not bool(torch.isfinite(v).all()) for v in by_rank.values())]
    total = len(bad)
    if not fdist.simulated():  # real ranks agree, so that all of them raise together
        device = next(iter(next(iter(params.values())).values())).device
        what = f"step {step}'s count of non-finite params (saving its checkpoint)"
        total = int(sharding.all_sum(torch.tensor(total, device=device), what))
    if total:
        where = f"params {bad[:4]}" if bad else "params of another rank"
        raise CheckpointError(f"refusing to save step {step}: non-finite values (NaN or inf) in {where}")


def snapshot(state: TrainState, run: RunConfig, data: dict[str, Any] | None, ranks=None,
             stage: Callable | None = None) -> Snapshot:
    """This process's part of the checkpoint of `state` at the data position `data` (index.json's
    train.data: the loader's `position(state.step)`; None: none): the shards its rank writes (every
    simulated rank's in a simulation), on the CPU (CPU tensors shared, not copied), or as `stage`
    gives each (`staged` copies a snapshot of device tensors later, off the training thread). The RNG
    states are taken now. With ranks (and a stage that reads nothing), the part of those ranks from the leaves'
    placements alone: fnmoe.checkpoint.index_only."""
    if data is not None and data.get("step") != state.step:
        raise ValueError(f"the data position is of step {data.get('step')}, the state of step {state.step}")
    stage = stage or (lambda t: t.detach().cpu())
    flat = {"tensors": flatten_dict(state.params), "opt_state": _flat_opt_state(state.opt_state)}
    if ranks is None:
        local = {section: {path: fdist.rank_values(t.to_local() if isinstance(t, DTensor) else t)
                           for path, t in leaves.items()} for section, leaves in flat.items()}
        _refuse_non_finite(local["tensors"], state.step)
        value = lambda section, path, t, rank: local[section][path][rank]  # noqa: E731
    else:
        value = lambda section, path, t, rank: _stored_part(t, rank)  # noqa: E731
    files: dict[str, dict[str, torch.Tensor]] = {}
    writers: dict[str, int] = {}
    parts = []
    for rank in fdist.ranks_here() if ranks is None else ranks:
        with fdist.unsimulated():
            leaves = {section: {path: (t, value(section, path, t, rank)) for path, t in section_leaves.items()}
                      for section, section_leaves in flat.items()}
            leaves["rng"] = {path: (t, t) for path, t in rng_states(rank).items()}
            rank_files, entries = _rank_part(leaves, rank, stage)
        files |= rank_files
        writers |= dict.fromkeys(rank_files, rank)
        parts.append(entries)
    schedule = {"name": run.optim.schedule, "position": state.step, "total_steps": run.train.steps,
                "warmup_steps": run.optim.warmup_steps}
    train = {"step": state.step, "schedule": schedule, "data": data or {}}
    return Snapshot(state.step, files, writers, _merge(parts), train, to_toml(run), to_dict(run.model),
                    {a: getattr(run.mesh, a) for a in MESH_AXES})


def staged(snap: Snapshot, after=None) -> Snapshot:
    """snap with fresh CPU copies of its tensors, made on the calling thread (a background save's):
    the training thread goes on meanwhile. A functional step returns new trees and never writes into
    the state it was given; a donating one (train.donate) does, so the loop waits for these copies
    before it (fnmoe.training.loop_steps): the tensors are as they were when `snapshot` took them. after: a CUDA event
    recorded on the training stream once the state was complete; the copies run on a side stream
    that waits for it."""
    stream = None
    if after is not None:
        stream = torch.cuda.Stream()
        stream.wait_event(after)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        files = {name: {key: t.detach().to("cpu", copy=True) for key, t in tensors.items()}
                 for name, tensors in snap.files.items()}
    return dataclasses.replace(snap, files=files)
