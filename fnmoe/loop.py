"""The training loop: data in, steps, metrics.jsonl and a progress line out.

Legend: B batch, L sequence.
"""
from __future__ import annotations

import logging
import math
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fnmoe import checkpoint, optim
from fnmoe.run import faults
from fnmoe.run import rundir
from fnmoe.parallel import sharding
from fnmoe.run import stop
from fnmoe.parallel import dist as fdist
from fnmoe.checkpoint.procs import _first_error, _from_lead
from fnmoe.compile import cache_stats, save_artifacts, warm_start
from fnmoe.config import RunConfig, to_toml
from fnmoe.data.loader import Loader
from fnmoe.plan.flops import flops_per_token, mfu
from fnmoe.run.metrics import (JsonlWriter, MetricsWriter, TensorBoardWriter, drop_rows_after, load_by_layer,
                              load_max_over_mean)
from fnmoe.data.mixture import training_data
from fnmoe.params import init_params, shape_mismatches
from fnmoe.train import eval_loss, init_state, make_train_step
from fnmoe.train_state import TrainState
from fnmoe.tree import tree_map

log = logging.getLogger("fnmoe")


def run_dir_of(run: RunConfig) -> Path:
    return Path(run.train.run_dir or Path("runs") / run.name)


class _NoOutput:
    """What ranks other than 0 have instead of the metrics writer."""

    error = None

    def write(self, *args) -> None:
        pass

    def close(self) -> None:
        pass


def _start_ranks(run: RunConfig):
    """(rank, mesh or None): the process group from torchrun's environment and the mesh; the mesh
    is checked against the job's size before any compute."""
    if fdist.launched():
        fdist.init_from_env(run.dist)
    if run.mesh.world == 1 and fdist.world() == 1:
        return 0, None
    mesh = sharding.make_mesh(run.mesh, run.dist)
    if fdist.rank() != 0:  # rank 0 speaks for the job; the others only warn
        log.setLevel(logging.WARNING)
    return fdist.rank(), mesh


def _use_deterministic(on: bool) -> None:
    """--train.deterministic: deterministic kernels only, which bit-exact resume on GPUs needs."""
    if not on:
        return
    if torch.cuda.is_available():
        # cuBLAS reads this when its handle is created, so it must be set before the first GPU matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _resume_point(run: RunConfig, root: Path) -> tuple[Path, dict] | None:
    """The checkpoint --resume names (and its verified index), or None for a fresh start; a fresh
    start is refused where it would replace an earlier run's checkpoints."""
    found = checkpoint.resume_point(run.resume, root)
    existing = checkpoint.list_checkpoints(root)
    if found is None and run.resume == "none" and existing:
        raise checkpoint.CheckpointError(
            f"{root} holds checkpoints of an earlier run (newest {existing[0][1].name}): continue it with "
            "--resume auto, or choose another --train.run-dir")
    if found:
        log.info("resuming from %s (step %d)", found[0], found[1]["step"])
    return found


def _metrics_writer(path: Path, resumed_from: int | None) -> JsonlWriter:
    """A fresh metrics.jsonl; on resume from step N the old one without its rows after N, plus a resume row."""
    if resumed_from is None:
        return JsonlWriter(path, fresh=True)
    drop_rows_after(path, resumed_from)
    writer = JsonlWriter(path, fresh=False)
    writer.write({"event": "resume", "from_step": resumed_from})
    return writer


def _save_on_interrupt(saver: checkpoint.Saver, state: TrainState, run: RunConfig, loader: Loader) -> str:
    """Ctrl-C: finish the save in flight, save the last finished step; say where the work is."""
    saver.join()
    if state.step > saver.last_step:
        saved = saver.save(state, run, loader.position(state.step), blocking=True)
        return f"saved checkpoint {saved}; continue with --resume auto"
    if state.step:
        return f"checkpoint {saver.root / f'step_{state.step}'} holds it; continue with --resume auto"
    return "no step finished, so no checkpoint was saved"


def _bar(done: int, total: int, width: int = 20) -> str:
    n = width * done // total
    return "[" + "#" * n + "." * (width - n) + "]"


def _profile_window(run: RunConfig, run_dir: Path, first: int, rank: int):
    """(first, last, profiler, trace path) for --profile.steps A:B, or None. A resumed run profiles
    the part of the window it runs; each rank of a mesh writes its own trace."""
    if not run.profile.steps:
        return None
    a, b = (int(x) for x in run.profile.steps.split(":"))
    if first > b:
        log.info("profile.steps %s: this run starts at step %d, after the window; no trace", run.profile.steps, first)
        return None
    a = max(a, first)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    name = f"trace_steps_{a}_{b}" + (f"_rank{rank}" if fdist.world() > 1 else "") + ".json"
    return a, b, torch.profiler.profile(activities=acts, record_shapes=True), run_dir / "profile" / name


def train(run: RunConfig) -> dict:
    """Train run from scratch or from the checkpoint --resume names, saving checkpoints on the way;
    returns a summary (steps done, last loss, final val_loss, the last checkpoint). Under torchrun
    every rank runs this; rank 0 prints and writes metrics.jsonl and config.toml.

    SIGINT, SIGTERM and SIGUSR1 stop every rank after the same step, which is saved (a second signal
    aborts; fnmoe.run.stop); the summary then says `interrupted`. One run at a time holds the run
    directory (fnmoe.run.rundir)."""
    rank, mesh = _start_ranks(run)
    try:
        with stop.on_signals(speak=rank == 0) as request:
            try:
                return _train(run, rank, mesh, request)
            except BaseException:
                if request.aborted_by is None:
                    raise
        return _aborted(run, request.aborted_by)  # out of on_signals: a third signal acts as usual
    except RuntimeError as e:
        if fdist.collective_failed(e):
            raise fdist.CollectiveError(fdist.failure_report(e, run.dist.timeout_s)) from e
        if not _is_oom(e):
            raise
        raise OutOfMemory(_oom_report(run, rank, e)) from None
    except BaseException as e:
        if mesh is not None:
            e.add_note(f"fnmoe: raised on rank {rank} of {fdist.world()}")
        raise
    finally:
        if mesh is not None and fdist.launched():
            dist.destroy_process_group()


def _aborted(run: RunConfig, signum: int) -> dict:
    """A second signal cut the stop short: what is on disk is what complete checkpoints hold."""
    run_dir = run_dir_of(run)
    found = checkpoint.list_checkpoints(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else []
    where = (f"the newest complete checkpoint is {found[0][1]}; continue with --resume auto" if found
             else "there is no checkpoint")
    log.warning("%s again while stopping: aborted (a save cut short leaves no partial checkpoint); %s",
                stop.name(signum), where)
    return {"steps": found[0][0] if found else 0, "interrupted": True, "aborted": True, "run_dir": str(run_dir)}


def _job_verdict(error: str | None, rank: int) -> None:
    """Raise rank 0's error on every rank: what rank 0 alone does (the lock, config.toml,
    metrics.jsonl) ends every rank alike, instead of leaving the others waiting in a collective."""
    error = _from_lead(error)
    if error:
        raise rundir.RunDirError(error if rank == 0 else f"rank 0: {error}")


class OutOfMemory(RuntimeError):
    """Training ran out of memory; the message holds the plan and the measured peak."""


def _is_oom(e: RuntimeError) -> bool:
    # CUDA raises torch.OutOfMemoryError; the CPU allocator a RuntimeError with this text
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def _oom_report(run: RunConfig, rank: int, e: RuntimeError) -> str:
    """What ran out, the measured peak, and the planner's table for this config, to pick a policy from."""
    from fnmoe.plan.summary import format_plan, plan

    if torch.cuda.is_available():
        peak = (f"peak device memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
                "(torch.cuda.max_memory_allocated)")
    else:  # Linux reports ru_maxrss in KiB
        peak = f"peak host memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (max RSS)"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"out of memory on rank {rank}: {first}\nmeasured: {peak}\n"
            f"the plan for this config (fnmoe plan; try --memory.recompute full, --memory.offload, "
            f"a smaller --train.batch-size or more --train.grad-accum):\n{format_plan(plan(run))}\n"
            "no checkpoint was written for the failed step; the last complete one is kept")


def _memory_report(run: RunConfig, params, batch: tuple, rank: int) -> None:
    """--memory.report: every rank measures (a mesh's forward needs all of them); rank 0 prints."""
    from fnmoe.memory import report as memory_report

    rows = memory_report.measure(run, params, batch)
    if rank == 0:
        log.info(memory_report.table(rows, run.memory, memory_report.eager_note(run)))


def _initial_params(run: RunConfig, device: torch.device, mesh):
    """The random init, or the weights of --train.init-from-hf (checked against the config's shapes)."""
    if not run.train.init_from_hf:
        return init_params(run.model, run.train.seed, device=device, mesh=mesh)
    from fnmoe import hf

    cfg, params = hf.load(run.train.init_from_hf, mesh=mesh)
    diff = shape_mismatches(params, run.model)
    if diff:
        raise ValueError(f"train.init_from_hf={run.train.init_from_hf}: its model ({cfg.n_layers} layers, dim "
                         f"{cfg.dim}, {cfg.moe.n_experts} experts) does not match the config's; first differences: "
                         f"{'; '.join(diff)}; `fnmoe convert --from-hf SRC --out DST` writes DST/config.toml "
                         "with its model")
    return _to(params, device)


def _to(tree, device: torch.device):
    """tree's plain tensors on device (DTensors are placed by their mesh already)."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t, tree)


def _train(run: RunConfig, rank: int, mesh, request: stop.Request) -> dict:
    """The run, holding its directory's lock (rank 0 takes it) from before anything in it is read
    until every exit: a return, an error, a signal's stop or abort."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = rundir.acquire(run_dir_of(run))
        except rundir.RunDirError as e:
            error = str(e)
    try:
        _job_verdict(error, rank)
        return _train_locked(run, rank, mesh, request)
    finally:
        if lock:
            lock.release()


def _open_outputs(run: RunConfig, run_dir: Path, state: TrainState, resumed: bool, rank: int):
    """Rank 0's config.toml and metrics writer (the others write nothing), with one verdict for all."""
    writer, error = _NoOutput(), None
    if rank == 0:
        try:
            rundir.write_text(run_dir / "config.toml", to_toml(run))
            # alone: the other ranks reach their first save only after rank 0 is past this (a step's collectives)
            checkpoint.discard_after(run_dir / "checkpoints", state.step)
            mirrors = [TensorBoardWriter(run_dir / "tensorboard")] if run.train.tensorboard else []
            if run.train.wandb:  # imported only when asked: the core never imports wandb
                from fnmoe.run.wandb_log import WandbWriter
                mirrors.append(WandbWriter(run, run_dir, resumed))
            writer = MetricsWriter(_metrics_writer(run_dir / "metrics.jsonl", state.step if resumed else None),
                                   *mirrors)
        except ValueError as e:  # RunDirError, or no tensorboard / wandb package
            error = str(e)
    _job_verdict(error, rank)
    return writer


def _check_host_memory(run: RunConfig, rank: int) -> None:
    """Before anything is allocated: the offload pool must fit plan.host_gb and this host's free
    memory (fnmoe.memory.host_limit). Hosts differ in what they have free, so every rank raises the
    first rank's error alike instead of leaving the others in a collective."""
    from fnmoe.memory.host_limit import HostMemoryError, host_memory_error

    mine = host_memory_error(run)
    error = _first_error(f"rank {rank}: {mine}" if mine and fdist.world() > 1 else mine)
    if error:
        raise HostMemoryError(f"{error}; stopped before step 1")


def _train_locked(run: RunConfig, rank: int, mesh, request: stop.Request) -> dict:
    _check_host_memory(run, rank)
    _use_deterministic(run.train.deterministic)
    torch.manual_seed(run.train.seed)
    if run.train.threads:
        torch.set_num_threads(run.train.threads)
    artifacts = warm_start(run.compile_cache, to_toml(run.model)) if run.model.compile else None
    run_dir = run_dir_of(run)
    ckpt_root = run_dir / "checkpoints"
    found = _resume_point(run, ckpt_root)

    t, L = run.train, run.data.seq_len
    device = fdist.compute_device(run.dist, run.mesh.world)
    # every rank evaluates the same global micro-batches: val_loss is the same on any mesh
    loader, val, weights = training_data(run)
    val = {name: [_to(b, device) for b in batches] for name, batches in val.items()}
    tx, _ = optim.from_config(run.optim, t.steps)
    if found:
        state = checkpoint.load_state(*found, run, tx, loader.data.fingerprint, mesh)
        state = TrainState(_to(state.params, device), _to(state.opt_state, device), state.step)
    else:
        state = init_state(_initial_params(run, device, mesh), tx)
    if state.step >= t.steps:
        log.info("%s is at step %d and train.steps=%d: nothing to train", found[0], state.step, t.steps)
        return {"steps": state.step, "loss": None, "val_loss": None, "run_dir": str(run_dir),
                "params": state.params, "interrupted": False, "checkpoint": str(found[0])}
    writer = _open_outputs(run, run_dir, state, bool(found), rank)
    train_step = make_train_step(run, tx)
    fpt = flops_per_token(run.model, L)
    saver = checkpoint.Saver(ckpt_root, run.checkpoint, last_step=state.step)  # on every rank: a save is collective
    prof = _profile_window(run, run_dir, state.step + 1, rank)
    log.info("run %s: steps %d..%d x %d sequences x %d tokens -> %s", run.name, state.step + 1, t.steps,
             t.batch_size, L, run_dir)

    if run.memory.report:
        _memory_report(run, state.params, _to(loader.batch_at(state.step, rank, run.dp_size, 0), device), rank)
    start, tokens, row, first = time.perf_counter(), state.step * t.batch_size * L, {}, state.step + 1
    try:
        why = stop.agreed(request)  # a signal during the setup stops before the first step
        for step in range(state.step + 1, t.steps + 1):
            if why:
                break
            faults.before_step(step, rank)
            if prof and step == prof[0]:
                prof[2].start()
            batch = [_to(loader.batch_at(step - 1, rank, run.dp_size, m), device) for m in range(t.grad_accum)]
            t_step = time.perf_counter()
            new_state, m = train_step(state, batch)
            dt = time.perf_counter() - t_step
            tokens += t.batch_size * L
            tps = t.batch_size * L / dt
            row = {"step": step, "loss": m["loss"], "lr": optim.last_lr(new_state.opt_state),
                   "grad_norm": m["grad_norm"], "tokens": tokens, "tokens_per_s": tps,
                   "mfu": mfu(fpt, tps, t.peak_tflops),
                   "expert_load_max_over_mean": load_max_over_mean(m["expert_counts_NE"]),
                   "expert_load_by_layer": load_by_layer(m["expert_counts_NE"]),
                   "skipped": m["skipped"], "time_s": time.perf_counter() - start}
            for key in ("dropped_tokens", "skipped_why"):
                if key in m:
                    row[key] = m[key]
            writer.write(row, m["expert_counts_NE"])
            faults.signal_after(step, rank, lambda: request.signum is not None)
            # the step boundary: every rank learns here whether any was signalled or failed to write
            why = stop.agreed(request, write_failed=writer.error is not None)
            if why == stop.WRITE_FAILED:
                break
            state = new_state  # only now: a checkpoint of `state` never lacks its metrics row
            saver.wait_staged()  # a background save's copies of the state before: done, its memory free
            if artifacts and step == first and rank == 0:  # all is compiled after the first step; ranks compile alike
                save_artifacts(artifacts)
                log.info("compile: %s (artifacts in %s)", cache_stats(), artifacts)
            if prof and step == prof[1]:
                prof[2].stop()
                prof[3].parent.mkdir(parents=True, exist_ok=True)
                prof[2].export_chrome_trace(str(prof[3]))
                log.info("profile of steps %d..%d written to %s", prof[0], prof[1], prof[3])
            if step % t.log_every == 0 or step == t.steps:
                log.info(_progress_line(row, t.steps))
            if why and step < t.steps:  # at the last step, the run ends as it would have
                break
            why = 0
            if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                writer.write(_evaluate(step, state.params, val, weights, run))
            if run.checkpoint.every and step % run.checkpoint.every == 0 and step < t.steps:
                saver.save(state, run, loader.position(state.step))
            faults.after_step(step, rank)
        if why:
            return _stop(why, writer, saver, state, run, loader, rank)
        saved = saver.save(state, run, loader.position(state.step), blocking=True)
        val_row = _evaluate(t.steps, state.params, val, weights, run)
        val_loss = val_row["val_loss"]
        writer.write(val_row)
        if writer.error is not None:
            raise rundir.RunDirError(f"{writer.error}; the run finished and saved {saved}")
    except KeyboardInterrupt:
        log.warning("interrupted at step %d of %d; %s", state.step, t.steps,
                    _save_on_interrupt(saver, state, run, loader))
        return {"steps": state.step, "interrupted": True, "run_dir": str(run_dir)}
    finally:
        saver.join()
        writer.close()
    log.info("done: %d steps in %.1f s, final train loss %.4f, held-out loss %.4f; metrics in %s, checkpoint %s",
             t.steps, time.perf_counter() - start, row["loss"], val_loss, run_dir / "metrics.jsonl", saved)
    return {"steps": t.steps, "loss": row["loss"], "val_loss": val_loss, "run_dir": str(run_dir),
            "params": state.params, "interrupted": False, "checkpoint": str(saved)}


def _stop(why: int, writer, saver: checkpoint.Saver, state: TrainState, run: RunConfig, loader: Loader,
          rank: int) -> dict:
    """Every rank stops here, after the last step whose metrics row was written: saved, then a
    summary (a signal) or a RunDirError (a write failure)."""
    if why != stop.WRITE_FAILED:
        where = _save_on_interrupt(saver, state, run, loader)
        if rank == 0:  # the others said it in their checkpoint lines
            log.warning("%s: interrupted at step %d of %d; %s", stop.name(why), state.step, run.train.steps, where)
        return {"steps": state.step, "interrupted": True, "run_dir": str(run_dir_of(run))}
    what = str(writer.error) if rank == 0 else "rank 0 could not write its files"
    try:
        where = _save_on_interrupt(saver, state, run, loader)
    except checkpoint.CheckpointError as e:
        where = f"and no checkpoint was saved either: {e}"
    raise rundir.RunDirError(f"{what}; stopped after step {state.step}: {where}")


def _evaluate(step: int, params, val: dict, weights: dict, run: RunConfig) -> dict:
    """The eval row: val_loss, and for a mixture each source's val_loss/<name> (val_loss is then
    their mean weighted as the batches are); a mixture's row is also a progress line."""
    losses = {name: eval_loss(params, batches, run) for name, batches in val.items()}
    row = _val_row(step, sum(weights[name] * loss for name, loss in losses.items()))
    if "" not in losses:
        row.update({f"val_loss/{name}": loss for name, loss in losses.items()})
        log.info(_eval_line(row, losses))
    return row


def _val_row(step: int, val_loss: float) -> dict:
    return {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 80.0))}


def _eval_line(row: dict, losses: dict) -> str:
    parts = " | ".join(f"{name} {loss:.4f}" for name, loss in losses.items())
    return f"eval step {row['step']}: val_loss {row['val_loss']:.4f} (weighted) | {parts}"


def _progress_line(row: dict, total: int) -> str:
    m = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    load = "n/a" if row["expert_load_max_over_mean"] is None else f"{row['expert_load_max_over_mean']:.2f}"
    skip = f" SKIPPED ({row.get('skipped_why', 'non-finite gradients')})" if row["skipped"] else ""
    return (f"step {row['step']:>{len(str(total))}}/{total} {_bar(row['step'], total)} loss {row['loss']:.4f} "
            f"| lr {row['lr']:.2e} | gnorm {row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s "
            f"| mfu {m} | load max/mean {load} | {row['time_s']:.1f}s{skip}")
