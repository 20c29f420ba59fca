"""`--resume auto|PATH` continues the run it names: the checkpoint's config.toml is the base of the
flags, so a resume that repeats none of the run's flags trains the same model on the same data
with the same settings as an uninterrupted run; a flag given on the resume still wins and is named."""
from __future__ import annotations

import json
from pathlib import Path

from fnmoe.cli import main
from conftest import tiny_flags
from test_checkpoint import one_thread  # noqa: F401 (the fixture: in-process runs on one thread)

# non-default flags the resume does not repeat: model shape, data, optimizer; a constant lr with no
# warmup, so the 2-step run's schedule is the 4-step run's and their losses can be compared
RUN_FLAGS = [*tiny_flags(1, "--train.eval-every", "0"), "--optim.schedule", "constant", "--optim.warmup-steps", "0",
             "--optim.lr", "0.002", "--train.seed", "3"]


def corpus(path: Path) -> Path:
    """A corpus of its own (not the bundled one): lines of digits and letters."""
    path.write_text("".join(json.dumps({"text": f"{i:05d} " + "abcdefghij"[i % 10] * (20 + i % 13)}) + "\n"
                            for i in range(300)))
    return path


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def saved(run_dir: Path) -> str:
    return (run_dir / "config.toml").read_text()


def test_resume_auto_continues_with_the_runs_own_flags(tmp_path, capsys):
    data = corpus(tmp_path / "mine.jsonl")
    flags = [*RUN_FLAGS, "--data.corpus", str(data)]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["train", *flags, "--train.steps", "4", "--train.run-dir", str(whole)]) == 0
    assert main(["train", *flags, "--train.steps", "2", "--train.run-dir", str(cut)]) == 0
    capsys.readouterr()
    assert main(["train", "--train.run-dir", str(cut), "--resume", "auto", "--train.steps", "4"]) == 0
    out = capsys.readouterr().out
    # the changed flag, one line, named as a flag; nothing else changed
    assert "1 setting changed" in out and "\n  --train.steps: 2 -> 4\n" in out, out
    assert "data.corpus" not in out.split("resuming from")[-1].split("\n\n")[0]
    # the resumed run's config is the saved one but its length; its losses are the uninterrupted run's
    assert saved(cut) == saved(whole).replace(str(whole), str(cut)).replace('resume = "none"', 'resume = "auto"')
    assert str(data) in saved(cut)
    assert losses(cut) == losses(whole), (losses(cut), losses(whole))


def test_a_flag_given_on_resume_wins_and_is_named(tmp_path, capsys):
    data = corpus(tmp_path / "mine.jsonl")
    run = tmp_path / "run"
    assert main(["train", *RUN_FLAGS, "--data.corpus", str(data), "--train.steps", "2", "--train.run-dir",
                 str(run)]) == 0
    capsys.readouterr()
    ckpt = run / "checkpoints" / "step_2"
    assert main(["train", "--train.run-dir", str(run), "--resume", str(ckpt), "--train.steps", "3",
                 "--optim.lr", "0.001", "--data.corpus", "bundled"]) == 0
    out = capsys.readouterr().out
    assert f"the base config is {ckpt}'s config.toml" in out
    for line in ("  --data.corpus: " + repr(str(data)) + " -> 'bundled'", "  --optim.lr: 0.002 -> 0.001",
                 "  --train.steps: 2 -> 3"):
        assert line in out.splitlines(), out
    assert 'corpus = "bundled"' in saved(run) and "lr = 0.001" in saved(run)


def test_a_copied_run_continues_where_it_is_now(tmp_path, monkeypatch):
    """A run directory copied to the default place (runs/tiny) and resumed there without
    --train.run-dir, its config.toml naming the old place: the copy gets the checkpoints and metrics,
    the original is left as it was."""
    import shutil

    old, new = tmp_path / "old", tmp_path / "runs" / "tiny"
    assert main(["train", *RUN_FLAGS, "--train.steps", "2", "--train.run-dir", str(old)]) == 0
    shutil.copytree(old, new)
    before = sorted(p.name for p in (old / "checkpoints").iterdir())
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "auto", "--train.steps", "3"]) == 0
    assert (new / "checkpoints" / "step_3").is_dir() and 3 in losses(new)
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == before and 3 not in losses(old)
