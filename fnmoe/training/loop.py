"""The training loop: data in, steps, metrics.jsonl and a progress line out. This module starts the
ranks, holds the run directory, answers signals and failures, and sets a run up (its state, outputs,
step and saver); the steps themselves are fnmoe.training.loop_steps'.

Legend: B batch, L sequence.
"""
from __future__ import annotations

import logging
import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from fnmoe import checkpoint, optim, threads
from fnmoe.run import guards
from fnmoe.run import rundir
from fnmoe.parallel import sharding
from fnmoe.run import stop
from fnmoe.parallel import dist as fdist
from fnmoe.parallel.same_config import ConfigMismatch, check_same_config
from fnmoe.checkpoint.procs import first_error, from_lead
from fnmoe.compile import warm_start
from fnmoe.kernels import gemm as cpu_gemm
from fnmoe.config import RunConfig, to_toml
from fnmoe.plan.activations import pool_bytes
from fnmoe.plan.flops import flops_per_token
from fnmoe.run.notes import log_length
from fnmoe.run.progress import profile_window
from fnmoe.run.metrics import JsonlWriter, MetricsWriter, TensorBoardWriter, drop_rows_after
from fnmoe.data.mixture import training_data
from fnmoe.memory.policies import train_runner
from fnmoe.models.params import shape_mismatches
from fnmoe.training.loop_steps import Session, run_dir_of, run_steps, to_device
from fnmoe.training.step import init_state, make_train_step
from fnmoe.training.state import TrainState

log = logging.getLogger("fnmoe")


class _NoOutput:
    """What ranks other than 0 have instead of the metrics writer."""

    error = None

    def write(self, *args) -> None:
        pass

    def close(self) -> None:
        pass


def _start_ranks(run: RunConfig):
    """(rank, mesh or None): the process group from torchrun's environment and the mesh; the mesh
    is checked against the job's size before any compute, and every rank's config against rank 0's
    before the mesh is made (fnmoe.parallel.same_config)."""
    if fdist.launched():
        fdist.init_from_env(run.dist)
        try:
            check_same_config(run)
        except ConfigMismatch:
            dist.destroy_process_group()
            raise
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


def train(run: RunConfig) -> dict:
    """Train run from scratch or from the checkpoint --resume names, saving checkpoints on the way;
    returns a summary (steps done, last loss, final val_loss, the last checkpoint). Under torchrun
    every rank runs this; rank 0 prints and writes metrics.jsonl and config.toml.

    SIGINT, SIGTERM, SIGHUP and SIGUSR1 stop every rank after the same step, which is saved (a
    second signal aborts; fnmoe.run.stop); the summary then says `interrupted`. A worker torchrun
    restarts after such a stop ends at once (`stopped_before`). One run at a time holds the run
    directory (fnmoe.run.rundir)."""
    rank, mesh = _start_ranks(run)
    try:
        stopped = from_lead(stop.honoured(run_dir_of(run)) if rank == 0 else None)
        if stopped:
            return _stopped_before(run, rank, stopped)
        with stop.on_signals(speak=rank == 0) as request:
            try:
                summary = _train(run, rank, mesh, request)
            except BaseException:
                if request.aborted_by is None:
                    raise
                summary = None
        if summary is None:
            return _aborted(run, request.aborted_by)  # out of on_signals: a third signal acts as usual
        if summary.get("interrupted"):
            stop.linger()
        return summary
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


def _stopped_before(run: RunConfig, rank: int, stopped: dict) -> dict:
    """A restart by torchrun of a run a signal stopped, its stop complete: end without training,
    which would undo the stop."""
    if rank == 0:
        log.warning("%s stopped this run after step %d (%s); this is torchrun restarting it, which ends here rather "
                    "than train past the stop; a new launch with --resume auto continues it", stopped["signal"],
                    stopped["step"], stopped["where"])
    return {"steps": stopped["step"], "interrupted": False, "stopped_before": stopped, "run_dir": str(run_dir_of(run))}


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
    error = from_lead(error)
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
    found = checkpoint.list_checkpoints(run_dir_of(run) / "checkpoints")
    kept = (f"the newest complete one, {found[0][1]}, is kept (continue with --resume auto)" if found
            else "the run has no checkpoint yet")
    return (f"out of memory on rank {rank}: {first}\nmeasured: {peak}\n"
            f"the plan for this config (fnmoe plan; try --memory.recompute full, --memory.offload, "
            f"a smaller --train.batch-size or more --train.grad-accum):\n{format_plan(plan(run))}\n"
            f"no checkpoint was written for the failed step; {kept}")


def _memory_report(run: RunConfig, params, batch: tuple, rank: int) -> None:
    """--memory.report: every rank measures (a mesh's forward needs all of them); rank 0 prints."""
    from fnmoe.plan import memory_report

    rows = memory_report.measure(run, params, batch)
    if rank == 0:
        log.info(memory_report.table(rows, run.memory, memory_report.eager_note(run)))


def _initial_params(run: RunConfig, device: torch.device, mesh):
    """The random init, or the weights of --train.init-from-hf (checked against the config's shapes)."""
    if not run.train.init_from_hf:
        return sharding.init_params(run.model, run.train.seed, device=device, mesh=mesh)
    from fnmoe import hf

    cfg, params = hf.load(run.train.init_from_hf, mesh=mesh)
    diff = shape_mismatches(params, run.model)
    if diff:
        raise ValueError(f"train.init_from_hf={run.train.init_from_hf}: its model ({cfg.n_layers} layers, dim "
                         f"{cfg.dim}, {cfg.moe.n_experts} experts) does not match the config's; first differences: "
                         f"{'; '.join(diff)}; `fnmoe convert --from-hf SRC --out DST` writes DST/config.toml "
                         "with its model")
    return to_device(params, device)


def _train(run: RunConfig, rank: int, mesh, request: stop.Request) -> dict:
    """The run, holding its directory's lock (rank 0 takes it) from before anything in it is read
    until every exit: a return, an error, a signal's stop or abort."""
    lock, console, error = None, None, None
    if rank == 0:
        try:
            lock = rundir.acquire(run_dir_of(run))
            console = rundir.console_log()
        except rundir.RunDirError as e:
            error = str(e)
    try:
        _job_verdict(error, rank)
        if rank == 0:
            stop.forget(run_dir_of(run))  # this run's own ending will say how it ended
        return _train_locked(run, rank, mesh, request)
    finally:
        if console:
            rundir.close_console_log(console)
        if lock:
            lock.release()


def _open_outputs(run: RunConfig, run_dir: Path, state: TrainState, resumed: bool, rank: int):
    """Rank 0's config.toml and metrics writer (the others write nothing), with one verdict for all."""
    writer, error = _NoOutput(), None
    if rank == 0:
        try:
            rundir.write_text(run_dir / "config.toml", to_toml(run))
            rundir.start_console_log(run_dir)  # the run's checks passed: its log lines so far, then the rest
            # alone: the other ranks reach their first save only after rank 0 is past this (a step's collectives)
            checkpoint.set_aside_after(run_dir / "checkpoints", state.step)
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
    memory (fnmoe.plan.host_limit). Hosts differ in what they have free, so every rank raises the
    first rank's error alike instead of leaving the others in a collective."""
    from fnmoe.plan.host_limit import HostMemoryError, host_memory_error

    mine = host_memory_error(run)
    error = first_error(f"rank {rank}: {mine}" if mine and fdist.world() > 1 else mine)
    if error:
        raise HostMemoryError(f"{error}; stopped before step 1")


def _prepare(run: RunConfig, rank: int) -> tuple[Path | None, tuple[Path, dict] | None]:
    """(the compile cache's artifacts, the checkpoint to resume from): the host-memory check, seeds,
    threads and determinism, and every directory the run writes later checked writable now."""
    _check_host_memory(run, rank)
    _use_deterministic(run.train.deterministic)
    torch.manual_seed(run.train.seed)
    if run.train.threads:
        torch.set_num_threads(run.train.threads)
    artifacts = warm_start(run.compile_cache, to_toml(run.model)) if run.model.compile else None
    guards.preflight(run, run_dir_of(run), rank, artifacts)  # what the run writes later is writable now
    # after the preflight, whose rank 0 makes and removes the checkpoints directory while the other
    # ranks wait: listing it beside that removal raised FileNotFoundError on rank 1 (seen in the suite)
    return artifacts, _resume_point(run, run_dir_of(run) / "checkpoints")


def _first_state(run: RunConfig, found, loader, tx, mesh, device: torch.device) -> TrainState:
    """The checkpoint's state (any mesh's) when resuming, else a fresh init's."""
    if not found:
        return init_state(_initial_params(run, device, mesh), tx)
    state = checkpoint.load_state(*found, run, tx, loader.data.fingerprint, mesh)
    return TrainState(to_device(state.params, device), to_device(state.opt_state, device), state.step)


def _train_locked(run: RunConfig, rank: int, mesh, request: stop.Request) -> dict:
    artifacts, found = _prepare(run, rank)
    device = fdist.compute_device(run.dist, run.mesh.world)
    # every rank evaluates the same global micro-batches: val_loss is the same on any mesh
    loader, val, weights = training_data(run)
    val = {name: [to_device(b, device) for b in batches] for name, batches in val.items()}
    tx = optim.from_config(run.optim, run.train.steps)
    state = _first_state(run, found, loader, tx, mesh, device)
    if state.step >= run.train.steps:
        log.info("%s is at step %d and train.steps=%d: nothing to train", found[0], state.step, run.train.steps)
        return {"steps": state.step, "loss": None, "val_loss": None, "run_dir": str(run_dir_of(run)),
                "params": state.params, "interrupted": False, "checkpoint": str(found[0])}
    guards.check_finite_start(state.params, guards.start_source(run, found[0] if found else None))
    return run_steps(_setup(run, rank, state, bool(found), (loader, val, weights), device, tx, artifacts), request)


def _setup(run: RunConfig, rank: int, state: TrainState, resumed: bool, data: tuple, device: torch.device, tx,
           artifacts: Path | None) -> Session:
    """Rank 0's outputs, the step (its runner's host pool sized here), the saver, the profiler's window,
    and --memory.report's table."""
    t, L, run_dir = run.train, run.data.seq_len, run_dir_of(run)
    writer = _open_outputs(run, run_dir, state, resumed, rank)
    # the pool sized here; the loop owns its state, so the step may update it in place (--train.donate)
    train_step = make_train_step(run, tx, train_runner(run, pool_bytes(run)), donate=run.train.donate)
    fpt = flops_per_token(run.model, L)
    saver = checkpoint.Saver(run_dir / "checkpoints", run.checkpoint, last_step=state.step)  # on every rank: collective
    prof = profile_window(run.profile.steps, run_dir, state.step + 1, rank)
    cpu_gemm.build_before(run.model, device)  # a first build here, not in step 1's time
    log.info("run %s: steps %d..%d x %d sequences x %d tokens -> %s", run.name, state.step + 1, t.steps,
             t.batch_size, L, run_dir)
    log.info(threads.describe())
    if rank == 0:
        log_length(run)
    if run.memory.report:
        _memory_report(run, state.params, to_device(data[0].batch_at(state.step, rank, run.dp_size, 0), device), rank)
    return Session(run, rank, state, data, device, artifacts, writer, train_step, saver, prof, fpt)


