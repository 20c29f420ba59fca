"""`fnmoe rehearse`: one rank of a config's full mesh runs one real training step on fake tensors,
and what it holds and sends is set against the planner.

Legend: T tokens of a micro-batch on a rank, K top-k, S ep ranks.

The process joins torch's fake process group as rank R of mesh.fsdp x mesh.ep ranks and runs, under
FakeTensorMode (shapes and dtypes, no bytes), fnmoe's own code: the sharded chunked init, the
forward and backward under the configured memory policies (offload's host-pool bookkeeping
included), the FSDP gathers and reduce-scatters, the EP all-to-alls, the optimizer update and the
router-bias rule (fnmoe.training.step.make_device_step), and the checkpoint index every rank's shards
would give. Collectives return at once with outputs of the right shape: nothing is sent, the
bytes are counted (fnmoe.plan.meters.CommMeter). Regions run eager (compiled ones save what inductor's
partitioner picks, which can differ).

Fake tensors hold no values, so routing cannot come from the router: every exchange sends a rank's
T·K rows evenly over the S ep ranks and receives plan.imbalance times that (this rank plays the
busiest one, as the planner does).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from fnmoe import _torch, checkpoint, optim
from fnmoe.parallel import dispatch
from fnmoe.parallel import sharding
from fnmoe._torch import FakeStore, FakeTensorMode
from fnmoe.config import RunConfig, to_toml, validate
from fnmoe.memory.policies import train_runner
from fnmoe.plan.activations import pool_bytes
from fnmoe.plan.meters import CATEGORIES, CommMeter, PhaseMeter, StorageMeter, plain_tensors
from fnmoe.training.step import make_device_step
from fnmoe.training.state import TrainState
from fnmoe.tree import flatten_dict

MAX_WORLD = 1 << 16  # ranks a rehearsal plays (its host structures are per leaf, not per rank)
GB = 1e9


def _check(run: RunConfig, rank: int | str) -> None:
    world = run.mesh.world
    if world > MAX_WORLD:
        raise ValueError(f"mesh.fsdp x mesh.ep = {world} ranks: a rehearsal plays at most {MAX_WORLD}")
    if rank != "worst" and not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"--rank {rank} is out of range: the mesh has ranks 0..{world - 1} (or 'worst')")
    if dist.is_initialized():
        raise RuntimeError("fnmoe.plan.rehearse: a process group is already running in this process")


def held_bytes(run: RunConfig) -> list[int]:
    """Per rank, the bytes of its fp32 param shards (torch.chunk gives leading ranks more), from the
    mesh's shape alone (sharding.axis_coords: where rank r sits on ("fsdp", "ep"))."""
    from fnmoe.models.params import leaf_inits
    fsdp, ep = run.mesh.fsdp, run.mesh.ep
    sizes = {"fsdp": fsdp, "ep": ep, sharding.DP: fsdp * ep}
    out = [0] * run.mesh.world
    for path, init in flatten_dict(leaf_inits(run.model)).items():
        spec = sharding.leaf_spec(path, init.shape, sizes)
        for r in range(run.mesh.world):
            index = sharding.local_index(spec, init.shape, sharding.axis_coords(r, fsdp, ep), sizes)
            out[r] += 4 * math.prod(len(range(*s.indices(n))) for s, n in zip(index, init.shape))
    return out


def _routing(imbalance: float, ep: int):
    def splits(n_rows: int, S: int) -> tuple[list[int], list[int]]:
        recv = math.ceil(n_rows * (imbalance if ep > 1 else 1.0) / S)
        return sharding.chunk_lengths(n_rows, S), [recv] * S
    return splits


def _bytes(tree) -> int:
    return sum({_torch.storage_key(t): t.untyped_storage().nbytes() for t in plain_tensors(tree)}.values())


class Clock:
    """Says each phase of a rehearsal as it begins (say(line)), with the time the one before took."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.name, self.t0, self.start = say, "", time.perf_counter(), time.perf_counter()

    def begin(self, name: str) -> None:
        now = time.perf_counter()
        took = f" ({self.name} took {now - self.t0:.1f} s)" if self.name else ""
        self.say(f"rehearse: {name}...{took}")
        self.name, self.t0 = name.split(":")[0], now

    def end(self) -> None:
        now = time.perf_counter()
        self.say(f"rehearse: done in {now - self.start:.1f} s ({self.name} took {now - self.t0:.1f} s)")


class Phases(PhaseMeter):
    """The step's phases on a Clock: each micro-batch's forward (fnmoe.models.seams.mark) and backward (the
    first op autograd's engine runs after it), and the update. Passes every op on unchanged."""

    def __init__(self, clock: Clock, n_micro: int):
        super().__init__()
        self.clock, self.n, self.k, self.waiting = clock, n_micro, 0, False

    def marked(self, phase: str, tree) -> None:
        if phase == "forward":
            self.k += 1
            self.clock.begin(f"forward of micro-batch {self.k} of {self.n}")
            self.waiting = True
        elif phase == "update":
            self.clock.begin("update: reduce-scatters, optimizer")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.waiting and _torch.in_backward():
            self.waiting = False
            self.clock.begin(f"backward of micro-batch {self.k} of {self.n}")
        return func(*args, **(kwargs or {}))


def rehearse(run: RunConfig, rank: int | str = "worst", fresh_process: bool = True,
             say: Callable[[str], None] | None = None) -> dict:
    """The rehearsal report of one step of run as `rank` (an int, or "worst": the rank holding the
    most param bytes), and the plan beside it (see compare). It runs in a fresh process unless told
    otherwise: DTensor caches its plans by mesh value across process groups, so a second rehearsal
    of another rank in one process would reuse the first one's local shapes. say(line), in this
    process, hears each phase as it begins (init, forward, backward, update, index)."""
    _check(run, rank)
    validate(run)
    if rank == "worst":
        held = held_bytes(run)
        rank = max(range(run.mesh.world), key=held.__getitem__)
    if not fresh_process:
        return _rehearse(run, rank, Clock(say) if say else None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{run.name}.toml"
        path.write_text(to_toml(run))
        done = subprocess.run([sys.executable, "-m", "fnmoe", "rehearse", "--config", str(path), "--rank", str(rank),
                               "--json"], capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: it ran, and differs from the plan
        raise RuntimeError(f"the rehearsal's process failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout)
    report.pop("compare")
    return report


def _rehearse(run: RunConfig, rank: int, clock: Clock | None = None) -> dict:
    from fnmoe.plan.summary import plan
    t0 = time.perf_counter()
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, compile=False))
    _torch.clear_dtensor_caches()
    dist.init_process_group("fake", world_size=run.mesh.world, rank=rank, store=FakeStore())
    try:
        out = _step(run, sharding.make_mesh(run.mesh, run.dist), rank, clock)
    finally:
        dist.destroy_process_group()
    if clock:
        clock.end()
    out.update(rank=rank, world=run.mesh.world, config=run.name, wall_s=time.perf_counter() - t0,
               host_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out["plan"] = plan(run)
    return out


def _step(run: RunConfig, mesh, rank: int, clock: Clock | None = None) -> dict:
    cfg = run.model
    tx = optim.from_config(run.optim, run.train.steps)
    T = run.micro_batch * run.data.seq_len
    if clock:
        clock.begin(f"init: rank {rank} of {run.mesh.world} (fsdp {run.mesh.fsdp} x ep {run.mesh.ep}), its "
                    "param shards and optimizer state (fake tensors)")
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = sharding.init_params(cfg, run.train.seed, mesh=mesh)
        tokens = torch.zeros(run.micro_batch, run.data.seq_len, dtype=torch.int64)
        batches, n_global = [(tokens, tokens)] * run.train.grad_accum, T * run.train.grad_accum * run.mesh.world
        with dispatch.pinned_splits(_routing(run.plan.imbalance, run.mesh.ep)):
            out, new = measure_step(run, mesh, TrainState(params, tx.init(params), 0), tx, batches, n_global,
                                    Phases(clock, len(batches)) if clock else None)
        if clock:
            clock.begin("index: the checkpoint's index.json of every rank's shards")
        out["index_json_bytes"] = len(checkpoint.index_only(new, run, range(run.mesh.world)))
    out["routing"] = (f"pinned: every exchange sends T*K={T * cfg.moe.top_k} rows evenly over the ep ranks and "
                      f"receives plan.imbalance={run.plan.imbalance} times that (fake tensors hold no routing)")
    return out


def measure_step(run: RunConfig, mesh, state: TrainState, tx, micro_batches: list, n_global: int,
                 phases: Phases | None = None):
    """(what one step of this rank holds and sends, the new state), measured by fnmoe.plan.meters: on
    fake tensors here, on real ones in tests/test_mesh_memory.py (the same numbers, checked). phases,
    when given, says the step's phases as they begin."""
    T = run.micro_batch * run.data.seq_len
    storage = StorageMeter((math.ceil(T / run.train.ce_chunks), run.model.vocab_size))
    comm = CommMeter(sharding.group_axes(mesh))
    # the step's runner, its host pool sized here (under fake tensors the pool is fake: bookkeeping only)
    runner = train_runner(run, pool_bytes(run))
    # the step as the training loop builds it: donated where run.train.donate says (the update's workspace)
    device_step, pool = make_device_step(run, tx, runner, donate=run.train.donate), runner.pool
    if pool is not None:
        storage.exclude(pool.buffers)  # host memory: what the pool holds is reported on its own
    storage.track(state.params, "params")
    storage.track(state.opt_state, "optim")
    with storage, comm, (phases or contextlib.nullcontext()):
        new, _ = device_step(state, micro_batches, n_global)
    mem = storage.report()
    end = {"params": _bytes(new.params), "optim": _bytes(new.opt_state)}
    mem["end"] = {c: end.get(c, 0) for c in CATEGORIES}
    return {"memory": mem, "collectives": comm.rows(),
            "host_offloaded_bytes": pool.peak_used if pool is not None else 0}, new


# ---------------------------------------------------------------- against the plan

TOLERANCE, FLOOR = 0.10, 256 * 2**20  # a category fails beyond 10% of the plan or 256 MiB, whichever is larger
MEMORY_ROWS = ("params", "grads", "optim", "gathered", "activations", "recompute_transient", "logits", "ep_buffers",
               "update_transient", "offload_host", "total_device")


def rehearsed_bytes(report: dict) -> dict[str, int]:
    """The rehearsal's bytes in the planner's categories (fnmoe.plan.summary's per_rank_bytes): state at the
    end of the step, gradients once whole, each transient at its own peak, activations as what the
    forward left alive when backward began (params, state, gradients and gathered weights aside)."""
    m = report["memory"]
    top, start = m["category_peak"], m["at_backward"]
    saved = sum(start.values()) - sum(start[c] for c in ("params", "optim", "gathered", "grads"))
    return {"params": m["end"]["params"], "grads": top["grads"], "optim": m["end"]["optim"],
            "gathered": top["gathered"], "activations": saved, "recompute_transient": top["backward"],
            "logits": top["logits"], "ep_buffers": top["ep_buffers"],
            "update_transient": top["optim"] - m["end"]["optim"], "offload_host": report["host_offloaded_bytes"],
            "total_device": m["peak"]}


def rehearsed_comm(report: dict) -> dict[str, int]:
    """Bytes sent in the planner's collective kinds (fnmoe.plan.comm.comm_bytes), and what it leaves out."""
    out = {"fsdp": 0, "ep": 0, "not planned": 0}
    for row in report["collectives"]:
        step = row["phase"] != "update"  # the optimizer's (Muon's whole-matrix exchange) are not planned
        if step and row["kind"] in ("all_gather", "reduce_scatter"):
            out["fsdp"] += row["bytes"]
        elif step and row["kind"] == "all_to_all" and "ep" in row["axis"].split("/"):
            out["ep"] += row["bytes"]
        else:
            out["not planned"] += row["bytes"]
    return out


def _row(name: str, planned: int, got: int) -> dict:
    allowed = max(TOLERANCE * planned, FLOOR)
    # the planned total adds every category's peak as if they coincided: a bound, which the true peak
    # may stay under by any amount but not pass
    ok = got - planned <= allowed if name == "total_device" else abs(got - planned) <= allowed
    return {"name": name, "planned": planned, "rehearsed": got, "ratio": got / planned if planned else None, "ok": ok}


def compare(report: dict) -> dict:
    """Planned against rehearsed, per memory category and collective kind; ok is every row's."""
    p = report["plan"]
    mem, comm = rehearsed_bytes(report), rehearsed_comm(report)
    rows = [_row(k, p["per_rank_bytes"][k], mem[k]) for k in MEMORY_ROWS]
    comm_rows = [_row(k, p["comm_bytes_detail"][k], comm[k]) for k in ("fsdp", "ep")]
    return {"memory": rows, "comm": comm_rows, "not_planned_comm": comm["not planned"],
            "ok": all(r["ok"] for r in rows + comm_rows)}


def format_report(report: dict, cmp: dict) -> str:
    mib = lambda b: f"{b / 2**20:12,.1f}"  # noqa: E731 (MiB = 2**20 B; the plan's GB are 1e9 B)
    lines = [f"rehearsal of {report['config']}: rank {report['rank']} of {report['world']} "
             f"(fsdp {report['plan']['mesh']['fsdp']} x ep {report['plan']['mesh']['ep']}), one step on fake tensors, "
             f"{report['wall_s']:.1f} s, host RSS {report['host_rss_bytes'] / GB:.2f} GB",
             f"  routing {report['routing']}", "",
             f"  {'MiB per rank':<22}{'planned':>12} {'rehearsed':>12} {'ratio':>7}"]
    ratio = lambda r: f"{r['ratio']:7.3f}" if r["ratio"] is not None else "      -"  # noqa: E731
    flag = lambda r: "" if r["ok"] else "  DIFFERS"  # noqa: E731
    for r in cmp["memory"]:
        lines.append(f"  {r['name']:<22}{mib(r['planned'])} {mib(r['rehearsed'])} {ratio(r)}{flag(r)}")
    emulated = report["memory"]["category_peak"].get("emulation", 0)
    if emulated:
        lines.append(f"  (the CPU emulation of the fp8 GEMMs held {emulated / 2**20:,.1f} MiB of float32 operands at "
                     f"its peak, which a GPU's scaled GEMM never makes: left out of every row)")
    lines += ["", f"  {'MiB sent per step':<22}{'planned':>10} {'rehearsed':>10} {'ratio':>7}"]
    for r in cmp["comm"]:
        lines.append(f"  {r['name']:<22}{mib(r['planned'])} {mib(r['rehearsed'])} {ratio(r)}{flag(r)}")
    lines.append(f"  {'not planned':<22}{'-':>12} {mib(cmp['not_planned_comm'])}")
    lines += ["", f"  {'collective':<20}{'axis':<10}{'dtype':<10}{'phase':<8}{'calls':>7}{'MiB sent':>13}"]
    for c in report["collectives"]:
        lines.append(f"  {c['kind']:<20}{c['axis']:<10}{c['dtype']:<10}{c['phase']:<8}{c['calls']:>7}{mib(c['bytes'])}")
    host, fits = report["host_offloaded_bytes"], report["plan"]["fits"]
    lines += ["", f"  host: the pool held {host / GB:.2f} GB of offloaded tensors; the plan pins "
                  f"{report['plan']['per_rank_bytes']['host_pool'] / GB:.2f} GB for it, against "
                  f"{fits['host_gb']:g} GB usable a GPU on {report['plan']['hardware']['profile']}: "
                  f"{'fits' if fits['host'] else 'DOES NOT FIT'}"]
    lines += ["", f"  checkpoint index.json  {report['index_json_bytes'] / 2**20:.2f} MiB",
              f"  {'agrees with the plan' if cmp['ok'] else 'DIFFERS from the plan'} "
              f"(a category fails beyond {TOLERANCE:.0%} or {FLOOR >> 20} MiB)"]
    return "\n".join(lines)
