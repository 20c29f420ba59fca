"""Bytes of what a rank holds whatever it computes: fp32 master params, gradients, optimizer
state, and the full weights it gathers for one block's compute.

Shapes come from params.leaf_inits (nothing allocated), cached per model for the search's many
layouts.
"""
from __future__ import annotations

import math
from functools import lru_cache

from fnmoe.config import ModelConfig, RunConfig
from fnmoe.dtypes import DTYPE_BYTES
from fnmoe.models.params import leaf_inits
from fnmoe.optim.base import default_label
from fnmoe.parallel import fp8, sharding
from fnmoe.tree import flatten_dict, leaf_kind

MASTER_BYTES = GRAD_BYTES = 4  # fp32 master params and fp32 reduce-scattered gradients
GB = 1e9


@lru_cache(maxsize=16)
def leaf_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(dotted path, shape) of every leaf; cached, since flattening a 1T tree takes milliseconds and
    `fnmoe plan --search` plans hundreds of layouts of one model."""
    return tuple((path, tuple(init.shape)) for path, init in flatten_dict(leaf_inits(cfg)).items())


def state_bytes(run: RunConfig) -> dict:
    """Per-rank bytes of fp32 master params, grads (grad_bytes) and optimizer state (every leaf
    sharded over all fsdp·ep ranks)."""
    params, grads, optim = _state_elems(run.model, run.mesh.world, run.optim.name == "muon")
    sb = DTYPE_BYTES[run.plan.state_dtype]
    return {"params": params * MASTER_BYTES, "grads": grad_bytes(run, grads), "optim": optim * sb}


def grad_bytes(run: RunConfig, elems: int) -> int:
    """A rank's gradients of elems elements: float32, twice with gradient accumulation (the sum and a
    micro-batch's). Reduce-scattered in bf16 for one micro-batch and a donated update, bf16 as they
    arrived (fnmoe.parallel.gather: the update casts a leaf's copy; a tied embedding's two are summed
    in float32); the pure update casts them all."""
    if run.train.grad_accum > 1:
        return 2 * elems * GRAD_BYTES
    if run.mesh.world == 1 or reduce_bytes(run) == GRAD_BYTES or not run.train.donate:
        return elems * GRAD_BYTES
    tied = math.ceil(run.model.vocab_size * run.model.dim / run.mesh.world) if run.model.tie_embeddings else 0
    return (elems - tied) * reduce_bytes(run) + tied * GRAD_BYTES


@lru_cache(maxsize=256)
def _state_elems(cfg: ModelConfig, world: int, muon: bool) -> tuple[int, int, int]:
    """Elements a rank holds of (params, grads, optimizer moments)."""
    params = grads = optim = 0
    for path, shape in leaf_shapes(cfg):
        n = math.ceil(math.prod(shape) / world)
        params += n
        if leaf_kind(path) == "buffer":
            continue
        grads += n
        optim += n * (1 if default_label(path, len(shape), muon) == "muon" else 2)
    return params, grads, optim


def reduce_bytes(run: RunConfig) -> int:
    """Bytes an element of a gradient's reduce-scatter sends (mesh.reduce_dtype; fp32 without it)."""
    return DTYPE_BYTES[getattr(run.mesh, "reduce_dtype", "float32")]


@lru_cache(maxsize=256)
def block_numels(cfg: ModelConfig, ep: int) -> list[int]:
    """Elements a rank holds of each gathered block (embedding, layers, head): dense leaves whole,
    expert stacks E/ep experts."""
    blocks = [0] * (cfg.n_layers + 2)  # embedding, layers, final norm and head
    for path, shape in leaf_shapes(cfg):
        head, _, rest = path.partition(".")
        if leaf_kind(path) == "buffer":
            continue
        i = 0 if head == "embed" else int(rest.partition(".")[0]) + 1 if head == "layers" else cfg.n_layers + 1
        blocks[i] += math.prod(shape) // (ep if leaf_kind(path) == "expert" else 1)
    return blocks


def gathered_bytes(run: RunConfig) -> int:
    """Transient full weights in the compute dtype: a layer and the next one, prefetched (all layers
    without resharding, or on one rank where the compute-dtype copies are saved for backward), or
    the embedding or head alone. One fp32 rank gathers nothing. fp8 expert gathers add the packs
    the step keeps (expert_pack_bytes), and the layer prefetched beside the one computing holds its
    expert stacks as received, 1 byte an element, plus one stack's unpacked copy (rehearsed on K2's
    shapes: the forward's peak, 16.56 GiB against 16.53 so planned). fp8 expert GEMMs keep the
    computing layer's stacks in e4m3 beside it (the gathers' packs, or their one quantisation)."""
    s, blocks = DTYPE_BYTES[run.model.compute_dtype], block_numels(run.model, run.mesh.ep)
    if run.mesh.world == 1:
        return 0 if s == 4 else sum(blocks) * s
    fp8_gathers = run.mesh.expert_gather_dtype == "float8_e4m3fn"
    packs = expert_pack_bytes(run.model, run.mesh.fsdp, run.mesh.ep) if fp8_gathers else 0
    # fp8 expert GEMMs keep a computing layer's stacks in e4m3 too (fnmoe.kernels.fp8_blocks.weight_blocks)
    fp8_gemms = getattr(run.mesh, "expert_gemm_dtype", "compute") == "float8_e4m3fn"
    gemm_blocks = max(expert_numels(run.model, run.mesh.ep)) if fp8_gemms else 0
    if not run.mesh.reshard_after_forward:
        every = sum(expert_numels(run.model, run.mesh.ep)) if fp8_gemms else 0
        return (sum(blocks) + max(blocks)) * s + packs + every
    layer = max(blocks[1:-1])
    experts = max(expert_numels(run.model, run.mesh.ep)) if fp8_gathers else 0
    prefetched = (layer - experts) * s + experts + (_largest_expert(run.model, run.mesh.ep) if experts else 0)
    return max(layer * s + prefetched + gemm_blocks, blocks[0] * s, blocks[-1] * s) + packs


@lru_cache(maxsize=256)
def expert_numels(cfg: ModelConfig, ep: int) -> tuple[int, ...]:
    """Elements of expert stacks a rank holds of each layer (E/ep experts), 0 for a dense layer
    (cached: `plan --search` asks for thousands of layouts of one model)."""
    out = [0] * cfg.n_layers
    for path, shape in leaf_shapes(cfg):
        if path.startswith("layers.") and leaf_kind(path) == "expert":
            out[int(path.split(".")[1])] += math.prod(shape) // ep
    return tuple(out)


@lru_cache(maxsize=256)
def _largest_expert(cfg: ModelConfig, ep: int) -> int:
    return max((math.prod(shape) // ep for path, shape in leaf_shapes(cfg) if leaf_kind(path) == "expert"), default=0)


@lru_cache(maxsize=256)
def expert_pack_bytes(cfg: ModelConfig, fsdp: int, ep: int) -> int:
    """Bytes of a rank's fp8 packs of its expert shards (fnmoe.parallel.fp8.pack, what each fp8 gather
    sends and the step keeps): each shard padded to the gather's rows along its split dim, 1 byte an
    element and 4 a 128x128 block's scale. 0 where fsdp gathers no expert stack."""
    sizes = {"fsdp": fsdp, "ep": ep, sharding.DP: fsdp * ep}
    total = 0
    for path, shape in leaf_shapes(cfg):
        split = dict(sharding.leaf_spec(path, shape, sizes).splits)
        if leaf_kind(path) != "expert" or "fsdp" not in split:
            continue
        d, local = split["fsdp"], [shape[0] // ep, *shape[1:]]
        local[d] = math.ceil(local[d] / fsdp)
        total += math.prod(local) + 4 * fp8.scale_count(tuple(local))
    return total


def unsharded_grad_bytes(run: RunConfig) -> int:
    """The largest gathered leaf's gradient before its reduce-scatter: compute dtype, and the copy
    the reduce-scatter sends (mesh.reduce_dtype)."""
    return largest_leaf(run) * (DTYPE_BYTES[run.model.compute_dtype] + reduce_bytes(run))


def largest_leaf(run: RunConfig, layers: bool = False) -> int:
    """Elements of the largest leaf a rank gathers (expert stacks: its E/ep experts; of the layers'
    only with layers); 0 on one rank."""
    return 0 if run.mesh.world == 1 else _largest(run.model, run.mesh.ep, layers)


@lru_cache(maxsize=256)
def _largest(cfg: ModelConfig, ep: int, layers: bool) -> int:
    return max(math.prod(shape) // (ep if leaf_kind(path) == "expert" else 1) for path, shape in leaf_shapes(cfg)
               if leaf_kind(path) != "buffer" and (path.startswith("layers.") or not layers))


def update_transient_bytes(run: RunConfig) -> int:
    """What the optimizer's update allocates beyond params, gradients and optimizer state, at its peak.

    The functional update (--train.no-donate) makes the new optimizer state, the updates and the new
    params while the old ones, kept until the step is known finite, live: optim + 2 x params; Muon
    also holds the Nesterov blend (fp32) and the bf16 Newton-Schulz iterates of every matrix of the
    rank at once, 1.5 x params more (rehearsed on the 1T and 671B presets).

    The donated update (--train.donate, fnmoe.optim.in_place) runs leaf by leaf in place: one leaf's
    workspace, the largest (_leaf_workspace)."""
    if not run.train.donate:
        states = state_bytes(run)
        return states["optim"] + int((3.5 if run.optim.name == "muon" else 2) * states["params"])
    return _largest_workspace(run.model, run.mesh.fsdp, run.mesh.ep, run.optim.name == "muon",
                              DTYPE_BYTES[run.plan.state_dtype], DTYPE_BYTES[run.optim.ns_dtype])


@lru_cache(maxsize=256)
def _largest_workspace(cfg: ModelConfig, fsdp: int, ep: int, muon: bool, sb: int, nb: int) -> int:
    world = fsdp * ep
    sizes = {"fsdp": fsdp, "ep": ep, sharding.DP: world}
    return max(_leaf_workspace(path, shape, default_label(path, len(shape), muon),
                               sharding.leaf_spec(path, shape, sizes).splits, sizes, sb, nb)
               for path, shape in leaf_shapes(cfg))


def _leaf_workspace(path: str, shape: tuple[int, ...], label: str, splits: tuple, sizes: dict, sb: int,
                    nb: int) -> int:
    """Bytes one leaf's donated update holds at its peak (rehearsed: tests/test_donate.py), n its shard's
    elements, state in sb bytes, Newton-Schulz in nb:
      frozen  the zero update and the new value: 8n
      AdamW   the clipped gradient, the new moments, the step and its denominator, fp32: (12 + 2 sb) n
      Muon, whole matrices on the shard (expert stacks split on E, one rank): the clipped gradient, the
              new momentum, the Nesterov blend (fp32), the batch, iterate and its twin (nb), and the two
              [R, R] products of each of the m matrices (R = min(in, out)): (8 + sb + 3 nb) n + 2 nb m R^2
      Muon, matrices split (dense leaves on a mesh): the same on the shard, its send buffer (nb), and on
              the owner of the most matrices of its group (own of them, each I x O) what it receives,
              makes whole, batches and iterates (5 nb each) and the [R, R] products:
              (8 + sb + nb) n + own (5 nb I O + 2 nb R^2)"""
    n = math.ceil(math.prod(shape) / sizes[sharding.DP])
    if label == "frozen":
        return 8 * n
    if label == "adamw":
        return (12 + 2 * sb) * n
    I, O = shape[-2:]
    R = min(I, O)
    split = [axis for axis, d in splits if d >= len(shape) - 2]
    if not split:
        return (8 + sb + 3 * nb) * n + 2 * nb * (n // (I * O)) * R * R
    local = math.prod(shape[:-2]) // math.prod(sizes[axis] for axis, d in splits if d < len(shape) - 2)
    own = math.ceil(local / sizes[split[0]])
    return (8 + sb + nb) * n + own * (5 * nb * I * O + 2 * nb * R * R)
