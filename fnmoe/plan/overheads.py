"""Work a real step does beside its model FLOPs and collectives, each a named term of the step time
(step_time.py adds them to their phase's compute): Muon's Newton-Schulz iterations, the head's logits
recomputed under CE chunks, the dequantising of fp8 expert gathers, the quantising of fp8 block inputs
for the host and their dequantising for the recompute, the count exchange's host
syncs, and the optimizer update's passes over the state. Sources and figures: docs/memory_plan.md,
"What a real NCCL step costs".

Legend: m, n a Muon matrix's short and long side, T tokens a rank a step, D model, V vocab.
"""
from __future__ import annotations

import math
from functools import lru_cache

from fnmoe.config import ModelConfig, RunConfig
from fnmoe.config.hardware import hardware
from fnmoe.optim.base import default_label
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.plan.state import expert_numels, expert_pack_bytes, leaf_shapes, state_bytes
from fnmoe.tree import leaf_kind

def overheads_s(run: RunConfig) -> dict[str, tuple[str, float]]:
    """{term: (phase, seconds a step on the busiest rank)}, every term present (0.0 where the run
    does not pay it), so a plan names what it charged."""
    dequant, syncs, inputs = fp8_dequant_s(run), count_sync_s(run), fp8_inputs_s(run)
    return {"muon newton-schulz": ("update", muon_ns_s(run)),
            "head logits recomputed": ("backward", head_recompute_s(run)),
            "fp8 gather dequantise": ("forward", dequant[0]),
            "fp8 gather dequantise (backward)": ("backward", dequant[1]),
            "fp8 block inputs quantise": ("forward", inputs[0]),
            "fp8 block inputs dequantise": ("backward", inputs[1]),
            "count exchange syncs": ("forward", syncs[0]),
            "count exchange syncs (recompute)": ("backward", syncs[1]),
            "update passes": ("update", update_passes_s(run))}


def muon_ns_s(run: RunConfig) -> float:
    """Newton-Schulz on every Muon matrix (each whole matrix on one rank: a rank's share is the
    total over the world), ns_steps iterations of 4·m²·n + 2·m³ FLOPs, in bf16 at the GEMM rate."""
    if run.optim.name != "muon":
        return 0.0
    flops = run.optim.ns_steps * _ns_flops_per_step(run.model) / run.mesh.world
    return flops / (hardware(run.plan).matmul_tflops * 1e12)


@lru_cache(maxsize=64)
def _ns_flops_per_step(cfg: ModelConfig) -> float:
    """One iteration over every Muon matrix: A = X·Xᵀ (2m²n), A·A (2m³), B·X (2m²n)."""
    total = 0.0
    for path, shape in leaf_shapes(cfg):
        if leaf_kind(path) == "buffer" or default_label(path, len(shape), True) != "muon":
            continue
        m, n = sorted(shape[-2:])
        total += math.prod(shape[:-2]) * (4.0 * m * m * n + 2.0 * m ** 3)
    return total


def head_recompute_s(run: RunConfig) -> float:
    """train.ce_chunks > 1 checkpoints each chunk's norm and logits: backward runs the head's forward
    GEMM again, 2·T·D·V FLOPs."""
    if run.train.ce_chunks <= 1:
        return 0.0
    tokens = tokens_per_rank(run) * run.train.grad_accum
    return 2.0 * tokens * run.model.dim * run.model.vocab_size / (hardware(run.plan).matmul_tflops * 1e12)


def fp8_inputs_s(run: RunConfig) -> tuple[float, float]:
    """(forward, backward) under memory.offload_dtype: each offloaded block input (every block but
    the last) quantised in 1x128 tiles (read in the compute dtype, written 1 byte an element), and
    dequantised for its recompute (read 1, a float32 product written and read, the input written)."""
    if run.memory.offload_dtype == "compute" or not run.memory.offload:
        return 0.0, 0.0
    s = 2 if run.model.compute_dtype == "bfloat16" else 4
    elems = tokens_per_rank(run) * run.train.grad_accum * run.model.dim * (run.model.n_layers - 1)
    hbm = hardware(run.plan).hbm_tbps * 1e12
    return elems * (s + 1) / hbm, elems * (1 + 4 + 4 + s) / hbm


def fp8_dequant_s(run: RunConfig) -> tuple[float, float]:
    """(forward, backward): with fp8 expert gathers each gathered stack is dequantised into the compute
    dtype once a gather: its fp8 pack read (1 byte an element and the block scales) and the copy
    written, at the HBM rate; backward gathers again when resharding or under full recompute."""
    mesh = run.mesh
    if mesh.expert_gather_dtype != "float8_e4m3fn" or mesh.world == 1:
        return 0.0, 0.0
    elems = _expert_elems(run.model, mesh.ep)
    pack = expert_pack_bytes(run.model, mesh.fsdp, mesh.ep) * mesh.fsdp  # every shard's pack, received
    s = 2 if run.model.compute_dtype == "bfloat16" else 4
    once = run.train.grad_accum * (pack + s * elems) / (hardware(run.plan).hbm_tbps * 1e12)
    again = mesh.reshard_after_forward or run.memory.recompute == "full"
    return once, once if again else 0.0


@lru_cache(maxsize=256)
def _expert_elems(cfg: ModelConfig, ep: int) -> int:
    """Elements of the expert stacks a rank gathers, every layer (`plan --search` asks often)."""
    return sum(expert_numels(cfg, ep))


def count_sync_s(run: RunConfig) -> tuple[float, float]:
    """(forward, backward): the count exchange before each dispatch waits on the host (the splits of
    the all-to-all), once a MoE layer a chunk of a pass that routes; the recompute routes again."""
    cfg = run.model
    if run.mesh.ep == 1 or not cfg.moe.n_experts:
        return 0.0, 0.0
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    chunks = cfg.moe.token_chunks * run.memory.block_chunks
    once = n_moe * chunks * run.train.grad_accum * hardware(run.plan).host_sync_us * 1e-6
    recomputed = run.memory.recompute == "full" or run.memory.moe == "full"
    return once, once if recomputed else 0.0


def update_passes_s(run: RunConfig) -> float:
    """The optimizer update reads the rank's params, gradients and optimizer state and writes the
    params and the state back, once (a lower bound: the fused AdamW's one kernel a leaf; Muon's
    momentum and its update are further elementwise passes, not counted)."""
    b = state_bytes(run)
    return (2 * b["params"] + b["grads"] + 2 * b["optim"]) / (hardware(run.plan).hbm_tbps * 1e12)
