"""Hardware profiles for the planner: `[plan] hardware = "NAME"` (`--plan.hardware`) picks one, and
any figure given in the `plan` section overrides the profile's.

Every figure is a GPU's: memory usable by one training process, and sustained (achieved) rates, one
direction. Units are decimal: GB = 1e9 bytes, GB/s = 1e9 bytes a second, TB/s = 1e12, TFLOP/s =
1e12 FLOP a second (a card sold as "96 GB" of HBM holds 96 GiB = 103 GB). Sources and the reasoning
behind each "usable" and "achieved" figure: docs/memory_plan.md, "Hardware profiles". `custom` has
no figures of its own: every one must be given.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Annotated

from fnmoe.config.schema import NonNegativeFloat, PlanConfig, PositiveFloat, Range


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: Annotated[int, Range(1)]
    """GPUs that share the fast in-node links"""
    hbm_gb: NonNegativeFloat
    """device memory a training process can use, GB (1e9 B)"""
    host_gb: NonNegativeFloat
    """host memory a GPU's process can use for offload, GB (1e9 B)"""
    matmul_tflops: PositiveFloat
    """sustained bf16 GEMM rate, TFLOP/s"""
    hbm_tbps: PositiveFloat
    """sustained device-memory bandwidth, TB/s (1e12 B/s): a GEMM on few rows is bound by reading its weight"""
    attention_tflops: PositiveFloat
    """sustained flash-attention rate (forward and backward), TFLOP/s"""
    nvlink_gbps: PositiveFloat
    """ring collectives inside a node, GB/s a GPU, achieved"""
    nvlink_a2a_gbps: PositiveFloat
    """an all-to-all inside a node, GB/s a GPU, achieved (every peer at once)"""
    network_gbps: PositiveFloat
    """collectives across nodes, GB/s a GPU, achieved"""
    network_nominal_gbps: PositiveFloat
    """the cross-node line rate a GPU, GB/s: no layout's cross-node traffic moves faster"""
    d2h_gbps: PositiveFloat
    """device -> host copies (offload's copies out), GB/s a GPU with every GPU of the node copying"""
    h2d_gbps: PositiveFloat
    """host -> device copies (offload's reloads), GB/s a GPU with every GPU of the node copying"""
    # below: figures every profile shares unless given (custom too); sources in docs/memory_plan.md,
    # "What a real NCCL step costs"
    nccl_ring_slowdown: NonNegativeFloat = 0.05
    """the fraction by which compute slows while an NCCL ring (all-gather, reduce-scatter) runs beside
    it: its kernel holds SMs the GEMMs would use"""
    nccl_a2a_slowdown: NonNegativeFloat = 0.05
    """the same while an NCCL all-to-all runs beside compute"""
    host_sync_us: NonNegativeFloat = 50.0
    """microseconds a host sync costs the GPU (the count exchange before each dispatch: the copy of
    the counts, the wait, the launches queued again)"""
    expert_matmul_tflops: PositiveFloat | None = None
    """sustained routed-expert grouped-GEMM rate, TFLOP/s; None: matmul_tflops"""
    fp8_matmul_tflops: PositiveFloat | None = None
    """sustained fp8 GEMM rate (--mesh.expert-gemm-dtype float8_e4m3fn), TFLOP/s: the fp8 dense peak at
    the bf16 rate's achieved fraction; None: twice matmul_tflops (Hopper's and Blackwell's fp8 peak)"""


FIGURES = tuple(f.name for f in dataclasses.fields(Hardware) if f.default is dataclasses.MISSING)
"""the figures a profile must give (custom: every one)"""
SHARED = tuple(f.name for f in dataclasses.fields(Hardware) if f.default is not dataclasses.MISSING)
OPTIONAL_RATES = ("expert_matmul_tflops", "fp8_matmul_tflops")
"""the figures None leaves to another (the checks of their annotation do not reach inside an Optional)"""

PROFILES: dict[str, Hardware] = {
    # JUPITER Booster: 4 GH200 a node (96 GiB HBM3: CUDA sees ~97.9k MiB = 102.7 GB; 120 GB LPDDR5X
    # each), NVLink 4 NV6 between every pair, 4x InfiniBand NDR200 a node
    "jupiter-gh200": Hardware(gpus_per_node=4, hbm_gb=96.0, host_gb=100.0, matmul_tflops=989.0 * 0.55,
                              hbm_tbps=4.0 * 0.9, attention_tflops=989.0 * 0.4, nvlink_gbps=150.0,
                              nvlink_a2a_gbps=360.0, network_gbps=22.0,
                              network_nominal_gbps=25.0, d2h_gbps=150.0, h2d_gbps=400.0,
                              fp8_matmul_tflops=1979.0 * 0.55),
    # DGX H100: 8 H100 SXM (80 GiB HBM3: CUDA sees 81,559 MiB = 85.5 GB) on NVSwitch, 2 TB DDR5 a node,
    # 8x ConnectX-7 NDR400 (one a GPU), PCIe Gen5 x16 to the host
    "dgx-h100": Hardware(gpus_per_node=8, hbm_gb=80.0, host_gb=200.0, matmul_tflops=989.0 * 0.55,
                         hbm_tbps=3.35 * 0.9, attention_tflops=989.0 * 0.4, nvlink_gbps=360.0, nvlink_a2a_gbps=360.0,
                         network_gbps=40.0,
                         network_nominal_gbps=50.0, d2h_gbps=50.0, h2d_gbps=50.0, fp8_matmul_tflops=1979.0 * 0.55),
    # DGX B200: 8 B200 SXM (sold as 180 GB HBM3e; CUDA sees ~178.4 GiB = 191.5 GB, 8 TB/s) on NVSwitch (NVLink 5,
    # 14.4 TB/s a node = 900 GB/s a direction a GPU), 8x ConnectX-7 NDR400 (one a GPU), PCIe Gen5 x16 to the
    # host, 1.8-2 TB DDR5 a node; 2,250 TFLOP/s dense bf16 a GPU at 1,000 W. The same usable and achieved
    # fractions as dgx-h100; sources in docs/memory_plan.md
    "dgx-b200": Hardware(gpus_per_node=8, hbm_gb=179.0, host_gb=200.0, matmul_tflops=2250.0 * 0.55,
                         hbm_tbps=8.0 * 0.9, attention_tflops=2250.0 * 0.4, nvlink_gbps=720.0, nvlink_a2a_gbps=720.0,
                         network_gbps=40.0, network_nominal_gbps=50.0, d2h_gbps=50.0, h2d_gbps=50.0,
                         fp8_matmul_tflops=4500.0 * 0.55),
}


@functools.lru_cache(maxsize=64)
def hardware(plan: PlanConfig) -> Hardware:
    """The figures a plan section stands for: its profile's, each overridden by a figure it gives.
    ValueError naming the missing figures for `custom`, and an unknown profile."""
    if plan.hardware == "custom":
        missing = [name for name in FIGURES if getattr(plan, name) is None]
        if missing:
            raise ValueError(f"plan.hardware = 'custom' needs every figure; missing: "
                             f"{', '.join('plan.' + m for m in missing)} (or name a profile: {', '.join(PROFILES)})")
        return Hardware(**{name: getattr(plan, name) for name in FIGURES},
                        **{name: getattr(plan, name) for name in SHARED if getattr(plan, name) is not None})
    if plan.hardware not in PROFILES:
        raise ValueError(f"plan.hardware = {plan.hardware!r} is not a profile; known: "
                         f"{', '.join([*PROFILES, 'custom'])}")
    given = {name: getattr(plan, name) for name in FIGURES + SHARED if getattr(plan, name) is not None}
    return dataclasses.replace(PROFILES[plan.hardware], **given)
