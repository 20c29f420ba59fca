"""What the training loop says between steps: its progress line, its held-out rows and lines, and the
profiler's window (--profile.steps A:B).

Legend: no tensors here.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fnmoe.parallel import dist as fdist

log = logging.getLogger("fnmoe")


def bar(done: int, total: int, width: int = 20) -> str:
    n = width * done // total
    return "[" + "#" * n + "." * (width - n) + "]"


def duration(seconds: float) -> str:
    """seconds as 42s, 3m05s or 2h07m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def window_means(rows: list[dict]) -> dict:
    """What the progress line says of the steps since the last one (rows: their metrics rows, in
    order): the mean loss over the steps that were not skipped (None when all were), tokens/s as the
    window's tokens over its steps' time, mfu as that rate's, and how many steps were skipped."""
    losses = [r["loss"] for r in rows if not r["skipped"]]
    seconds = sum(1.0 / r["tokens_per_s"] for r in rows)  # per token; each step has the same tokens
    tps = len(rows) / seconds
    last = rows[-1]
    mfu = None if last["mfu"] is None else last["mfu"] * tps / last["tokens_per_s"]
    return {"loss": sum(losses) / len(losses) if losses else None, "tokens_per_s": tps, "mfu": mfu,
            "skipped": len(rows) - len(losses)}


def final_loss(rows: list[dict]) -> str:
    """The last line's train loss, labelled: the last step's, and the mean the last progress line
    showed (rows: its steps' metrics rows) where that line spans more steps."""
    if not rows:
        return "no step to train"
    row, mean = rows[-1], window_means(rows)["loss"]
    last = f"final train loss {row['loss']:.4f} (step {row['step']}"
    if len(rows) == 1 or mean is None:
        return last + ")"
    return f"{last}; {mean:.4f} the mean of steps {rows[0]['step']}-{row['step']}, as on the progress line)"


def progress_line(rows: list[dict], total: int, before_s: float = 0.0, first: bool = False) -> str:
    """The steps since the last progress line (their metrics rows, in order) as one log line: the
    last step's number, lr, gradient norm and expert load; the window's mean loss and tokens/s
    (window_means); the time since training began (the last row's time_s) and the time left at the
    window's pace (wall time per step, evals and saves included; before_s: time_s when the window
    began), except after a run's first step (first), whose compiles and first touches say nothing of
    the pace."""
    row, means = rows[-1], window_means(rows)
    m = "n/a" if means["mfu"] is None else f"{100 * means['mfu']:.1f}%"
    load = "n/a" if row["expert_load_max_over_mean"] is None else f"{row['expert_load_max_over_mean']:.2f}"
    if row.get("ep_rank_load_max_over_mean") is not None:  # what --plan.imbalance stands for
        load += f" (ep rank {row['ep_rank_load_max_over_mean']:.2f})"
    loss = "n/a" if means["loss"] is None else f"{means['loss']:.4f}"
    skip = f" SKIPPED ({row.get('skipped_why', 'non-finite gradients')})" if row["skipped"] else ""
    if means["skipped"] > row["skipped"]:
        skip += f" ({means['skipped']} of the last {len(rows)} steps skipped)"
    left = (total - row["step"]) * (row["time_s"] - before_s) / len(rows)
    eta = "" if first else f", {duration(left)} left"
    return (f"step {row['step']:>{len(str(total))}}/{total} {bar(row['step'], total)} loss {loss} "
            f"| lr {row['lr']:.2e} | gnorm {row['grad_norm']:.3f} | {means['tokens_per_s']:,.0f} tok/s "
            f"| mfu {m} | load max/mean {load} | {duration(row['time_s'])} elapsed{eta}{skip}")


def progress_note(log_every: int) -> str:
    """The line before the first progress line: what its figures are."""
    return (f"progress: the first step, then every {log_every} steps (--train.log-every); loss and tok/s are "
            "means over the steps since the line before, the time left at their pace (from the second line)")


def slow_steps(times_s: list[float], window: int = 5, factor: float = 3.0, warmup: int = 2,
               history: int = 200) -> tuple[float, float] | None:
    """(the median of the last `window` step times, the median of the up to `history` before them)
    when the first is over `factor` times the second, else None: this run's steps have become far
    slower than its own earlier ones. The first `warmup` steps (compiles, first-touch allocations)
    are left out, and the earlier steps must number at least `window`."""
    earlier = times_s[warmup:-window][-history:]
    if len(earlier) < window:
        return None
    recent, before = sorted(times_s[-window:])[window // 2], sorted(earlier)[len(earlier) // 2]
    return (recent, before) if recent > factor * before else None


def slow_warning(step: int, recent: float, before: float, window: int, cpu: bool, passive: bool = False) -> str:
    """The warning when slow_steps says the steps have slowed down, with what to try: on CPU, other
    work on the cores; unless OpenMP's threads wait passively already (passive), the next run with
    OMP_WAIT_POLICY=PASSIVE, the fastest choice while the cores stay shared (tools/bench_threads.py)."""
    what = "other work may be sharing the device or the host"
    if cpu:
        what = ("other processes may be sharing the CPU cores (`uptime` shows the load): close them" +
                ("" if passive else ", or stop the run (Ctrl-C saves a checkpoint) and continue it with "
                 "`OMP_WAIT_POLICY=PASSIVE fnmoe train ... --resume auto`: threads that sleep at once run "
                 "fastest while the cores stay shared"))
    return (f"step {step}: steps are {recent / before:.1f}x slower than earlier in this run (median "
            f"{recent:.3f} s over the last {window} steps against {before:.3f} s before); {what}")


def val_row(step: int, val_loss: float) -> dict:
    return {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 80.0))}


def eval_line(row: dict, losses: dict) -> str:
    """An eval row as a log line: a corpus's val_loss and perplexity, a mixture's weighted val_loss
    and each source's."""
    if list(losses) == [""]:
        return f"eval step {row['step']}: val_loss {row['val_loss']:.4f} | ppl {row['val_ppl']:.2f}"
    parts = " | ".join(f"{name} {loss:.4f}" for name, loss in losses.items())
    return f"eval step {row['step']}: val_loss {row['val_loss']:.4f} (weighted) | {parts}"


@dataclass(eq=False)
class ProfileWindow:
    """--profile.steps A:B of a run: the profiler runs from step `first` to step `last`, its chrome
    trace written to `path` when step `last` ends."""
    first: int
    last: int
    profiler: torch.profiler.profile
    path: Path

    def before(self, step: int) -> None:
        if step == self.first:
            self.profiler.start()

    def after(self, step: int) -> None:
        if step == self.last:
            self.profiler.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))
            log.info("profile of steps %d..%d written to %s", self.first, self.last, self.path)


def profile_window(spec: str | None, run_dir: Path, first: int, rank: int) -> ProfileWindow | None:
    """The window of --profile.steps A:B (spec) a run starting at step `first` profiles, or None. A
    resumed run profiles the part of the window it runs; each rank of a mesh writes its own trace."""
    if not spec:
        return None
    a, b = (int(x) for x in spec.split(":"))
    if first > b:
        log.info("profile.steps %s: this run starts at step %d, after the window; no trace", spec, first)
        return None
    a = max(a, first)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    name = f"trace_steps_{a}_{b}" + (f"_rank{rank}" if fdist.world() > 1 else "") + ".json"
    return ProfileWindow(a, b, torch.profiler.profile(activities=acts, record_shapes=True), run_dir / "profile" / name)
