"""fp8 routed-expert GEMMs (--mesh.expert-gemm-dtype float8_e4m3fn): DeepSeek-V3's tiling, e4m3
operands, fp32 accumulation, outputs in the activations' dtype.

Legend: R rows (sorted by expert), D in, F out, E experts, K a GEMM's contracted dim, N its other,
M a quantised matrix's rows, G its 1x128 tiles along K, T a tile's elements (128).

Activations are quantised in 1x128 tiles along the contracted dim (`quantise_rows`): a row's K
elements in tiles of 128, one float32 power-of-two scale a tile (fnmoe.parallel.fp8's scale rule,
so q * s is exact in bf16 and fp32). Weights are fnmoe.parallel.fp8's 128x128 blocks. Per GEMM:
  forward      y_RF  = x_RD · w_EDF        x in 1x128 tiles along D, w in 128x128 blocks
  input grad   dx_RD = g_RF · w_EDF^T      g in 1x128 tiles along F, the same blocks transposed
  weight grad  dw_EDF = x_RD^T · g_RF      x and g in 128x1 tiles along R (the rows: the contracted dim)
The forward keeps only fp8 operands for backward (x twice: its 1x128 and its 128x1 tiles, 2 bytes an
element, as a bf16 x), not x itself.

The weights: an fp8 expert gather (mesh.expert_gather_dtype) delivers each stack as q * s of its
packs, exactly, in the compute dtype, and the GEMMs take those packs themselves (no second
quantisation: fnmoe.kernels.fp8_blocks.weight_blocks). Without fp8 gathers a stack is quantised at
its first GEMM, once for all the token chunks and the input gradient that use it.

Where it runs: on CUDA through torch.nn.functional.scaled_grouped_mm (public from torch 2.10; the
recipes ScalingType.BlockWise1x128 / BlockWise128x128); a build or GPU without a kernel for these
recipes raises one line naming what is missing. On CPU an emulation: dequantise, the grouped GEMM in
float32, the output rounded to the activations' dtype. The emulation is the tests' reference.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from fnmoe.kernels import gemm as cpu_gemm
from fnmoe.kernels import fp8_blocks as fp8
from fnmoe.kernels import wgrad

TILE = fp8.BLOCK

_dtype: torch.dtype | None = None
"""the dtype the routed experts' GEMMs run in now, when not the compute dtype (`expert_gemm_dtype`)"""


@contextlib.contextmanager
def expert_gemm_dtype(dtype: torch.dtype | None):
    """Routed-expert GEMMs run inside in dtype (fp8.E4M3, or None: the compute dtype). fnmoe.training.step
    enters it around a micro-batch's forward and backward (backward's recomputes run the same GEMMs)."""
    if dtype not in (None, fp8.E4M3):
        raise ValueError(f"expert GEMMs run in the compute dtype or float8_e4m3fn, not {dtype}")
    global _dtype
    before, _dtype = _dtype, dtype
    try:
        yield
    finally:
        _dtype = before


def active() -> bool:
    """Whether routed-expert GEMMs run in fp8 now."""
    return _dtype is not None


_emulating = 0
"""how many CPU emulations of an fp8 GEMM are running (`emulating`)"""


@contextlib.contextmanager
def _emulation():
    global _emulating
    _emulating += 1
    try:
        yield
    finally:
        _emulating -= 1


def emulating() -> bool:
    """Whether the CPU emulation of an fp8 GEMM runs now: its float32 operands and output are
    storages a GPU's scaled GEMM never makes (fnmoe.plan.meters books them apart, so a rehearsal on
    CPU measures the GPU's bytes); the GEMM's output in the activations' dtype is made outside."""
    return _emulating > 0


def quantise_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in e4m3, the float32 scale of each 1x128 tile [M, ceil(K / 128)]) of x; x ~ q * s.

    In x's own dtype, not a float32 copy: a tile's amax is one of its elements, and a power-of-two
    scale is exact in bf16 as in float32, so q is the float32 path's to the bit, while the one
    temporary, x scaled, takes 2 bytes an element (the float32 path held ~12: on K2's busiest
    backward GEMM, 6 GB)."""
    x_MK = fp8.scalable(x_MK)
    M, K = x_MK.shape
    n = fp8.blocks(K)
    pad = n * TILE - K
    x_MGT = (x_MK if isinstance(pad, int) and pad == 0 and x_MK.is_contiguous()
             else F.pad(x_MK, (0, pad))).view(M, n, TILE)
    s = fp8.pow2_scale(x_MGT.abs().amax(-1).float())
    # unsqueeze and narrow, not [:, :, None] and [:, :K]: a simulated mesh's ragged rows take no indexing
    y = (x_MGT * s.reciprocal().to(x_MK.dtype).unsqueeze(-1)).view(M, n * TILE).narrow(1, 0, K)
    return y.clamp_(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3), s


def dequantise_rows(q_MK: torch.Tensor, s_MG: torch.Tensor) -> torch.Tensor:
    """q * s of quantise_rows, float32."""
    M, K = q_MK.shape
    n = s_MG.shape[1]
    q_MGT = F.pad(q_MK.float(), (0, n * TILE - K)).view(M, n, TILE)
    return (q_MGT * s_MG.unsqueeze(-1)).view(M, n * TILE).narrow(1, 0, K)


def _emulated_mm(x: torch.Tensor, w: torch.Tensor, end_E: torch.Tensor) -> torch.Tensor:
    """x_RK[r] @ w_EKN[expert of r] in float32 (the dequantised operands)."""
    if cpu_gemm.available():
        return torch.ops.fnmoe_cpu.grouped_mm(x, w, end_E, True)  # float32 operands: fp32 either way
    out, start = [], 0
    for e, end in enumerate(end_E.tolist()):  # host sync: where the C++ kernels did not build
        out.append(x[start:end] @ w[e])
        start = end
    return torch.cat(out)


def _emulated_wgrad(x: torch.Tensor, g: torch.Tensor, end_E: torch.Tensor) -> torch.Tensor:
    """x_RD[rows of e]^T @ g_RF[rows of e] for each expert e, float32 [E, D, F]."""
    if cpu_gemm.available():
        return torch.ops.fnmoe_cpu.grouped_mm_wgrad(x, g, end_E, torch.float32, True)
    out, start = [], 0
    for end in end_E.tolist():
        out.append(x[start:end].T @ g[start:end])
        start = end
    return torch.stack(out)


def _cuda_mm(a_q, a_s, b_q, b_s, recipe_b, offs, out_dtype, what: str) -> torch.Tensor:
    """torch's scaled grouped GEMM, or one line naming what this torch or GPU lacks."""
    mm, types = getattr(F, "scaled_grouped_mm", None), getattr(F, "ScalingType", None)
    if mm is None or types is None:
        raise RuntimeError(f"mesh.expert_gemm_dtype='float8_e4m3fn' on a GPU needs torch.nn.functional."
                           f"scaled_grouped_mm, which torch {torch.__version__} lacks")
    try:
        return mm(a_q, b_q, a_s, types.BlockWise1x128, b_s, getattr(types, recipe_b), offs=offs,
                  output_dtype=out_dtype)
    except (RuntimeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"mesh.expert_gemm_dtype='float8_e4m3fn': torch {torch.__version__}'s scaled_grouped_mm "
                           f"has no BlockWise1x128 x {recipe_b} kernel for the {what} on "
                           f"{torch.cuda.get_device_name()}: {first}") from e


def grouped_mm_fp8(xq, xs, wq, ws, end_E, out_dtype: torch.dtype) -> torch.Tensor:
    """y_RN = dequantised x_RK · dequantised w_EKN, grouped by expert; x in 1x128 tiles (xs [R, K/128]),
    w in 128x128 blocks (ws [E, K/128, N/128])."""
    if xq.device.type == "cuda":
        return _cuda_mm(xq, xs, wq, ws, "BlockWise128x128", end_E.to(torch.int32), out_dtype, "forward/input grad")
    with _emulation():
        y = _emulated_mm(dequantise_rows(xq, xs), fp8.dequantise(wq, ws, torch.float32), end_E)
    return y.to(out_dtype, copy=True)


def grouped_wgrad_fp8(xTq, xTs, gTq, gTs, end_E, out_dtype: torch.dtype) -> torch.Tensor:
    """dw_EDF = x_RD^T · g_RF per expert from x^T [D, R] and g^T [F, R], each in 1x128 tiles along R."""
    if xTq.device.type == "cuda":
        return _cuda_mm(xTq, xTs, gTq.T, gTs.T, "BlockWise1x128", end_E.to(torch.int32), out_dtype,
                        "weight grad").to(out_dtype)
    with _emulation():
        dw = _emulated_wgrad(dequantise_rows(xTq, xTs).T, dequantise_rows(gTq, gTs).T, end_E)
    return dw.to(out_dtype, copy=True)


class _Fp8GroupedMM(torch.autograd.Function):
    """y_RF = x_RD · w_EDF[expert of r] with every GEMM (forward, input and weight grad) in fp8."""

    @staticmethod
    def forward(ctx, x_RD, w_EDF, end_E):
        xq, xs = quantise_rows(x_RD)
        wq, ws = fp8.weight_blocks(w_EDF)
        xTq, xTs = quantise_rows(x_RD.T) if ctx.needs_input_grad[1] else (None, None)
        ctx.save_for_backward(xTq, xTs, wq, ws, end_E)
        ctx.dtypes, ctx.leaf = (x_RD.dtype, w_EDF.dtype), wgrad.leaf(w_EDF)
        return grouped_mm_fp8(xq, xs, wq, ws, end_E, x_RD.dtype)

    @staticmethod
    def backward(ctx, g_RF):
        xTq, xTs, wq, ws, end_E = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g_x = g_w = None
        if ctx.needs_input_grad[0]:
            gq, gs = quantise_rows(g_RF)
            g_x = grouped_mm_fp8(gq, gs, wq.transpose(1, 2), ws.transpose(1, 2), end_E, x_dtype)
        if ctx.needs_input_grad[1]:
            g_w = wgrad.weight_grad(ctx.leaf,
                                    lambda: grouped_wgrad_fp8(xTq, xTs, *quantise_rows(g_RF.T), end_E, w_dtype))
        return g_x, g_w, None


def grouped_mm(x_RD: torch.Tensor, w_EDF: torch.Tensor, end_E: torch.Tensor) -> torch.Tensor:
    """y_RF[r] = x_RD[r] @ w_EDF[expert of r] through fp8 (end_E: int64 cumulative row counts); y in
    x's dtype, w's gradient in w's."""
    return _Fp8GroupedMM.apply(x_RD, w_EDF, end_E)


def expert_mlp(x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E) -> torch.Tensor:
    """fnmoe.models.moe.expert_mlp's SwiGLU with its three GEMMs in fp8 (the SiLU and the product in x's dtype)."""
    end_E = torch.cumsum(counts_E, 0)
    h_RF = F.silu(grouped_mm(x_RD, w_gate_EDF, end_E)) * grouped_mm(x_RD, w_up_EDF, end_E)
    return grouped_mm(h_RF, w_down_EFD, end_E)
