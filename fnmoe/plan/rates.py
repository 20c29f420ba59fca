"""The rate table: rates measured on a GPU (tools/gpu_check.sh) or published (nccl-tests and the
issues that quote them), each row with its source, and the figures `--plan.rates measured` takes from
it: for each term the nearest row of the profile's GPU and the run's shape; the profile's stated
figure where no row is, and the plan names which terms were measured and which assumed. A figure
given in the `plan` section wins over both. Rows are added from measurements, never fitted to a
run's total (docs/memory_plan.md, "Rates: measured and stated").

Legend: M rows a GEMM multiplies (an expert's rows in one chunk), I and O its in and out dims.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fnmoe.config import RunConfig
from fnmoe.config.hardware import hardware
from fnmoe.plan.gemm_time import expert_gemm_shape

H200_CHECK = "tools/gpu_check.sh on one H200 (132 SMs, torch 2.11+cu130), 2026-12-04; docs/memory_plan.md, " \
             "\"Measured on one H200\""


@dataclass(frozen=True)
class Rate:
    term: str
    """the Hardware figure it gives: expert_matmul_tflops, matmul_tflops, attention_tflops, network_gbps"""
    gpus: tuple[str, ...]
    """the profiles it stands for (the GPU it ran on, and those with the same SMs and clocks for a
    compute-bound rate)"""
    value: float
    shape: tuple[int, int, int] | None
    """(M, I, O) of the GEMM it timed; None for a rate that does not depend on a GEMM's shape"""
    what: str
    source: str


HOPPER = ("jupiter-gh200", "dgx-h100")  # GH200 and H100 SXM: the H200's 132 SMs at the same clocks
RATES: tuple[Rate, ...] = (
    Rate("expert_matmul_tflops", HOPPER, 532.0, (683, 7168, 2048),
         "K2's routed experts (96 a GPU, 7168 x 2048, top-8), one block chunk of 2 x 4096 tokens, balanced: "
         "forward, recompute and backward in 43.4 ms", H200_CHECK),
    Rate("expert_matmul_tflops", HOPPER, 521.0, (853, 7168, 2048),
         "the same at imbalance 1.25 (the busiest GPU's 853 rows an expert): 55.4 ms for 1.25 x the FLOPs",
         H200_CHECK),
    Rate("matmul_tflops", HOPPER, 488.0, (8192, 7168, 2048),
         "K2's block compiled (71.0 ms) less its experts alone (43.4): 27.6 ms where the stated rates give 24.75 "
         "for its dense GEMMs and attention's core; one measurement does not split the two, so both take its "
         "0.897 of the stated rate", H200_CHECK),
    Rate("attention_tflops", HOPPER, 355.0, None,
         "the same block: MLA's core at 0.897 of the stated 396", H200_CHECK),
    Rate("network_gbps", ("jupiter-gh200",), 24.0, None,
         "NCCL across nodes on quad-GH200 nodes with 200 Gb/s a GPU (NCCL_NCHANNELS_PER_NET_PEER=4)",
         "https://github.com/NVIDIA/nccl/issues/1272"),
)


def measured_run(run: RunConfig) -> tuple[RunConfig, dict]:
    """run with each figure the rate table has for its profile's GPU and shapes, and {"measured":
    {figure: {value, stated, what, source}}, "assumed": [figures left at the stated rate]}. A figure
    the plan section gives is kept and counted as given."""
    hw, given = hardware(run.plan), {f.name for f in dataclasses.fields(run.plan) if _given(run.plan, f.name)}
    shape = expert_gemm_shape(run)
    measured, figures = {}, {}
    for term in ("expert_matmul_tflops", "matmul_tflops", "attention_tflops", "network_gbps"):
        rows = [r for r in RATES if r.term == term and run.plan.hardware in r.gpus]
        if term in given or not rows:
            continue
        row = min(rows, key=lambda r: _distance(r.shape, shape if term == "expert_matmul_tflops" else None))
        stated = getattr(hw, term) or hw.matmul_tflops
        figures[term] = row.value
        measured[term] = {"value": row.value, "stated": stated, "shape": row.shape, "what": row.what,
                          "source": row.source}
    terms = ("expert_matmul_tflops", "matmul_tflops", "attention_tflops", "hbm_tbps", "nvlink_gbps",
             "nvlink_a2a_gbps", "network_gbps", "d2h_gbps", "h2d_gbps")
    report = {"measured": measured, "given": sorted(t for t in terms if t in given),
              "assumed": [t for t in terms if t not in measured and t not in given]}
    return dataclasses.replace(run, plan=dataclasses.replace(run.plan, **figures)), report


def _given(plan, name: str) -> bool:
    return name not in ("imbalance", "state_dtype", "hardware", "dispatch", "rates") and getattr(plan, name) is not None


def _distance(a: tuple | None, b: tuple | None) -> float:
    """How far apart two GEMM shapes are: summed |log| ratios of M, I and O (0 without shapes)."""
    if a is None or b is None:
        return 0.0
    return sum(abs(math.log(x / y)) for x, y in zip(a, b))
