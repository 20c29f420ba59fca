"""Activation memory policies: how a block's saved tensors are kept for backward.

`none` keeps everything; `full` recomputes the whole block in backward (torch.utils.checkpoint,
non-reentrant), keeping only its input, the routing and the EP exchange's outputs; the expert
counts a block returns are read from the forward only. With memory.keep_exchange off the recompute
sends the exchange's rows again (dispatch and combine: 6 all-to-all passes a MoE layer against 4)
and keeps only the routing and the count exchange's output (S·X integers), so the splits, and with
them every rank's sequence of collectives, are the forward's. The flag is the block policy's only:
region policies (below) always keep the exchange (a replayed collective inside a compiled region's
recompute would be ordered by the compiler's partitioner, and `selective` keeps the expert GEMM's
input, the permuted exchange rows, anyway).

`offload` (memory.offload) wraps each block but the last in saved-tensor hooks: a saved tensor of
at least memory.offload_min_bytes that is not one of the block's parameters (or a view of one) is
copied into a HostPool and the original is dropped, so its memory is freed until backward unpacks
the copy. With recompute='full' the block keeps its input (through the hooks) and what its recompute
replays (the routing, the exchange's outputs: _Kept), both in the pool. The pool (fnmoe.memory.host_pool)
is preallocated host memory filled through a Copier, on CUDA a side stream with a bound on copies
in flight, on CPU copies that finish at once, behind the same calls. When backward first needs a
block's tensors they come back to the device, the last saved first, with the block before's behind
them; each device copy is let go after its last unpack, so it lives only while backward uses it.

Per region (memory.attention / moe / mlp): `full` and `selective` are checkpoints with a
selective-checkpoint policy traced into the region's compiled graph; `offload` puts the region's
saved tensors in the pool. Every recompute saves the router's top-k outputs and the expert-parallel
exchange (ROUTING_OPS, EXCHANGE_OPS): backward never routes or communicates again (but the exchange's
rows under `full` without keep_exchange), so routing cannot change and the counts the router bias
learns from are the forward's.
"""
from __future__ import annotations

import collections
import functools
import math
from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fnmoe import _torch, caches

from fnmoe.models import transforms
from fnmoe.kernels import fp8_gemm
from fnmoe import compile as fcompile
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import replay, reshard
from fnmoe.config import REGIONS, MemoryConfig
from fnmoe.memory.host_pool import Handle, HostPool
from fnmoe.models.seams import Chunking
from fnmoe._torch import TorchDispatchMode
from fnmoe.tree import flatten_dict, tree_map


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
    """fn(*args) keeping only its inputs and the outputs of save_ops for backward (non-reentrant).
    Gathered weights among the inputs are held weakly and gathered again by the recompute
    (reshard.weak_args); traced into a compiled region, the graph's saved inputs meet reshard's
    hooks instead."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, _policy(save_ops))
    held = None if torch.compiler.is_compiling() else reshard.weak_args(args)
    if held is not None:
        return checkpoint(lambda *a: fn(*reshard.strong_args(a)), *held, use_reentrant=False, context_fn=context_fn)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)


class _Kept:
    """The outputs of save_ops that a block's recompute takes instead of running them again, by op
    and call order. With a pool, each dense tensor of at least min_bytes is kept as a host copy (a
    Handle in `handles`, which the runner's reload prefetches) until backward takes it back: torch's
    selective-checkpoint cache holds its tensors where no saved-tensor hook sees them, so offload
    could not move them (rehearsed: the exchange's outputs, 4.2 GB a MoE layer of the 1T preset)."""

    def __init__(self, save_ops: frozenset, pool: HostPool | None = None, min_bytes: int = 0,
                 handles: list | None = None, stats: dict | None = None, replay_exchange: bool = False):
        self.save_ops, self.pool, self.min_bytes = save_ops, pool, min_bytes
        self.replay_exchange = replay_exchange
        self.handles = handles if handles is not None else []
        self.stats = stats if stats is not None else {"kept": 0, "offloaded": 0}
        self.outputs: dict = collections.defaultdict(list)

    def kept(self, func, args) -> bool:
        """Whether func's output is kept (else the recompute runs it again). The same answer in the
        forward and the recompute: it reads only the inputs' dtype, which recompute reproduces."""
        if func not in self.save_ops:
            return False
        # rows of tokens (floating) are the exchange's bulk; its counts (integers) are tiny and set the
        # splits, so they stay kept: no count exchange and no host sync on it again in backward
        return not (self.replay_exchange and func in EXCHANGE_OPS and args[0].is_floating_point())

    def keep(self, func, out) -> None:
        if self.pool is not None and func in EXCHANGE_OPS:
            # a collective's output is written by its backend (NCCL's stream, gloo's thread) until it is
            # waited for: the copy to the host may only read it after (waiting twice is harmless)
            out = tree_map(lambda x: _torch.funcol.wait_tensor(x) if isinstance(x, torch.Tensor) else x, out)
        self.outputs[func].append(tree_map(self._pack, out))

    def _pack(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        x, n = x.detach(), x.numel() * x.element_size()
        if self.pool is None or n < self.min_bytes or not _dense(x):
            self.stats["kept"] += n
            return x
        self.stats["offloaded"] += n
        handle = self.pool.store(x)
        self.handles.append(handle)
        return handle

    def take(self, func, i: int):
        """The i-th kept output of func, let go of here: backward's graph holds it while it needs it."""
        out, self.outputs[func][i] = self.outputs[func][i], None
        return tree_map(lambda x: self.pool.load(x) if isinstance(x, Handle) else x, out)


class _Keeping(TorchDispatchMode):
    """The forward of a recomputed block: save_ops' outputs go to _Kept."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # as torch's selective-checkpoint modes
        return True

    def __init__(self, kept: _Kept):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.kept.kept(func, args):
            self.kept.keep(func, out)
        return out


class _Replaying(TorchDispatchMode):
    """The recompute in backward: what _Kept kept is answered from it, in the forward's call order;
    the rest runs again (the exchange's rows too, without memory.keep_exchange, on the ep group's
    replay group: fnmoe.parallel.replay)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, kept: _Kept):
        super().__init__()
        self.kept, self.calls = kept, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in EXCHANGE_OPS and not self.kept.kept(func, args):
            # a replayed exchange runs on its own group: it never queues on the ep group ahead of a
            # gradient backward waits for (autograd sends those on the group it was given)
            args = (*args[:3], replay.replay_group_name(args[3]), *args[4:])
        if not self.kept.kept(func, args):
            return func(*args, **(kwargs or {}))
        self.calls[func] += 1
        return self.kept.take(func, self.calls[func] - 1)


def recompute_block(fn: Callable, *args, kept: _Kept):
    """recompute for a whole block, its kept outputs in `kept` (on the host with a pool)."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (_Keeping(kept), _Replaying(kept)))


def _plain(fn: Callable, *args):
    return fn(*args)


@caches.register
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


def _dense(t: torch.Tensor) -> bool:
    """t's elements fill a block of numel elements exactly once (any dim order)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Fp8Handle:
    """A saved tensor kept in the pool as e4m3 rows with a float32 scale a 1x128 tile (its last dim the rows'
    elements): unpacked as their dequantised values, in its dtype and shape."""

    def __init__(self, pool: HostPool, t: torch.Tensor, handles: list):
        q, s = fp8_gemm.quantise_rows(t.reshape(-1, t.shape[-1]))
        self.q, self.s, self.shape, self.dtype = pool.store(q), pool.store(s), t.shape, t.dtype
        handles += [self.q, self.s]

    def add_use(self) -> None:
        self.q.uses += 1
        self.s.uses += 1

    def load(self, pool: HostPool) -> torch.Tensor:
        return fp8_gemm.dequantise_rows(pool.load(self.q), pool.load(self.s)).to(self.dtype).view(self.shape)


def _offload_hooks(pool: HostPool, keep: set[int], min_bytes: int, stats: dict, handles: list,
                   on_first_unpack: Callable[[], None], fp8_inputs: frozenset = frozenset()):
    """(pack, unpack) moving saved tensors of >= min_bytes whose storage is not in keep to the pool;
    a tensor saved twice (same storage, view and version) is copied once. handles collects this
    block's handles in the order they were saved; the block's first unpack calls on_first_unpack
    (the runner's reload of this block and the one before it). A floating tensor whose storage is in
    fp8_inputs (the block's input, under memory.offload_dtype) goes in e4m3 (_Fp8Handle)."""
    copies: dict[tuple, tuple] = {}

    def pack(t: torch.Tensor):
        n = t.numel() * t.element_size()
        # expanded (overlapping) tensors are broadcasts of small ones: not worth a copy
        # a gathered weight is the block's params in compute form (saved whole by a chunked block)
        if (n < min_bytes or _torch.storage_key(t) in keep or (t.is_leaf and t.requires_grad)
                or not _dense(t) or reshard.is_gathered(t)):
            stats["kept"] += n
            return t
        # a size that differs by rank (simulated ranks: a symbolic int) has no hash: no dedup then
        sized = not any(isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride()))
        key = (_torch.storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
               _torch.tensor_version(t)) if sized else None
        seen = copies.get(key)
        if seen is not None and not seen[0].expired():  # the same storage, still alive: the same values
            if isinstance(seen[1], _Fp8Handle):
                seen[1].add_use()
            else:
                seen[1].uses += 1
            return seen[1]
        if _torch.storage_key(t) in fp8_inputs and t.is_floating_point():
            handle = _Fp8Handle(pool, t, handles)
            stats["offloaded"] += pool_bytes_of(handle)
        else:
            stats["offloaded"] += n
            handle = pool.store(t)  # the handle holds no reference to t: its memory is freed
            handles.append(handle)
        if sized:
            copies[key] = (StorageWeakRef(t.untyped_storage()), handle)
        return handle

    def unpack(handle):
        if isinstance(handle, _Fp8Handle):
            on_first_unpack()
            return handle.load(pool)
        if not isinstance(handle, Handle):
            return handle
        on_first_unpack()
        return pool.load(handle)

    return pack, unpack


def pool_bytes_of(handle: _Fp8Handle) -> int:
    """The bytes an fp8 block input takes in the pool: its e4m3 rows and their scales."""
    return sum(math.prod(h.like[0]) * h.like[2].itemsize for h in (handle.q, handle.s))


def offloads(mem: MemoryConfig) -> bool:
    """Whether mem copies saved tensors to the host pool (the block policy's or a region's offload)."""
    return mem.offload or "offload" in (getattr(mem, r) for r in REGIONS)


class Runner:
    """A fnmoe.models.seams.BlockRunner under a MemoryConfig: `runner(i, fn, p, x_BLD, *rest)` runs block
    i under the block policy, and `runner.region(i, name, fn, compile, *args)` one of its regions
    under that region's policy. With reshard (several ranks, --mesh.reshard-after-forward) gathered
    weights are regathered in backward, not kept (fnmoe.parallel.reshard), composed with offload where both
    apply. stats[i] holds the kept and offloaded bytes of block i's saved tensors in the latest
    forward (offload only)."""

    def __init__(self, mem: MemoryConfig, n_layers: int, pool: HostPool | None = None, reshard: bool = False):
        if offloads(mem) and (pool is None or n_layers < 1):
            raise ValueError("offload needs a HostPool and the model's n_layers (a run's pool: "
                             "train_runner(run, fnmoe.plan.activations.pool_bytes(run)))")
        self.mem, self.n_layers, self.pool, self.reshard = mem, n_layers, pool, reshard
        # offload knows a block's params by their storages, so its blocks take params already cast:
        # a compiled region casting inside would save the casts, and offload would copy weights
        self.offloads = offloads(mem)
        self.stats, self.handles, self.reloaded = {}, {}, set()

    def begin(self) -> None:
        """A micro-batch's forward begins (fnmoe.training.step's step calls it): the pool is rewound (the
        previous backward is over, and its copies with it) and the per-block bookkeeping starts afresh."""
        if self.pool is not None:
            self.pool.rewind()
            self.stats, self.handles, self.reloaded = {}, {}, set()

    def __call__(self, i: int, fn: Callable, p: dict, x_BLD: torch.Tensor, *rest):
        if self.mem.recompute == "full" or self.mem.offload or self.reshard:
            _check_untransformed()
        inner = _plain
        chunked = self.block_chunks(i) is not None
        if self.mem.recompute == "full" and not chunked:  # the chunks recompute themselves (fnmoe.models.block_chunks)
            inner = functools.partial(recompute_block, kept=self._kept(i))
        if self.pool is not None and self._offloading(i) and x_BLD.requires_grad:
            x_BLD.register_hook(functools.partial(self._release, i))
        if self.mem.offload and self._offloading(i):
            with self._hooks(i, p, (x_BLD, *rest)):
                return inner(fn, p, x_BLD, *rest)
        if self.reshard and (self.mem.recompute != "full" or chunked):
            with reshard.hooks():
                return inner(fn, p, x_BLD, *rest)
        return inner(fn, p, x_BLD, *rest)

    def _kept(self, i: int) -> _Kept:
        """A new record of what block i's recompute takes back (routing, the exchange), in the pool
        where the block offloads."""
        pool = self.pool if self.mem.offload and self._offloading(i) else None
        return _Kept(ROUTING_OPS | EXCHANGE_OPS, pool, self.mem.offload_min_bytes,
                     *((self.handles.setdefault(i, []), self.stats.setdefault(i, {"kept": 0, "offloaded": 0}))
                       if pool else (None, None)), replay_exchange=not self.mem.keep_exchange)

    def block_chunks(self, i: int) -> Chunking | None:
        """fnmoe.models.seams.BlockRunner.block_chunks: memory.block_chunks > 1 under full recompute, while
        gradients are taken (a forward without them runs whole); each chunk keeps its own routing and
        exchange (in the pool where the block offloads)."""
        n = self.mem.block_chunks
        if n == 1 or self.mem.recompute != "full" or not torch.is_grad_enabled():
            return None

        def modes():
            kept = self._kept(i)
            return _Keeping(kept), _Replaying(kept)
        return Chunking(n, modes)

    def region(self, i: int, name: str, fn: Callable, compile: bool, *args):
        policy = getattr(self.mem, name)
        if policy != "none":
            _check_untransformed()
        call = with_policy(fn, policy)
        call = fcompile.compiled(call) if compile else call
        if policy != "offload" or not self._offloading(i):
            return call(*args)
        with self._hooks(i, args[0], args[1:]):
            return call(*args)

    def chunk_recompute(self, i: int) -> str | None:
        """fnmoe.models.seams.BlockRunner.chunk_recompute: the MoE region's chunks are recomputed one
        at a time under full recompute (the block's or the region's); the region's checkpoint keeps the
        exchange's outputs, the block's unless --memory.no-keep-exchange. Selective recompute keeps the
        matmuls the chunks would recompute: its chunks run as they are."""
        if self.block_chunks(i) is not None:  # a block chunk's MoE runs its token chunks as they are
            return None
        if self.mem.recompute == "full":
            return "keep" if self.mem.keep_exchange else "replay"
        return "keep" if self.mem.moe == "full" else None

    def _offloading(self, i: int) -> bool:
        # the last block's saved tensors are the first backward needs: a copy would only add latency
        return i != self.n_layers - 1 and torch.is_grad_enabled()

    def _hooks(self, i: int, p: dict, args: tuple):
        # params, and inputs every block shares (RoPE tables, masks, buffers, the router's state: a
        # dict), outlive this block: a copy of them would free nothing
        shared = list(flatten_dict(p).values()) + [a for a in args
                                                   if isinstance(a, torch.Tensor) and not a.requires_grad]
        shared += [t for a in args if isinstance(a, dict) for t in flatten_dict(a).values()]
        keep = {_torch.storage_key(t.to_local() if isinstance(t, DTensor) else t)
                for t in shared if isinstance(t, torch.Tensor)}
        stats = self.stats.setdefault(i, {"kept": 0, "offloaded": 0})
        handles = self.handles.setdefault(i, [])
        # the block's input: the first of args (memory.offload_dtype keeps it in fp8)
        fp8_inputs = frozenset({_torch.storage_key(args[0])} if self.mem.offload_dtype != "compute" else ())
        offload = _offload_hooks(self.pool, keep, self.mem.offload_min_bytes, stats, handles,
                                 functools.partial(self._reload, i), fp8_inputs)
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


def _check_untransformed() -> None:
    """Raise under torch.func's transforms: checkpoints and saved-tensor hooks have no batching rule
    (offload reads storages a vmapped tensor has not) and torch.func's grad refuses them."""
    names = transforms.active()
    if names:
        raise ValueError(f"memory policies (recompute, offload, resharding) do not run under torch.func's "
                         f"transforms ({', '.join(names)}): pass runner=None (fnmoe.models.seams.PLAIN) inside "
                         "the transform")


def block_runner(mem: MemoryConfig, n_layers: int = 0, pool: HostPool | None = None,
                 reshard: bool = False) -> Runner | None:
    """The runner for model.hidden_states under this policy (None: fnmoe.models.seams.PLAIN will do)."""
    plain = mem.recompute == "none" and not offloads(mem) and all(getattr(mem, r) == "none" for r in REGIONS)
    if plain and not reshard:
        return None
    return Runner(mem, max(n_layers, 1), pool, reshard)


def regathers(run) -> bool:
    """Whether run's gathered weights are dropped after forward and gathered again in backward:
    several ranks with --mesh.reshard-after-forward."""
    return run.mesh.world > 1 and run.mesh.reshard_after_forward


def train_runner(run, pool_bytes: int = 0) -> Runner:
    """The runner of run's training step under run.memory, its host pool of pool_bytes (sized where
    the step is built: fnmoe.plan.activations.pool_bytes; 0 when nothing is offloaded) on the device
    training runs on; with regathers(run), resharding."""
    mem = run.memory
    device = fdist.compute_device(run.dist, run.mesh.world)  # where training runs (fnmoe.training.loop's rule)
    device = device if device.type == "cuda" else None
    pool = HostPool(pool_bytes, device, mem.max_inflight_bytes) if pool_bytes and offloads(mem) else None
    return Runner(mem, max(run.model.n_layers, 1), pool, regathers(run))
