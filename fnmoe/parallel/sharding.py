"""The 2-D mesh ("fsdp", "ep"), logical-axis rules, storage placement and gather-for-compute.

Legend: E experts, D model, F hidden. "axis" is a mesh axis, "dim" a tensor dim.

Storage (docs/design.md §4): every dim of a leaf has a logical axis (`logical_axes`); the ordered
`RULES` table maps logical axes to mesh axes, first rule first, each mesh axis used once a leaf:

  dense leaves   dim 0 over the flattened ("fsdp", "ep") axis "dp"   -> DTensor on the 1-D dp mesh
  expert stacks  dim 0 over "ep" (E/ep whole experts a rank), then over "fsdp" while each rank
                 keeps whole experts (fsdp*ep divides E), else dim 1 over "fsdp" -> 2-D mesh
  buffers        replicated plain tensors (they have no gradient and change by their own rule)

Splits follow torch.chunk (DTensor's convention), in rule order: the expert dim is split over ep
first and each ep part over fsdp, which DTensor calls _StridedShard(0, ep) on fsdp (fnmoe._torch.StridedShard).

Compute: fnmoe.parallel.gather all-gathers a block's leaves in the compute dtype (dense leaves over dp; an
expert stack over fsdp alone, giving the ep rank its own experts), one block early; gradients come
back as fp32 shards (a reduce-scatter of each rank's partial sums).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fnmoe import _torch, caches
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import replay
from fnmoe._torch import StridedShard
from fnmoe.config import DistConfig, MeshConfig, ModelConfig
from fnmoe.models import params as fparams
from fnmoe.parallel.dispatch import all_reduce_sum
from fnmoe.tree import Tree, flatten_dict, leaf_kind, map_with_path, tree_flatten

MESH_AXES = ("fsdp", "ep")
DP = "dp"
RULES: tuple[tuple[str, str], ...] = (
    ("expert", "ep"),         # whole experts to each ep rank: EP needs no weight communication
    ("expert", "fsdp"),       # then the rank's experts over fsdp, while each keeps whole experts
    ("expert_row", "fsdp"),   # else fsdp splits each expert's rows (fsdp*ep does not divide E)
    ("row", DP),              # dense leaves: dim 0 over every rank
)


# ---------------------------------------------------------------- mesh

def make_mesh(mcfg: MeshConfig, dcfg: DistConfig | None = None) -> DeviceMesh:
    """The ("fsdp", "ep") mesh over every rank and its flattened "dp" axis; each group gets
    dcfg's timeout and is warmed by a barrier."""
    world = fdist.world()
    if world != mcfg.world:
        raise ValueError(f"mesh.fsdp={mcfg.fsdp} x mesh.ep={mcfg.ep} = {mcfg.world} ranks, but the job has "
                         f"{world} (torchrun --nproc-per-node x nodes must equal mesh.fsdp x mesh.ep)")
    if fdist.simulated() or fdist.fake_group():  # no real groups to make or warm
        mesh = init_device_mesh("cpu", (mcfg.fsdp, mcfg.ep), mesh_dim_names=MESH_AXES)
        _torch.flatten_mesh(mesh[MESH_AXES], DP)
        for m in (mesh, *(submesh(mesh, name) for name in (*MESH_AXES, DP))):
            m.get_coordinate()  # computed (with tensor ops) and cached now, not inside a step
            _ranks(m)  # (a rehearsal's steps run under FakeTensorMode, which cannot read them)
        replay.make_replay_groups(mesh, submesh(mesh, "ep").get_group().group_name)
        return mesh
    # one options object per group: c10d writes per-group fields into the one it is given
    opts = {axis: fdist.group_options(dcfg or DistConfig()) for axis in (*MESH_AXES, DP)}
    mesh = init_device_mesh(fdist.compute_device(dcfg, world).type, (mcfg.fsdp, mcfg.ep),
                            mesh_dim_names=MESH_AXES, backend_override={axis: opts[axis] for axis in MESH_AXES})
    _torch.flatten_mesh(mesh[MESH_AXES], DP, backend_override=opts[DP])
    for m in (submesh(mesh, "fsdp"), submesh(mesh, "ep"), dp_mesh(mesh)):
        dist.barrier(group=m.get_group())
    ep = submesh(mesh, "ep").get_group().group_name
    replay.make_replay_groups(mesh, ep, backend_override={axis: fdist.group_options(dcfg or DistConfig())
                                                          for axis in MESH_AXES})
    if mcfg.ep > 1:
        dist.barrier(group=replay_group(ep))
    return mesh


def replay_group(group_name: str):
    """The process group a replayed exchange on group_name runs on (fnmoe.parallel.replay)."""
    return _torch.group_of(replay.replay_group_name(group_name))


@caches.register  # keeps the meshes alive
@functools.cache
def _ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of mesh in row-major order, computed once (DeviceMesh.mesh builds a tensor
    at every call, which is slow in a simulation)."""
    return tuple(mesh.mesh.flatten().tolist())


def position(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index on each dim of a mesh of this shape of its i-th rank (row-major, as DeviceMesh lays
    ranks out): the one rule from a rank to its mesh coordinates."""
    out = []
    for n in reversed(shape):
        i, c = divmod(i, n)
        out.append(c)
    return tuple(reversed(out))


def axis_coords(i: int, fsdp: int, ep: int) -> dict[str, int]:
    """The i-th rank's position on each axis of an (fsdp, ep) mesh, the flattened dp axis included."""
    return {**dict(zip(MESH_AXES, position(i, (fsdp, ep)))), DP: i}


def _coord(mesh: DeviceMesh, rank: int) -> dict[str, int]:
    """rank's position on each axis of the ("fsdp", "ep") mesh."""
    return axis_coords(_ranks(mesh).index(rank), mesh.size(0), mesh.size(1))


# ---------------------------------------------------------------- rules and specs

def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axis of each dim of the leaf at path (None: never sharded)."""
    if leaf_kind(path) == "buffer" or ndim == 0:
        return (None,) * ndim
    if ndim == 3 and leaf_kind(path) == "expert":
        return ("expert", "expert_row", None)
    return ("row",) + (None,) * (ndim - 1)


@dataclass(frozen=True)
class LeafSpec:
    """Where a leaf lives: the mesh axes (in split order) and the dim each splits; () is replicated."""
    splits: tuple[tuple[str, int], ...]


def leaf_spec(path: str, shape: tuple[int, ...], sizes: dict[str, int]) -> LeafSpec:
    """Apply RULES in order; a rule fits when its axis is unused (dp counts as fsdp and ep) and,
    for an expert dim, the split keeps whole experts on every rank."""
    axes = logical_axes(path, len(shape))
    used: set[str] = set()
    splits = []
    parts = dict.fromkeys(range(len(shape)), 1)
    for logical, axis in RULES:
        members = MESH_AXES if axis == DP else (axis,)
        if any(m in used for m in members) or logical not in axes or sizes[axis] == 1:
            continue
        d = axes.index(logical)
        if logical == "expert" and shape[d] % (parts[d] * sizes[axis]):
            continue
        splits.append((axis, d))
        parts[d] *= sizes[axis]
        used.update(members)
    return LeafSpec(tuple(splits))


def mesh_sizes(mesh: DeviceMesh | None) -> dict[str, int]:
    if mesh is None:
        return {"fsdp": 1, "ep": 1, DP: 1}
    return {"fsdp": mesh.size(0), "ep": mesh.size(1), DP: mesh.size()}


def param_specs(tree: Tree, mesh: DeviceMesh | None) -> Tree:
    """A LeafSpec per leaf of a params tree (tensors or LeafInits)."""
    sizes = mesh_sizes(mesh)
    return map_with_path(lambda path, x: leaf_spec(path, tuple(x.shape), sizes), tree)


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's i-th of `parts` pieces of range(n) as (start, stop)."""
    size = -(-n // parts)
    return min(i * size, n), min((i + 1) * size, n)


def local_index(spec: LeafSpec, shape: tuple[int, ...], coord: dict[str, int],
                sizes: dict[str, int]) -> tuple[slice, ...]:
    """The slice of the global leaf a rank at coord stores."""
    bounds = [(0, n) for n in shape]
    for axis, d in spec.splits:
        lo, hi = bounds[d]
        a, b = _chunk(hi - lo, sizes[axis], coord[axis])
        bounds[d] = (lo + a, lo + b)
    return tuple(slice(lo, hi) for lo, hi in bounds)


_submeshes: dict[tuple[int, str], tuple[DeviceMesh, DeviceMesh]] = {}
caches.register(_submeshes.clear)  # keeps the meshes alive


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """mesh[name], one object per axis: a simulation caches coordinates by mesh object, and a
    recompute in backward must run the same ops as the forward did. Kept by the mesh object, not
    its value: meshes of two process groups in turn (two rehearsals of different ranks) are equal
    but hold different coordinates."""
    hit = _submeshes.get((id(mesh), name))
    if hit is None or hit[0] is not mesh:
        with warnings.catch_warnings():  # torch asks callers to keep the flattened mesh; this cache does
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            hit = _submeshes[(id(mesh), name)] = (mesh, mesh[name])
    return hit[1]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened ("fsdp", "ep") mesh that make_mesh made."""
    return submesh(mesh, DP)


def group_axes(mesh: DeviceMesh) -> dict[str, str]:
    """{process group name: the mesh axes it serves, "/"-joined}; with fsdp 1 the ep group is the dp
    group ("ep/dp"). Axes of one rank have no group."""
    groups = {a: submesh(mesh, a) for a in MESH_AXES} | {DP: dp_mesh(mesh)}
    out: dict[str, list[str]] = {}
    for axis, m in groups.items():
        if m.size() > 1:
            out.setdefault(m.get_group().group_name, []).append(axis)
    axes = {name: "/".join(a) for name, a in out.items()}
    ep = submesh(mesh, "ep")
    if ep.size() > 1:  # a recompute's replayed exchanges run on the ep group's twin (fnmoe.parallel.replay)
        name = ep.get_group().group_name
        axes[replay.replay_group_name(name)] = axes[name]
    return axes


def placements(spec: LeafSpec, mesh: DeviceMesh) -> tuple[DeviceMesh, tuple]:
    """The DTensor mesh and placements of a spec: dense leaves on the 1-D dp mesh, expert stacks
    on the 2-D mesh."""
    split = dict(spec.splits)
    if DP in split:
        return dp_mesh(mesh), (Shard(split[DP]),)
    ep = Shard(split["ep"]) if "ep" in split else Replicate()
    if "fsdp" not in split:
        fsdp = Replicate()
    elif split["fsdp"] == split.get("ep"):  # fsdp splits ep's part of the dim: right-to-left sharding
        fsdp = StridedShard(split["fsdp"], split_factor=mesh.size(1))
    else:
        fsdp = Shard(split["fsdp"])
    return mesh, (fsdp, ep)


def _distribute(path: str, shape: tuple[int, ...], mesh: DeviceMesh, local: Callable) -> torch.Tensor:
    """A leaf whose local value on each rank is local(index of that rank's slice)."""
    sizes = mesh_sizes(mesh)
    spec = leaf_spec(path, shape, sizes)
    # drawn or read on the host, held where the mesh computes (a no-op on CPU meshes)
    value = fdist.rank_map(lambda r: local(local_index(spec, shape, _coord(mesh, r), sizes)).to(mesh.device_type))
    if not spec.splits:
        return value
    dmesh, places = placements(spec, mesh)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(value, dmesh, places, shape=torch.Size(shape), stride=stride)


def shard_params(params: Tree, mesh: DeviceMesh) -> Tree:
    """A full params tree (the same on every rank) as this rank's shards: DTensor leaves, buffers plain."""
    return map_with_path(lambda path, t: _distribute(path, tuple(t.shape), mesh, lambda idx: t[idx].clone()),
                         params)



def full_params(params: Tree) -> Tree:
    """Every leaf whole on every rank (tests and export); plain leaves are returned as they are."""
    return map_with_path(lambda _, t: t.full_tensor() if isinstance(t, DTensor) else t, params)


def distribute(tree: Tree, mesh: DeviceMesh, read: Callable[[str, tuple[slice, ...]], torch.Tensor]) -> Tree:
    """Leaves placed by the rules whose local value on each rank is read(path, that rank's slice);
    `tree` gives the paths and global shapes (tensors, meta tensors or LeafInits)."""
    return map_with_path(lambda path, x: _distribute(path, tuple(x.shape), mesh, lambda idx: read(path, idx)), tree)


def init_params(cfg: ModelConfig, seed: int = 0, *, device: str | torch.device = "cpu",
                mesh: DeviceMesh | None = None) -> Tree:
    """fp32 master params for cfg, the same values for a seed on any mesh (fnmoe.init_params): with
    a mesh this rank's shards (DTensor leaves, placed where the mesh computes), each rank drawing only
    the chunks it stores; without one fnmoe.models.params.init_params' whole tree on device
    (device="meta" is abstract)."""
    if mesh is None:
        return fparams.init_params(cfg, seed, device=device)
    fparams.check_config(cfg)
    inits = fparams.leaf_inits(cfg)
    by_path = flatten_dict(inits)
    return distribute(inits, mesh, lambda path, index: fparams.draw_leaf(by_path[path], seed, path, index))


def distribute_like(t: DTensor, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> DTensor:
    """A DTensor placed as t whose local value on each rank is read(that rank's slice of t)."""
    value = fdist.rank_map(lambda r: read(stored_slice(t, r)[0]).to(t.device_mesh.device_type))
    return DTensor.from_local(value, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())


def stored_slice(t: DTensor, rank: int) -> tuple[tuple[slice, ...], bool]:
    """(the slice of t's global value that rank stores, whether rank is the lowest rank storing
    it) for a DTensor placed by `placements`: what a sharded checkpoint writes once."""
    dmesh = t.device_mesh
    names = dmesh.mesh_dim_names
    coord = dict(zip(names, coordinate(dmesh, rank)))
    split = {name: p.dim for name, p in zip(names, t.placements) if isinstance(p, (Shard, StridedShard))}
    # in RULES order: ep splits the expert dim first, then fsdp each ep part (_StridedShard)
    spec = LeafSpec(tuple((axis, split[axis]) for axis in (DP, "ep", "fsdp") if axis in split))
    idx = local_index(spec, tuple(t.shape), coord, dict(zip(names, dmesh.shape)))
    # moving to coordinate 0 on the axes that replicate t keeps the slice and lowers the rank
    return idx, all(coord[name] == 0 for name in names if name not in split)


# ---------------------------------------------------------------- reductions

def all_sum(t: torch.Tensor, what: str = "a sum") -> torch.Tensor:
    """t summed over every rank (t itself without a process group); `what` names t in a failure's message."""
    if not dist.is_initialized():
        return t
    fdist.entering(f"all-reduce of {what} over every rank")
    return all_reduce_sum(t, dist.group.WORLD)


def global_norm_sq(tree: Tree) -> torch.Tensor:
    """Squared L2 norm of all floating leaves, fp32: sharded leaves summed over the ranks of their
    mesh (dense over dp, expert stacks over fsdp then ep), replicated leaves counted once."""
    by_mesh: dict[DeviceMesh | None, torch.Tensor] = {}
    for x in tree_flatten(tree)[0]:
        if not x.is_floating_point():
            continue
        local = _torch.as_arrived(x.to_local() if isinstance(x, DTensor) else x)  # a bf16 gradient read as bf16
        key = x.device_mesh if isinstance(x, DTensor) else None
        sq = torch.linalg.vector_norm(local, dtype=torch.float32).square()
        by_mesh[key] = by_mesh[key] + sq if key in by_mesh else sq
    total = torch.zeros((), dtype=torch.float32)
    for m, sq in by_mesh.items():
        if m is not None:
            for d in range(m.ndim):
                fdist.entering(f"all-reduce of the gradient norm over {m.mesh_dim_names[d]}")
                sq = all_reduce_sum(sq, m.get_group(d))
        total = total + sq
    return total


# ---------------------------------------------------------------- layouts for whole-matrix work (Muon)

def split_dims(t: DTensor) -> dict[int, int]:
    """{mesh dim: tensor dim} for every mesh dim that splits t (Shard or _StridedShard)."""
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"a DTensor with placements {t.placements} holds partial sums: reduce it first")
    return {m: p.dim for m, p in enumerate(t.placements) if isinstance(p, (Shard, StridedShard))}


def coordinate(mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    """A global rank's index on each dim of mesh (DeviceMesh.get_coordinate knows only its own)."""
    return position(_ranks(mesh).index(rank), tuple(mesh.shape))


def chunk_lengths(n: int, parts: int) -> list[int]:
    """The lengths of torch.chunk's `parts` pieces of n (DTensor's Shard rule), empty pieces included."""
    return [b - a for a, b in (_chunk(n, parts, i) for i in range(parts))]
