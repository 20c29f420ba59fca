"""The training loop: data in, steps, metrics.jsonl and a progress line out.

Legend: B batch, L sequence.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from fnmoe import optim
from fnmoe.compile import setup_cache
from fnmoe.config import RunConfig, to_toml
from fnmoe.data import Loader, load_data, val_batches
from fnmoe.metrics import JsonlWriter, flops_per_token, load_max_over_mean, mfu
from fnmoe.model import init_params
from fnmoe.train import eval_loss, init_state, make_train_step

log = logging.getLogger("fnmoe")


def run_dir_of(run: RunConfig) -> Path:
    return Path(run.train.run_dir or Path("runs") / run.name)


def _unsupported(run: RunConfig) -> None:
    """Say clearly what this build cannot do yet, before any work starts."""
    if run.mesh.world > 1:
        raise ValueError(f"mesh.fsdp={run.mesh.fsdp} x mesh.ep={run.mesh.ep}: multi-rank training is not "
                         "built yet; use mesh.fsdp=1 mesh.ep=1")
    if run.resume != "none":
        raise ValueError(f"--resume {run.resume!r}: checkpoint resume is not built yet; use --resume none")
    if run.checkpoint.every:
        raise ValueError(f"checkpoint.every={run.checkpoint.every}: checkpoint saving is not built yet; use 0")


def _bar(done: int, total: int, width: int = 20) -> str:
    n = width * done // total
    return "[" + "#" * n + "." * (width - n) + "]"


def _profile_window(run: RunConfig, run_dir: Path):
    """(first, last, profiler) for --profile.steps A:B, or None."""
    if not run.profile.steps:
        return None
    a, b = (int(x) for x in run.profile.steps.split(":"))
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    return a, b, prof, run_dir / "profile" / f"trace_steps_{a}_{b}.json"


def train(run: RunConfig) -> dict:
    """Train run from scratch; returns a summary (steps done, last loss, final val_loss)."""
    _unsupported(run)
    torch.manual_seed(run.train.seed)
    if run.train.threads:
        torch.set_num_threads(run.train.threads)
    if run.model.compile:
        setup_cache(run.compile_cache)
    run_dir = run_dir_of(run)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(run))

    t, L = run.train, run.data.seq_len
    data = load_data(run.data, run.model.vocab_size)
    loader = Loader(data, L, t.batch_size, t.grad_accum, t.seed)
    val = val_batches(data, L, run.micro_batch, t.eval_batches)
    tx, schedule = optim.from_config(run.optim, t.steps)
    state = init_state(init_params(run.model, t.seed), tx)
    train_step = make_train_step(run, tx)
    fpt = flops_per_token(run.model, L)
    writer = JsonlWriter(run_dir / "metrics.jsonl", fresh=True)
    prof = _profile_window(run, run_dir)
    log.info("run %s: %d steps x %d sequences x %d tokens -> %s", run.name, t.steps, t.batch_size, L, run_dir)

    start, tokens, row, val_loss = time.perf_counter(), 0, {}, None
    try:
        for step in range(1, t.steps + 1):
            if prof and step == prof[0]:
                prof[2].start()
            batch = [loader.batch_at(step - 1, 0, 1, m) for m in range(t.grad_accum)]
            t_step = time.perf_counter()
            state, m = train_step(state, batch)
            dt = time.perf_counter() - t_step
            tokens += t.batch_size * L
            tps = t.batch_size * L / dt
            row = {"step": step, "loss": m["loss"], "lr": schedule(torch.tensor(step - 1)).item(),
                   "grad_norm": m["grad_norm"], "tokens": tokens, "tokens_per_s": tps,
                   "mfu": mfu(fpt, tps, t.peak_tflops),
                   "expert_load_max_over_mean": load_max_over_mean(m["expert_counts_LE"]),
                   "skipped": m["skipped"], "time_s": time.perf_counter() - start}
            writer.write(row)
            if prof and step == prof[1]:
                prof[2].stop()
                prof[3].parent.mkdir(parents=True, exist_ok=True)
                prof[2].export_chrome_trace(str(prof[3]))
                log.info("profile of steps %d..%d written to %s", prof[0], prof[1], prof[3])
            if step % t.log_every == 0 or step == t.steps:
                log.info(_progress_line(row, t.steps))
            if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                writer.write({"step": step, "val_loss": eval_loss(state.params, val, run)})
    except KeyboardInterrupt:
        done = row.get("step", 0)
        log.warning("interrupted at step %d of %d; %s holds %d step rows; no checkpoint was saved "
                    "(checkpointing is not built yet)", done, t.steps, run_dir / "metrics.jsonl", done)
        writer.close()
        return {"steps": done, "interrupted": True, "run_dir": str(run_dir)}
    val_loss = eval_loss(state.params, val, run)
    writer.write({"step": t.steps, "val_loss": val_loss})
    writer.close()
    log.info("done: %d steps in %.1f s, final train loss %.4f, held-out loss %.4f; metrics in %s",
             t.steps, time.perf_counter() - start, row["loss"], val_loss, run_dir / "metrics.jsonl")
    return {"steps": t.steps, "loss": row["loss"], "val_loss": val_loss, "run_dir": str(run_dir),
            "params": state.params, "interrupted": False}


def _progress_line(row: dict, total: int) -> str:
    m = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    load = "n/a" if row["expert_load_max_over_mean"] is None else f"{row['expert_load_max_over_mean']:.2f}"
    skip = " SKIPPED (non-finite grads)" if row["skipped"] else ""
    return (f"step {row['step']:>{len(str(total))}}/{total} {_bar(row['step'], total)} loss {row['loss']:.4f} "
            f"| lr {row['lr']:.2e} | gnorm {row['grad_norm']:.3f} | {row['tokens_per_s']:,.0f} tok/s "
            f"| mfu {m} | load max/mean {load} | {row['time_s']:.1f}s{skip}")
