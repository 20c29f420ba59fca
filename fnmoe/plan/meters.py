"""Meters for one rank's training step, as dispatch modes: the bytes it holds by category, and the
bytes its collectives send. `fnmoe rehearse` runs them over fake tensors; tests/test_mesh_memory.py
runs the collective meter on a real gloo mesh.

Legend: none (no tensor names here).

StorageMeter keeps, for every storage an op makes while it is active, a weak reference whose
callback subtracts its bytes when autograd or the caller frees it (as torch's MemTracker does), so
the running total is exact after every op and the peak costs nothing to keep. A storage's category
is decided when it is made, from the op and the step's phase:

  phase forward   all-gather outputs and what an fp8 gather makes (fnmoe.parallel.fp8: its packs,
                  kept for the step, and its dequantised stacks): gathered; all-to-all outputs:
                  ep_buffers; a tensor whose last dim is the vocabulary: logits; anything else:
                  activations (what is still alive when backward starts is what the forward saved)
  phase backward  (autograd's engine running) reduce-scatter outputs: grads; gathers, all-to-alls
                  and logits as in forward; anything else: backward (recomputed activations and the
                  activation gradients of the block running, which recompute policies bound)
  phase update    optim (the optimizer's temporaries and its new state)
  any phase       what the CPU emulation of an fp8 expert GEMM makes (fnmoe.kernels.fp8_gemm.emulating:
                  its float32 operands and output, which a GPU's scaled GEMM never makes): emulation

The phase is set by fnmoe.models.seams.mark (fnmoe.training.step calls it at each micro-batch and before the update;
a meter listens while it runs, and without one it does nothing). Tensors made before the meter
starts are registered with `track`.

CommMeter counts the _c10d_functional collectives (DTensor's redistribute and fnmoe's all-to-alls
run on them) by kind, mesh axis and dtype: bytes a rank sends under ring accounting (an all-gather
sends its input to g-1 peers, a reduce-scatter (g-1)/g of its input, an all-to-all every split but
its own, an all-reduce 2(g-1)/g) and the number of calls.
"""
from __future__ import annotations

import collections
import math
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fnmoe import _torch

from fnmoe.models import seams
from fnmoe.parallel import dist as fdist
from fnmoe.kernels import fp8_gemm
from fnmoe.parallel import fp8
from fnmoe._torch import TorchDispatchMode, is_traceable_wrapper_subclass
from fnmoe.tree import tree_leaves

PHASE_CATEGORY = {"forward": "activations", "grads": "grads", "update": "optim"}
CATEGORIES = ("params", "grads", "optim", "gathered", "activations", "backward", "logits", "ep_buffers", "emulation")
def plain_tensors(tree) -> list[torch.Tensor]:
    """The plain tensors of tree's leaves, wrapper subclasses (DTensor, AsyncCollectiveTensor) unwrapped."""
    out = []
    for t in tree_leaves(tree):
        if is_traceable_wrapper_subclass(t):
            out += plain_tensors([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        elif isinstance(t, torch.Tensor):
            out.append(t)
    return out


def _c10d():
    return _torch.c10d_ops


def _collective_kind(name: str) -> str | None:
    """The category of a collective's output from its op or call-site name."""
    name = name.replace("-", "_")
    for part, category in (("all_to_all", "ep_buffers"), ("all_gather", "gathered"), ("reduce_scatter", "grads")):
        if part in name:
            return category
    return None


class PhaseMeter(TorchDispatchMode):
    """A dispatch mode that the step's phase marks (fnmoe.models.seams.mark) reach while it is active."""

    def __enter__(self):
        seams.listen(self)
        return super().__enter__()

    def __exit__(self, *exc):
        seams.unlisten(self)
        return super().__exit__(*exc)

    def marked(self, phase: str, tree) -> None:
        self.phase = phase


class StorageMeter(PhaseMeter):
    """Live and peak bytes by category of the storages made while active (and those tracked)."""

    def __init__(self, logits_shape: tuple[int, ...] = ()):
        super().__init__()
        self.logits_shape, self.phase = tuple(logits_shape), "forward"
        self.live: collections.Counter = collections.Counter()
        self.top: collections.Counter = collections.Counter()  # each category's own peak
        self.top_at: dict[str, int] = {}  # when (the count of storages made so far) it was reached
        self.made = 0
        self.total = self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._info: dict[int, list] = {}  # storage -> [bytes, category, weak reference, when made]
        self.at_backward: dict[str, int] | None = None  # live bytes when the first backward began
        self._excluded: set[int] = set()

    def marked(self, phase: str, tree) -> None:
        """From now on in phase; tree's storages (a phase's gradients) count as the phase's category."""
        self.phase = phase
        if tree is not None:
            self.track(tree, PHASE_CATEGORY[phase])

    def track(self, tree, category: str) -> None:
        """Count tree's storages as category from now on (params and optimizer state made before the
        meter started; a step's gradients once they are whole)."""
        for t in plain_tensors(tree):
            st = t.untyped_storage()
            info = self._info.get(_torch.storage_key(st))
            if info is None:
                self._add(st, category)
            elif info[1] != category:
                # made before the old category's peak and alive since: that peak counted it
                if info[3] <= self.top_at.get(info[1], -1):
                    self.top[info[1]] -= info[0]
                self.live[info[1]] -= info[0]
                info[1] = category
                self._grow(category, info[0])

    def exclude(self, tree) -> None:
        """Never count tree's storages (a host pool's buffers: host memory, not device)."""
        self._excluded |= {_torch.storage_key(t) for t in plain_tensors(tree)}

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        key = _torch.storage_key(st)
        if key in self._info or key in self._excluded:
            return
        n = st.nbytes()
        self.made += 1
        self._info[key] = info = [n, category, None, self.made]
        info[2] = weakref.ref(st, lambda _, key=key: self._free(key))
        self._grow(category, n)
        if category == "emulation":  # not a GPU's: outside the device total and its peak
            return
        self.total += n
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.live)

    def _grow(self, category: str, n: int) -> None:
        self.live[category] += n
        if self.live[category] > self.top[category]:
            self.top[category], self.top_at[category] = self.live[category], self.made

    def _free(self, key: int) -> None:
        info = self._info.pop(key, None)
        if info is not None:
            self.live[info[1]] -= info[0]
            self.total -= info[0] if info[1] != "emulation" else 0

    def _category(self, func, t: torch.Tensor) -> str:
        if fp8_gemm.emulating():
            return "emulation"
        if self.phase != "forward":
            return PHASE_CATEGORY[self.phase]
        backward = _torch.in_backward()
        if backward and self.at_backward is None:
            self.at_backward = dict(self.live)
        if fp8.making():
            return "gathered"
        if func.namespace.startswith("_c10d_functional"):
            # a collective's output met first at its wait: the call site named it (fnmoe.parallel.dist.entering)
            kind = _collective_kind(func._opname if func._opname != "wait_tensor" else fdist.last_entered())
            if kind == "ep_buffers" and not backward:
                return "activations"  # the forward's exchange outputs: saved (recompute keeps them) or soon freed
            if kind:
                return kind
        if tuple(t.shape) == self.logits_shape:
            return "logits"
        return "backward" if backward else "activations"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # DTensor runs its local ops, which come back here (as in MemTracker)
            return NotImplemented
        if func is _c10d().wait_tensor.default and _torch.is_fake(args[0]):
            return args[0]  # what a real backend's wait returns (fake tensors' wait makes a new tensor)
        out = func(*args, **(kwargs or {}))
        fresh = [t for t in plain_tensors(out) if _torch.storage_key(t) not in self._info]
        if fresh and not _torch.in_sharding_propagation():
            for t in fresh:
                self._add(t.untyped_storage(), self._category(func, t))
        return out

    def report(self) -> dict:
        return {"peak": self.peak, "at_peak": {c: self.at_peak.get(c, 0) for c in CATEGORIES},
                "at_backward": {c: (self.at_backward or {}).get(c, 0) for c in CATEGORIES},
                "category_peak": {c: self.top[c] for c in CATEGORIES},
                "end": {c: self.live[c] for c in CATEGORIES}}


class CommMeter(PhaseMeter):
    """Bytes sent and calls of each (kind, axis, dtype) of collective; axes: {group name: axis}."""

    def __init__(self, axes: dict[str, str] | None = None):
        super().__init__()
        self.axes, self.phase = axes or {}, "forward"
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def _axis(self, group_name: str) -> str:
        return self.axes.get(group_name, group_name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        c10d = _c10d()
        if func.namespace != "_c10d_functional" or func in (c10d.wait_tensor.default,
                                                            c10d._wrap_tensor_autograd.default):
            return out
        x = args[0][0] if func is c10d.all_gather_into_tensor_coalesced.default else args[0]
        dtype = str(x.dtype).removeprefix("torch.")
        if func is c10d.all_gather_into_tensor.default:
            key, n = ("all_gather", args[2]), x.nbytes * (args[1] - 1)
        elif func is c10d.all_gather_into_tensor_coalesced.default:  # fnmoe.parallel.gather: a block's leaves, one call
            key, n = ("all_gather", args[2]), sum(t.nbytes for t in args[0]) * (args[1] - 1)
        elif func is c10d.reduce_scatter_tensor.default:
            key, n = ("reduce_scatter", args[3]), x.nbytes * (args[2] - 1) // args[2]
        elif func is c10d.all_to_all_single.default:
            group = _torch.group_of(args[3])
            splits = list(args[2]) or [x.shape[0] // group.size()] * group.size()
            row = x.element_size() * math.prod(x.shape[1:])
            kind = "all_to_all" if x.is_floating_point() else "all_to_all counts"
            key, n = (kind, args[3]), row * (sum(splits) - splits[dist.get_rank(group)])
        elif func is c10d.all_reduce.default:
            g = _torch.group_of(args[2]).size()
            key, n = ("all_reduce", args[2]), x.nbytes * 2 * (g - 1) // g
        else:
            key, n = (f"unaccounted {func}", ""), 0
        phase = "update" if self.phase == "update" else "step"
        name = (key[0], self._axis(key[1]), dtype, phase)
        self.bytes[name] += int(n)
        self.calls[name] += 1
        return out

    def rows(self) -> list[dict]:
        """One row per (kind, axis, dtype, phase): phase "step" (forward and backward) or "update"."""
        return [{"kind": k, "axis": a, "dtype": d, "phase": p, "bytes": self.bytes[(k, a, d, p)],
                 "calls": self.calls[(k, a, d, p)]} for k, a, d, p in sorted(self.bytes)]


COMPUTE_OPS = frozenset({"mm", "bmm", "addmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                         "_scaled_dot_product_cudnn_attention"})
COMPUTE_NAMESPACES = frozenset({"fnmoe", "fnmoe_cpu"})  # fnmoe.kernels' C++ ops
COLLECTIVES = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
               "all_reduce": "all_reduce"}


class OrderMeter(PhaseMeter):
    """Which collectives of a step overlap compute as fnmoe issues them: a collective overlaps when
    a matmul or an attention kernel (or one of fnmoe's own C++ ops) runs between its issue and the
    first wait for its output; one waited for at issue, or never waited for before the step ends
    with nothing run meanwhile, does not. A process group runs its collectives in issue order (as
    NCCL runs a communicator's), so a wait for one is a wait for every collective issued before it on
    its group: those end there too. Counted per (phase, kind): phase forward, backward (the autograd
    engine running: recompute included) or update; kind all_gather, reduce_scatter, all_to_all,
    all_to_all counts, all_reduce. `log` lists each collective as issued: (phase, kind, group)."""

    def __init__(self):
        super().__init__()
        self.phase, self.computed = "forward", 0
        # id(output) -> (its weakref, [(phase, kind), compute ops at issue, waited])
        self.pending: dict[int, tuple] = {}
        self.issued: collections.Counter = collections.Counter()
        self.overlapped: collections.Counter = collections.Counter()
        self.queues: dict[str, list] = collections.defaultdict(list)  # group -> its records, in issue order
        self.log: list[tuple[str, str, str]] = []

    def _phase(self) -> str:
        return "update" if self.phase == "update" else "backward" if _torch.in_backward() else "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func._opname
        if func.namespace == "_c10d_functional" and name in COLLECTIVES:
            kind = COLLECTIVES[name]
            if kind == "all_to_all" and not args[0].is_floating_point():
                kind = "all_to_all counts"
            group = next(a for a in reversed(args) if isinstance(a, str))
            record = [(self._phase(), kind), self.computed, False, group]  # a coalesced call's outputs share one
            self.issued[record[0]] += 1
            self.queues[group].append(record)
            self.log.append((*record[0], group))
            for t in out if isinstance(out, (list, tuple)) else [out]:
                self.pending[id(t)] = (weakref.ref(t), record)  # an id alone may be a freed tensor's
        elif func.namespace == "_c10d_functional" and name == "_wrap_tensor_autograd":
            # an autograd collective's output is waited for through this wrapper of it
            entry = self.pending.get(id(args[0]))
            if entry is not None and entry[0]() is args[0]:
                self.pending[id(out)] = (weakref.ref(out), entry[1])
        elif func.namespace == "_c10d_functional" and name == "wait_tensor":
            entry = self.pending.get(id(args[0]))
            if entry is not None and entry[0]() is args[0]:
                self._done(id(args[0]))
        elif name in COMPUTE_OPS or func.namespace in COMPUTE_NAMESPACES:
            self.computed += 1
        return out

    def _done(self, key: int) -> None:
        record = self.pending.pop(key, (None, None))[1]
        if record is None:
            return
        queue = self.queues[record[3]]
        ahead = queue[:next(i for i, r in enumerate(queue) if r is record) + 1] if any(
            r is record for r in queue) else []
        del queue[:len(ahead)]
        for r in ahead:  # the group ran them in order: each ends by this wait
            if not r[2]:
                r[2] = True
                self.overlapped[r[0]] += self.computed > r[1]

    def finish(self) -> dict[tuple[str, str], tuple[int, int]]:
        """{(phase, kind): (issued, overlapped)}; a collective whose wait was never seen counts as
        not overlapped (what the model cannot show to hide, it charges)."""
        return {k: (n, self.overlapped[k]) for k, n in sorted(self.issued.items())}
