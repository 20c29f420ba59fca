"""Causal GQA/MHA attention on CPU for short rows: fnmoe/kernels/csrc/attention.cpp (built with
fnmoe.kernels.gemm's extension), as an autograd.Function.

Legend: B batch, L positions, H query heads, G kv heads, A q/k head dim, U value head dim.
With bf16 compute its forward+backward against SDPA's CPU flash kernel (2 cores with AVX512-BF16,
B=4, H=4, G=2, A=64): L=256 ~2.3-3.1 vs ~6 ms, L=512 7-8 vs 19-22 ms, L=1024 ~30 vs ~48 ms
(without AVX512-BF16, scores as fp32 GEMMs: 3.4-4.3, 10.4-10.8, 43-49 ms). Numerics match flash's
(fp32 scores and dP from exact products; P and dS rounded to bf16 for the GEMMs that take them).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from fnmoe import caches
from fnmoe.kernels import gemm as cpu_gemm
from fnmoe.config import ModelConfig

AUTO_MAX_LEN = 1024
"""impl='auto' takes the kernel up to this many positions (measured faster up to here; a task holds
[r L, L] bf16 P and dS, 4 MiB each at L = 1024, r = 2)"""
MAX_TASK_BYTES = 1 << 30
"""impl='cpu' refuses rows whose per-task P and dS would pass this (every thread holds its own)"""


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(q_BLHA, k_BLGA, v_BLGU, scale):
        return torch.ops.fnmoe_cpu.attention(q_BLHA, k_BLGA, v_BLGU, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q_BLHA, k_BLGA, v_BLGU, scale = inputs
        y_BLHU, lse_BHL = output
        ctx.save_for_backward(q_BLHA, k_BLGA, v_BLGU, y_BLHU, lse_BHL)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse_BHL)

    @staticmethod
    def backward(ctx, dy_BLHU, _dlse):
        dq, dk, dv = torch.ops.fnmoe_cpu.attention_bwd(dy_BLHU, *ctx.saved_tensors, ctx.scale)
        return dq, dk, dv, None


def unsupported(dtype: torch.dtype, device: torch.device, n_heads: int, n_kv_heads: int, mask) -> str | None:
    """Why the kernel cannot take this attention, or None."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return f"it takes bfloat16 on CPU (got {dtype} on {torch.device(device).type})"
    if mask is not None:
        return "it is plain causal: packed documents (a document mask) need SDPA or flex attention"
    if n_heads % n_kv_heads:
        return f"{n_heads} query heads do not split over {n_kv_heads} kv heads"
    if not cpu_gemm.available():
        return f"fnmoe's C++ CPU kernels did not build ({cpu_gemm.build_error()})"
    return None


def choice(cfg: ModelConfig, B: int, L: int, dtype: torch.dtype, device: torch.device, mask=None) -> str:
    """"cpu", "sdpa" or "math" for cfg.attention_impl on [B, L] rows: auto takes the kernel where it
    applies, rows are short and every thread gets a (batch, kv head) task. Runs outside compiled code."""
    if cfg.attention_impl in ("sdpa", "math"):
        return cfg.attention_impl
    kv_heads = cfg.n_heads if cfg.attention == "mla" else cfg.n_kv_heads
    why = unsupported(dtype, device, cfg.n_heads, kv_heads, mask)
    if cfg.attention_impl == "cpu":
        task_bytes = 2 * (cfg.n_heads // kv_heads) * L * L * 2  # P and dS, bf16 [r L, L]
        if why is None and task_bytes > MAX_TASK_BYTES:
            why = (f"each (batch, kv head) task holds [r L, L] bf16 probabilities and their gradient, "
                   f"{task_bytes / 2**30:.1f} GiB at L={L}, r={cfg.n_heads // kv_heads}")
        if why:
            raise ValueError(f"model.attention_impl='cpu' cannot run here: {why}; use 'auto' or 'sdpa'")
        return "cpu"
    return "cpu" if why is None and L <= AUTO_MAX_LEN and B * kv_heads >= _threads() else "sdpa"


# dynamo cannot trace the thread count: a compiled caller (torch.compile(fnmoe.forward)) keeps the one it
# traced with, a choice of speed only (both paths compute the same attention)
@torch.compiler.assume_constant_result
def _threads() -> int:
    return torch.get_num_threads()


def resolved(cfg: ModelConfig, B: int, L: int, dtype: torch.dtype, device: torch.device, mask=None) -> ModelConfig:
    """cfg with attention_impl set to choice(...): what a compiled attention region is given."""
    return _config_with(cfg, choice(cfg, B, L, dtype, device, mask))


# a compiled caller (torch.compile(fnmoe.forward)) takes the object while it traces (dynamo honours the
# mark on a plain function only; through the cache it would trace dataclasses.replace)
@torch.compiler.assume_constant_result
def _config_with(cfg: ModelConfig, impl: str) -> ModelConfig:
    return _with_impl(cfg, impl)


@caches.register
@functools.cache
def _with_impl(cfg: ModelConfig, impl: str) -> ModelConfig:  # one object per pair: a stable config for compile
    return dataclasses.replace(cfg, attention_impl=impl)


def attention(q_BLHA: torch.Tensor, k_BLGA: torch.Tensor, v_BLGU: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T scale, causal) v as [B, L, H, U]; head h reads kv head h // (H / G)."""
    cpu_gemm.require("model.attention_impl='sdpa'")
    return _Attention.apply(q_BLHA, k_BLGA, v_BLGU, float(scale))[0]
