"""Whether each exchange that two whole-block chunks in flight hide behind the other chunk's compute
fits its window: the recorded op order (overlap.py) says an exchange has compute between its issue
and its wait, not that the compute lasts as long as the exchange. Here each window's compute and each
exchange's duration come from the plan, and what an exchange outlasts its window by is waited for.

Legend: N block chunks, T tokens a rank's micro-batch, L layers, M MoE layers.

The windows, by fnmoe.models.block_chunks (forward, a pair of chunks c and c+1 a MoE layer):
  c's dispatch behind c+1's attention; c+1's dispatch behind c's experts; c's combine behind c+1's
  experts; c+1's combine behind c's output step (its shared expert) and c+2's attention.
In backward (the exchange replayed, memory.keep_exchange off), for every chunk but the last
differentiated: chunk c-1's replayed dispatch behind chunk c's MoE part (its experts' input and weight
gradients, its shared expert's), its replayed combine behind chunk c's attention backward. The
replayed exchanges run on their own group (fnmoe.parallel.replay), so none queues behind a gradient
backward waits for; on the forward's one group the exchanges run in issue order, which is their
windows' order, so each excess is counted once.
"""
from __future__ import annotations

from fnmoe.config import RunConfig
from fnmoe.config.hardware import hardware
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.plan.flops import region_flops
from fnmoe.plan.gemm_time import routed_expert_s, routed_flops_per_token
from fnmoe.plan.state import GB


def window_excess_s(run: RunConfig, comm: dict, recv: float) -> dict[str, float]:
    """{phase: seconds a step the busiest rank waits for exchanges that outlast their windows}; 0.0
    where no chunks are in flight (a whole block, no expert parallelism). recv: step_time's
    ep_receive_factor; comm: comm_bytes."""
    cfg, N = run.model, run.memory.block_chunks
    if run.mesh.ep == 1 or not cfg.moe.n_experts or N == 1 or run.memory.recompute != "full":
        return {"forward": 0.0, "backward": 0.0}
    w = windows_s(run)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    passes = n_moe * N * run.train.grad_accum
    t = pass_s(run, comm["parts"]["forward/all_to_all/blocks"], recv) / (2 * passes)
    forward = sum(max(0.0, t - win) for win in (w["attention"], w["experts"], w["experts"],
                                                 w["output"] + w["attention"])) * passes / 2
    backward = 0.0
    if not run.memory.keep_exchange:
        backward = (max(0.0, t - w["moe_backward"]) + max(0.0, t - w["attention_backward"])) \
            * n_moe * (N - 1) * run.train.grad_accum
    return {"forward": forward, "backward": backward}


def pass_s(run: RunConfig, link: dict, recv: float) -> float:
    """Seconds an all-to-all's bytes (link: inside and across nodes) take on the busiest rank."""
    hw = hardware(run.plan)
    return recv * max(link["intra"] / (hw.nvlink_a2a_gbps * GB), link["inter"] / (hw.network_gbps * GB))


def windows_s(run: RunConfig) -> dict[str, float]:
    """Seconds of one chunk's compute a MoE layer on the busiest rank: its attention (GEMMs and core),
    its experts, its output step (the shared expert and router), in forward; its MoE part and its
    attention in backward (twice the forward's FLOPs)."""
    hw, cfg, N = hardware(run.plan), run.model, run.memory.block_chunks
    gemm, attn = hw.matmul_tflops * 1e12, hw.attention_tflops * 1e12
    f, tokens = region_flops(run), tokens_per_rank(run) / N
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    attention = tokens * (f["attention"] / cfg.n_layers / gemm + f["attention_core"] / cfg.n_layers / attn)
    output = tokens * (f["moe"] - routed_flops_per_token(run)) / n_moe / gemm
    experts = routed_expert_s(run, recomputed=True)
    chunks = n_moe * N * run.train.grad_accum
    fwd = experts["forward"] / chunks
    return {"attention": attention, "experts": fwd, "output": output,
            "moe_backward": experts["backward"] / chunks - fwd + 2 * output, "attention_backward": 2 * attention}
