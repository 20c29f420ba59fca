"""The one module through which fnmoe reaches private torch APIs (docs/design.md §1, rule 9).

Any torch release may rename or drop these. When one is missing, importing fnmoe (or, for the
few looked up on use, calling the wrapper that needs it) fails here with UnsupportedTorchError,
naming the API, the installed torch and the versions fnmoe supports. The rest of fnmoe imports
the names below and never touches `torch._*`, `torch.*._private_module` or `tensor._attr` itself
(tests/test_house.py checks that).

Looked up on use, not at import: inductor's helpers (a slow import that only some commands need)
and `DeviceMesh._flatten` / the process-group timeout (attributes of objects made at run time).
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import sys
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

SUPPORTED = "2.11 <= torch < 2.15"
"""The torch versions fnmoe supports: pyproject.toml's torch requirement."""


class UnsupportedTorchError(ImportError, RuntimeError):
    """A private torch API fnmoe uses is missing from the installed torch."""


def unsupported(what: str, error: BaseException | str) -> UnsupportedTorchError:
    return UnsupportedTorchError(f"fnmoe needs {what}, a private torch API that the installed torch "
                                 f"{torch.__version__} does not have (fnmoe supports {SUPPORTED}): {error}")


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise unsupported(name, e) from e


def _attr(obj: Any, path: str, what: str):
    """obj.<path> (dotted), or UnsupportedTorchError naming `what`."""
    try:
        for name in path.split("."):
            obj = getattr(obj, name)
    except AttributeError as e:
        raise unsupported(what, e) from e
    return obj


def _names(module: str, *names: str) -> tuple:
    mod = _module(module)
    return tuple(_attr(mod, n, f"{module}.{n}") for n in names)


# -- trees: key paths, flatten/unflatten (fnmoe.tree)
pytree = _module("torch.utils._pytree")

# -- collectives dynamo traces, and their ops (fnmoe.parallel.dispatch, fnmoe.memory.policies)
funcol = _module("torch.distributed._functional_collectives")
all_to_all_ops = tuple(_attr(torch.ops, f"{ns}.all_to_all_single.default", f"torch.ops.{ns}.all_to_all_single")
                       for ns in ("_c10d_functional", "_c10d_functional_autograd"))

# -- ranks simulated in one process: LocalTensorMode over the fake group (fnmoe.parallel.dist)
LocalTensor, LocalTensorMode, enabled_local_tensor_mode, maybe_disable_local_tensor_mode = _names(
    "torch.distributed._local_tensor", "LocalTensor", "LocalTensorMode", "enabled_local_tensor_mode",
    "maybe_disable_local_tensor_mode")
(FakeStore,) = _names("torch.testing._internal.distributed.fake_pg", "FakeStore")
FakeTensorMode, is_fake = _names("torch._subclasses.fake_tensor", "FakeTensorMode", "is_fake")

# -- whether the CPU multiplies bf16 natively (fnmoe.kernels.bf16)
cpu_avx512_bf16, cpu_amx_tile = _names("torch.cpu", "_is_avx512_bf16_supported", "_is_amx_tile_supported")
_attr(LocalTensor, "_local_tensors", "LocalTensor._local_tensors")


def local_tensors(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """{rank: value} of a LocalTensor."""
    return t._local_tensors


# -- process groups: the rendezvous store, a new group's timeout (fnmoe.parallel.dist)
(default_store,) = _names("torch.distributed.distributed_c10d", "_get_default_store")


def gloo_options():
    """Options for a new gloo process group."""
    return _attr(dist, "ProcessGroupGloo._Options", "torch.distributed.ProcessGroupGloo._Options")()


def set_pg_timeout(opts, timeout: datetime.timedelta) -> None:
    """Give a new process group's options (gloo's or NCCL's) a timeout."""
    try:
        opts._timeout = timeout
    except AttributeError as e:
        raise unsupported(f"{type(opts).__qualname__}._timeout", e) from e


# -- DTensor: a dim split twice, flattened mesh axes (fnmoe.parallel.sharding)
(StridedShard,) = _names("torch.distributed.tensor.placement_types", "_StridedShard")


def flatten_mesh(mesh, name: str, backend_override=None):
    """mesh's axes flattened into one axis called name (DeviceMesh._flatten); the flattened mesh."""
    flatten = _attr(mesh, "_flatten", "DeviceMesh._flatten")
    return flatten(name) if backend_override is None else flatten(name, backend_override=backend_override)


# -- tensor internals: in-place version counter, a view's base (fnmoe.memory.policies, fnmoe.parallel.reshard)
_attr(torch.Tensor, "_version", "torch.Tensor._version")
_attr(torch.Tensor, "_base", "torch.Tensor._base")


def tensor_version(t: torch.Tensor) -> int:
    """t's version counter: it grows with every in-place change of t's storage through t or a view."""
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor t is a view of (the root, for a view of a view), or None."""
    return t._base


# -- dispatch modes: see every op, unwrap tensor subclasses (fnmoe.plan.memory_report)
TorchDispatchMode, is_traceable_wrapper_subclass, _top_mode, _pop_mode_temporarily = _names(
    "torch.utils._python_dispatch", "TorchDispatchMode", "is_traceable_wrapper_subclass",
    "_get_current_dispatch_mode", "_pop_mode_temporarily")
_sac_modes = _names("torch.utils.checkpoint", "_CachingTorchDispatchMode", "_CachedTorchDispatchMode")


@contextlib.contextmanager
def outside_checkpoint_log():
    """Ops run here bypass the selective checkpoint whose forward or recompute is running (its
    dispatch mode, on top of the stack, is lifted for the block; modes beneath it, e.g. simulated
    ranks', stay). torch >= 2.13's recompute requires every op to have run in the forward: an
    FSDP gather that only the recompute issues must be outside its log (fnmoe.parallel.reshard)."""
    if not isinstance(_top_mode(), _sac_modes):
        yield
        return
    with _pop_mode_temporarily():
        yield

# -- ops: CUDA's grouped GEMM (None where absent), size facts for compile (fnmoe.models.moe, fnmoe.parallel.dispatch)
grouped_mm: Callable | None = getattr(torch, "_grouped_mm", None)
check: Callable = _attr(torch, "_check", "torch._check")

# -- torch.func: which transforms are active around a call, and the tensor under their wrappers
# (fnmoe.models.transforms, fnmoe.models.transformer)
_functorch_C = _attr(torch, "_C._functorch", "torch._C._functorch")
_interpreter_stack: Callable = _attr(_functorch_C, "get_interpreter_stack", "functorch's interpreter stack")
_is_wrapped: Callable = _attr(_functorch_C, "is_functorch_wrapped_tensor", "functorch's wrapped-tensor test")
_get_unwrapped: Callable = _attr(_functorch_C, "get_unwrapped", "functorch's unwrap")
_forward_ad = _module("torch.autograd.forward_ad")


def functorch_transforms() -> tuple[str, ...]:
    """The torch.func transforms active around this call, outermost first ("vmap", "jvp", "grad",
    "functionalize"), plus "forward_ad" inside a torch.autograd.forward_ad dual level."""
    stack = _interpreter_stack() or []
    names = tuple(i.key().name.lower() for i in stack)
    return names + (("forward_ad",) if _attr(_forward_ad, "_current_level", "the forward-AD level") >= 0 else ())


c10d_ops = _attr(torch.ops, "_c10d_functional", "torch.ops._c10d_functional")
efficient_attention = _attr(torch.ops, "aten._scaled_dot_product_efficient_attention",
                            "torch.ops.aten._scaled_dot_product_efficient_attention")
_resolve_group = _attr(dist, "distributed_c10d._resolve_process_group", "distributed_c10d._resolve_process_group")
_graph_task = _attr(torch, "_C._current_graph_task_id", "torch._C._current_graph_task_id")


def group_of(name: str):
    """The process group a functional collective names."""
    return _resolve_group(name)


(wait_on_use,) = _names("torch.distributed._functional_collectives", "_maybe_wrap_tensor")
"""a collective's output that waits for it at its first non-view use (AsyncCollectiveTensor)"""
_are_we_tracing, _is_view_op = _names("torch.distributed._functional_collectives", "_are_we_tracing", "_is_view_op")


class _CastOnUse(funcol.AsyncCollectiveTensor):
    """A collective's output in flight, seen in another dtype: waited for and cast at its first
    non-view use or at `resolve()` (a cast at once would wait for the collective there). A view of
    one (DTensor.from_local takes one) is another, resolved with it: one cast, one copy. An
    AsyncCollectiveTensor, so that torch's code that waits for those (a simulation's LocalTensor,
    DTensor, compiled regions' inputs) resolves it."""
    __slots__ = ("value", "base", "views")

    @staticmethod
    def __new__(cls, elem: torch.Tensor, dtype: torch.dtype, base=None):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=dtype,
                                                layout=elem.layout, device=elem.device)
        r.elem, r.completed, r.value, r.base, r.views = elem, False, None, base, []
        return r

    def resolve(self) -> torch.Tensor:
        if self.value is None:
            if self.base is not None:
                self.base.resolve()  # settles this view too
            else:
                self._settle(funcol.wait_tensor(self.elem).to(self.dtype))
        return self.value

    wait = trigger_wait = _get_acs_underlying_tensor = resolve

    def _settle(self, value: torch.Tensor) -> None:
        self.value, self.elem, self.base, self.completed = value, None, None, True  # the low-precision copy goes
        for ref, view in self.views:
            if (v := ref()) is not None and v.value is None:
                v._settle(view(value))
        self.views = []

    def __tensor_flatten__(self):
        return ["elem" if self.value is None else "value"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        (t,) = inner.values()
        return t if t.dtype == dtype else _CastOnUse(t, dtype)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"_CastOnUse({self.resolve()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x, rest = args[0] if args else None, (args[1:], kwargs)
        if (isinstance(x, cls) and x.value is None and _is_view_op(func)
                and not any(isinstance(a, cls) for a in pytree.tree_leaves(rest))):
            out = func(x.elem, *args[1:], **kwargs)
            if isinstance(out, torch.Tensor):
                view = cls(out, x.dtype, x)
                x.views.append((weakref.ref(view), lambda v: func(v, *args[1:], **kwargs)))
                return view
        args, kwargs = pytree.tree_map_only(cls, cls.resolve, (args, kwargs))
        return func(*args, **kwargs)


def cast_on_use(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A collective's output t (in flight) in dtype, waited for and cast at its first use; its
    `resolve()` does both now. Under dynamo it waits and casts at once, as torch's own
    AsyncCollectiveTensor does there; fake tensors (fnmoe.plan.rehearse) take the wrapper as real
    ones do, so a rehearsal holds what a run holds."""
    if t.dtype == dtype:
        return wait_on_use(t)
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(t).to(dtype)
    return _CastOnUse(t, dtype)


def as_arrived(t: torch.Tensor) -> torch.Tensor:
    """t's values as its collective delivered them, in its own dtype, when t is a cast_on_use
    tensor not yet cast (a reader that upcasts anyway, as a norm in fp32, need not make the cast
    copy); else t."""
    if isinstance(t, _CastOnUse) and t.value is None:
        funcol.wait_tensor((t if t.base is None else t.base).elem)  # a view's collective is its base's
        return t.elem
    return t


def resolve(t: torch.Tensor) -> None:
    """Wait for and cast a cast_on_use tensor now (nothing for any other)."""
    if isinstance(t, _CastOnUse):
        t.resolve()


_engine = _attr(torch.autograd, "Variable._execution_engine", "torch.autograd.Variable._execution_engine")


def at_backward_end(fn: Callable[[], None]) -> None:
    """Run fn when the backward pass running on this thread ends (inside the engine, as FSDP's
    post-backward callback)."""
    _engine.queue_callback(fn)


def graph_task() -> int:
    """The id of the backward pass autograd's engine runs on this thread, -1 outside one."""
    return _graph_task()


_will_execute = _attr(torch._C, "_will_engine_execute_node", "torch._C._will_engine_execute_node")


def backward_reaches(leaf: torch.Tensor) -> bool:
    """Whether the backward pass running now delivers a gradient to leaf (its inputs= may leave it out)."""
    return _will_execute(torch.autograd.graph.get_gradient_edge(leaf).node)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread."""
    return _graph_task() != -1


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """An id of t's storage (or of a storage), unique while it lives: the StorageImpl's address (a
    fake tensor's data pointer is 0 for all)."""
    return (t.untyped_storage() if isinstance(t, torch.Tensor) else t)._cdata


_PROPAGATION = "_propagate_tensor_meta_non_cached"  # DTensor's ShardingPropagator, torch 2.11-2.13


def in_sharding_propagation(depth: int = 16) -> bool:
    """Whether DTensor is deriving an op's output shape by running it on fake global-shape tensors
    (which a real run never allocates: its own fake mode makes them)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == _PROPAGATION:
            return True
        frame = frame.f_back
    return False


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding decisions and redistribution plans: they are cached by mesh value and
    hold the mesh object they were made with (and its rank's coordinates), which is wrong for the
    mesh of another process group, of another rank, in the same process (fnmoe.plan.rehearse, run twice)."""
    from torch.distributed.tensor import DTensor
    redistribute = _module("torch.distributed.tensor._redistribute")
    redistribute._gen_transform_infos.cache_clear()
    redistribute.clear_redistribute_planner_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def tracing() -> bool:
    """Whether make_fx is tracing this call (torch.func.linearize does): tensor values cannot be read."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    return get_proxy_mode() is not None


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under torch.func's wrappers (a vmap's whole batch); t itself when unwrapped."""
    while _is_wrapped(t):
        t = _get_unwrapped(t)
    return t


# -- compile: dynamo/functorch flags, trace-time hooks, counters (fnmoe.compile)
dynamo = _module("torch._dynamo")
dynamo_config = _module("torch._dynamo.config")
functorch_config = _module("torch._functorch.config")
dynamo_utils = _module("torch._dynamo.utils")
(comptime,) = _names("torch._dynamo.comptime", "comptime")
override_optimization_hint: Callable | None = getattr(dynamo, "override_optimization_hint", None)  # not in 2.11


def dynamo_counters() -> dict:
    """dynamo's event counters by kind ("inductor", "aot_autograd", ...), for this process."""
    return dynamo_utils.counters


def inductor_default_cache_dir() -> str:
    """The cache directory inductor picks when TORCHINDUCTOR_CACHE_DIR is unset."""
    (default_cache_dir,) = _names("torch._inductor.runtime.cache_dir_utils", "default_cache_dir")
    return default_cache_dir()


def pick_vec_isa():
    """The SIMD level inductor compiles CPU kernels for here (falsy where it finds none)."""
    (pick,) = _names("torch._inductor.cpu_vec_isa", "pick_vec_isa")
    return pick()


# -- compile inspection: explain, guard failures, generated code (fnmoe.plan.inspect_compile)
dynamo_reset: Callable[[], None] = _attr(dynamo, "reset", "torch._dynamo.reset")
dynamo_explain: Callable = _attr(dynamo, "explain", "torch._dynamo.explain")
guard_failures: dict = _attr(dynamo_utils, "guard_failures", "torch._dynamo.utils.guard_failures")


def run_and_get_code(fn: Callable, *args):
    """(fn(*args), the source of every module inductor generated for it)."""
    (run,) = _names("torch._inductor.utils", "run_and_get_code")
    return run(fn, *args)
