"""Routed-expert GEMM time a step on the busiest rank: each GEMM at the roofline, max(FLOPs / the
sustained GEMM rate, bytes / the sustained HBM bandwidth), and the rows the busiest rank's experts
receive, `plan.imbalance` times the mean under expert parallelism.

Legend: T tokens of a rank's micro-batch, K top-k, E experts, X experts a rank holds (E/ep),
N chunks (model.moe.token_chunks of the MoE region, or memory.block_chunks of the whole block:
either way the experts run once a chunk), r rows an expert gets in one chunk, I and O a matrix's
in and out dims.

A chunk runs each expert's matrices on r = T·K·imbalance / X / N rows. Forward (and its recompute
in backward) and the input gradient each read the expert's weight I·O and the rows' inputs and
outputs; the weight gradient reads the rows' inputs and output gradients and writes its I·O
result, which autograd then adds in place into the gathered weight's gradient (fnmoe/models/moe_chunks.py:
read both, write one) every chunk but the first: 4N - 3 passes over I·O a step of N chunks, where a
GEMM accumulating into its output would make N. fp8 GEMMs (mesh.expert_gemm_dtype) add their
operands' quantisation passes: the rows' every GEMM, a weight's once a gather (its blocks serve every
chunk) and never behind fp8 gathers of whole experts, whose packs are the blocks. With few rows a
chunk the weight's bytes outlast its FLOPs: on the busiest GH200 of the K2 preset (373 rows an
expert a chunk) the weight gradient is HBM-bound and the forward is not; in 64 chunks (93 rows) both are.
"""
from __future__ import annotations

from functools import lru_cache

from fnmoe.config import ModelConfig, RunConfig
from fnmoe.config.hardware import hardware
from fnmoe.dtypes import DTYPE_BYTES
from fnmoe.tree import leaf_kind
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.plan.state import leaf_shapes


def rows_per_expert(run: RunConfig) -> float:
    """r: rows one expert of the busiest rank gets in one chunk of a micro-batch."""
    m, ep = run.model.moe, run.mesh.ep
    imbalance = run.plan.imbalance if ep > 1 else 1.0  # one ep rank computes its own tokens: nothing to wait for
    return tokens_per_rank(run) * m.top_k * imbalance * ep / m.n_experts / expert_chunks(run)


def expert_chunks(run: RunConfig) -> int:
    """N: the chunks a micro-batch's experts run in (a MoE region's token chunks, a block's chunks)."""
    return run.model.moe.token_chunks * run.memory.block_chunks


def routed_flops_per_token(run: RunConfig) -> float:
    """Forward FLOPs a token spends in routed experts, all layers (balanced: K of E experts)."""
    m = run.model.moe
    return sum(2.0 * I * O * m.top_k for I, O in _expert_matrices(run.model))


def expert_gemm_shape(run: RunConfig) -> tuple[int, int, int] | None:
    """(r, I, O) of the busiest rank's largest expert GEMM in one chunk; None for a dense model."""
    mats = _expert_matrices(run.model)
    return (round(rows_per_expert(run)), *max(mats)) if mats else None


@lru_cache(maxsize=64)
def _expert_matrices(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """(I, O) of one expert's matrix, for every expert stack of every layer (`plan --search` asks
    for thousands of layouts of one model)."""
    return tuple((shape[-2], shape[-1]) for path, shape in leaf_shapes(cfg) if leaf_kind(path) == "expert")


def routed_expert_s(run: RunConfig, recomputed: bool) -> dict:
    """Seconds the busiest rank spends in routed-expert GEMMs a step (every micro-batch), by phase:
    forward, and backward (input and weight gradients, plus the forward again when the MoE region
    is `recomputed`)."""
    hw, m = hardware(run.plan), run.model.moe
    if not m.n_experts:  # a dense model
        return {"forward": 0.0, "backward": 0.0}
    rate, hbm = (hw.expert_matmul_tflops or hw.matmul_tflops) * 1e12, hw.hbm_tbps * 1e12
    s = o = DTYPE_BYTES[run.model.compute_dtype]  # an operand's bytes, an output's
    fp8 = fp8_gemms(run)
    if fp8:
        rate, s = (hw.fp8_matmul_tflops or 2 * hw.matmul_tflops) * 1e12, 1
    r, X, N = rows_per_expert(run), m.n_experts // run.mesh.ep, expert_chunks(run)

    def gemm(flops: float, nbytes: float) -> float:
        return max(flops / rate, nbytes / hbm)

    def quantised(elems: float) -> float:
        """fp8's quantisation pass of an operand: read in the compute dtype, written 1 byte an element."""
        return (o + 1) * elems / hbm if fp8 else 0.0
    # a stack's blocks are made once a gather (fnmoe.kernels.fp8_blocks.weight_blocks), not once a chunk
    weight_passes = 0.0 if gathered_packs(run) else 1.0 / N
    forward = input_grad = weight_grad = 0.0
    for I, O in _expert_matrices(run.model):
        flops = 2.0 * r * I * O
        forward += gemm(flops, s * (I * O + r * I) + o * r * O) + quantised(r * I + I * O * weight_passes)
        input_grad += gemm(flops, s * (I * O + r * O) + o * r * I) + quantised(r * O)
        weight_grad += gemm(flops, s * r * (I + O) + o * I * O * (4 * N - 3) / N) + quantised(r * (I + O))
    per_step = X * N * run.train.grad_accum
    return {"forward": per_step * forward,
            "backward": per_step * (forward * (1 if recomputed else 0) + input_grad + weight_grad)}


def fp8_gemms(run: RunConfig) -> bool:
    """Whether the routed experts' GEMMs run in fp8 (mesh.expert_gemm_dtype)."""
    return getattr(run.mesh, "expert_gemm_dtype", "compute") == "float8_e4m3fn"


def gathered_packs(run: RunConfig) -> bool:
    """Whether fp8 expert GEMMs take their weights' blocks from the fp8 gathers' packs (no quantisation
    of a weight): gathers in fp8 of whole experts a rank (fsdp x ep divides E; fnmoe.parallel.fp8.unpack)."""
    m, mesh = run.model.moe, run.mesh
    return (fp8_gemms(run) and mesh.expert_gather_dtype == "float8_e4m3fn" and mesh.fsdp > 1
            and m.n_experts % (mesh.fsdp * mesh.ep) == 0)


def moe_layer_expert_s(run: RunConfig, recomputed: bool) -> dict:
    """routed_expert_s of one MoE layer on one chunk of a micro-batch, by phase: every MoE layer has
    the same expert stacks (tools/gpu_checks/k2layer.py times one such layer beside it)."""
    n_moe = sum(run.model.is_moe_layer(i) for i in range(run.model.n_layers))
    if not n_moe:
        raise ValueError("moe_layer_expert_s: the model has no MoE layer (model.moe.n_experts=0)")
    n = n_moe * expert_chunks(run) * run.train.grad_accum
    return {phase: s / n for phase, s in routed_expert_s(run, recomputed).items()}
