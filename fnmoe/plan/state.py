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
from fnmoe.params import leaf_inits
from fnmoe.optim.base import default_label
from fnmoe.tree import flatten_dict, leaf_kind

MASTER_BYTES = GRAD_BYTES = 4  # fp32 master params and fp32 reduce-scattered gradients
GB = 1e9


@lru_cache(maxsize=16)
def leaf_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(dotted path, shape) of every leaf; cached, since flattening a 1T tree takes milliseconds and
    `fnmoe plan --search` plans hundreds of layouts of one model."""
    return tuple((path, tuple(init.shape)) for path, init in flatten_dict(leaf_inits(cfg)).items())


def state_bytes(run: RunConfig) -> dict:
    """Per-rank bytes of fp32 master params, fp32 grads (twice with gradient accumulation: the sum
    and a micro-batch's) and optimizer state (every leaf sharded over all fsdp·ep ranks)."""
    params, grads, optim = _state_elems(run.model, run.mesh.world, run.optim.name == "muon")
    sb = DTYPE_BYTES[run.plan.state_dtype]
    # with micro-batches, each later backward's gradients live beside their running sum
    return {"params": params * MASTER_BYTES, "grads": grads * GRAD_BYTES * (2 if run.train.grad_accum > 1 else 1),
            "optim": optim * sb}


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
    the embedding or head alone. One fp32 rank gathers nothing."""
    s, blocks = DTYPE_BYTES[run.model.compute_dtype], block_numels(run.model, run.mesh.ep)
    if run.mesh.world == 1:
        return 0 if s == 4 else sum(blocks) * s
    if not run.mesh.reshard_after_forward:
        return (sum(blocks) + max(blocks)) * s
    return max(2 * max(blocks[1:-1]), blocks[0], blocks[-1]) * s


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
