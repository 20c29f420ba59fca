"""`fnmoe plan`: everything the planner reports for one RunConfig, as a dict and as a table.

The pieces: state.py (params, grads, optimizer state, gathered weights), activations.py (what a
policy saves), comm.py (bytes sent), step_time.py (the step-time model), flops.py (parameter
counts, FLOPs per token, MFU).
"""
from __future__ import annotations

from functools import lru_cache

from fnmoe.config import ModelConfig, RunConfig
from fnmoe.plan.activations import activation_plan, ep_buffer_bytes, logits_bytes, tokens_per_rank
from fnmoe.plan.comm import comm_bytes
from fnmoe.plan.flops import flops_per_token, param_counts
from fnmoe.plan.state import GB, gathered_bytes, state_bytes
from fnmoe.plan.step_time import step_time


def plan(run: RunConfig) -> dict:
    """Everything `fnmoe plan` reports, as one JSON-ready dict (bytes are per rank)."""
    total, active, fpt = _counts(run.model, run.data.seq_len)
    states, acts = state_bytes(run), activation_plan(run)
    per_rank = dict(states, gathered=gathered_bytes(run), activations=acts["device"],
                    recompute_transient=acts["transient"], logits=logits_bytes(run),
                    ep_buffers=ep_buffer_bytes(run), offload_host=acts["host"])
    step = sum(v for k, v in per_rank.items() if k != "offload_host")
    # the update makes the new optimizer state, the updates and the new params while the old ones,
    # kept until the step is known finite (a non-finite step leaves them bitwise as they were), live
    # Muon also holds the Nesterov blend (fp32) and the bf16 Newton-Schulz iterates of every matrix of
    # the rank at once: 1.5 times the params' bytes more (rehearsed on the 1T and 671B presets)
    per_rank["update_transient"] = states["optim"] + int((3.5 if run.optim.name == "muon" else 2) * states["params"])
    per_rank["total_device"] = max(step, sum(states.values()) + per_rank["update_transient"])
    comm = comm_bytes(run)
    pl = run.plan
    return {"config": run.name, "mesh": {"fsdp": run.mesh.fsdp, "ep": run.mesh.ep, "world": run.mesh.world},
            "tokens_per_rank_microbatch": tokens_per_rank(run), "memory": _policy(run),
            "total_params": total, "active_params": active, "flops_per_token": fpt,
            "per_rank_bytes": per_rank, "comm_bytes_per_step": comm["total"], "comm_bytes_detail": comm,
            "fits": {"device": per_rank["total_device"] <= pl.hbm_gb * GB,
                     "host": per_rank["offload_host"] <= pl.host_gb * GB, "hbm_gb": pl.hbm_gb, "host_gb": pl.host_gb},
            "per_host_offload_bytes": per_rank["offload_host"] * pl.gpus_per_node,
            "step_time": step_time(run, fpt, comm, acts["host"])}


@lru_cache(maxsize=16)
def _counts(cfg: ModelConfig, seq_len: int) -> tuple[int, int, float]:
    """(total params, active params, FLOPs per token), cached for the search's many layouts."""
    return (*param_counts(cfg), flops_per_token(cfg, seq_len))


def _policy(run: RunConfig) -> str:
    m = run.memory
    if m.recompute == "full":
        return "full recompute" + (" + offload" if m.offload else "")
    regions = ", ".join(f"{r}={getattr(m, r)}" for r in ("attention", "moe", "mlp"))
    return regions + (" + offload" if m.offload else "")


def format_plan(p: dict) -> str:
    """The human-readable table of `fnmoe plan`."""
    gb = lambda b: f"{b / GB:9.2f} GB"  # noqa: E731
    r, t, c = p["per_rank_bytes"], p["step_time"], p["comm_bytes_detail"]
    terms = ", ".join(f"{k} {v:.2f} s" for k, v in t["terms_s"].items() if v and k not in ("compute", "host link"))
    lines = [f"plan for {p['config']} on fsdp {p['mesh']['fsdp']} x ep {p['mesh']['ep']} ({p['mesh']['world']} ranks), "
             f"{p['tokens_per_rank_microbatch']} tokens a rank a micro-batch; memory: {p['memory']}",
             f"  params {p['total_params']:.4g} total, {p['active_params']:.4g} active; "
             f"{p['flops_per_token'] / 1e9:.1f} GFLOP/token", "", "  per rank (device)"]
    for key in ("params", "grads", "optim", "gathered", "activations", "recompute_transient", "logits", "ep_buffers",
                "update_transient"):
        lines.append(f"    {key:<20}{gb(r[key])}")
    lines += [f"    {'total':<20}{gb(r['total_device'])}   fits {p['fits']['hbm_gb']:.0f} GB: {p['fits']['device']}",
              f"  host, offloaded       {gb(r['offload_host'])} a GPU, {gb(p['per_host_offload_bytes'])} a node; "
              f"fits {p['fits']['host_gb']:.0f} GB a GPU: {p['fits']['host']}",
              f"  communication         {gb(p['comm_bytes_per_step'])} sent a rank a step "
              f"(fsdp {c['fsdp'] / GB:.1f}: {c['fsdp_intra_node'] / GB:.1f} inside a node, "
              f"{c['fsdp_inter_node'] / GB:.1f} across; ep {c['ep'] / GB:.1f}: {c['ep_intra_node'] / GB:.1f} inside, "
              f"{c['ep_inter_node'] / GB:.1f} across)",
              f"  step time (a model, stated rates): compute {t['compute_s']:.2f} s, comm {t['comm_s']:.2f} s "
              f"({terms}), offload {t['offload_s']:.2f} s -> {t['tokens_per_s_per_gpu_overlapped']:,.0f} tok/s/GPU "
              f"overlapped ({t['bound']} bound), {t['tokens_per_s_per_gpu_serial']:,.0f} serial"]
    return "\n".join(lines)

