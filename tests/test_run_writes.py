"""A run writes only inside its own directory (issue 56, item 1): a file there that shares its inode
with a file elsewhere (a hard link, which O_NOFOLLOW does not see) is never written in place, and a
symlinked directory under the run directory (checkpoints/, plots/) is refused, not followed."""
import json
import os
from pathlib import Path

import pytest

from fnmoe import checkpoint
from fnmoe.checkpoint import save as ckpt_save
from fnmoe.cli import main
from fnmoe.run import rundir
from conftest import tiny_flags

PRECIOUS = "a file outside the run\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(PRECIOUS)
    return victim


def _train(run_dir: Path) -> int:
    return main(["train", *tiny_flags(1), "--train.steps", "1", "--train.eval-every", "0", "--train.run-dir",
                 str(run_dir), "--model.moe.impl", "padded", "--model.attention-impl", "sdpa"])


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "fontManager" not in line]
    assert "Traceback" not in "\n".join(err) and len(err) == 1, err  # (matplotlib's first use says it made a cache)
    return err[0]


def test_a_hard_linked_metrics_file_is_replaced_not_written_through(tmp_path):
    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.link(victim, run_dir / "metrics.jsonl")
    os.link(victim, run_dir / "config.toml.tmp")  # a temp name a whole-file write reuses
    assert _train(run_dir) == 0
    assert victim.read_text() == PRECIOUS
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1]
    assert os.stat(run_dir / "metrics.jsonl").st_nlink == 1 and os.stat(victim).st_nlink == 1


def test_a_hard_linked_lock_file_is_refused_naming_it(tmp_path, capsys):
    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.link(victim, run_dir / rundir.LOCK)
    assert _train(run_dir) == 2
    assert _one_line(capsys) == (f"fnmoe train: error: creating the lock file {run_dir / rundir.LOCK} refused: it has "
                                 "2 hard links, so writing it would change a file outside the run too; remove it (or "
                                 "give it a copy of its own)")
    assert victim.read_text() == PRECIOUS


def test_whole_file_writes_make_a_new_file_beside_a_hard_link(tmp_path):
    """write_text (config.toml, stopped.json, wandb_id) and drop_rows_after (a resume's metrics.jsonl)
    through a temp name hard-linked to a file elsewhere: that file keeps its bytes."""
    from fnmoe.run.metrics import drop_rows_after

    victim = _victim(tmp_path)
    os.link(victim, tmp_path / "stopped.json.tmp")
    rundir.write_text(tmp_path / "stopped.json", "{}\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    os.link(victim, tmp_path / "metrics.jsonl.tmp")
    drop_rows_after(tmp_path / "metrics.jsonl", 1)
    assert victim.read_text() == PRECIOUS
    assert (tmp_path / "stopped.json").read_text() == "{}\n"
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_symlinked_checkpoints_directory_is_refused_before_step_1(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(elsewhere)
    assert _train(run_dir) == 2
    assert _one_line(capsys) == (
        f"fnmoe train: error: cannot write checkpoints: {run_dir / 'checkpoints'} is a symbolic link (to {elsewhere}), "
        "and a run writes only inside its own directory; remove the link (for a run on another disk, point "
        "--train.run-dir there); stopped before step 1")
    assert list(elsewhere.iterdir()) == []


def test_a_checkpoint_save_follows_no_link(tmp_path):
    """checkpoint.write itself (a link made after the preflight): refused before any byte is written."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "checkpoints").symlink_to(elsewhere)
    snap = type("Snap", (), {"step": 3})()
    with pytest.raises(checkpoint.CheckpointError, match="is a symbolic link"):
        ckpt_save.write(snap, tmp_path / "checkpoints", keep_last=1)
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "step.tmp").symlink_to(elsewhere)
    with pytest.raises(rundir.RunDirError, match="step.tmp is a symbolic link"):
        ckpt_save._write_chunks(tmp_path / "ckpts" / "step.tmp" / "model.safetensors", [b"x"])
    assert list(elsewhere.iterdir()) == []


def test_plot_into_a_symlinked_plots_directory_is_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "loss": 5.0 - s / 10} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "plots").symlink_to(elsewhere)
    assert main(["plot", str(tmp_path)]) == 2
    assert _one_line(capsys) == (
        f"fnmoe plot: error: writing {tmp_path / 'plots' / 'loss.png'} refused: {tmp_path / 'plots'} is a symbolic "
        f"link (to {elsewhere}), and a run writes only inside its own directory; remove the link (for a run on "
        "another disk, point --train.run-dir there)")
    assert list(elsewhere.iterdir()) == []
    (tmp_path / "plots").unlink()
    (tmp_path / "plots").mkdir()
    victim = _victim(tmp_path)
    os.link(victim, tmp_path / "plots" / ".loss.png.tmp")  # a stale temp file sharing a file elsewhere
    assert main(["plot", str(tmp_path)]) == 0
    assert victim.read_text() == PRECIOUS and (tmp_path / "plots" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_a_plot_that_fails_removes_the_directory_it_made(tmp_path, capsys, monkeypatch):
    """A chart that cannot be written: one line, and no plots/ directory left behind."""
    figure = pytest.importorskip("matplotlib.figure")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(figure.Figure, "savefig", full)
    assert main(["plot", str(tmp_path)]) == 2
    assert _one_line(capsys) == (f"fnmoe plot: error: writing {tmp_path / 'plots' / 'loss.png'} failed: No space left "
                                 "on device (disk full or over a file-size limit)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
