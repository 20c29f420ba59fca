"""A run's guards (fnmoe.run.guards): what it writes later is checked writable before step 1, weights
that are not finite at the start are refused there, and skipped steps (non-finite) stop a run: a
given number in a row (train.max_consecutive_skips), or every step of it, end with exit 2 and how
many were skipped, never with "done"."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from fnmoe import hf
from fnmoe.cli import main, parse_run
from fnmoe.config import MeshConfig, RunConfig, TrainConfig
from fnmoe.parallel.sharding import init_params
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.run import guards
from fnmoe.run.rundir import LOCK

from conftest import tiny_flags

ROOT = Path(__file__).resolve().parents[1]


def _train(capsys, run_dir, *flags) -> tuple[int, str, str]:
    code = main(["train", *tiny_flags(), "--train.run-dir", str(run_dir), "--train.eval-every", "0", *flags])
    out, err = capsys.readouterr()
    return code, out, err.strip()


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("flag, what, subdir", [
    ((), "checkpoints", "checkpoints"),
    (("--train.tensorboard",), "TensorBoard logs (train.tensorboard)", "tensorboard"),
    (("--train.wandb",), "W&B files (train.wandb)", "wandb"),
    (("--profile.steps", "1:1"), "profiler traces (profile.steps)", "profile"),
])
def test_an_output_that_cannot_be_written_stops_the_run_before_step_1(tmp_path, capsys, flag, what, subdir):
    """<run-dir>/checkpoints (or another output directory) a file: one line naming it, exit 2, no step
    taken and nothing written (the checkpoints used to fail at the final save, after the whole run)."""
    (tmp_path / subdir).write_text("")
    code, out, err = _train(capsys, tmp_path, "--train.steps", "2", *flag)
    assert code == 2
    assert err == (f"fnmoe train: error: cannot write {what}: {tmp_path / subdir} is a file, not a directory; "
                   "stopped before step 1")
    assert "step 1/" not in out and sorted(p.name for p in tmp_path.iterdir()) == [subdir]


def test_the_check_makes_no_directory_it_does_not_leave(tmp_path):
    """The output check creates what is missing, writes a file there and removes both again."""
    run = RunConfig(train=TrainConfig(tensorboard=True), name="x")
    assert guards.check_outputs(run, tmp_path / "new" / "run", 0) is None
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert guards.check_outputs(run, tmp_path / "run", 0) is None
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


def test_the_checkpoints_are_listed_only_after_the_check_that_removes_what_it_made(tmp_path, monkeypatch):
    """Rank 0's check makes the checkpoints directory and removes it while the other ranks wait in
    its gather; a rank listing the directory before that check raced the removal (FileNotFoundError
    on rank 1, once in a suite run). Every rank runs the check first, then looks for a checkpoint."""
    from fnmoe.training import loop

    calls = []
    monkeypatch.setattr(loop.guards, "preflight", lambda *a: calls.append("preflight"))
    monkeypatch.setattr(loop, "_resume_point", lambda *a: calls.append("resume point"))
    run = parse_run([*tiny_flags(), "--train.run-dir", str(tmp_path / "run")], "fnmoe train")
    loop._prepare(run, rank=1)
    assert calls == ["preflight", "resume point"]


def test_a_run_whose_every_step_is_skipped_fails_and_saves_nothing(tmp_path, capsys):
    """--optim.eps 0: Adam divides 0 by 0 on untouched rows, every update is non-finite and skipped.
    The run used to end "done" with exit 0 and a checkpoint of the untrained weights."""
    code, out, err = _train(capsys, tmp_path, "--train.steps", "3", "--optim.eps", "0")
    assert code == 2
    assert err == ("fnmoe train: error: every step of this run was skipped (3 of 3, steps 1..3, non-finite update): "
                   "the weights never changed; look at --optim.lr and --optim.eps (an eps of 0 divides by zero); "
                   "no checkpoint was saved")
    assert [r["skipped"] for r in _rows(tmp_path)] == [1, 1, 1]
    assert "done:" not in out and not (tmp_path / "checkpoints").exists() and not (tmp_path / LOCK).exists()


def test_skipped_steps_in_a_row_stop_the_run_at_the_limit(tmp_path, capsys):
    code, out, err = _train(capsys, tmp_path, "--train.steps", "50", "--optim.eps", "0",
                            "--train.max-consecutive-skips", "2")
    assert code == 2
    assert err == ("fnmoe train: error: stopped after step 2: 2 steps in a row were skipped (1..2, non-finite update; "
                   "train.max_consecutive_skips=2), 2 of the 2 steps this run took; look at --optim.lr and "
                   "--optim.eps (an eps of 0 divides by zero); the weights are still those after step 0, and no "
                   "checkpoint was saved for the skipped steps")
    assert len(_rows(tmp_path)) == 2


def test_the_skip_counter_counts_runs_of_skips_not_scattered_ones():
    counter = guards.SkipCounter(3)
    for step, skipped in enumerate([1, 1, 0, 1, 1, 0, 1, 1], 1):  # never 3 in a row
        counter.count(step, {"skipped": skipped, "skipped_why": "non-finite loss or gradients"})
    counter.check_end(8)  # not every step skipped
    with pytest.raises(guards.SkippedSteps, match=r"stopped after step 9: 3 steps in a row were skipped \(7\.\.9, "
                                                  r"non-finite loss or gradients; train\.max_consecutive_skips=3\), "
                                                  r"7 of the 9 steps this run took"):
        counter.count(9, {"skipped": 1, "skipped_why": "non-finite loss or gradients"})
    never = guards.SkipCounter(0)
    for step in range(1, 30):
        never.count(step, {"skipped": 1})
    with pytest.raises(guards.SkippedSteps, match=r"every step of this run was skipped \(29 of 29, steps 1\.\.29"):
        never.check_end(29)
    assert RunConfig().train.max_consecutive_skips == 10


def test_non_finite_weights_from_hf_are_refused_at_the_start(tmp_path, capsys):
    """A Hugging Face checkpoint with a NaN in one tensor, as --train.init-from-hf: refused before step 1
    (its every step used to be skipped, and the run ended "done" with exit 0)."""
    flags = ["--config", str(ROOT / "configs" / "tiny_qwen3.toml"), *tiny_flags()]
    run = parse_run(flags, "test")
    hf_dir = hf.save(tmp_path / "hf", init_params(run.model, seed=1), run.model)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("nan")
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    code = main(["train", *flags, "--train.steps", "2", "--train.run-dir", str(tmp_path / "run"),
                 "--train.init-from-hf", str(hf_dir)])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.strip() == (f"fnmoe train: error: refusing to train from the weights of train.init_from_hf={hf_dir}: "
                           "it holds non-finite values (NaN or inf) in layers.1.attn.w_o_ND; every step would be "
                           "skipped; stopped before step 1")
    assert "step 1/" not in out


def test_a_non_finite_shard_on_one_simulated_rank_is_found():
    """On a mesh each rank looks at its own shards: a NaN in rank 1's part of a sharded leaf is named."""
    run = RunConfig(mesh=MeshConfig(fsdp=2), name="x")
    with fdist.simulate(2):
        mesh = sharding.make_mesh(run.mesh, run.dist)
        params = init_params(run.model, seed=0, mesh=mesh)
        guards.check_finite_start(params, "the test's weights")
        w = params["layers"]["1"]["moe"]["w_up_EDF"]
        assert isinstance(w, DTensor)
        local = w.to_local()
        nan_on_1 = fdist.tensor_map(local, lambda r, t: t.clone().index_fill_(0, torch.tensor([0]), float("nan"))
                                    if r == 1 else t)
        local.copy_(nan_on_1)
        with pytest.raises(guards.NonFiniteStart, match=r"^refusing to train from the test's weights: it holds non-"
                                                        r"finite values \(NaN or inf\) in layers\.1\.moe\.w_up_EDF;"):
            guards.check_finite_start(params, "the test's weights")
