"""Sharded checkpoints: each rank writes its own shards once, any mesh loads any checkpoint bit for
bit, a failed rank leaves no checkpoint, and a 2x2 run resumed under torchrun repeats its losses.

Meshes other than the torchrun one are simulated in this process (fnmoe.parallel.dist.simulate), which
writes and reads every simulated rank's files as the real ranks would.
"""
import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fnmoe import checkpoint, optim
from fnmoe.parallel import sharding
from fnmoe.parallel import dist as fdist
from fnmoe.checkpoint import CheckpointError, load_params, verify
from fnmoe.cli import parse_run
from fnmoe.data.loader import Loader, load_data
from fnmoe.parallel.sharding import init_params
from fnmoe.training.step import init_state
from fnmoe.training.state import TrainState
from fnmoe.tree import tree_flatten_with_paths, tree_map
from conftest import whole
from test_checkpoint import SMALL, losses, rows, spawn_env

ROOT = Path(__file__).resolve().parents[1]
FP32 = ["--model.compute-dtype", "float32", "--model.no-compile"]
BIAS = ["--model.moe.router-bias"]  # a buffer: a replicated plain tensor among the params


def _run(fsdp: int, ep: int):
    return parse_run([*SMALL, *FP32, *BIAS, "--mesh.fsdp", str(fsdp), "--mesh.ep", str(ep)], "fnmoe train")


def _setup(run):
    """(tx, loader, mesh or None) of a run; call inside fdist.simulate(run.mesh.world) for a mesh."""
    tx = optim.from_config(run.optim, run.train.steps)
    loader = Loader(load_data(run.data, run.model.vocab_size), run.data.seq_len, run.train.batch_size, 1,
                    run.train.seed)
    return tx, loader, sharding.make_mesh(run.mesh) if run.mesh.world > 1 else None


def _updated(state: TrainState, tx) -> TrainState:
    """Two AdamW updates from made-up gradients (moments and counts that are not zeros, without the
    forward and backward that are slow in a simulation) and buffers moved off their init."""
    params, opt_state = state.params, state.opt_state
    for _ in range(2):
        grads = tree_map(lambda p: torch.sin(7 * p) + 0.1, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
    params = {**params, "buffers": tree_map(lambda b: b + 0.25, params["buffers"])}
    return TrainState(params, opt_state, 2)


def _whole(tree) -> dict[str, torch.Tensor]:
    """Every leaf whole and plain (conftest.whole), by path."""
    paths, leaves, _ = tree_flatten_with_paths(tree)
    return {p: whole(x) for p, x in zip(paths, leaves)}


def _state_whole(state) -> dict[str, torch.Tensor]:
    """Params and optimizer state, whole, by path; without the optimizer's 0-D float64 leaves, the
    hyperparameters, which a resume takes from the current config (lr is the last one used)."""
    hyper = lambda t: t.ndim == 0 and t.dtype == torch.float64  # noqa: E731
    return _whole(state.params) | {f"opt_state.{p}": t for p, t in _whole(state.opt_state).items() if not hyper(t)}


def _assert_bitwise(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for path, w in want.items():
        g = got[path]
        assert g.dtype == w.dtype and g.shape == w.shape, (where, path)
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), (where, path)


def _load_and_save(ckpt: Path, mesh_shape: tuple[int, int], root: Path):
    """(the state of ckpt loaded on a mesh, whole; the checkpoint that mesh saves of it)."""
    run = _run(*mesh_shape)
    tx, loader, mesh = _setup(run)
    state = checkpoint.load_state(ckpt, verify(ckpt), run, tx, loader.data.fingerprint, mesh)
    return _state_whole(state), checkpoint.Saver(root, run.checkpoint).save(state, run, loader.position(state.step))


def test_resharding_chain_keeps_params_and_optimizer_state_bitwise_and_each_shard_once(tmp_path):
    """2x2 -> 4x1 -> 1x1 -> 1x4: after two AdamW updates on 2x2, every load gives the same bits."""
    with fdist.simulate(4):
        run = _run(2, 2)
        tx, loader, mesh = _setup(run)
        state = _updated(init_state(init_params(run.model, run.train.seed, mesh=mesh), tx), tx)
        want = _state_whole(state)
        ckpt = checkpoint.Saver(tmp_path / "2x2", run.checkpoint).save(state, run, loader.position(state.step))
    assert want["opt_state.1.adamw.count"] == 2

    index = verify(ckpt)
    names = {f"{kind}-rank{r:05d}.safetensors" for kind in ("params", "state") for r in range(4)}
    assert set(index["files"]) == names | {"config.toml"}
    assert {m["writer_rank"] for m in index["files"].values()} == {0, 1, 2, 3}
    for section in ("tensors", "opt_state"):
        for path, entry in index[section].items():
            n = sum(torch.Size(s["shape"]).numel() for s in checkpoint.parts(entry["shards"]))
            assert n == torch.Size(entry["shape"]).numel(), f"{section} '{path}' is stored {n} values, not once"
    # replicated leaves: one copy, from rank 0
    bias = index["tensors"]["buffers.layers.1.moe.router_bias_E"]
    assert bias["placement"] == {"fsdp": "Replicate()", "ep": "Replicate()"}
    assert [s["file"] for s in checkpoint.parts(bias["shards"])] == ["params-rank00000.safetensors"]
    assert [s["file"] for s in index["opt_state"]["1.adamw.count"]["shards"]] == ["state-rank00000.safetensors"]
    assert sorted(index["rng"]) == [f"rank{r}.torch_cpu" for r in range(4)]

    # expert ids are global: rank 1 (fsdp 0, ep 1) holds experts 4 and 5 of 8
    path = "layers.1.moe.w_up_EDF"
    entry = index["tensors"][path]
    assert entry["placement"] == {"fsdp": "_StridedShard(dim=0, sf=2)", "ep": "Shard(dim=0)"}
    assert len(entry["shards"]) == 1 and entry["shards"][0]["grid"]  # one grid stands for the 4 ranks' parts
    (shard,) = [s for s in checkpoint.parts(entry["shards"]) if s["file"] == "params-rank00001.safetensors"]
    assert shard["offset"] == [4, 0, 0] and shard["shape"][0] == 2
    with safe_open(ckpt / shard["file"], framework="pt") as f:
        assert torch.equal(f.get_tensor(shard["key"]), want[path][4:6])
    assert index["tensors"]["embed.w_VD"]["placement"] == {"dp": "Shard(dim=0)"}

    with fdist.simulate(4):
        got, ckpt = _load_and_save(ckpt, (4, 1), tmp_path / "4x1")
    _assert_bitwise(got, want, "4x1")
    got, ckpt = _load_and_save(ckpt, (1, 1), tmp_path / "1x1")
    _assert_bitwise(got, want, "1x1")
    assert set(verify(ckpt)["files"]) == {"params-rank00000.safetensors", "state-rank00000.safetensors",
                                          "config.toml"}
    with fdist.simulate(4):
        got, _ = _load_and_save(ckpt, (1, 4), tmp_path / "1x4")
    _assert_bitwise(got, want, "1x4")


def test_a_failed_rank_leaves_no_checkpoint(tmp_path, monkeypatch):
    """A full disk on one rank's file: the save raises, and nothing looks like a checkpoint."""
    root = tmp_path / "checkpoints"
    write_chunks = checkpoint.save._write_chunks

    def full_on_rank_2(path, chunks):
        if "rank00002" in path.name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_chunks(path, chunks)
    with fdist.simulate(4):
        run = _run(2, 2)
        tx, loader, mesh = _setup(run)
        state = init_state(init_params(run.model, run.train.seed, mesh=mesh), tx)
        saver = checkpoint.Saver(root, run.checkpoint)
        saver.save(state, run, loader.position(state.step))
        monkeypatch.setattr(checkpoint.save, "_write_chunks", full_on_rank_2)
        with pytest.raises(CheckpointError, match=r"step 1: writing .*rank00002.safetensors failed: No space"):
            saver.save(TrainState(state.params, state.opt_state, 1), run, loader.position(1))
    assert sorted(p.name for p in root.iterdir()) == ["step_0"]
    verify(root / "step_0")


def _torchrun(run_dir: Path, *extra: str) -> None:
    """Train the 2x2 mesh for 4 steps, saving at steps 2 and 4, as 4 gloo processes under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "fnmoe",
           "train", *SMALL, *FP32, "--mesh.fsdp", "2", "--mesh.ep", "2", "--dist.timeout-s", "10",
           "--train.steps", "4", "--checkpoint.every", "2", "--train.run-dir", str(run_dir), *extra]
    res = subprocess.run(cmd, cwd=run_dir.parent, env=spawn_env(PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_2x2_run_resumed_from_step_2_repeats_the_uninterrupted_losses_bitwise(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _torchrun(a)
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_4")  # as if killed after step 4's metrics row, before its save
    _torchrun(b, "--resume", "auto", "--profile.steps", "4:4")
    assert losses(b) == losses(a) and sorted(losses(a)) == [1, 2, 3, 4]
    for rank in range(4):  # each rank its own trace (they used to overwrite one file)
        assert json.loads((b / "profile" / f"trace_steps_4_4_rank{rank}.json").read_text())["traceEvents"]
    assert [r.get("step", r.get("event")) for r in rows(b)] == [1, 2, "resume", 3, 4, 4]
    ia, ib = (verify(d / "checkpoints" / "step_4") for d in (a, b))
    assert set(ia["files"]) == set(ib["files"]) and len(ia["files"]) == 9
    for name in ia["files"]:  # params, optimizer state and every rank's RNG: the same bytes
        if name != "config.toml":
            assert ia["files"][name]["sha256"] == ib["files"][name]["sha256"], name
    _, params = load_params(a / "checkpoints" / "step_4")  # a real 4-rank checkpoint, whole in one process
    assert params["layers"]["1"]["moe"]["w_up_EDF"].shape[0] == 8
