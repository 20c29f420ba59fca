"""Part of step 2 of tools/gpu_check.sh, k2layer: the fp8 expert GEMMs (--mesh.expert-gemm-dtype
float8_e4m3fn) at the K2 preset's per-GPU shapes, against bf16.

expert_mlp over one balanced chunk's rows of the GPU's X experts (forward, then the input and weight
gradients: 3 GEMMs of 2·R·I·O a matrix, three matrices), timed in bf16 and with every GEMM in fp8
(fnmoe.kernels.fp8_gemm: torch's scaled_grouped_mm on CUDA, the emulation on CPU); each row its
TFLOP/s. The fp8 output against the emulation of the same operands (dequantised, an fp32 GEMM:
only the accumulation order and the bf16 output's rounding differ) and against bf16 (e4m3's rounding
of both operands, ~3.8% relative in the tests). A torch or GPU without the kernel's recipes gives a
row naming what is missing.

Legend: R rows (sorted by expert), D model, F expert hidden, X experts a GPU holds.
"""
from __future__ import annotations

import torch

from gpu_checks.common import Recorder, status

from fnmoe.kernels import fp8_blocks, fp8_gemm
from fnmoe.models.moe import expert_mlp


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _dequantised(x_RD: torch.Tensor, w_XDF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands as fp8_gemm quantises them (1x128 row tiles, 128x128 weight blocks), dequantised in fp32."""
    return (fp8_gemm.dequantise_rows(*fp8_gemm.quantise_rows(x_RD)),
            fp8_blocks.dequantise(*fp8_blocks.quantise(w_XDF), torch.float32))


def _grouped(x_RD: torch.Tensor, w_XDF: torch.Tensor, counts_X: torch.Tensor) -> torch.Tensor:
    """x · w per expert in fp32, a loop (the reference)."""
    out, start = [], 0
    for e, n in enumerate(counts_X.tolist()):
        out.append(x_RD[start:start + n].float() @ w_XDF[e].float())
        start += n
    return torch.cat(out)


def check_fp8_gemm(rec: Recorder, lay, tokens: int, counts_X: torch.Tensor, warmup: int, iters: int) -> None:
    from gpu_checks.k2layer import timed_ms

    R, p = int(counts_X.sum()), lay.p
    x_RD, gy_RD = lay.inputs(tokens, (R, lay.D))
    counts = counts_X.to(lay.device)
    flops = 3 * 2.0 * R * lay.D * lay.F * 3  # forward, input and weight gradients of three matrices

    def pass_(fp8: bool) -> torch.Tensor:
        x_RD.grad = None
        with fp8_gemm.expert_gemm_dtype(fp8_blocks.E4M3 if fp8 else None):
            y_RD = expert_mlp(x_RD, p["w_gate_EDF"], p["w_up_EDF"], p["w_down_EFD"], counts, lay.gemm)
        y_RD.backward(gy_RD)
        return y_RD
    rows = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        ms = timed_ms(lambda: pass_(fp8), lay.device, warmup, iters)
        rows[name] = ms
        rec.row(f"K2 expert GEMMs {name}, {R} rows", f"{ms:.3g} ms, {flops / ms / 1e9:.3g} TFLOP/s", "info")
    rec.row("K2 expert GEMMs fp8 / bf16 time", f"{rows['fp8'] / rows['bf16']:.2f} (<1: fp8 faster)", "info")
    with torch.no_grad(), fp8_gemm.expert_gemm_dtype(fp8_blocks.E4M3):
        x, w = x_RD.detach(), p["w_gate_EDF"].detach()
        got = fp8_gemm.grouped_mm(x, w, torch.cumsum(counts, 0))
        want = _grouped(*_dequantised(x, w), counts_X)
        exact = _grouped(x.float(), w.float(), counts_X)
    err, err16 = _rel(got, want), _rel(got, exact)
    rec.row("K2 fp8 GEMM vs its emulation", f"relative error {err:.2e} (fp32 accumulation order, bf16 output)",
            status(err < 1e-2))
    rec.row("K2 fp8 GEMM vs the bf16 operands", f"relative error {err16:.3f} (e4m3's rounding: ~0.04 expected)",
            status(err16 < 0.06))
