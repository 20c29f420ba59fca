"""The model's paths under torch.func's transforms (vmap, jvp, linearize, grad, vjp).

vmap and forward-mode AD (jvp, linearize, torch.autograd.forward_ad) run every op batched or
with tangents, and the fast paths cannot take that: the expert GEMMs' groups are ragged (each
batch member routes its own way) and padded/loop read counts on the host, fnmoe's C++ CPU ops have
no batching or forward-AD rules, SDPA's CPU flash kernel has no forward AD. Under those transforms
the model runs composite paths instead: attention as math (softmax of q·k, `attention_impl="math"`)
and the experts dense (every expert on every token, weighted by the routing: `moe.impl="dense"`,
E/K times the routed FLOPs). So does grad of grad: the fast paths' backward (SDPA's flash kernel,
the C++ ops) has no derivative of its own. Compiled regions run eager under any transform (dynamo
traces functorch's wrappers only partly). One grad or vjp keeps the fast paths: their autograd
Functions compose with it. Reverse-over-reverse through plain autograd (create_graph=True) cannot
be seen at forward time: set the composite paths in the config for it. `hidden_states` decides
once per call, outside compiled code, and says so once. Sharded (DTensor) params do not compose
with the transforms: `check_transformable` says so.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch.distributed.tensor import DTensor

from fnmoe import _torch, caches
from fnmoe.compile import say_once
from fnmoe.config import ModelConfig

BATCHING = ("vmap", "jvp", "forward_ad")
"""transforms that need the composite paths (as do two nested grads)"""


# dynamo cannot trace functorch's interpreter stack: a compiled caller (torch.compile(fnmoe.forward))
# takes it while it traces, and dynamo compiles again under other transforms (it guards them)
@torch.compiler.assume_constant_result
def active() -> tuple[str, ...]:
    """The torch.func transforms around this call (see fnmoe._torch.functorch_transforms)."""
    return _torch.functorch_transforms()


def model_config(cfg: ModelConfig) -> ModelConfig:
    """cfg as the model runs it under the active transforms: itself when none is active."""
    names = active()
    if not names:
        return cfg
    composite = any(n in BATCHING for n in names) or names.count("grad") > 1
    run = _under(cfg, composite)
    if run is not cfg:
        say_once("under torch.func's transforms the model runs "
                 + ("math attention and dense experts (every expert on every token), " if composite else "")
                 + "compiled regions eager")
    return run


@caches.register
@functools.cache
def _under(cfg: ModelConfig, composite: bool) -> ModelConfig:  # one object per pair: stable for the caches
    if not composite:
        return dataclasses.replace(cfg, compile=False) if cfg.compile else cfg
    moe = dataclasses.replace(cfg.moe, impl="dense") if cfg.moe.n_experts else cfg.moe
    return dataclasses.replace(cfg, compile=False, attention_impl="math", moe=moe)


def check_transformable(leaf) -> None:
    """Raise if a transform is active over sharded params (leaf: one of them, maybe wrapped by a transform)."""
    names = active()
    if names and isinstance(_torch.unwrapped(leaf), DTensor):
        raise ValueError(
            f"torch.func transforms ({', '.join(names)}) do not run over sharded params (DTensor leaves, "
            "under a mesh): their collectives and placements have no batching or forward-AD rules. "
            "Run the transform over a single-process params tree (e.g. the checkpoint loaded without a mesh).")
