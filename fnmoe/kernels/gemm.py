"""The experts' grouped GEMMs on CPU: fnmoe/kernels/csrc/grouped_gemm.cpp, built on first use, as torch ops.
The same extension carries fnmoe/kernels/csrc/attention.cpp (see fnmoe.kernels.attention).

Legend: R rows (sorted by expert), D in, F out, E experts.
One ragged grouped GEMM runs as one OpenMP parallel region: each thread takes an equal share of
rows and multiplies every expert piece in it single-threaded. torch's CPU `_grouped_mm` wakes the
threads once per expert, and a bmm over [E, C] slabs multiplies padding (C is the largest count:
1.4-2.0x the rows at a fresh model's routing). Measured here (2 cores, bf16, R=4096, D=F=256,
E=16, one skewed layer): this 0.73 ms, padded bmm 1.20 ms, torch's grouped_mm 1.66 ms, one dense
matmul of the same rows 0.61 ms.

The extension builds with torch's cpp_extension (a C++ compiler and ninja; ~20 s once on 2 quiet cores,
minutes under load: 175-221 s seen at load 7-10) into
build_dir(): the checkout's compile_cache/cpu_gemm/torch-<version>-<SIMD level>. When it cannot
build, `available()` is False and says why once; model.moe.impl='auto' then runs the padded path
and model.attention_impl='auto' SDPA.

Builds and loads take turns on a flock of build_dir()/fnmoe-build.lock (`build_lock`), which the
kernel releases however its holder ends. Its holder writes its pid, host and start time there; a
waiter names them after 2 s and every 30 s, gives up after FNMOE_BUILD_LOCK_WAIT_S seconds (default
600: a build takes ~17 s; then the kernels are unavailable, saying why, and the padded path
serves) and ends at once on SIGTERM or SIGINT (fnmoe.kernels.lock_wait): a holder that is stopped (not
dead) never lets go. torch's own lock beside it (a file `lock` made with
O_EXCL, removed by its maker) outlives a builder killed with kill -9, and every later load would
wait for it forever; under our flock no one else builds, so one found there is such a leftover
and is removed, with a line.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from pathlib import Path

import torch

from fnmoe import _torch
from fnmoe.kernels import bf16
from fnmoe.compile import default_cache_dir, say_once
from fnmoe.kernels import lock_wait, wgrad

SOURCES = [Path(__file__).resolve().parent / "csrc" / name for name in ("grouped_gemm.cpp", "attention.cpp")]
NAME = "fnmoe_cpu_gemm"
LOCK = "fnmoe-build.lock"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
WAIT_ENV = "FNMOE_BUILD_LOCK_WAIT_S"
WAIT_DEFAULT_S = 600.0
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
log = logging.getLogger("fnmoe")


_loaded = False  # a plain global: compiled code reads it (a guard), never traces the build


@functools.cache
def build_error() -> str | None:
    """None once the extension is loaded (and its ops have fake kernels for compile), else why it
    could not be."""
    global _loaded
    try:
        from torch.utils import cpp_extension

        isa_flags = vector_isa()[1]
        build = build_dir()
        build.mkdir(parents=True, exist_ok=True)
        with build_lock(build):
            building = needs_build(build)
            if building:  # a long silence otherwise; said where a library's logging shows no INFO too
                log.log(logging.INFO if log.isEnabledFor(logging.INFO) else logging.WARNING,
                        "building fnmoe's C++ CPU kernels in %s (once per checkout and torch version; ~20 s on 2 "
                        "quiet cores, minutes while other work shares them)...", build)
            t0 = time.perf_counter()
            cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], build_directory=str(build),
                               extra_cflags=["-O3", "-fopenmp", *isa_flags], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
            if building:
                log.info("built fnmoe's C++ CPU kernels in %.1f s", time.perf_counter() - t0)
    except Exception as e:  # no compiler, no ninja, a read-only cache: the padded path serves
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    torch.library.register_fake("fnmoe_cpu::grouped_mm")(
        lambda x_RD, w_EDF, end_E, fp32: x_RD.new_empty(x_RD.shape[0], w_EDF.shape[2]))
    torch.library.register_fake("fnmoe_cpu::grouped_mm_wgrad")(
        lambda x_RD, g_RF, end_E, dtype, fp32: x_RD.new_empty(end_E.shape[0], x_RD.shape[1], g_RF.shape[1],
                                                              dtype=dtype))
    torch.library.register_fake("fnmoe_cpu::attention")(
        lambda q, k, v, scale: (q.new_empty(*q.shape[:3], v.shape[3]),
                                q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)))
    torch.library.register_fake("fnmoe_cpu::attention_bwd")(
        lambda dy, q, k, v, y, lse, scale: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
    _loaded = True
    return None


@contextlib.contextmanager
def build_lock(build: Path):
    """Held around a build and load of the extension in build: our flock (waited for while another
    process builds or loads), then torch's lock file removed if a killed builder left it. Where the
    file system has no flock, torch's lock file alone, as cpp_extension takes it."""
    fd = os.open(build / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if _flock(fd, build / LOCK):
            lock_wait.claim(fd)
            _remove_stale_torch_lock(build)
        yield
    finally:
        os.close(fd)  # releases the flock


def _flock(fd: int, path: Path) -> bool:
    """Take the flock on fd, waiting while another process holds it (lock_wait.wait_flock: said,
    bounded, ended by SIGTERM/SIGINT); False where there is none."""
    try:
        lock_wait.wait_flock(fd, path, "the kernel-build lock", WAIT_ENV, WAIT_DEFAULT_S)
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return False
        raise
    return True


def _remove_stale_torch_lock(build: Path) -> None:
    """torch's lock file, found while we hold the flock: its maker died mid-build (kill -9)."""
    with contextlib.suppress(FileNotFoundError):
        (build / TORCH_LOCK).unlink()
        log.warning("removed %s, left by a process killed while it built or loaded fnmoe's C++ CPU kernels",
                    build / TORCH_LOCK)


def needs_build(build: Path) -> bool:
    """Whether the extension in build is missing or older than a source or header (cpp_extension then
    builds it; it also rebuilds for changed flags, which this does not see)."""
    lib = build / f"{NAME}.so"
    return not lib.exists() or any(src.stat().st_mtime > lib.stat().st_mtime for src in SOURCES[0].parent.iterdir())


def build_dir() -> Path:
    """Where the extension builds: under the default compile cache whatever inductor cache a run
    chooses (a cold-cache run, or a test's temp cache, must not rebuild it), per torch version and
    SIMD level."""
    return default_cache_dir() / "cpu_gemm" / f"torch-{torch.__version__.replace('+', '_')}-{vector_isa()[0]}"


def vector_isa() -> tuple[str, list[str]]:
    """The SIMD level inductor compiles its CPU kernels for here, and the flags that select it
    (ATen's Vectorized then uses AVX2/AVX512 code): ("default", []) where it finds none."""
    try:
        isa = _torch.pick_vec_isa()
    except Exception:  # an inductor without the helper: portable code, slower loops
        return "default", []
    if not isa:
        return "default", []
    flags = isa.build_arch_flags().split() + [f"-D{m}" for m in isa.build_macro()]
    return str(isa).split()[0], flags


def build_before(model, device: torch.device | str) -> None:
    """Build or load the extension now where `model` (a ModelConfig) takes it on device: CPU experts on
    model.moe.impl auto or grouped, CPU attention in bf16 on auto or cpu. A training loop calls it
    before its first step, so that a first build is no step's time (step 1's tokens/s)."""
    if torch.device(device).type != "cpu":
        return
    experts = model.moe.n_experts > 0 and model.moe.impl in ("auto", "grouped")
    attention = model.compute_dtype == "bfloat16" and model.attention_impl in ("auto", "cpu")
    if experts or attention:
        available()


@torch.compiler.assume_constant_result  # compiled callers take it while they trace: never trace the build
def available() -> bool:
    """Whether the C++ CPU ops (grouped GEMM, attention) run here (builds them on the first call)."""
    why = build_error()
    if why:
        say_once(f"fnmoe's C++ CPU kernels did not build ({why}); on CPU MoE experts run as padded batched "
                 "matmuls and attention through SDPA (slower). model.moe.impl='padded' with "
                 "model.attention_impl='sdpa' skips the build.")
    return why is None


def require(instead: str) -> None:
    """Raise, naming why and what to use instead, unless the ops are loaded (the plain global is
    read first: compiled code reads it without tracing the build)."""
    if not _loaded and not available():
        raise RuntimeError(f"fnmoe's C++ CPU kernels did not build ({build_error()}); use {instead}")


class _GroupedMM(torch.autograd.Function):
    """An autograd.Function, not a torch.library custom op: torch.func's transforms take it (the
    train step's value_and_grad is tested against torch.func.grad_and_value)."""

    @staticmethod
    def forward(x_RD, w_EDF, end_E, fp32):
        return torch.ops.fnmoe_cpu.grouped_mm(x_RD, w_EDF, end_E, fp32)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3])
        ctx.fp32, ctx.leaf = inputs[3], wgrad.leaf(inputs[1])

    @staticmethod
    def backward(ctx, g_RF):
        x_RD, w_EDF, end_E = ctx.saved_tensors
        ops, fp32 = torch.ops.fnmoe_cpu, ctx.fp32
        g_x = ops.grouped_mm(g_RF, w_EDF.transpose(1, 2), end_E, fp32) if ctx.needs_input_grad[0] else None
        g_w = wgrad.weight_grad(ctx.leaf, lambda: ops.grouped_mm_wgrad(x_RD, g_RF, end_E, w_EDF.dtype, fp32)) \
            if ctx.needs_input_grad[1] else None
        return g_x, g_w, None, None


def grouped_mm(x_RD: torch.Tensor, w_EDF: torch.Tensor, end_E: torch.Tensor) -> torch.Tensor:
    """y_RF[r] = x_RD[r] @ w_EDF[expert of r]; end_E: int64 cumulative row counts per expert. w may
    be stored in another float dtype (fp32 master weights): slices are cast to x's dtype as they
    are multiplied, and w's gradient comes back in w's dtype. A bf16 x on a CPU without native bf16
    GEMMs multiplies in fp32, each result rounded once to bf16 (fnmoe.kernels.bf16)."""
    require("model.moe.impl='padded'")
    return _GroupedMM.apply(x_RD, w_EDF, end_E, x_RD.dtype == torch.bfloat16 and bf16.wanted())
