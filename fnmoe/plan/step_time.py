"""The step-time model: compute at stated sustained rates with the work a real step adds
(overheads.py) and the SMs NCCL takes, collectives over the two-level network, offload copies over
the host link, each link apart; overlapped and serial bounds, and what bounds the step.
"""
from __future__ import annotations


from fnmoe.config import RunConfig
from fnmoe.config.hardware import hardware
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.plan.flops import recompute_flops, region_flops
from fnmoe.plan.gemm_time import routed_expert_s, routed_flops_per_token
from fnmoe.plan.overheads import overheads_s
from fnmoe.plan.windows import window_excess_s
from fnmoe.plan.state import GB


def step_time(run: RunConfig, fpt: float, comm: dict, host_bytes: int, exposed: dict | None = None) -> dict:
    """A model, not a measurement: compute at the stated sustained rates (GEMMs, and attention's
    core at its own rate) plus the work a real step does beside its model FLOPs (overheads.py),
    collectives over the two-level network of plan_net (rings at nvlink_gbps and all-to-alls at
    nvlink_a2a_gbps inside a node of gpus_per_node, network_gbps across nodes), offload's copies out
    at d2h_gbps and back at h2d_gbps. An all-to-all lasts as long as its busiest endpoint's larger
    side (`ep_receive_factor`). The NIC, NVLink and the host link carry their traffic side by side:
    what hides behind compute is bounded by the busiest link, not their sum; and while an NCCL kernel
    runs beside compute it slows it (`nccl_*_slowdown` on the overlapped share). 'overlapped'
    assumes every collective and copy hides behind compute, 'serial' that nothing does; 'as_built'
    (with `exposed`, overlap.exposed_fractions) charges what fnmoe waits for at issue. 'bound' names
    the largest term."""
    hw = hardware(run.plan)
    tokens = tokens_per_rank(run) * run.train.grad_accum
    compute = _compute_s(run, fpt, tokens)
    extra = overheads_s(run)
    for phase, sec in extra.values():
        compute[phase] += sec
    nv, net = hw.nvlink_gbps * GB, hw.network_gbps * GB
    recv = ep_receive_factor(run)
    fsdp_intra_s, fsdp_inter_s = comm["fsdp_intra_node"] / nv, comm["fsdp_inter_node"] / net
    ep_intra_s = recv * comm["ep_intra_node"] / (hw.nvlink_a2a_gbps * GB)
    ep_inter_s = recv * comm["ep_inter_node"] / net
    comm_s = fsdp_intra_s + fsdp_inter_s + max(ep_intra_s, ep_inter_s)
    copies = {"forward": host_bytes * run.train.grad_accum / (hw.d2h_gbps * GB),
              "backward": host_bytes * run.train.grad_accum / (hw.h2d_gbps * GB)}
    offload_s = sum(copies.values())
    c = sum(compute.values())
    links = {"nic": fsdp_inter_s + ep_inter_s, "nvlink": fsdp_intra_s + ep_intra_s, "host link": offload_s}
    slowdown = _slowdown(hw, c, max(fsdp_intra_s, fsdp_inter_s), max(ep_intra_s, ep_inter_s))
    overlapped, serial = max(c + slowdown, *links.values()), c + comm_s + offload_s
    terms = {"compute": c, "nccl slowdown": slowdown, "fsdp inside node": fsdp_intra_s,
             "fsdp across nodes": fsdp_inter_s, "ep inside node": ep_intra_s, "ep across nodes": ep_inter_s,
             "host link": offload_s}
    if max(links["nic"], links["nvlink"]) >= max(c + slowdown, offload_s):
        bound = max(("fsdp inside node", "fsdp across nodes", "ep inside node", "ep across nodes"), key=terms.get)
    else:
        bound = "compute" if c + slowdown >= offload_s else "host link"
    out = {"model": "stated rates; not measured", "compute_s": c, "comm_s": comm_s,
           "offload_s": offload_s, "terms_s": terms, "links_s": links, "bound": bound,
           "ep_dispatch": run.plan.dispatch, "ep_receive_factor": recv,
           "overheads_s": {name: sec for name, (_, sec) in extra.items()},
           "step_s_overlapped": overlapped, "step_s_serial": serial,
           "tokens_per_s_per_gpu_overlapped": tokens / overlapped, "tokens_per_s_per_gpu_serial": tokens / serial}
    if exposed is not None:
        out.update(_as_built(run, comm, compute, copies, exposed, tokens))
    return out


def ep_receive_factor(run: RunConfig) -> float:
    """What an EP pass on the busiest rank lasts, over the bytes it sends, averaged over the passes.
    comm_bytes counts the bytes it sends: T·K rows in the dispatch, imbalance times that in the
    combine. But it receives imbalance x T·K in the dispatch (and sends T·K back), links are full
    duplex and an all-to-all ends with its slowest endpoint: every pass lasts imbalance x the
    balanced one, 2·imbalance / (1 + imbalance) of what the sent bytes say. node_dedup's passes are
    counted balanced (comm._rows_a_token): imbalance each."""
    imb = run.plan.imbalance if run.mesh.ep > 1 else 1.0
    return imb if run.plan.dispatch == "node_dedup" else 2 * imb / (1 + imb)


def _slowdown(hw, compute: float, ring_s: float, a2a_s: float) -> float:
    """Seconds compute loses to NCCL kernels that run beside it: each kind's slowdown on the share of
    compute it overlaps."""
    return hw.nccl_ring_slowdown * min(ring_s, compute) + hw.nccl_a2a_slowdown * min(a2a_s, compute)


def _compute_s(run: RunConfig, fpt: float, tokens: int) -> dict:
    """Seconds of compute a step by phase on the busiest rank: forward a third of the FLOPs,
    backward two thirds plus what recompute repeats; routed experts at the roofline with the
    imbalanced rows (gemm_time), the rest at the stated rates."""
    hw = hardware(run.plan)
    core = region_flops(run)["attention_core"] * 3  # forward and backward, as in fpt
    re_gemm, re_core = recompute_flops(run)
    routed = routed_flops_per_token(run)
    recomputed = run.memory.recompute == "full" or run.memory.moe == "full"
    other, re_other = fpt - core - 3 * routed, re_gemm - (routed if recomputed else 0.0)
    gemm, attn = hw.matmul_tflops * 1e12, hw.attention_tflops * 1e12
    experts = routed_expert_s(run, recomputed)
    return {"forward": tokens * (other / 3 / gemm + core / 3 / attn) + experts["forward"],
            "backward": tokens * (other * 2 / 3 / gemm + core * 2 / 3 / attn + re_other / gemm + re_core / attn)
            + experts["backward"], "update": 0.0}


def _as_built(run: RunConfig, comm: dict, compute: dict, copies: dict, exposed: dict, tokens: int) -> dict:
    """The step as fnmoe runs it: in each phase, what it issues ahead of the compute that needs it
    (and offload's copies, on their side stream) hides behind that phase's compute, which the NCCL
    kernels running beside it slow; what it waits for at issue adds to it. The hidden traffic of each
    link (NIC, NVLink, host link) is summed apart, and the busiest link bounds the phase. A layer's
    collectives are exposed in the fractions recorded for a MoE layer of the proxy
    (overlap.exposed_fractions), and what an exchange hidden between two chunks in flight outlasts its
    window by (windows.py); the embedding's, final norm's and head's, at the ends of each pass, are
    exposed whole. Blocks are alike, so a phase's sums stand for its blocks'."""
    hw = hardware(run.plan)
    nv, net, recv = hw.nvlink_gbps * GB, hw.network_gbps * GB, ep_receive_factor(run)
    phases = ("forward", "backward", "update")
    links = {ph: {"nic": 0.0, "nvlink": 0.0, "host link": copies.get(ph, 0.0)} for ph in phases}
    busy = {ph: {"ring": 0.0, "all_to_all": 0.0} for ph in phases}
    shown = dict.fromkeys(phases, 0.0)
    for key, link in comm["parts"].items():
        phase, kind, where = key.split("/")
        a2a = kind == "all_to_all"
        intra = recv * link["intra"] / (hw.nvlink_a2a_gbps * GB) if a2a else link["intra"] / nv
        inter = (recv if a2a else 1.0) * link["inter"] / net
        t = max(intra, inter)  # both links at once: the slower one ends the collective
        f = 1.0 if where == "outer" else exposed.get((phase, kind), 1.0)
        shown[phase] += f * t
        links[phase]["nvlink"] += (1 - f) * intra
        links[phase]["nic"] += (1 - f) * inter
        busy[phase]["all_to_all" if a2a else "ring"] += (1 - f) * t
    late = window_excess_s(run, comm, recv) if comm["parts"] else {}
    for phase, sec in late.items():  # hidden by op order, yet longer than the compute it hides behind
        shown[phase] += sec
    slow = {ph: _slowdown(hw, compute[ph], busy[ph]["ring"], busy[ph]["all_to_all"]) for ph in phases}
    step = {ph: max(compute[ph] + slow[ph], *links[ph].values()) + shown[ph] for ph in phases}
    total = sum(step.values())
    return {"step_s_as_built": total, "tokens_per_s_per_gpu_as_built": tokens / total,
            "as_built_s": {ph: {"compute": compute[ph], "nccl_slowdown": slow[ph], "hidden": max(links[ph].values()),
                                "hidden_by_link": links[ph], "exposed": shown[ph]} for ph in phases},
            "window_excess_s": late,
            "exposed_fractions": {"/".join(k): v for k, v in sorted(exposed.items())}}
