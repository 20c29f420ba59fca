"""Activation memory policies: how a block's saved tensors are kept for backward.

`none` keeps everything; `full` recomputes the whole block in backward (torch.utils.checkpoint,
non-reentrant), keeping only its input and the routing; the expert counts a block returns are
read from the forward only.

`offload` (memory.offload) wraps each block but the last in saved-tensor hooks: a saved tensor of
at least memory.offload_min_bytes that is not one of the block's parameters (or a view of one) is
copied into a HostPool and the original is dropped, so its memory is freed until backward unpacks
the copy. With recompute='full' the only such tensor is the block input. The pool is preallocated
host memory (HostPool.buffers, which a memory meter can be told about; pinned on CUDA), filled
through a Copier: on CUDA a side stream with a bound on copies in flight, on CPU copies that finish
at once, behind the same calls, so CPU tests run the code the GPU runs. When backward first needs a
block's tensors they come back to the device, the last saved first, with the block before's behind
them; each device copy is let go after its last unpack, so it lives only while backward uses it.

Per region (memory.attention / moe / mlp): `full` and `selective` are checkpoints with a
selective-checkpoint policy traced into the region's compiled graph; `offload` puts the region's
saved tensors in the pool. Every recompute saves the router's top-k outputs and the expert-parallel
exchange (ROUTING_OPS, EXCHANGE_OPS): backward never routes or communicates again, so routing
cannot change and the counts the router bias learns from are the forward's.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fnmoe import _torch
from fnmoe import compile as fcompile
from fnmoe import reshard
from fnmoe.config import MemoryConfig
from fnmoe.tree import flatten_dict


aten = torch.ops.aten
ROUTING_OPS = frozenset({aten.topk.default})
"""outputs every recompute keeps: routing is decided once, in the forward"""
# not wait_tensor: the FSDP gathers that recompute does repeat are waited by it, and a wait answered
# from the cache would leave their work (holding shards and gathered weights) in c10d for good
EXCHANGE_OPS = frozenset(_torch.all_to_all_ops)
"""the expert-parallel exchange: recompute never repeats communication"""
SELECTIVE_SAVE_OPS = ROUTING_OPS | EXCHANGE_OPS | frozenset(
    getattr(aten, name).default for name in (
        "mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_flex_attention") if hasattr(aten, name))
"""selective recompute keeps matmul and attention outputs and recomputes the cheap elementwise rest
(norms, SwiGLU, RoPE, softmax of the router), as Megatron's and TorchTitan's op-level policies do"""


def _policy(save_ops: frozenset) -> Callable:
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def recompute(fn: Callable, *args, save_ops: frozenset = ROUTING_OPS | EXCHANGE_OPS):
    """fn(*args) keeping only its inputs and the outputs of save_ops for backward (non-reentrant)."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _policy(save_ops)))


def _plain(fn: Callable, *args):
    return fn(*args)


@functools.lru_cache(maxsize=None)   # one function per (region, policy): compiled once each
def with_policy(fn: Callable, policy: str) -> Callable:
    """fn under a recompute policy ('full' or 'selective'), as one function that can be compiled
    (the checkpoint is traced into the region's graph); other policies leave fn as it is."""
    if policy not in ("full", "selective"):
        return fn
    save_ops = SELECTIVE_SAVE_OPS if policy == "selective" else ROUTING_OPS | EXCHANGE_OPS

    @functools.wraps(fn)
    def region(*args):
        return recompute(fn, *args, save_ops=save_ops)
    return region


PIN_UNIT = 2 << 20
"""the pool's size is a multiple of this; its segments are powers of two of at least this size"""


def pool_segments(nbytes: int) -> list[int]:
    """Sizes of the host pool's segments: nbytes rounded up to PIN_UNIT, as powers of two, largest
    first. CUDA's caching host allocator rounds every pinned allocation up to a power of two (a
    40 GiB pool would pin 64 GiB); segments of those sizes pin exactly what was asked."""
    units = -(-max(nbytes, 1) // PIN_UNIT)
    return [PIN_UNIT << b for b in reversed(range(units.bit_length())) if units >> b & 1]


class _Done:
    """A copy that has finished (CPU copies run at once): torch.cuda.Event's API."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = _Done()


class Copier:
    """The pool's copy primitives, the one place that differs by device. CUDA: copies run on a side
    stream and return events; the other stream waits on an event before using a copy. CPU: the same
    calls copy at once and return DONE, so everything around them (the handles' lifecycle, the
    in-flight bound, the reload order) runs the same code on CPU as on CUDA."""

    def __init__(self, device: torch.device | str | None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(torch.device(device)) if self.cuda else None

    def to_host(self, slot: torch.Tensor, t: torch.Tensor):
        """slot <- t; the event of the copy. t's memory may be freed by its owner at once."""
        if not self.cuda:
            slot.copy_(t)
            return DONE
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
        with torch.cuda.stream(self.stream):
            slot.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)  # the allocator keeps t's memory until the copy has read it
        return done

    def to_device(self, host: torch.Tensor, device: torch.device, after) -> tuple[torch.Tensor, object]:
        """(a new device tensor that will hold host's values, the event of that copy), the copy
        started once `after` (the copy into host) is done."""
        # allocated here, on the compute stream: memory from the side stream's pool could not be
        # reused by the compute stream once backward frees it (reserved memory would grow a block)
        back = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        if not self.cuda:
            back.copy_(host)
            return back, DONE
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            back.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        back.record_stream(self.stream)  # freed before the copy ended (never used): not reused early
        return back, ready

    def wait(self, event, device: torch.device) -> None:
        """The compute stream waits for event (nothing to wait for on CPU)."""
        if self.cuda:
            torch.cuda.current_stream(device).wait_event(event)


@dataclasses.dataclass(eq=False)
class Handle:
    """A saved tensor in the pool: its host copy, and while backward needs it its device copy."""
    host: torch.Tensor
    device: torch.device
    done: object  # the device-to-host copy's event
    uses: int = 1  # unpacks still to come (a tensor saved twice is stored once)
    back: torch.Tensor | None = None  # the device copy, from prefetch until the last unpack
    ready: object = None  # the host-to-device copy's event


class HostPool:
    """Host memory that offloaded saved tensors are copied into (a bump allocator over segments,
    rewound at the start of each forward pass, when the previous backward has consumed every copy).

    On CUDA the segments are pinned and copies run on a side stream (Copier), so the forward does
    not wait for them; at most max_inflight_bytes of copies are in flight (the oldest is waited for
    beyond that). On CPU the same code runs with copies that finish at once."""

    def __init__(self, nbytes: int, device: torch.device | str | None = None, max_inflight_bytes: int = 1 << 30):
        self.copier = Copier(device)
        self.buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=self.copier.cuda) for n in pool_segments(nbytes)]
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight: collections.deque = collections.deque()  # (event, bytes) of copies not known done
        self._inflight_bytes = 0
        self.segment, self.offset, self.used = 0, 0, 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def rewind(self) -> None:
        self._wait_inflight(0)
        self.segment, self.offset, self.used = 0, 0, 0

    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    def _wait_inflight(self, room: int) -> None:
        """Forget the copies that have finished; wait for the oldest while room more would pass the bound."""
        while self.inflight and (self.inflight[0][0].query()
                                 or self._inflight_bytes + room > self.max_inflight_bytes):
            event, n = self.inflight.popleft()
            event.synchronize()
            self._inflight_bytes -= n

    def _slot(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        while self.segment < len(self.buffers):
            # 64-byte aligned slots, like the allocator: kernels (and rounding) do not change
            start = -(-self.offset // 64) * 64
            buffer = self.buffers[self.segment]
            if start + n <= buffer.numel():
                self.offset, self.used = start + n, self.used + n
                return buffer[start:start + n].view(t.dtype).as_strided(t.shape, t.stride())
            self.segment, self.offset = self.segment + 1, 0
        raise RuntimeError(f"offload host pool of {self.nbytes} bytes is full; plan it larger "
                           "(fnmoe plan reports offload_host)")

    def store(self, t: torch.Tensor) -> Handle:
        """A copy of t in the pool with its shape, dtype and strides (t must be non-overlapping and
        dense: the same strides keep backward's kernels, and so its rounding, unchanged). The handle
        holds no reference to t."""
        n = t.numel() * t.element_size()
        self._wait_inflight(n)
        slot = self._slot(t)
        done = self.copier.to_host(slot, t)
        self.inflight.append((done, n))
        self._inflight_bytes += n
        return Handle(slot, t.device, done)

    def prefetch(self, handle: Handle) -> None:
        """Start bringing handle back to its device (idempotent while its copy is there)."""
        if handle.back is None:
            handle.back, handle.ready = self.copier.to_device(handle.host, handle.device, handle.done)

    def load(self, handle: Handle) -> torch.Tensor:
        """handle's device tensor for one unpack; after its last unpack the handle lets it go, so
        the tensor lives only as long as backward uses it."""
        self.prefetch(handle)
        self.copier.wait(handle.ready, handle.device)
        back = handle.back
        handle.uses -= 1
        if handle.uses <= 0:
            handle.back = handle.ready = None
        return back


def _dense(t: torch.Tensor) -> bool:
    """t's elements fill a block of numel elements exactly once (any dim order)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _offload_hooks(pool: HostPool, keep: set[int], min_bytes: int, stats: dict, handles: list,
                   on_first_unpack: Callable[[], None]):
    """(pack, unpack) moving saved tensors of >= min_bytes whose storage is not in keep to the pool;
    a tensor saved twice (same storage, view and version) is copied once. handles collects this
    block's handles in the order they were saved; the block's first unpack calls on_first_unpack
    (the runner's reload of this block and the one before it)."""
    copies: dict[tuple, tuple] = {}

    def pack(t: torch.Tensor):
        n = t.numel() * t.element_size()
        # expanded (overlapping) tensors are broadcasts of small ones: not worth a copy
        if (n < min_bytes or t.untyped_storage().data_ptr() in keep or (t.is_leaf and t.requires_grad)
                or not _dense(t)):
            stats["kept"] += n
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype,
               _torch.tensor_version(t))
        seen = copies.get(key)
        if seen is not None and not seen[0].expired():  # the same storage, still alive: the same values
            seen[1].uses += 1
            return seen[1]
        stats["offloaded"] += n
        handle = pool.store(t)  # the handle holds no reference to t: its memory is freed
        copies[key] = (StorageWeakRef(t.untyped_storage()), handle)
        handles.append(handle)
        return handle

    def unpack(handle):
        if not isinstance(handle, Handle):
            return handle
        on_first_unpack()
        return pool.load(handle)

    return pack, unpack


REGIONS = ("attention", "moe", "mlp")


class Runner:
    """A fnmoe.runner.BlockRunner under a MemoryConfig: `runner(i, fn, p, x_BLD, *rest)` runs block
    i under the block policy, and `runner.region(i, name, fn, compile, *args)` one of its regions
    under that region's policy. With reshard (several ranks, --mesh.reshard-after-forward) gathered
    weights are regathered in backward, not kept (fnmoe.reshard), composed with offload where both
    apply. stats[i] holds the kept and offloaded bytes of block i's saved tensors in the latest
    forward (offload only)."""

    def __init__(self, mem: MemoryConfig, n_layers: int, pool: HostPool | None = None, reshard: bool = False):
        offloads = mem.offload or "offload" in (getattr(mem, r) for r in REGIONS)
        if offloads and (pool is None or n_layers < 1):
            raise ValueError("offload needs a HostPool and the model's n_layers")
        self.mem, self.n_layers, self.pool, self.reshard = mem, n_layers, pool, reshard
        # offload knows a block's params by their storages, so its blocks take params already cast:
        # a compiled region casting inside would save the casts, and offload would copy weights
        self.offloads = offloads
        # a block recomputed in backward gathers its weights again there by itself: nothing to
        # reshard, and a gather issued one block early would not be among the ops recompute replays
        self.prefetch = mem.recompute != "full"
        self.stats, self.handles, self.reloaded = {}, {}, set()

    def __call__(self, i: int, fn: Callable, p: dict, x_BLD: torch.Tensor, *rest):
        if i == 0 and self.pool is not None:
            self.pool.rewind()
            self.stats, self.handles, self.reloaded = {}, {}, set()
        inner = recompute if self.mem.recompute == "full" else _plain
        if self.pool is not None and self._offloading(i) and x_BLD.requires_grad:
            x_BLD.register_hook(functools.partial(self._release, i))
        if self.mem.offload and self._offloading(i):
            with self._hooks(i, p, (x_BLD, *rest)):
                return inner(fn, p, x_BLD, *rest)
        if self.reshard and inner is _plain:
            with reshard.hooks():
                return fn(p, x_BLD, *rest)
        return inner(fn, p, x_BLD, *rest)

    def region(self, i: int, name: str, fn: Callable, compile: bool, *args):
        policy = getattr(self.mem, name)
        call = with_policy(fn, policy)
        call = fcompile.compiled(call) if compile else call
        if policy != "offload" or not self._offloading(i):
            return call(*args)
        with self._hooks(i, args[0], args[1:]):
            return call(*args)

    def _offloading(self, i: int) -> bool:
        # the last block's saved tensors are the first backward needs: a copy would only add latency
        return i != self.n_layers - 1 and torch.is_grad_enabled()

    def _hooks(self, i: int, p: dict, args: tuple):
        # params, and inputs every block shares (RoPE tables, masks, buffers), outlive this block:
        # a copy of them would free nothing
        shared = list(flatten_dict(p).values()) + [a for a in args
                                                   if isinstance(a, torch.Tensor) and not a.requires_grad]
        keep = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
                for t in shared if isinstance(t, torch.Tensor)}
        stats = self.stats.setdefault(i, {"kept": 0, "offloaded": 0})
        handles = self.handles.setdefault(i, [])
        offload = _offload_hooks(self.pool, keep, self.mem.offload_min_bytes, stats, handles,
                                 functools.partial(self._reload, i))
        return reshard.hooks(offload) if self.reshard else torch.autograd.graph.saved_tensors_hooks(*offload)

    def _release(self, i: int, grad_BLD=None) -> None:
        """Block i's backward is over (its input's gradient is complete): let go of the device copies
        it did not use, saved for nodes backward never ran (topk's indices, for one, whose values
        take no gradient); a late unpack would bring one back again."""
        for handle in self.handles.get(i, ()):
            handle.back = handle.ready = None

    def _reload(self, i: int) -> None:
        """Block i's backward has begun: bring its saved tensors back, the last saved first (backward
        needs them in reverse), then block i-1's, whose copies then run while block i computes."""
        if i in self.reloaded:
            return
        self.reloaded.add(i)
        for j in (i, i - 1):
            for handle in reversed(self.handles.get(j, ())):
                self.pool.prefetch(handle)


def block_runner(mem: MemoryConfig, n_layers: int = 0, pool: HostPool | None = None,
                 reshard: bool = False) -> Runner | None:
    """The runner for model.hidden_states under this policy (None: fnmoe.runner.PLAIN will do)."""
    plain = mem.recompute == "none" and not mem.offload and all(getattr(mem, r) == "none" for r in REGIONS)
    if plain and not reshard:
        return None
    return Runner(mem, max(n_layers, 1), pool, reshard)


def train_runner(run) -> Runner | None:
    """block_runner for a RunConfig: the host pool sized from the planner's offload bytes (+25%);
    with several ranks and resharding, gathered weights are dropped after forward and gathered again
    in backward."""
    from fnmoe.plan import activation_plan

    mem = run.memory
    offloads = mem.offload or "offload" in (getattr(mem, r) for r in REGIONS)
    device = "cuda" if torch.cuda.is_available() else None  # where training runs (fnmoe.loop's rule)
    pool = HostPool(int(activation_plan(run)["host"] * 1.25) + (1 << 20), device, mem.max_inflight_bytes) \
        if offloads else None
    return block_runner(mem, run.model.n_layers, pool, run.mesh.world > 1 and run.mesh.reshard_after_forward)
