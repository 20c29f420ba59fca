"""The experts' grouped GEMMs on CPU: fnmoe/csrc/grouped_gemm.cpp, built on first use, as torch ops.

Legend: R rows (sorted by expert), D in, F out, E experts.
One ragged grouped GEMM runs as one OpenMP parallel region: each thread takes an equal share of
rows and multiplies every expert piece in it single-threaded. torch's CPU `_grouped_mm` wakes the
threads once per expert, and a bmm over [E, C] slabs multiplies padding (C is the largest count:
1.4-2.0x the rows at a fresh model's routing). Measured here (2 cores, bf16, R=4096, D=F=256,
E=16, one skewed layer): this 0.73 ms, padded bmm 1.20 ms, torch._grouped_mm 1.66 ms, one dense
matmul of the same rows 0.61 ms.

The extension builds with torch's cpp_extension (a C++ compiler and ninja; ~20 s once) into the
compile cache (fnmoe.compile.cache_root()/cpu_gemm). When it cannot build, `available()` is False
and says why once; model.moe.impl='auto' then runs the padded path.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from fnmoe.compile import cache_root, say_once

SOURCE = Path(__file__).resolve().parent / "csrc" / "grouped_gemm.cpp"


@functools.cache
def _build_error() -> str | None:
    """None once the extension is loaded, else why it could not be."""
    try:
        from torch.utils import cpp_extension

        build = cache_root() / "cpu_gemm" / f"torch-{torch.__version__.replace('+', '_')}"
        build.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name="fnmoe_cpu_gemm", sources=[str(SOURCE)], build_directory=str(build),
                           extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
        return None
    except Exception as e:  # no compiler, no ninja, a read-only cache: the padded path serves
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def available() -> bool:
    """Whether the CPU grouped GEMM ops run here (builds them on the first call)."""
    why = _build_error()
    if why:
        say_once(f"fnmoe's CPU grouped GEMM did not build ({why}); MoE experts on CPU run as padded "
                 "batched matmuls (slower). model.moe.impl='padded' skips the build.")
    return why is None


def _ops():
    why = _build_error()
    if why:
        raise RuntimeError(f"fnmoe's CPU grouped GEMM did not build ({why}); use model.moe.impl='padded'")
    return torch.ops.fnmoe_cpu


@torch.library.custom_op("fnmoe::grouped_mm", mutates_args=())
def grouped_mm(x_RD: torch.Tensor, w_EDF: torch.Tensor, end_E: torch.Tensor) -> torch.Tensor:
    """y_RF[r] = x_RD[r] @ w_EDF[expert of r]; end_E: int64 cumulative row counts per expert. w may
    be stored in another float dtype (fp32 master weights): slices are cast to x's dtype as they
    are multiplied, and w's gradient comes back in w's dtype."""
    return _ops().grouped_mm(x_RD, w_EDF, end_E)


@torch.library.custom_op("fnmoe::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x_RD: torch.Tensor, g_RF: torch.Tensor, end_E: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """g_EDF[e] = x_RD[rows of e]^T @ g_RF[rows of e], in dtype."""
    return _ops().grouped_mm_wgrad(x_RD, g_RF, end_E, dtype)


@grouped_mm.register_fake
def _(x_RD, w_EDF, end_E):
    return x_RD.new_empty(x_RD.shape[0], w_EDF.shape[2])


@grouped_mm_wgrad.register_fake
def _(x_RD, g_RF, end_E, dtype):
    return x_RD.new_empty(end_E.shape[0], x_RD.shape[1], g_RF.shape[1], dtype=dtype)


def _setup_context(ctx, inputs, output):
    x_RD, w_EDF, end_E = inputs
    ctx.save_for_backward(x_RD, w_EDF, end_E)


def _backward(ctx, g_RF):
    x_RD, w_EDF, end_E = ctx.saved_tensors
    g_x = grouped_mm(g_RF, w_EDF.transpose(1, 2), end_E) if ctx.needs_input_grad[0] else None
    g_w = grouped_mm_wgrad(x_RD, g_RF, end_E, w_EDF.dtype) if ctx.needs_input_grad[1] else None
    return g_x, g_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
