"""`fnmoe plan`: everything the planner reports for one RunConfig, as a dict and as a table.

The pieces: state.py (params, grads, optimizer state, gathered weights), activations.py (what a
policy saves), comm.py (bytes sent), step_time.py (the step-time model), flops.py (parameter
counts, FLOPs per token, MFU).
"""
from __future__ import annotations

import dataclasses
import logging
from functools import lru_cache

import torch.distributed as dist

from fnmoe.config import REGIONS, ModelConfig, RunConfig, validate
from fnmoe.config.hardware import hardware
from fnmoe.plan.activations import activation_plan, ep_buffer_bytes, logits_bytes, pool_bytes, tokens_per_rank
from fnmoe.plan.comm import comm_bytes
from fnmoe.plan.flops import flops_per_token, param_counts
from fnmoe.plan.overlap import exposed_fractions, overlap_key
from fnmoe.plan.state import GB, gathered_bytes, state_bytes, update_transient_bytes
from fnmoe.plan.rates import measured_run
from fnmoe.plan.step_time import step_time

log = logging.getLogger(__name__)


def plan(run: RunConfig, as_built: bool = True, check: bool = True) -> dict:
    """Everything `fnmoe plan` reports, as one JSON-ready dict (bytes are per rank). With as_built
    and more than one rank, the step time as fnmoe runs it too (overlap.exposed_fractions records
    a proxy step on simulated ranks: a few seconds, once per code path in a process; not where a
    process group already runs). run is validated first (check=False: the search's candidates, valid
    by construction): numbers for a config that train refuses would mislead."""
    if check:
        validate(run)
    total, active, fpt = _counts(run.model, run.data.seq_len)
    per_rank = per_rank_bytes(run)
    comm = comm_bytes(run)
    hw = hardware(run.plan)
    exposed = _exposed(run) if as_built else None
    return {"config": run.name, "mesh": {"fsdp": run.mesh.fsdp, "ep": run.mesh.ep, "world": run.mesh.world},
            "tokens_per_rank_microbatch": tokens_per_rank(run), "memory": _policy(run),
            "total_params": total, "active_params": active, "flops_per_token": fpt,
            "per_rank_bytes": per_rank, "comm_bytes_per_step": comm["total"], "comm_bytes_detail": comm,
            "fits": dict(zip(("device", "host"), fits(run, per_rank)), hbm_gb=hw.hbm_gb, host_gb=hw.host_gb),
            "per_host_offload_bytes": per_rank["offload_host"] * hw.gpus_per_node,
            "hardware": {"profile": run.plan.hardware, **dataclasses.asdict(hw)},
            **_step_times(run, fpt, comm, per_rank["offload_host"], exposed)}


def _step_times(run: RunConfig, fpt: float, comm: dict, host_bytes: int, exposed: dict | None) -> dict:
    """step_time at the rates plan.rates names, the other rates' figures beside it, and which
    figures were measured (rates.measured_run)."""
    at_measured, report = measured_run(run)
    times = {"stated": step_time(run, fpt, comm, host_bytes, exposed),
             "measured": step_time(at_measured, fpt, comm, host_bytes, exposed)}
    mode = run.plan.rates
    other = "measured" if mode == "stated" else "stated"
    keys = ("tokens_per_s_per_gpu_as_built", "tokens_per_s_per_gpu_overlapped", "tokens_per_s_per_gpu_serial", "bound")
    return {"step_time": times[mode], "rates": {"mode": mode, **report},
            "step_time_beside": {"rates": other, **{k: times[other][k] for k in keys if k in times[other]}}}


def per_rank_bytes(run: RunConfig) -> dict:
    """A rank's device bytes by category, its peak (total_device) and its host bytes (offload_host)."""
    states, acts = state_bytes(run), activation_plan(run)
    per_rank = dict(states, gathered=gathered_bytes(run), activations=acts["device"],
                    recompute_transient=acts["transient"], logits=logits_bytes(run),
                    ep_buffers=ep_buffer_bytes(run), offload_host=acts["host"])
    step = sum(v for k, v in per_rank.items() if k != "offload_host")
    # the functional update's new state beside the old, or the donated one's largest leaf's workspace
    per_rank["update_transient"] = update_transient_bytes(run)
    per_rank["total_device"] = max(step, sum(states.values()) + per_rank["update_transient"])
    # what the run pins for it: fnmoe.plan.host_limit stops a run before step 1 past the profile
    per_rank["host_pool"] = pool_bytes(run)
    return per_rank


def fits(run: RunConfig, per_rank: dict) -> tuple[bool, bool]:
    """(device, host): whether a rank's bytes fit the hardware profile's usable memory."""
    hw = hardware(run.plan)
    return per_rank["total_device"] <= hw.hbm_gb * GB, per_rank["host_pool"] <= hw.host_gb * GB


def _exposed(run: RunConfig) -> dict | None:
    """overlap.exposed_fractions, {} on one rank; None where no proxy step can be recorded: a
    process group already runs here, or the proxy's step fails on simulated ranks (said once)."""
    if run.mesh.world == 1:
        return {}
    if dist.is_initialized():  # a proxy needs simulated ranks of its own
        return None
    try:
        return exposed_fractions(run)
    except Exception as e:  # noqa: BLE001 - the plan stands without it; the step time says so
        key = overlap_key(run)
        if key not in _unrecorded:
            _unrecorded.add(key)
            log.warning("fnmoe plan: no as-built step time for memory policy %s: its proxy step failed on "
                        "simulated ranks (%s: %s); the serial figure stands in", _policy(run), type(e).__name__,
                        str(e).splitlines()[0][:200])
        return None


_unrecorded: set = set()


@lru_cache(maxsize=16)
def _counts(cfg: ModelConfig, seq_len: int) -> tuple[int, int, float]:
    """(total params, active params, FLOPs per token), cached for the search's many layouts."""
    return (*param_counts(cfg), flops_per_token(cfg, seq_len))


def _policy(run: RunConfig) -> str:
    m = run.memory
    if m.recompute == "full":
        chunks = f" in {m.block_chunks} block chunks" if m.block_chunks > 1 else ""
        return "full recompute" + chunks + (" + offload" if m.offload else "")
    regions = ", ".join(f"{r}={getattr(m, r)}" for r in REGIONS)
    return regions + (" + offload" if m.offload else "")


def format_plan(p: dict) -> str:
    """The human-readable table of `fnmoe plan`."""
    gb = lambda b: f"{b / GB:9.2f} GB"  # noqa: E731
    r, t, c, h = p["per_rank_bytes"], p["step_time"], p["comm_bytes_detail"], p["hardware"]
    terms = ", ".join(f"{k} {v:.2f} s" for k, v in t["terms_s"].items() if v and k not in ("compute", "host link"))
    lines = [f"plan for {p['config']} on fsdp {p['mesh']['fsdp']} x ep {p['mesh']['ep']} ({p['mesh']['world']} ranks), "
             f"{p['tokens_per_rank_microbatch']} tokens a rank a micro-batch; memory: {p['memory']}",
             f"  params {p['total_params']:.4g} total, {p['active_params']:.4g} active; "
             f"{p['flops_per_token'] / 1e9:.1f} GFLOP/token",
             f"  hardware {h['profile']}: {h['gpus_per_node']} GPUs a node, {h['hbm_gb']:g} GB device and "
             f"{h['host_gb']:g} GB host usable a GPU, {h['matmul_tflops']:.0f} TFLOP/s GEMMs at up to "
             f"{h['hbm_tbps']:g} TB/s HBM, {h['network_gbps']:g} GB/s across nodes achieved "
             f"({h['network_nominal_gbps']:g} nominal), {h['nvlink_gbps']:g} inside, host link "
             f"{h['d2h_gbps']:g} out / {h['h2d_gbps']:g} in (GB = 1e9 bytes, TB = 1e12)", "", "  per rank (device)"]
    for key in ("params", "grads", "optim", "gathered", "activations", "recompute_transient", "logits", "ep_buffers",
                "update_transient"):
        lines.append(f"    {key:<20}{gb(r[key])}")
    step = sum(r[k] for k in ("params", "grads", "optim", "gathered", "activations", "recompute_transient", "logits",
                              "ep_buffers"))
    update = sum(r[k] for k in ("params", "grads", "optim", "update_transient"))
    lines += [f"    {'total':<20}{gb(r['total_device'])}   fits {p['fits']['hbm_gb']:g} GB: {p['fits']['device']} "
              f"(not the sum of the rows: the larger of the step's peak, {step / GB:.2f} GB = the rows above but "
              f"update_transient, and the update's, {update / GB:.2f} GB = params + grads + optim + update_transient)",
              f"  host, offloaded       {gb(r['offload_host'])} a GPU, {gb(p['per_host_offload_bytes'])} a node; "
              f"its pool pins {r['host_pool'] / GB:.2f} GB, fits {p['fits']['host_gb']:g} GB a GPU: "
              f"{p['fits']['host']}",
              f"  communication         {gb(p['comm_bytes_per_step'])} sent a rank a step "
              f"(fsdp {c['fsdp'] / GB:.1f}: {c['fsdp_intra_node'] / GB:.1f} inside a node, "
              f"{c['fsdp_inter_node'] / GB:.1f} across; ep {c['ep'] / GB:.1f}: {c['ep_intra_node'] / GB:.1f} inside, "
              f"{c['ep_inter_node'] / GB:.1f} across)",
              f"  step time (a model, {p['rates']['mode']} rates): compute {t['compute_s']:.2f} s, "
              f"comm {t['comm_s']:.2f} s "
              f"({terms}), offload {t['offload_s']:.2f} s -> {t['tokens_per_s_per_gpu_overlapped']:,.0f} tok/s/GPU "
              f"overlapped ({t['bound']} bound), {t['tokens_per_s_per_gpu_serial']:,.0f} serial"]
    if "tokens_per_s_per_gpu_as_built" in t:
        a = t["as_built_s"]
        lines.append(f"  as built: {t['tokens_per_s_per_gpu_as_built']:,.0f} tok/s/GPU (" + "; ".join(
            f"{ph} {a[ph]['compute']:.2f} s compute, {a[ph]['hidden']:.2f} hidden, {a[ph]['exposed']:.2f} waited for"
            for ph in ("forward", "backward")) + f"; update {a['update']['exposed']:.2f} waited for)")
    lines += _rates_lines(p)
    return "\n".join(lines)



def _rates_lines(p: dict) -> list[str]:
    """What the step time's terms add beyond the model FLOPs, and the figure at the other rates."""
    t, b, r = p["step_time"], p["step_time_beside"], p["rates"]
    extra = ", ".join(f"{k} {v:.2f} s" for k, v in t["overheads_s"].items() if v)
    lines = [f"  charged beside the GEMMs: nccl slowdown {t['terms_s']['nccl slowdown']:.2f} s; {extra or 'nothing'}; "
             f"each EP pass x{t['ep_receive_factor']:.3f} (the busiest rank's receive side)"]
    built = f"{b['tokens_per_s_per_gpu_as_built']:,.0f} as built, " if "tokens_per_s_per_gpu_as_built" in b else ""
    measured = "; ".join(f"{k} {m['value']:g} (stated {m['stated']:.0f})" for k, m in r["measured"].items())
    lines.append(f"  at {b['rates']} rates: {built}{b['tokens_per_s_per_gpu_overlapped']:,.0f} overlapped, "
                 f"{b['tokens_per_s_per_gpu_serial']:,.0f} serial tok/s/GPU "
                 f"(measured: {measured or 'none for this GPU'}; "
                 f"assumed: {', '.join(r['assumed']) or 'none'}; docs/memory_plan.md, \"Rates: measured and stated\")")
    return lines
