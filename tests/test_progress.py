"""What a training run says while it runs (fnmoe/run/progress.py): the progress line's windowed means,
elapsed and remaining time, the first step, every eval, and the warning when steps slow down."""
import json
import re

import pytest

from fnmoe.cli import main
from fnmoe.run.progress import duration, progress_line, slow_steps, slow_warning, window_means
from conftest import tiny_flags


def _row(step: int, loss: float, tps: float, time_s: float, skipped: int = 0) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens": 100 * step, "tokens_per_s": tps,
            "mfu": None, "expert_load_max_over_mean": 1.5, "skipped": skipped, "time_s": time_s}


def test_window_means_and_time_left():
    rows = [_row(11, 4.0, 100.0, 12.0), _row(12, float("nan"), 300.0, 13.0, skipped=1), _row(13, 3.0, 200.0, 15.0)]
    got = window_means(rows)
    assert got["loss"] == 3.5 and got["skipped"] == 1  # the skipped step's loss is left out
    assert got["tokens_per_s"] == pytest.approx(3 / (1 / 100 + 1 / 300 + 1 / 200))  # the steps' tokens over their time
    line = progress_line(rows, 100, before_s=10.0)
    # 3 steps took 15 - 10 = 5 s of wall time: 87 steps left at 5/3 s each
    assert line.startswith("step  13/100 [##") and "loss 3.5000 |" in line and "| 164 tok/s |" in line
    assert line.endswith(f"| 15s elapsed, {duration(87 * 5 / 3)} left (1 of the last 3 steps skipped)"), line
    assert progress_line(rows[:2], 100, 10.0).endswith("SKIPPED (non-finite gradients)")
    assert [duration(s) for s in (0.4, 59, 61, 3599, 7322)] == ["0s", "59s", "1m01s", "59m59s", "2h02m"]


def test_slow_steps_fire_on_a_slowdown_only():
    steady = [5.0, 2.0] + [0.20, 0.22, 0.19, 0.21, 0.20, 0.23, 0.20, 0.21, 0.19, 0.20]  # warmup, then steady
    assert slow_steps(steady) is None
    assert slow_steps(steady + [0.9, 0.2, 0.3, 0.25, 0.22]) is None  # one slow step among five: the median holds
    recent, before = slow_steps(steady + [0.9, 0.7, 0.8, 0.74, 0.66])
    assert (recent, before) == (0.74, 0.20) and slow_steps(steady + [0.5] * 5) is None  # 0.5 < 3 x 0.20
    assert slow_steps([0.2] * 6 + [1.0] * 5) is None  # too few earlier steps (past the warmup) to compare with
    line = slow_warning(40, recent, before, 5, cpu=True)
    assert "step 40: steps are 3.7x slower than earlier in this run" in line and "OMP_WAIT_POLICY=PASSIVE" in line
    assert "close them" in slow_warning(40, recent, before, 5, cpu=True, passive=True)
    assert "PASSIVE" not in slow_warning(40, recent, before, 5, cpu=True, passive=True)


def test_train_logs_step_one_windowed_means_and_every_eval(tmp_path, capsys):
    """A single-corpus run prints its first step, every log_every-th with the window's mean loss and
    tokens/s and the time left, and every eval (at eval_every and at the end) with its val_loss."""
    assert main(["train", "--train.steps", "5", "--train.log-every", "2", "--train.eval-every", "2",
                 "--train.run-dir", str(tmp_path), *tiny_flags(1)]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "loss" in r}
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]
    for r in evals:
        assert f"eval step {r['step']}: val_loss {r['val_loss']:.4f} | ppl {r['val_ppl']:.2f}" in out, out
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"^step (\d)/5 .*$", out, re.M)}
    assert sorted(lines) == [1, 2, 4, 5], out  # the first step, every 2nd, the last
    for step, window in {1: [1], 2: [2], 4: [3, 4], 5: [5]}.items():
        mean = sum(steps[s]["loss"] for s in window) / len(window)  # the window's mean, computed here
        tps = len(window) / sum(1 / steps[s]["tokens_per_s"] for s in window)
        assert f" loss {mean:.4f} |" in lines[step] and f"| {tps:,.0f} tok/s |" in lines[step], (lines[step], window)
        if step > 1:  # the first step's pace is no run's (compiles, first touches): no time left on it
            assert re.search(r"\| \d+s elapsed, \d+s left$", lines[step]), lines[step]
    assert lines[1].endswith("s elapsed") and lines[5].endswith(" 0s left")


def test_a_run_whose_steps_slow_down_warns_once(tmp_path, capsys, monkeypatch):
    """Steps 11.. take 0.4 s more (as when other work takes the cores): one warning, naming the step
    and what to try, and no second one while they stay slow."""
    import time

    from fnmoe.training import loop

    make = loop.make_train_step

    def slowed(*args, **kwargs):
        step_fn = make(*args, **kwargs)

        def train_step(state, batch):
            if state.step >= 10:
                time.sleep(0.4)
            return step_fn(state, batch)
        return train_step
    monkeypatch.setattr(loop, "make_train_step", slowed)
    assert main(["train", "--train.steps", "16", "--train.log-every", "8", "--train.eval-every", "0",
                 "--train.run-dir", str(tmp_path), *tiny_flags(1)]) == 0
    out = capsys.readouterr().out
    warned = [line for line in out.splitlines() if "slower than earlier in this run" in line]
    assert len(warned) == 1 and warned[0].startswith("step 1") and "close them" in warned[0], out
