"""A schedule that follows the run (issue 37): a warmup longer than the run is clamped with a
warning, --train.tokens sets the steps, a resume that moves the lr says by how much, and the last
line tells this process's steps from the run's. Learning rates against values computed by hand."""
import json
import math

import pytest

from fnmoe.cli import main
from fnmoe.config import load_config
from conftest import tiny_flags


def rows(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_a_short_run_clamps_the_warmup_and_says_so(tmp_path, capsys):
    """The preset's 50 warmup steps on a 10-step run: clamped to 1 (a tenth), warned; the lr of
    step s (0-based s-1) is the cosine from the peak at index 0 to peak x 0.1 at index 9."""
    assert main(["train", "--train.steps", "10", *tiny_flags(1), "--train.run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "optim.warmup_steps=50 is not shorter than the run (train.steps=10): the warmup is clamped to 1 step," in out
    want = [3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 9))) for i in range(10)]
    assert [r["lr"] for r in rows(tmp_path / "run")] == pytest.approx(want, rel=1e-6)


def test_train_tokens_and_extending_a_finished_run(tmp_path, capsys):
    """--train.tokens 512 with 4 x 32 tokens a step is 4 steps (config.toml keeps both); extending
    the finished run to 8 steps warns that the lr of step 5 jumps from the 4-step schedule's floor
    to the 8-step one's value, which metrics.jsonl's step 5 then shows; the last line names the
    steps this process ran, apart from the run's."""
    run_dir = tmp_path / "run"
    common = [*tiny_flags(1), "--optim.warmup-steps", "2", "--train.run-dir", str(run_dir)]
    assert main(["train", "--train.tokens", "512", *common]) == 0
    out = capsys.readouterr().out
    assert "train.tokens=512: 4 steps of 4 x 32 tokens (512 tokens)" in out and "done: 4 steps in" in out
    saved = load_config(run_dir / "config.toml")
    assert (saved.train.tokens, saved.train.steps) == (512, 4) and len(rows(run_dir)) == 4
    assert main(["train", "--train.tokens", "1024", *common, "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    cosine = lambda i, total: 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i - 1, total - 2) / (total - 2))))  # noqa: E731
    old, new = cosine(4, 4), cosine(4, 8)  # warmup 2: the peak at index 1
    assert old == pytest.approx(3e-4) and rows(run_dir)[4]["lr"] == pytest.approx(new, rel=1e-6)
    assert (f"the learning rate jumps up at step 5: {old:.3g} by the checkpoint's schedule (cosine over 4 steps, "
            f"peak 0.003) (the saved run had ended there, at the end of its decay), {new:.3g} by this run's "
            "(cosine over 8 steps, peak 0.003)") in out
    assert "done: the run is at step 8; this process ran steps 5..8 (4) in" in out
