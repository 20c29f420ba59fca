"""A resume keeps the checkpoint it resumed from in place (issue 55, round 4): after `fnmoe train
--resume auto` (or --resume PATH) continues a run for two more steps, saving each, the checkpoint it
loaded is still at its path with every file's bytes as they were (sha256 of each), whatever the
continued run did: its donated steps wrote into the loaded state in place, its saves wrote beside
it and pruned to --checkpoint.keep-last 3 (which keeps it: it is among the 3 newest), and the run
set aside nothing (no checkpoint was newer than it).
"""
import hashlib
from pathlib import Path

import pytest

from fnmoe.cli import main
from conftest import tiny_flags
from test_checkpoint import one_thread  # noqa: F401 (the fixture: in-process runs on one thread)
from test_checkpoint import rows

SMALL = tiny_flags(1, "--train.eval-every", "0")


def _train(run_dir: Path, steps: int, *extra: str) -> int:
    return main(["train", *SMALL, "--train.steps", str(steps), "--train.run-dir", str(run_dir),
                 "--checkpoint.every", "1", "--checkpoint.keep-last", "3", *extra])


def _digest(ckpt: Path) -> dict[str, str]:
    """Every file of ckpt by name -> sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir()) if p.is_file()}


@pytest.mark.parametrize("how", ["auto", "path"])
def test_the_checkpoint_a_run_resumed_from_is_left_as_it_was(tmp_path, how):
    run_dir = tmp_path / "run"
    assert _train(run_dir, 2) == 0
    root = run_dir / "checkpoints"
    resumed = root / "step_2"
    before = _digest(resumed)
    assert {"index.json", "config.toml", "params-rank00000.safetensors", "state-rank00000.safetensors"} <= set(before)
    assert _train(run_dir, 4, "--resume", "auto" if how == "auto" else str(resumed)) == 0
    assert [r["from_step"] for r in rows(run_dir) if r.get("event") == "resume"] == [2]
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3", "step_4"]  # step_1 pruned (keep-last 3)
    assert _digest(resumed) == before
