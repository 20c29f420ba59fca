"""The step-time model set against published, measured MoE training runs whose layout fnmoe can
express (FSDP x EP on a preset's shapes; no pipeline or tensor parallelism, bf16 GEMMs), and the
calibrated projection `fnmoe plan` prints beside the stated-rate one.

A run's implied factor is what its profile's GEMM and attention rates must be multiplied by for its
as-built projection to equal its measured tokens/s/GPU; RATE_FACTOR is the geometric mean of the
implied factors of RUNS. The calibrated projection is the step time at the rates x RATE_FACTOR:
everything else (collectives, HBM-bound expert GEMMs, offload copies) as stated. docs/memory_plan.md
"Calibration against measured runs" is tools/calibration_table.py's output of this data (checked by
tests/test_calibration.py), so change the data here and regenerate the page.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fnmoe.config import RunConfig
from fnmoe.config.hardware import hardware
from fnmoe.plan.step_time import step_time


@dataclass(frozen=True)
class MeasuredRun:
    name: str
    source: str
    """the address the measured figure and the layout were read from"""
    layout: str
    """the layout as the source states it"""
    flags: str
    """`fnmoe plan` arguments that express it (a preset and overrides)"""
    tokens_per_s_per_gpu: float
    """measured"""
    left_out: str
    """what the planned run does not model of the measured one"""


NEMO_SUMMARY = "https://docs.nvidia.com/nemo/automodel/latest/performance/performance-summary.md"
RUNS: tuple[MeasuredRun, ...] = (
    MeasuredRun(
        "NeMo AutoModel, Qwen3-30B-A3B, 8 x H100",
        f"{NEMO_SUMMARY}; recipe https://github.com/NVIDIA-NeMo/Automodel, "
        "examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml",
        "8 GPUs, EP 8 and FSDP 8 over the same 8, no TP/PP; GBS 512 x 4096, LBS 4, GA 16; whole-block "
        "activation checkpointing; TE + DeepEP, fake balanced gate; bf16 params and Adam (the table's first "
        "version, 2025-10-06, said 11,842)",
        "--config configs/qwen3_30b_a3b.toml --plan.hardware dgx-h100 --mesh.fsdp 1 --mesh.ep 8 "
        "--train.batch-size 512 --train.grad-accum 16 --memory.recompute full --memory.no-offload "
        "--memory.no-keep-exchange --plan.imbalance 1",
        12_040.0,
        "DeepEP's fused dispatch and its overlap with the experts (fnmoe's model waits for each combine); "
        "TE's kernels; the optimizer step's time; memory: it does not fit fnmoe (below)"),
    MeasuredRun(
        "TorchTitan, Qwen3-30B-A3B, 8 x B200 (a user's run)",
        "https://github.com/mlc-ai/pith-train/issues/79",
        "8 GPUs, FSDP 8, EP 1, PP 1; seq 8192, MBS 8, GBS 64; selective activation checkpointing; "
        "compiled blocks and loss; real data (DCLM); 19.41k, 19.53k, 19.52k tok/s/GPU in three steps",
        "--config configs/qwen3_30b_a3b.toml --plan.hardware dgx-b200 --mesh.fsdp 8 --mesh.ep 1 "
        "--train.batch-size 64 --train.grad-accum 1 --data.seq-len 8192 --memory.no-offload "
        "--memory.recompute none --memory.attention selective --memory.moe selective --memory.mlp selective",
        19_490.0,
        "TorchTitan's op-level selective checkpointing recomputes some GEMMs (fnmoe's selective only cheap "
        "ops); per-expert GEMM efficiency at 128 experts on real routing; the optimizer step's time"),
)

UNEXPRESSED: tuple[tuple[str, str, str], ...] = (
    ("NeMo AutoModel DeepSeek-V3 671B on 256 and 1,024 H100 (1,002 and 865 tok/s/GPU), Kimi-K2 on 256 H100 "
     "(924)", NEMO_SUMMARY,
     "pipeline parallelism (PP 4 / PP 8)"),
    ("NeMo AutoModel Nemotron V3 Nano 30B, Super 120B, Ultra 550B",
     NEMO_SUMMARY,
     "hybrid Mamba-attention models: not a shape fnmoe has"),
    ("NeMo AutoModel GPT-OSS 20B (8 H100, FSDP 8) and 120B (64 H100, FSDP 64)",
     NEMO_SUMMARY,
     "GPT-OSS's sliding-window attention with sinks, biased experts and clamped SwiGLU are not fnmoe shapes"),
    ("Megatron-Bridge Qwen3-30B-A3B on 8 B200 / GB200 / B300 / GB300 (EP 8) and 16 H100 (EP 16)",
     "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary.md (and its archive)",
     "FP8 / MXFP8 GEMMs (fnmoe computes in bf16); some H100 rows also use PP 2"),
    ("Megatron-Bridge GPT-OSS 120B BF16 on 64 B200 / GB200 (EP 8 / 64)",
     "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary-archive.md",
     "GPT-OSS's shapes (above)"),
    ("Megatron-Bridge DeepSeek-V3 and Qwen3-235B-A22B",
     "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary.md",
     "pipeline parallelism; FP8 / MXFP8"),
    ("TorchTitan + DeepEP (NousResearch), Qwen3-30B-A3B, 8 to 128 GPUs, EP 8: 14,796 tok/s/GPU on one node",
     "https://github.com/NousResearch/torchtitan/pull/19",
     "not planned: what was read of it gives neither the sequence length and batch nor the GPU"),
    ("TorchTitan DeepSeek-V3 671B on 256 B200 (Nebius)", "ml-cookbook recipe (../shared/ANCHORS.md)",
     "TP 2 and PP 2"),
)

RATE_FACTOR = 0.71
"""geometric mean of the implied factors of RUNS (tools/calibration_table.py derives it; the test
checks it still does)"""


def with_rates(run: RunConfig, factor: float) -> RunConfig:
    """run with its hardware's GEMM and attention rates multiplied by factor."""
    hw = hardware(run.plan)
    return dataclasses.replace(run, plan=dataclasses.replace(
        run.plan, matmul_tflops=hw.matmul_tflops * factor, attention_tflops=hw.attention_tflops * factor))


def calibrated(run: RunConfig, fpt: float, comm: dict, host_bytes: int, exposed: dict | None) -> dict:
    """The step time's tokens/s/GPU at the calibrated rates (step_time's arguments)."""
    fast = with_rates(run, RATE_FACTOR)
    t, hw = step_time(fast, fpt, comm, host_bytes, exposed), hardware(fast.plan)
    keys = ("tokens_per_s_per_gpu_as_built", "tokens_per_s_per_gpu_overlapped", "tokens_per_s_per_gpu_serial")
    return {"rate_factor": RATE_FACTOR, "matmul_tflops": hw.matmul_tflops, "attention_tflops": hw.attention_tflops,
            "bound": t["bound"], **{k: t[k] for k in keys if k in t}}


def implied_factor(run: RunConfig, p: dict, measured: float) -> float:
    """The factor on run's GEMM and attention rates at which its as-built projection (p: its plan,
    as built) equals `measured` tokens/s/GPU; ValueError where no rate reaches it (the collectives
    fnmoe waits for alone take longer). Bisection: the projection rises with the rates."""
    exposed = {tuple(k.split("/")): v for k, v in p["step_time"]["exposed_fractions"].items()}

    def projected(factor: float) -> float:
        return step_time(with_rates(run, factor), p["flops_per_token"], p["comm_bytes_detail"],
                         p["per_rank_bytes"]["offload_host"], exposed)["tokens_per_s_per_gpu_as_built"]
    lo, hi = 1 / 64, 64.0
    if projected(hi) < measured:
        raise ValueError(f"{measured:,.0f} tok/s/GPU is past {run.name}'s projection at any GEMM rate")
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if projected(mid) < measured else (lo, mid)
    return math.sqrt(lo * hi)
