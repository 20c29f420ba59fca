"""The training loop's steps, from the first to the last save: each step timed and its metrics row
written, its state adopted only then (so a checkpoint never lacks its row), the step boundary every
rank agrees on (a signal or a failed write stops all after the same step, saved), the progress line,
the held-out loss, samples and checkpoints every so many steps. fnmoe.training.loop sets a run up (`Session`)
and calls `run_steps`.

Legend: B batch, L sequence.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from fnmoe import checkpoint, optim, threads
from fnmoe.compile import cache_stats, save_artifacts
from fnmoe.config import RunConfig
from fnmoe.data.loader import Loader
from fnmoe.plan.flops import mfu
from fnmoe.run import faults, guards, rundir, stop
from fnmoe.run.metrics import load_by_layer, load_max_over_mean, rank_load_max_over_mean
from fnmoe.run.notes import steps_done
from fnmoe.run.progress import (ProfileWindow, eval_line, final_loss, progress_line, progress_note, slow_steps,
                                slow_warning, val_row)
from fnmoe.sampling.text import log_sample
from fnmoe.training.step import eval_loss
from fnmoe.training.state import TrainState, donated
from fnmoe.tree import tree_map

log = logging.getLogger("fnmoe")


def run_dir_of(run: RunConfig) -> Path:
    return Path(run.train.run_dir or Path("runs") / run.name)


def to_device(tree, device: torch.device):
    """tree's plain tensors on device (DTensors are placed by their mesh already)."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t, tree)


def _save_on_interrupt(saver: checkpoint.Saver, state: TrainState, run: RunConfig, loader: Loader) -> str:
    """Ctrl-C: finish the save in flight, save the last finished step; say where the work is. A state
    a donating step was given (cut short, or its row unwritten) is not saved: the step wrote into it."""
    saver.join()
    if donated(state):
        where = (f"checkpoint {saver.root / f'step_{saver.last_step}'} holds step {saver.last_step}; continue with "
                 "--resume auto" if saver.last_step else "there is no checkpoint")
        return (f"step {state.step + 1} wrote into step {state.step}'s state in place (train.donate), so that is not "
                f"saved: {where}")
    if state.step > saver.last_step:
        saved = saver.save(state, run, loader.position(state.step), blocking=True)
        return f"saved checkpoint {saved}; continue with --resume auto"
    if state.step:
        return f"checkpoint {saver.root / f'step_{state.step}'} holds it; continue with --resume auto"
    return "no step finished, so no checkpoint was saved"


@dataclass(eq=False)
class Session:
    """One run's steps and what they share (fnmoe.training.loop's setup). `state` is adopted step by step, only once
    the step's metrics row is written: a stop or Ctrl-C saves it."""
    run: RunConfig
    rank: int
    state: TrainState
    data: tuple  # (loader, held-out batches by source, their weights)
    device: torch.device
    artifacts: Path | None
    writer: Any
    train_step: Callable
    saver: checkpoint.Saver
    prof: ProfileWindow | None
    fpt: float
    start: float = 0.0
    tokens: int = 0
    row: dict = field(default_factory=dict)
    skips: Any = None
    window: list = field(default_factory=list)  # the metrics rows since the last progress line
    window_s: float = 0.0  # time_s when the window began
    shown: list = field(default_factory=list)  # the rows of the last progress line
    step_s: list = field(default_factory=list)  # each step's time, for the slow-step warning
    slow: bool = False  # the slow-step warning was given and the steps have not recovered since


def run_steps(s: Session, request: stop.Request) -> dict:
    """The steps, then the last save and the held-out loss; a signal or a failed metrics write stops
    every rank after the same step (_stop), Ctrl-C after the last adopted one, each saved."""
    t, first = s.run.train, s.state.step + 1
    s.start, s.tokens = time.perf_counter(), s.state.step * t.batch_size * s.run.data.seq_len
    try:
        why = _steps(s, request, first)
        if why:
            return _stop(why, s.writer, s.saver, s.state, s.run, s.data[0], s.rank)
        saved, val_loss = _finish(s)
    except KeyboardInterrupt:
        log.warning("interrupted at step %d of %d; %s", s.state.step, t.steps,
                    _save_on_interrupt(s.saver, s.state, s.run, s.data[0]))
        return {"steps": s.state.step, "interrupted": True, "run_dir": str(run_dir_of(s.run))}
    finally:
        s.saver.join()
        s.writer.close()
    log.info("done: %s, %s, held-out loss %.4f; metrics in %s, checkpoint %s",
             steps_done(first, t.steps, time.perf_counter() - s.start), final_loss(s.shown), val_loss,
             run_dir_of(s.run) / "metrics.jsonl", saved)
    return {"steps": t.steps, "loss": s.row["loss"], "val_loss": val_loss, "run_dir": str(run_dir_of(s.run)),
            "params": s.state.params, "interrupted": False, "checkpoint": str(saved)}


def _steps(s: Session, request: stop.Request, first: int) -> int:
    """Steps first..train.steps; 0, or why they stopped early (stop's signal or WRITE_FAILED)."""
    t = s.run.train
    why = stop.agreed(request)  # a signal during the setup stops before the first step
    s.skips = guards.SkipCounter(t.max_consecutive_skips)
    for step in range(first, t.steps + 1):
        if why:
            break
        faults.before_step(step, s.rank)
        if s.prof:
            s.prof.before(step)
        new_state, m = _step(s, step)
        s.writer.write(s.row, m["expert_counts_NE"])
        faults.signal_after(step, s.rank, lambda: request.signum is not None)
        # the step boundary: every rank learns here whether any was signalled or failed to write
        why = stop.agreed(request, write_failed=s.writer.error is not None)
        if why == stop.WRITE_FAILED:
            break
        s.state = new_state  # only now: a checkpoint of `state` never lacks its metrics row
        s.skips.count(step, m)  # train.max_consecutive_skips skipped in a row stop the run
        s.saver.wait_staged()  # a background save's copies of the state before: done, its memory free
        _after_step(s, step, first)
        if why and step < t.steps:  # at the last step, the run ends as it would have
            break
        why = 0
        _every(s, step)
        faults.after_step(step, s.rank)
    return why


def _step(s: Session, step: int) -> tuple[TrainState, dict]:
    """One optimizer step, timed: (its state, its metrics); its metrics row in s.row."""
    t, L = s.run.train, s.run.data.seq_len
    batch = [to_device(s.data[0].batch_at(step - 1, s.rank, s.run.dp_size, m), s.device) for m in range(t.grad_accum)]
    if s.run.train.donate:  # a background save copies the state this step updates in place: done first
        s.saver.wait_staged()
    t_step = time.perf_counter()
    new_state, m = s.train_step(s.state, batch)
    dt = time.perf_counter() - t_step
    s.step_s.append(dt)
    s.tokens += t.batch_size * L
    tps = t.batch_size * L / dt
    s.row = {"step": step, "loss": m["loss"], "lr": optim.last_lr(new_state.opt_state),
             "grad_norm": m["grad_norm"], "tokens": s.tokens, "tokens_per_s": tps,
             "mfu": mfu(s.fpt, tps, t.peak_tflops),
             "expert_load_max_over_mean": load_max_over_mean(m["expert_counts_NE"]),
             "expert_load_by_layer": load_by_layer(m["expert_counts_NE"]),
             "ep_rank_load_max_over_mean": rank_load_max_over_mean(m["expert_counts_NE"], s.run.mesh.ep),
             "skipped": m["skipped"], "time_s": time.perf_counter() - s.start}
    s.row.update({key: m[key] for key in ("dropped_tokens", "skipped_why") if key in m})
    return new_state, m


def _after_step(s: Session, step: int, first: int) -> None:
    """After a step is adopted: the compile cache's artifacts (after the first), the profiler's
    window, the progress line."""
    if s.artifacts and step == first and s.rank == 0:  # all is compiled after the first step; ranks compile alike
        save_artifacts(s.artifacts)
        log.info("compile: %s (artifacts in %s)", cache_stats(), s.artifacts)
    if s.prof:
        s.prof.after(step)
    t = s.run.train
    s.window.append(s.row)
    if step == first or step % t.log_every == 0 or step == t.steps:
        if step == first:
            log.info(progress_note(t.log_every))
        log.info(progress_line(s.window, t.steps, s.window_s, first=step == first))
        s.shown, s.window, s.window_s = s.window, [], s.row["time_s"]
    _warn_if_slow(s, step)


def _warn_if_slow(s: Session, step: int, window: int = 5) -> None:
    """One warning when the steps become far slower than this run's earlier ones (slow_steps), and
    again only after they have recovered."""
    del s.step_s[:-(window + 202)]  # all slow_steps reads: 2 warmup steps, 200 earlier ones and the window
    got = slow_steps(s.step_s, window)
    if got and not s.slow and s.rank == 0:
        log.warning(slow_warning(step, *got, window, cpu=s.device.type == "cpu", passive=threads.passive()))
    s.slow = got is not None


def _every(s: Session, step: int) -> None:
    """What runs every so many steps: the held-out loss, a sample, a checkpoint (the last step's are _finish's)."""
    t, (loader, val, weights) = s.run.train, s.data
    if t.eval_every and step % t.eval_every == 0 and step < t.steps:
        s.writer.write(_evaluate(step, s.state.params, val, weights, s.run))
    if t.sample_every and step % t.sample_every == 0:
        log_sample(step, s.state.params, s.run, s.rank)
    if s.run.checkpoint.every and step % s.run.checkpoint.every == 0 and step < t.steps:
        s.saver.save(s.state, s.run, loader.position(s.state.step))


def _finish(s: Session) -> tuple[Path, float]:
    """(the last checkpoint, the final held-out loss) after the last step."""
    loader, val, weights = s.data
    s.skips.check_end(s.state.step)  # a run whose every step was skipped is no success
    saved = s.saver.save(s.state, s.run, loader.position(s.state.step), blocking=True)
    row = _evaluate(s.run.train.steps, s.state.params, val, weights, s.run)
    s.writer.write(row)
    if s.writer.error is not None:
        raise rundir.RunDirError(f"{s.writer.error}; the run finished and saved {saved}")
    return saved, row["val_loss"]


def _stop(why: int, writer, saver: checkpoint.Saver, state: TrainState, run: RunConfig, loader: Loader,
          rank: int) -> dict:
    """Every rank stops here, after the last step whose metrics row was written: saved, then a
    summary (a signal) or a RunDirError (a write failure)."""
    if why != stop.WRITE_FAILED:
        where = _save_on_interrupt(saver, state, run, loader)
        if rank == 0:  # the others said it in their checkpoint lines
            log.warning("%s: interrupted at step %d of %d; %s", stop.name(why), state.step, run.train.steps, where)
            stop.record(run_dir_of(run), why, state.step, where)  # every rank has saved: the stop is complete
        faults.after_stop(rank)
        return {"steps": state.step, "interrupted": True, "run_dir": str(run_dir_of(run))}
    what = str(writer.error) if rank == 0 else "rank 0 could not write its files"
    try:
        where = _save_on_interrupt(saver, state, run, loader)
    except checkpoint.CheckpointError as e:
        where = f"and no checkpoint was saved either: {e}"
    raise rundir.RunDirError(f"{what}; stopped after step {state.step}: {where}")


def _evaluate(step: int, params, val: dict, weights: dict, run: RunConfig) -> dict:
    """The eval row: val_loss, and for a mixture each source's val_loss/<name> (val_loss is then
    their mean weighted as the batches are); every eval row is also a log line."""
    losses = {name: eval_loss(params, batches, run) for name, batches in val.items()}
    row = val_row(step, sum(weights[name] * loss for name, loss in losses.items()))
    if "" not in losses:
        row.update({f"val_loss/{name}": loss for name, loss in losses.items()})
    log.info(eval_line(row, losses))
    return row
