"""The step-time model set against published, measured MoE training runs whose layout fnmoe can
express (FSDP x EP on a preset's shapes; no pipeline or tensor parallelism, bf16 GEMMs): a
validation table, not a calibration. Each run's residual (measured over planned, at the stated and
at the measured rates) and their spread say how far the model is from runs it does not describe
whole; no factor is fitted to them (the rates are measured term by term: rates.py).
docs/memory_plan.md "Validation against measured runs" is tools/calibration_table.py's output of
this data (checked by tests/test_calibration.py), so change the data here and regenerate the page.
"""
from __future__ import annotations

from dataclasses import dataclass

from fnmoe.config import RunConfig


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
    *(MeasuredRun(
        f"TorchTitan, DeepSeek-V3-16B, 8 x B200, local batch {lbs}",
        "https://github.com/pytorch/torchtitan/pull/1993 (the notes of a user's runs)",
        f"8 GPUs, FSDP 8, EP 1; seq 4096, local batch {lbs}; no activation checkpointing; compiled model and "
        f"loss; {mfu}% MFU as TorchTitan counts it (peak 2,250 TFLOP/s), read as {mfu}% x 2,250 TFLOP/s / "
        "fnmoe's 16.41 GFLOP a token (DeepSeek-V3-16B at 4096)",
        f"--config configs/deepseek_v3_16b.toml --plan.hardware dgx-b200 --mesh.fsdp 8 --mesh.ep 1 "
        f"--train.batch-size {8 * lbs} --train.grad-accum 1 --data.seq-len 4096 --memory.no-offload "
        "--memory.recompute none --plan.imbalance 1",
        mfu / 100 * 2250e12 / 16.41e9,
        "TorchTitan's MFU counts FLOPs its own way (within a few % of fnmoe's); real routing's imbalance; "
        "64 small experts (2048 x 1408) a layer; the optimizer step's time")
      for lbs, mfu in ((4, 18), (6, 20))),
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

def residuals(run: RunConfig, p: dict, measured: float) -> dict:
    """A run's measured tokens/s/GPU over its as-built projection at each rates (p: its plan; the serial
    figure where no as-built one was recorded)."""
    out = {}
    for t in (p["step_time"], p["step_time_beside"]):
        mode = p["rates"]["mode"] if t is p["step_time"] else t["rates"]
        out[mode] = measured / t.get("tokens_per_s_per_gpu_as_built", t["tokens_per_s_per_gpu_serial"])
    return out
