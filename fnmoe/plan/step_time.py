"""The step-time model: compute at stated sustained rates, collectives over the two-level network,
offload copies over the host link; overlapped and serial bounds, and what bounds the step.
"""
from __future__ import annotations

import math
from functools import lru_cache

from fnmoe.config import REGIONS, ModelConfig, RunConfig
from fnmoe.config.hardware import hardware
from fnmoe.tree import leaf_kind
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.plan.gemm_time import routed_expert_s, routed_flops_per_token
from fnmoe.plan.state import GB, leaf_shapes


def region_flops(run: RunConfig) -> dict:
    """Forward FLOPs per token of every region kind summed over layers: {attention (its GEMMs),
    attention_core (q·k and p·v), moe, mlp}; recompute repeats a region's forward in backward."""
    return dict(_region_flops(run.model, run.data.seq_len))


@lru_cache(maxsize=64)
def _region_flops(cfg: ModelConfig, seq_len: int) -> tuple:
    out = {"attention": 0.0, "attention_core": 0.0, "moe": 0.0, "mlp": 0.0}
    for path, shape in leaf_shapes(cfg):
        parts = path.split(".")
        if parts[0] != "layers" or len(shape) < 2:
            continue
        n = math.prod(shape) * (cfg.moe.top_k / cfg.moe.n_experts if leaf_kind(path) == "expert" else 1)
        out["attention" if parts[2] == "attn" else parts[2]] += 2.0 * n
    out["attention_core"] = 1.0 * cfg.n_layers * seq_len * cfg.n_heads * (cfg.qk_head_dim_ + cfg.v_head_dim_)
    return tuple(out.items())


def recompute_flops(run: RunConfig) -> tuple[float, float]:
    """(GEMM, attention-core) FLOPs per token recomputed in backward: every region under full
    recompute, the regions whose policy is 'full' otherwise; selective recompute redoes norms and
    pointwise ops only, which the model counts as free."""
    f, mem = region_flops(run), run.memory
    if mem.recompute == "full":
        return f["attention"] + f["moe"] + f["mlp"], f["attention_core"]
    gemm = sum(f[r] for r in REGIONS if getattr(mem, r) == "full")
    return gemm, f["attention_core"] if mem.attention == "full" else 0.0


def step_time(run: RunConfig, fpt: float, comm: dict, host_bytes: int, exposed: dict | None = None) -> dict:
    """A model, not a measurement: compute at the stated sustained rates (GEMMs, and attention's
    core at its own rate), collectives over the two-level network of plan_net (rings at nvlink_gbps
    and all-to-alls at nvlink_a2a_gbps inside a node of gpus_per_node, network_gbps across nodes; an
    all-to-all uses both at once), offload's
    copies out at d2h_gbps and back at h2d_gbps, balanced routing. 'overlapped' assumes every
    collective and copy hides behind compute, 'serial' that nothing does; 'as_built' (with
    `exposed`, overlap.exposed_fractions) charges what fnmoe waits for at issue. 'bound' names the
    largest term."""
    hw = hardware(run.plan)
    tokens = tokens_per_rank(run) * run.train.grad_accum
    compute = _compute_s(run, fpt, tokens)
    nv, net = hw.nvlink_gbps * GB, hw.network_gbps * GB
    fsdp_intra_s, fsdp_inter_s = comm["fsdp_intra_node"] / nv, comm["fsdp_inter_node"] / net
    ep_intra, ep_inter = comm["ep_intra_node"], comm["ep_inter_node"]
    ep_intra_s, ep_inter_s = ep_intra / (hw.nvlink_a2a_gbps * GB), ep_inter / net
    comm_s = fsdp_intra_s + fsdp_inter_s + max(ep_intra_s, ep_inter_s)
    copies = {"forward": host_bytes * run.train.grad_accum / (hw.d2h_gbps * GB),
              "backward": host_bytes * run.train.grad_accum / (hw.h2d_gbps * GB)}
    offload_s = sum(copies.values())
    overlapped, serial = max(sum(compute.values()), comm_s, offload_s), sum(compute.values()) + comm_s + offload_s
    terms = {"compute": sum(compute.values()), "fsdp inside node": fsdp_intra_s, "fsdp across nodes": fsdp_inter_s,
             "ep inside node": ep_intra_s, "ep across nodes": ep_inter_s, "host link": offload_s}
    if comm_s >= max(terms["compute"], offload_s):
        bound = max(("fsdp inside node", "fsdp across nodes", "ep inside node", "ep across nodes"), key=terms.get)
    else:
        bound = "compute" if terms["compute"] >= offload_s else "host link"
    out = {"model": "stated rates; not measured", "compute_s": terms["compute"], "comm_s": comm_s,
           "offload_s": offload_s, "terms_s": terms, "bound": bound, "ep_dispatch": run.plan.dispatch,
           "step_s_overlapped": overlapped, "step_s_serial": serial,
           "tokens_per_s_per_gpu_overlapped": tokens / overlapped, "tokens_per_s_per_gpu_serial": tokens / serial}
    if exposed is not None:
        out.update(_as_built(run, comm, compute, copies, exposed, tokens))
    return out


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
            + experts["backward"]}


def _as_built(run: RunConfig, comm: dict, compute: dict, copies: dict, exposed: dict, tokens: int) -> dict:
    """The step as fnmoe runs it: in each phase, what it issues ahead of the compute that needs it
    (and offload's copies, on their side stream) hides behind that phase's compute; what it waits
    for at issue adds to it. A layer's collectives are exposed in the fractions recorded for a MoE
    layer of the proxy (overlap.exposed_fractions); the embedding's, final norm's and head's, at the
    ends of each pass, are exposed whole. Blocks are alike, so a phase's sums stand for its blocks'."""
    hw = hardware(run.plan)
    nv, net = hw.nvlink_gbps * GB, hw.network_gbps * GB
    hidden = dict(copies, update=0.0)
    shown = {"forward": 0.0, "backward": 0.0, "update": 0.0}
    for key, link in comm["parts"].items():
        phase, kind, where = key.split("/")
        # an all-to-all sends inside and across the node at once; a ring over nodes is all across
        if kind == "all_to_all":
            t = max(link["intra"] / (hw.nvlink_a2a_gbps * GB), link["inter"] / net)
        else:
            t = link["intra"] / nv + link["inter"] / net
        f = 1.0 if where == "outer" else exposed.get((phase, kind), 1.0)
        shown[phase] += f * t
        hidden[phase] += (1 - f) * t
    step = {ph: max(compute.get(ph, 0.0), hidden[ph]) + shown[ph] for ph in shown}
    total = sum(step.values())
    return {"step_s_as_built": total, "tokens_per_s_per_gpu_as_built": tokens / total,
            "as_built_s": {ph: {"compute": compute.get(ph, 0.0), "hidden": hidden[ph], "exposed": shown[ph]}
                           for ph in shown},
            "exposed_fractions": {"/".join(k): v for k, v in sorted(exposed.items())}}
