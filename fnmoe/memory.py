"""Activation memory policies: how a block's saved tensors are kept for backward.

`none` keeps everything; `full` recomputes the whole block in backward (torch.utils.checkpoint,
non-reentrant), keeping only its input. Routing is recomputed from the same inputs and weights,
so it cannot change; the expert counts a block returns are read from the forward only.

`offload` (memory.offload) wraps each block but the last in saved-tensor hooks: a saved tensor of
at least memory.offload_min_bytes that is not one of the block's parameters (or a view of one) is
copied into a HostPool and the original is dropped, so its memory is freed until backward unpacks
the copy. With recompute='full' the only such tensor is the block input. On CPU the pool is one
preallocated buffer, which a memory meter can be told about (HostPool.buffer); a CUDA pool would be
pinned and filled on a side stream (not built yet: offload raises on CUDA).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from fnmoe.config import MemoryConfig
from fnmoe.tree import flatten_dict


def _recompute(fn: Callable, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _plain(fn: Callable, *args):
    return fn(*args)


class HostPool:
    """A preallocated host buffer that offloaded saved tensors are copied into (a bump allocator,
    rewound at the start of each forward pass, when the previous backward has consumed every copy)."""

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.offset = 0

    def rewind(self) -> None:
        self.offset = 0

    def store(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t in the pool with its shape, dtype and strides (t must be non-overlapping and
        dense): the same strides keep backward's kernels, and so its rounding, unchanged."""
        n = t.numel() * t.element_size()
        start = -(-self.offset // 64) * 64  # 64-byte aligned slots, like the allocator: kernels (and rounding) do not change
        if start + n > self.buffer.numel():
            raise RuntimeError(f"offload host pool of {self.buffer.numel()} bytes is full; plan it larger "
                               "(fnmoe plan reports offload_host)")
        self.offset = start + n
        return self.buffer[start:start + n].view(t.dtype).as_strided(t.shape, t.stride()).copy_(t)


def _dense(t: torch.Tensor) -> bool:
    """t's elements fill a block of numel elements exactly once (any dim order)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _offload_hooks(pool: HostPool, keep: set[int], min_bytes: int, stats: dict):
    """(pack, unpack) moving saved tensors of >= min_bytes whose storage is not in keep to the pool."""
    def pack(t: torch.Tensor):
        n = t.numel() * t.element_size()
        # expanded (overlapping) tensors are broadcasts of small ones: not worth a copy
        if (n < min_bytes or t.untyped_storage().data_ptr() in keep or (t.is_leaf and t.requires_grad)
                or not _dense(t)):
            stats["kept"] += n
            return t
        stats["offloaded"] += n
        return pool.store(t)  # the handle holds no reference to t: its memory is freed

    return pack, lambda t: t


def block_runner(mem: MemoryConfig, n_layers: int = 0, pool: HostPool | None = None) -> Callable | None:
    """The block_fn for model.hidden_states under this policy (None: plain call). Offload needs
    n_layers (the last block stays) and a pool; runner.stats[i] has the kept and offloaded bytes of
    block i in the latest forward."""
    inner = {"none": _plain, "full": _recompute}[mem.recompute]
    if not mem.offload:
        return None if mem.recompute == "none" else inner
    if pool is None or n_layers < 1:
        raise ValueError("memory.offload=true needs a HostPool and the model's n_layers")
    calls = [0]
    stats: dict[int, dict] = {}

    def run(fn: Callable, p: dict, *args):
        i = calls[0] % n_layers
        calls[0] += 1
        if i == 0:
            pool.rewind()
        if i == n_layers - 1 or not torch.is_grad_enabled():
            return inner(fn, p, *args)
        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            raise NotImplementedError("memory.offload on CUDA (pinned pool, side stream) is not built yet")
        # params, and inputs every block shares (RoPE tables, buffers), outlive this block: a copy
        # of them would free nothing
        shared = [t for t in flatten_dict(p).values()] + [
            a for a in args if isinstance(a, torch.Tensor) and not a.requires_grad]
        keep = {t.untyped_storage().data_ptr() for t in shared}
        stats[i] = {"kept": 0, "offloaded": 0}
        with torch.autograd.graph.saved_tensors_hooks(*_offload_hooks(pool, keep, mem.offload_min_bytes, stats[i])):
            return inner(fn, p, *args)

    run.stats = stats
    return run


def train_runner(run) -> Callable | None:
    """block_runner for a RunConfig: the host pool sized from the planner's offload bytes (+25%)."""
    from fnmoe.plan import activation_plan

    mem = run.memory
    regions = [f"memory.{r}={getattr(mem, r)!r}" for r in ("attention", "moe", "mlp") if getattr(mem, r) != "none"]
    if regions:
        raise ValueError(f"{', '.join(regions)}: per-region policies are planned (fnmoe plan) but not run yet; "
                         "use memory.recompute and memory.offload")
    if not mem.offload:
        return block_runner(mem)
    pool = HostPool(int(activation_plan(run)["host"] * 1.25) + (1 << 20))
    return block_runner(mem, run.model.n_layers, pool)
