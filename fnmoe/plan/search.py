"""`fnmoe plan --search`: every layout of a world size the planner can judge, those that do not fit
the hardware profile's device or host memory dropped, the rest ranked by the step time as fnmoe
runs it (step_time's as-built projection; the overlapped bound and the serial figure beside it).

The candidates:
  mesh           fsdp x ep = world, ep dividing the expert count (ep 1: no expert parallelism). An
                 ep group is ep consecutive ranks, so ep <= gpus_per_node keeps the exchange inside
                 a node; the expert stacks are FSDP-sharded over the other fsdp ranks.
  memory         the named policies of POLICIES (whole-block recompute, keeping or replaying the
                 exchange, and offload, its block inputs also in fp8 with --memory.offload-dtype
                 float8_e4m3fn; selective recompute per region with the MoE region, the
                 largest, recomputed or offloaded).
  tokens a GPU   b sequences a GPU a step: the config's, and every b = k·2^e (k 1, 3, 5 or 7)
                 whose global batch (b x world sequences) stays within max_global_tokens.
  micro-batch    m sequences a micro-batch for every m dividing b, with grad_accum = b/m up to
                 MAX_ACCUM.
  reduce dtype   the gradients' reduce-scatter in float32 or bfloat16 (mesh.reduce_dtype).
  expert gathers the expert stacks' all-gather in the compute dtype or fp8 with block scales
                 (mesh.expert_gather_dtype), where experts are FSDP-sharded (fsdp > 1), fp8 with
                 bf16 reduce-scatters only (a layout that halves the gathers' bytes halves the
                 reductions' first: fp8 beside fp32 reductions never ranks above its bf16 twin).
  expert GEMMs   with --mesh.expert-gemm-dtype float8_e4m3fn, the routed experts' GEMMs in the compute
                 dtype or fp8, fp8 behind fp8 gathers only (the GEMMs take the gathers' packs as the
                 weights' blocks); else the compute dtype (a GPU's torch must have the fp8 kernels)
  chunks         the fewest cross-entropy chunks (--train.ce-chunks) and then, under full recompute,
                 whole-block chunks (--memory.block-chunks, dividing a micro-batch's sequences), else MoE
                 token chunks (1, 2, 4, ... dividing its tokens) that fit the device; more only shrink
                 memory and re-read the expert weights once a chunk.
Each candidate is a RunConfig that passes fnmoe.config.check.validate, as `fnmoe train` checks it.
The as-built projection records the collectives' order on simulated ranks once per code path
(overlap.py); the search computes it best upper bound first and stops where no candidate left can
enter the top rows, so the ranking is exact and a search takes seconds.
"""
from __future__ import annotations

import dataclasses

from fnmoe.config import RunConfig
from fnmoe.config.check import validate
from fnmoe.config.hardware import hardware
from fnmoe.dtypes import DTYPE_SHORT
from fnmoe.plan.activations import logits_bytes
from fnmoe.plan.state import GB
from fnmoe.plan.summary import fits, per_rank_bytes, plan

MAX_GLOBAL_TOKENS = 67_000_000  # Kimi K2's published global batch (~67M tokens)
CHUNKS = (1, 2, 4, 8, 16, 32, 64)
MAX_ACCUM = 8  # micro-batches a step: more regathers every block's weights again for each
CE_CHUNKS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LOGITS_BYTES = 2 * 10**9
# name -> MemoryConfig fields (the others from the config; region fields not named are "none")
POLICIES: dict[str, dict] = {
    "none": {"recompute": "none"},
    "full": {"recompute": "full"},
    "full, replay exchange": {"recompute": "full", "keep_exchange": False},
    "full+offload": {"recompute": "full", "offload": True},
    "full+offload, replay exchange": {"recompute": "full", "offload": True, "keep_exchange": False},
    "full+offload fp8, replay exchange": {"recompute": "full", "offload": True, "keep_exchange": False,
                                          "offload_dtype": "float8_e4m3fn"},
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


def per_gpu_sequences(run: RunConfig, world: int, max_global_tokens: int) -> list[int]:
    """Sequences a GPU a step to try: the config's, and 1, 2, 3, 4, 6, 8, ... within the token cap."""
    cap = max_global_tokens // (world * run.data.seq_len)
    steps = sorted({k * 2 ** e for k in (1, 3, 5, 7) for e in range(40) if k * 2 ** e <= cap})
    own = [b for b in [run.train.batch_size // world] if run.train.batch_size % world == 0 and 0 < b <= cap]
    return sorted(set(steps + own))


def with_layout(run: RunConfig, fsdp: int, ep: int, policy: str, micro_batch: int, per_gpu: int | None = None,
                reduce_dtype: str | None = None, token_chunks: int | None = None, check: bool = True,
                expert_gather: str | None = None, expert_gemm: str | None = None) -> RunConfig:
    """run on that mesh, memory policy and micro-batch (and, when given, sequences a GPU a step, the
    reduce-scatter dtype, MoE token chunks and the expert gathers' dtype; fp8 gathers fall back to
    the compute dtype where nothing is sharded over fsdp); the global batch kept unless per_gpu is
    given; checked as train checks (the search checks the rows it shows: its candidates are valid by
    construction)."""
    fields = {"recompute": "none", "offload": False, "attention": "none", "moe": "none", "mlp": "none",
              "keep_exchange": True, "block_chunks": 1, "offload_dtype": "compute"}
    memory = dataclasses.replace(run.memory, **{**fields, **POLICIES[policy]})
    batch = run.train.batch_size if per_gpu is None else per_gpu * fsdp * ep
    gather = expert_gather or run.mesh.expert_gather_dtype
    mesh = dataclasses.replace(run.mesh, fsdp=fsdp, ep=ep, **({"reduce_dtype": reduce_dtype} if reduce_dtype else {}),
                               expert_gather_dtype=gather if fsdp > 1 and run.model.moe.n_experts else "compute",
                               expert_gemm_dtype=expert_gemm or run.mesh.expert_gemm_dtype)
    model = run.model if token_chunks is None else dataclasses.replace(
        run.model, moe=dataclasses.replace(run.model.moe, token_chunks=token_chunks))
    train = dataclasses.replace(run.train, batch_size=batch, grad_accum=batch // (fsdp * ep * micro_batch))
    out = dataclasses.replace(run, model=model, mesh=mesh, memory=memory, train=train)
    return validate(out) if check else out


def candidates(run: RunConfig, world: int, max_global_tokens: int = MAX_GLOBAL_TOKENS) -> list[tuple[str, RunConfig]]:
    """(policy name, run) of every layout of `world` ranks the search plans, token chunks 1 (the
    search raises them to fit); ValueError when none."""
    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    sequences = per_gpu_sequences(run, world, max_global_tokens)
    if not sequences:
        raise ValueError(f"no layout of {world} ranks: a sequence a GPU ({world * run.data.seq_len:,} tokens a step) "
                         f"is over --max-global-tokens {max_global_tokens:,}")
    dtypes = ("float32", "bfloat16") if world > 1 else ("float32",)
    # the opt-in fp8 levers are tried where the config asks for them (a GPU's kernels must have them)
    fp8 = run.mesh.expert_gemm_dtype == "float8_e4m3fn"
    policies = [p for p in POLICIES if run.memory.offload_dtype != "compute" or "fp8" not in p]
    return [(policy, with_layout(run, fsdp, ep, policy, m, b, dt, 1, check=False, expert_gather=g, expert_gemm=x))
            for fsdp, ep in meshes(run, world) for policy in policies if not (ep == 1 and "replay" in policy)
            for b in sequences for m in divisors(b) if b // m <= MAX_ACCUM for dt in dtypes
            for g in (("compute", "float8_e4m3fn") if fsdp > 1 and run.model.moe.n_experts and dt == "bfloat16"
                      else ("compute",))
            # fp8 GEMMs behind fp8 gathers only: they take the gathers' packs, where behind compute-dtype
            # gathers they quantise the weights and the gathers send twice the bytes
            for x in (("compute", "float8_e4m3fn") if fp8 and g == "float8_e4m3fn" else ("compute",))]


def fitted(run: RunConfig) -> tuple[RunConfig, dict, tuple[bool, bool]]:
    """run with enough cross-entropy chunks that one chunk's logits take at most LOGITS_BYTES, then
    the fewest chunks that fit the device (the most that help where none fits): whole-block chunks
    under full recompute (dropless), else MoE token chunks; its bytes a rank, and whether they fit
    (device, host)."""
    T = run.micro_batch * run.data.seq_len
    ce = next((n for n in CE_CHUNKS if n >= run.train.ce_chunks and T % n == 0
               and logits_bytes(_with_chunks(run, "ce_chunks", n)) <= LOGITS_BYTES), run.train.ce_chunks)
    run = _with_chunks(run, "ce_chunks", ce)
    b = per_rank_bytes(run)
    ok = fits(run, b)
    blocks = run.memory.recompute == "full" and not run.model.moe.capacity_factor
    field, counts = ("block_chunks", divisors(run.micro_batch)) if blocks else ("token_chunks", CHUNKS)
    for n in counts[1:] if run.model.moe.n_experts or blocks else ():
        if ok[0] or T % n:
            break
        changed = _with_chunks(run, field, n)
        c = per_rank_bytes(changed)
        if c["total_device"] >= b["total_device"]:
            break
        run, b, ok = changed, c, fits(changed, c)
    return run, b, ok


def _with_chunks(run: RunConfig, field: str, n: int) -> RunConfig:
    if field == "ce_chunks":
        return dataclasses.replace(run, train=dataclasses.replace(run.train, ce_chunks=n))
    if field == "block_chunks":
        return dataclasses.replace(run, memory=dataclasses.replace(run.memory, block_chunks=n))
    return dataclasses.replace(run, model=dataclasses.replace(run.model, moe=dataclasses.replace(run.model.moe,
                                                                                               token_chunks=n)))


def row(policy: str, run: RunConfig, p: dict) -> dict:
    """One candidate's line of the ranking."""
    t, r, hw = p["step_time"], p["per_rank_bytes"], hardware(run.plan)
    return {"fsdp": run.mesh.fsdp, "ep": run.mesh.ep, "policy": policy, "micro_batch": run.micro_batch,
            "grad_accum": run.train.grad_accum, "sequences_per_gpu": run.micro_batch * run.train.grad_accum,
            "tokens_per_gpu": run.micro_batch * run.train.grad_accum * run.data.seq_len,
            "reduce_dtype": run.mesh.reduce_dtype, "token_chunks": run.model.moe.token_chunks,
            "block_chunks": run.memory.block_chunks, "expert_gather_dtype": run.mesh.expert_gather_dtype,
            "expert_gemm_dtype": run.mesh.expert_gemm_dtype,
            "ce_chunks": run.train.ce_chunks,
            "device_bytes": r["total_device"], "host_bytes": r["host_pool"],
            "device_left_gb": hw.hbm_gb - r["total_device"] / GB, "host_left_gb": hw.host_gb - r["host_pool"] / GB,
            "fits_device": p["fits"]["device"], "fits_host": p["fits"]["host"],
            # without a recorded proxy step (overlap.py), the serial figure: a lower bound of the as-built one
            "tokens_per_s_per_gpu": t.get("tokens_per_s_per_gpu_as_built", t["tokens_per_s_per_gpu_serial"]),
            "as_built": "tokens_per_s_per_gpu_as_built" in t,
            "tokens_per_s_per_gpu_overlapped": t["tokens_per_s_per_gpu_overlapped"],
            "tokens_per_s_per_gpu_serial": t["tokens_per_s_per_gpu_serial"], "bound": t["bound"],
            # the same at the other rates (plan.rates: stated or measured), as built where that was projected
            "tokens_per_s_per_gpu_beside": p["step_time_beside"].get("tokens_per_s_per_gpu_as_built",
                                                                     p["step_time_beside"]["tokens_per_s_per_gpu_serial"]),
            "beside_rates": p["step_time_beside"]["rates"],
            "terms_s": t["terms_s"], "as_built_s": t.get("as_built_s")}


def search(run: RunConfig, world: int | None = None, top: int = 10,
           max_global_tokens: int = MAX_GLOBAL_TOKENS) -> dict:
    """The ranking of layouts that fit, best as built first, and what the search considered."""
    world = run.mesh.world if world is None else world
    runs = [(policy, *fitted(c)) for policy, c in candidates(run, world, max_global_tokens)]
    fitting = [(policy, c, plan(c, as_built=False, check=False)) for policy, c, _, ok in runs if all(ok)]
    if not fitting:
        raise ValueError(_nothing_fits(run, world, runs))
    fitting.sort(key=lambda x: -x[2]["step_time"]["tokens_per_s_per_gpu_overlapped"])
    ranked: list[dict] = []
    for policy, c, p in fitting:
        bound = p["step_time"]["tokens_per_s_per_gpu_overlapped"]
        if len(ranked) >= top and bound <= ranked[top - 1]["tokens_per_s_per_gpu"]:
            break  # no layout left can enter the top rows: the overlapped figure bounds the as-built one
        ranked.append(row(policy, c, plan(c)))
        ranked.sort(key=lambda r: (-r["tokens_per_s_per_gpu"], -r["tokens_per_s_per_gpu_serial"], r["device_bytes"]))
    hw = hardware(run.plan)
    return {"config": run.name, "world": world, "hardware": run.plan.hardware, "hbm_gb": hw.hbm_gb,
            "host_gb": hw.host_gb, "network_gbps": hw.network_gbps, "seq_len": run.data.seq_len,
            "max_global_tokens": max_global_tokens, "dispatch": run.plan.dispatch, "candidates": len(runs),
            "fitting": len(fitting), "as_built_planned": len(ranked), "policies": list(POLICIES),
            "rule": "fsdp*ep = world, ep | n_experts; b sequences a GPU a step within max_global_tokens; "
                    "micro_batch | b, grad_accum = b/micro_batch; reduce dtype fp32 or bf16; expert gathers in the "
                    "compute dtype or fp8 (fsdp > 1); fewest block "
                    "(full recompute) or token chunks that fit", "ranking": ranked[:top]}


def _nothing_fits(run: RunConfig, world: int, runs: list) -> str:
    hw = hardware(run.plan)

    def over(x):
        b = x[2]
        return max(b["total_device"] - hw.hbm_gb * GB, 0) + max(b["host_pool"] - hw.host_gb * GB, 0)

    policy, c, b, (dev, host) = min(runs, key=over)
    misses = [f"device by {(b['total_device'] - hw.hbm_gb * GB) / GB:.1f} GB "
              f"({b['total_device'] / GB:.1f} of {hw.hbm_gb:g})" if not dev else "",
              f"host by {(b['host_pool'] - hw.host_gb * GB) / GB:.1f} GB "
              f"({b['host_pool'] / GB:.1f} of {hw.host_gb:g})" if not host else ""]
    return (f"no layout of {world} ranks fits {run.plan.hardware} ({len(runs)} planned); the closest, fsdp "
            f"{c.mesh.fsdp} x ep {c.mesh.ep}, {policy}, micro-batch {c.micro_batch} x {c.train.grad_accum}, "
            f"misses " + " and ".join(m for m in misses if m))


def chunks_label(r: dict) -> str:
    """A row's chunks: whole-block chunks as "14b", else MoE token chunks."""
    return f"{r['block_chunks']}b" if r.get("block_chunks", 1) > 1 else str(r["token_chunks"])


def format_search(s: dict) -> str:
    """The table of `fnmoe plan --search`."""
    lines = [f"layout search for {s['config']} on {s['world']} x {s['hardware']} ({s['hbm_gb']:g} GB device, "
             f"{s['host_gb']:g} GB host usable a GPU, {s['network_gbps']:g} GB/s across nodes): {s['candidates']} "
             f"layouts planned, {s['fitting']} fit, {s['as_built_planned']} projected as built; global batch up to "
             f"{s['max_global_tokens']:,} tokens of {s['seq_len']}; modelled, not measured",
             f"{'#':>3} {'fsdp x ep':>10} {'memory':<34}{'seq/GPU':>8} {'mb x acc':>9} {'rs':>4} {'eg':>4} {'gm':>4} "
             f"{'chk':>4} "
             f"{'ce':>4} "
             f"{'dev GB':>7} {'host GB':>8} {'as built':>9} {'overlap':>8} {'serial':>7} {'other':>7}  {'compute':>8} "
             f"{'fsdp':>7} "
             f"{'ep in':>7} {'ep out':>7} {'host':>6}  bound"]
    for i, r in enumerate(s["ranking"], 1):
        t = r["terms_s"]
        lines.append(f"{i:>3} {r['fsdp']:>4} x {r['ep']:<3} {r['policy']:<34}{r['sequences_per_gpu']:>8} "
                     f"{r['micro_batch']:>4} x {r['grad_accum']:<3} {DTYPE_SHORT[r['reduce_dtype']]:>4} "
                     f"{'fp8' if r.get('expert_gather_dtype') == 'float8_e4m3fn' else '-':>4} "
                     f"{'fp8' if r.get('expert_gemm_dtype') == 'float8_e4m3fn' else '-':>4} "
                     f"{chunks_label(r):>4} {r['ce_chunks']:>4} {r['device_bytes'] / GB:>7.1f} "
                     f"{r['host_bytes'] / GB:>8.1f} "
                     f"{r['tokens_per_s_per_gpu']:>8,.0f}{' ' if r['as_built'] else '*'} "
                     f"{r['tokens_per_s_per_gpu_overlapped']:>8,.0f} "
                     f"{r['tokens_per_s_per_gpu_serial']:>7,.0f} {r['tokens_per_s_per_gpu_beside']:>7,.0f}  "
                     f"{t['compute']:>7.2f}s "
                     f"{t['fsdp inside node'] + t['fsdp across nodes']:>6.2f}s {t['ep inside node']:>6.2f}s "
                     f"{t['ep across nodes']:>6.2f}s {t['host link']:>5.2f}s  {r['bound']}")
    lines.append("     rs: the gradients' reduce-scatter dtype; eg: fp8 expert gathers (- the compute dtype); "
                 "gm: fp8 expert GEMMs (--mesh.expert-gemm-dtype; - the compute dtype); memory 'offload fp8': "
                 "block inputs on the host in fp8 (--memory.offload-dtype); "
                 "chk: MoE token chunks (b: whole-block chunks of "
                 "sequences); ce: cross-entropy chunks; "
                 "as built: fnmoe's waits charged (the headline; * not recorded, the serial figure); "
                 "overlap / serial: every collective hidden / none; other: as built at the other rates "
                 f"({s['ranking'][0]['beside_rates'] if s['ranking'] else 'measured'}: --plan.rates; "
                 "docs/memory_plan.md, \"Rates: measured and stated\"); "
                 "bound: the largest term")
    return "\n".join(lines)
