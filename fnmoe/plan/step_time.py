"""The step-time model: compute at stated sustained rates, collectives over the two-level network,
offload copies over the host link; overlapped and serial bounds, and what bounds the step.
"""
from __future__ import annotations

import math

from fnmoe.config import RunConfig
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.plan.comm import ep_link_bytes
from fnmoe.plan.state import GB, leaf_shapes


def region_flops(run: RunConfig) -> dict:
    """Forward FLOPs per token of every region kind summed over layers: {attention (its GEMMs),
    attention_core (q·k and p·v), moe, mlp}; recompute repeats a region's forward in backward."""
    cfg = run.model
    out = {"attention": 0.0, "attention_core": 0.0, "moe": 0.0, "mlp": 0.0}
    for path, shape in leaf_shapes(cfg):
        parts = path.split(".")
        if parts[0] != "layers" or len(shape) < 2:
            continue
        n = math.prod(shape) * (cfg.moe.top_k / cfg.moe.n_experts if path.endswith(("_EDF", "_EFD")) else 1)
        out["attention" if parts[2] == "attn" else parts[2]] += 2.0 * n
    out["attention_core"] = 1.0 * cfg.n_layers * run.data.seq_len * cfg.n_heads * (cfg.qk_head_dim_ + cfg.v_head_dim_)
    return out


def recompute_flops(run: RunConfig) -> tuple[float, float]:
    """(GEMM, attention-core) FLOPs per token recomputed in backward: every region under full
    recompute, the regions whose policy is 'full' otherwise; selective recompute redoes norms and
    pointwise ops only, which the model counts as free."""
    f, mem = region_flops(run), run.memory
    if mem.recompute == "full":
        return f["attention"] + f["moe"] + f["mlp"], f["attention_core"]
    gemm = sum(f[r] for r in ("attention", "moe", "mlp") if getattr(mem, r) == "full")
    return gemm, f["attention_core"] if mem.attention == "full" else 0.0


def step_time(run: RunConfig, fpt: float, comm: dict, host_bytes: int) -> dict:
    """A model, not a measurement: compute at the stated sustained rates (GEMMs, and attention's
    core at its own rate), collectives over the two-level network of plan_net (nvlink_gbps inside a
    node of gpus_per_node, network_gbps across nodes; an all-to-all uses both at once), offload
    copies out and back at the host-link rate, balanced routing. 'overlapped' assumes communication
    and copies hide behind compute, 'serial' that nothing overlaps; 'bound' names the largest term."""
    pl = run.plan
    tokens = tokens_per_rank(run) * run.train.grad_accum
    core = region_flops(run)["attention_core"] * 3  # forward and backward, as in fpt
    re_gemm, re_core = recompute_flops(run)
    gemm_s = tokens * (fpt - core + re_gemm) / (pl.matmul_tflops * 1e12)
    compute = gemm_s + tokens * (core + re_core) / (pl.attention_tflops * 1e12)
    nv, net = pl.nvlink_gbps * GB, pl.network_gbps * GB
    fsdp_intra_s, fsdp_inter_s = comm["fsdp_intra_node"] / nv, comm["fsdp_inter_node"] / net
    ep_intra, ep_inter = ep_link_bytes(run, comm)
    ep_intra_s, ep_inter_s = ep_intra / nv, ep_inter / net
    comm_s = fsdp_intra_s + fsdp_inter_s + max(ep_intra_s, ep_inter_s)
    offload_s = 2 * host_bytes * run.train.grad_accum / (pl.host_link_gbps * GB)
    overlapped, serial = max(compute, comm_s, offload_s), compute + comm_s + offload_s
    terms = {"compute": compute, "fsdp inside node": fsdp_intra_s, "fsdp across nodes": fsdp_inter_s,
             "ep inside node": ep_intra_s, "ep across nodes": ep_inter_s, "host link": offload_s}
    if comm_s >= max(compute, offload_s):
        bound = max(("fsdp inside node", "fsdp across nodes", "ep inside node", "ep across nodes"), key=terms.get)
    else:
        bound = "compute" if compute >= offload_s else "host link"
    return {"model": "stated rates; not measured", "compute_s": compute, "comm_s": comm_s, "offload_s": offload_s,
            "terms_s": terms, "bound": bound, "ep_dispatch": pl.dispatch,
            "step_s_overlapped": overlapped, "step_s_serial": serial,
            "tokens_per_s_per_gpu_overlapped": tokens / overlapped, "tokens_per_s_per_gpu_serial": tokens / serial}

