"""--resume auto never loses a run: checkpoints that do not verify are kept (set aside or left in
place), a run whose checkpoints all fail is refused instead of started over, and a checkpoint
from a release with more config fields is read when the extra fields are outside the model."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fnmoe.checkpoint import saved_config, verify
from fnmoe.checkpoint.format import CheckpointError
from fnmoe.cli import main
from conftest import tiny_flags
from test_checkpoint import one_thread  # noqa: F401 (the fixture: in-process runs on one thread)

SMALL = tiny_flags(1, "--train.eval-every", "0")
PARAMS = "params-rank00000.safetensors"


def train(run_dir: Path, steps: int, *extra: str) -> int:
    return main(["train", *SMALL, "--train.steps", str(steps), "--train.run-dir", str(run_dir),
                 "--checkpoint.every", "1", "--checkpoint.keep-last", "2", *extra])


def digest(root: Path) -> dict[str, str]:
    """Every file under root by relative path -> sha256: what 'nothing removed or changed' compares."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 3 steps with checkpoints step_2 and step_3 (keep-last 2), copied by each test."""
    run_dir = tmp_path_factory.mktemp("trained")
    assert train(run_dir, 3) == 0
    return run_dir


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    import shutil
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def test_auto_refuses_when_no_checkpoint_verifies_and_removes_nothing(run_dir, capsys):
    """The data-loss repro: every checkpoint damaged -> exit 2 naming each and why and how to start
    over on purpose; checkpoints and metrics.jsonl byte for byte as they were."""
    root = run_dir / "checkpoints"
    flip_a_byte(root / "step_3" / PARAMS)
    (root / "step_2" / PARAMS).unlink()  # a transiently missing file
    before = digest(run_dir)
    capsys.readouterr()
    assert train(run_dir, 5, "--resume", "auto") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "none of the 2 checkpoints" in err and "nothing was removed" in err and "--train.run-dir" in err
    assert f"step_3: {root / 'step_3' / PARAMS} does not match its sha256" in err
    assert f"step_2: {root / 'step_2' / PARAMS} is missing" in err
    assert digest(run_dir) == before


def test_a_newer_checkpoint_that_does_not_verify_is_set_aside_and_stays_readable(run_dir, warnings_text):
    """The newest checkpoint lacks a file (say a file server's hiccup): the run resumes from the
    one before and keeps the newer one, whole, under checkpoints/set_aside; with its file back it
    verifies."""
    root = run_dir / "checkpoints"
    missing = (root / "step_3" / PARAMS).read_bytes()
    (root / "step_3" / PARAMS).unlink()
    kept = digest(root / "step_3")
    assert train(run_dir, 4, "--resume", "auto") == 0
    assert "resuming from step_2, the newest checkpoint that verifies" in warnings_text()
    aside = root / "set_aside" / "step_3"
    assert digest(aside) == kept
    (aside / PARAMS).write_bytes(missing)
    assert verify(aside)["step"] == 3
    assert sorted(p.name for p in root.iterdir()) == ["set_aside", "step_3", "step_4"]
    assert [json.loads(line).get("from_step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "event" in line] == [2]


def _add_field(ckpt: Path, table: str, line: str) -> None:
    """config.toml of ckpt as a release with one more field in `table` writes it (its size and
    checksum in index.json too)."""
    path, index_path = ckpt / "config.toml", ckpt / "index.json"
    text = path.read_text()
    assert f"[{table}]\n" in text
    data = text.replace(f"[{table}]\n", f"[{table}]\n{line}\n", 1).encode()
    path.write_bytes(data)
    index = json.loads(index_path.read_text())
    index["files"]["config.toml"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    index_path.write_text(json.dumps(index))


def test_unknown_fields_outside_the_model_are_ignored_with_their_names(run_dir, warnings_text):
    """A checkpoint whose config.toml has a field this release lacks, in the optimizer's table:
    verified, resumed, and the field named once."""
    root = run_dir / "checkpoints"
    _add_field(root / "step_3", "optim", "newer_knob = 0.5")
    assert verify(root / "step_3")["step"] == 3
    assert train(run_dir, 4, "--resume", "auto") == 0
    assert warnings_text().count("ignoring fields this fnmoe does not know, none of the model's: optim.newer_knob") == 1
    assert (root / "step_4").is_dir()


def test_unknown_model_fields_are_refused_by_name(run_dir, capsys):
    """The same in the model's table could change its shape or numerics: refused naming the field,
    and (both checkpoints so) the run is refused with nothing removed."""
    root = run_dir / "checkpoints"
    for ckpt in (root / "step_2", root / "step_3"):
        _add_field(ckpt, "model", "newer_norm = \"rms2\"")
    with pytest.raises(CheckpointError, match=r"model fields this fnmoe does not know: model\.newer_norm"):
        saved_config(root / "step_3")
    before = digest(run_dir)
    capsys.readouterr()
    assert train(run_dir, 4, "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "none of the 2 checkpoints" in err and "model.newer_norm" in err
    assert digest(run_dir) == before


def test_a_resume_with_another_batch_size_is_refused_naming_both(run_dir, capsys):
    """Step N's samples follow from N and the batch size: a resume with another size would skip or
    repeat samples of the epoch, so it is refused naming both sizes; grad-accum may change."""
    before = digest(run_dir)
    capsys.readouterr()
    assert train(run_dir, 5, "--resume", "auto", "--train.batch-size", "8") == 2
    err = capsys.readouterr().err
    assert "with --train.batch-size 8: it was saved at step 3 with batch size 4" in err, err
    assert "resume with --train.batch-size 4" in err and len(err.strip().splitlines()) == 1
    assert digest(run_dir) == before
    assert train(run_dir, 4, "--resume", "auto", "--train.grad-accum", "2") == 0


def test_a_resume_with_another_seq_len_is_refused_saying_why(run_dir, capsys):
    """Step N's windows of the token stream follow from N and the sequence length as from the batch
    size: another --data.seq-len is refused as another batch size is, saying it is the data order
    (it only warned before, and the run went on reading other windows)."""
    before = digest(run_dir)
    capsys.readouterr()
    assert train(run_dir, 5, "--resume", "auto", "--data.seq-len", "16") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "with --data.seq-len 16: it was saved at step 3 with sequence length 32, and the data order" in err, err
    assert "resume with --data.seq-len 32 or start a new run" in err, err
    assert digest(run_dir) == before
