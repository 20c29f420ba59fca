"""`fnmoe plan --search`: every layout of a world size the planner can judge — mesh, memory policy,
micro-batch — planned, those that do not fit device or host memory dropped, the rest ranked by
modelled tokens/s/GPU (fnmoe.plan.step_time.step_time, overlapped; the serial figure breaks ties).

The candidates:
  mesh          fsdp x ep = world, ep dividing the expert count (ep 1 always: no expert parallelism);
                reshard_after_forward as the config says.
  memory        the named policies of POLICIES (whole-block recompute and offload, and selective
                recompute per region with the MoE region, the largest, recomputed or offloaded).
  micro-batch   the global batch (train.batch_size sequences) is kept: a rank reads b = batch/world
                sequences a step, as m sequences a micro-batch for every m dividing b, with
                grad_accum = b/m.
Each candidate is a RunConfig that passes fnmoe.config.check.validate, as `fnmoe train` checks it.
"""
from __future__ import annotations

import dataclasses

from fnmoe.config import RunConfig
from fnmoe.config.check import validate
from fnmoe.plan.state import GB
from fnmoe.plan.summary import plan

# name -> MemoryConfig fields (the others from the config; region fields not named are "none")
POLICIES: dict[str, dict] = {
    "none": {"recompute": "none"},
    "full": {"recompute": "full"},
    "full+offload": {"recompute": "full", "offload": True},
    "offload": {"recompute": "none", "offload": True},
    "selective": {"attention": "selective", "moe": "selective", "mlp": "selective"},
    "selective, moe full": {"attention": "selective", "moe": "full", "mlp": "selective"},
    "selective, moe offload": {"attention": "selective", "moe": "offload", "mlp": "selective"},
}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(run: RunConfig, world: int) -> list[tuple[int, int]]:
    """(fsdp, ep) with fsdp·ep = world and ep dividing the expert count."""
    E = run.model.moe.n_experts
    return [(world // ep, ep) for ep in divisors(world) if ep == 1 or (E and E % ep == 0)]


def with_layout(run: RunConfig, fsdp: int, ep: int, policy: str, micro_batch: int) -> RunConfig:
    """run on that mesh, memory policy and micro-batch, the global batch kept; checked as train checks."""
    fields = {"recompute": "none", "offload": False, "attention": "none", "moe": "none", "mlp": "none"}
    memory = dataclasses.replace(run.memory, **{**fields, **POLICIES[policy]})
    accum = run.train.batch_size // (fsdp * ep * micro_batch)
    return validate(dataclasses.replace(run, mesh=dataclasses.replace(run.mesh, fsdp=fsdp, ep=ep), memory=memory,
                                        train=dataclasses.replace(run.train, grad_accum=accum)))


def candidates(run: RunConfig, world: int) -> list[tuple[str, RunConfig]]:
    """(policy name, run) of every layout of `world` ranks the search plans; ValueError when none."""
    batch = run.train.batch_size
    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    if batch % world:
        near = sorted(divisors(batch), key=lambda w: abs(w - world))[:2]
        raise ValueError(f"no layout of {world} ranks keeps train.batch_size={batch}: every rank reads whole "
                         f"sequences, so the world must divide the batch (the nearest that do: "
                         f"{', '.join(map(str, sorted(near)))}); or set --train.batch-size to a multiple of {world}")
    return [(policy, with_layout(run, fsdp, ep, policy, m)) for fsdp, ep in meshes(run, world)
            for policy in POLICIES for m in divisors(batch // world)]


def row(policy: str, run: RunConfig) -> dict:
    """One candidate's line of the ranking."""
    p = plan(run)
    t, r = p["step_time"], p["per_rank_bytes"]
    return {"fsdp": run.mesh.fsdp, "ep": run.mesh.ep, "policy": policy, "micro_batch": run.micro_batch,
            "grad_accum": run.train.grad_accum, "device_bytes": r["total_device"], "host_bytes": r["offload_host"],
            "fits_device": p["fits"]["device"], "fits_host": p["fits"]["host"],
            "tokens_per_s_per_gpu": t["tokens_per_s_per_gpu_overlapped"],
            "tokens_per_s_per_gpu_serial": t["tokens_per_s_per_gpu_serial"], "bound": t["bound"],
            "terms_s": t["terms_s"]}


def search(run: RunConfig, world: int | None = None, top: int = 10) -> dict:
    """The ranking of layouts that fit, best first, and what the search considered."""
    world = run.mesh.world if world is None else world
    rows = [row(policy, c) for policy, c in candidates(run, world)]
    fitting = [r for r in rows if r["fits_device"] and r["fits_host"]]
    if not fitting:
        raise ValueError(_nothing_fits(run, world, rows))
    fitting.sort(key=lambda r: (-r["tokens_per_s_per_gpu"], -r["tokens_per_s_per_gpu_serial"], r["device_bytes"]))
    return {"config": run.name, "world": world, "hbm_gb": run.plan.hbm_gb, "host_gb": run.plan.host_gb,
            "batch_size": run.train.batch_size, "seq_len": run.data.seq_len, "dispatch": run.plan.dispatch,
            "candidates": len(rows), "fitting": len(fitting), "policies": list(POLICIES),
            "rule": "fsdp*ep = world, ep | n_experts; micro_batch | batch/world, "
                    "grad_accum = batch/(world*micro_batch)",
            "ranking": fitting[:top]}


def _nothing_fits(run: RunConfig, world: int, rows: list[dict]) -> str:
    def over(r):
        return max(r["device_bytes"] - run.plan.hbm_gb * GB, 0) + max(r["host_bytes"] - run.plan.host_gb * GB, 0)

    best = min(rows, key=over)
    misses = [f"device by {(best['device_bytes'] - run.plan.hbm_gb * GB) / GB:.1f} GB "
              f"({best['device_bytes'] / GB:.1f} of {run.plan.hbm_gb:g})" if not best["fits_device"] else "",
              f"host by {(best['host_bytes'] - run.plan.host_gb * GB) / GB:.1f} GB "
              f"({best['host_bytes'] / GB:.1f} of {run.plan.host_gb:g})" if not best["fits_host"] else ""]
    return (f"no layout of {world} ranks fits ({len(rows)} planned); the closest, fsdp {best['fsdp']} x "
            f"ep {best['ep']}, {best['policy']}, micro-batch {best['micro_batch']}, misses "
            + " and ".join(m for m in misses if m))


def format_search(s: dict) -> str:
    """The table of `fnmoe plan --search`."""
    lines = [f"layout search for {s['config']} on {s['world']} ranks: {s['candidates']} layouts planned, "
             f"{s['fitting']} fit {s['hbm_gb']:g} GB device / {s['host_gb']:g} GB host a GPU; global batch "
             f"{s['batch_size']} x {s['seq_len']} kept (grad_accum = batch / (world x micro-batch)); "
             f"EP dispatch modelled: {s['dispatch']}; modelled, not measured",
             f"{'#':>3} {'fsdp x ep':>10} {'memory':<24}{'mb x acc':>9} {'dev GB':>7} {'host GB':>8} "
             f"{'tok/s/GPU':>10} {'serial':>7}  {'compute':>8} {'fsdp':>7} {'ep in':>7} {'ep out':>7} "
             f"{'host':>6}  bound"]
    for i, r in enumerate(s["ranking"], 1):
        t = r["terms_s"]
        lines.append(f"{i:>3} {r['fsdp']:>4} x {r['ep']:<3} {r['policy']:<24}{r['micro_batch']:>4} x "
                     f"{r['grad_accum']:<3} {r['device_bytes'] / GB:>7.1f} {r['host_bytes'] / GB:>8.1f} "
                     f"{r['tokens_per_s_per_gpu']:>10,.0f} "
                     f"{r['tokens_per_s_per_gpu_serial']:>7,.0f}  {t['compute']:>7.2f}s "
                     f"{t['fsdp inside node'] + t['fsdp across nodes']:>6.2f}s {t['ep inside node']:>6.2f}s "
                     f"{t['ep across nodes']:>6.2f}s {t['host link']:>5.2f}s  {r['bound']}")
    return "\n".join(lines)
