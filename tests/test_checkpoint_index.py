"""index.json is a contract checked on load and by `verify` (issue 46): a fault injected into a real
saved checkpoint's index.json (or a Hugging Face index) is refused in one line naming the entry or
file; a loader never returns memory it did not write, nothing is allocated beyond the files' sizes,
no file outside the directory is opened, and a resume deletes nothing."""
import dataclasses
import json
import re
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from fnmoe import checkpoint, hf
from fnmoe.checkpoint import CheckpointError, load_params, verify
from fnmoe.checkpoint.format import compact, tiling_problem
from fnmoe.cli import main
from fnmoe.config import load_config
from fnmoe.parallel import dist as fdist
from fnmoe.parallel.sharding import init_params
from fnmoe.training.step import init_state
from fnmoe.training.state import TrainState
from test_checkpoint import args, rows, train_here
from test_checkpoint_mesh import _run, _setup

ROOT = Path(__file__).resolve().parents[1]
P0, P1 = "params-rank00000.safetensors", "params-rank00001.safetensors"
EMBED, STACK, BIAS = "embed.w_VD", "layers.1.moe.w_up_EDF", "buffers.layers.1.moe.router_bias_E"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A step_2 checkpoint saved by a simulated 2x2 mesh: 4 ranks' files, dense leaves in 4 row
    parts (one grid each), expert stacks in two-level grids, the router bias whole in rank 0's file."""
    with fdist.simulate(4):
        run = _run(2, 2)
        tx, loader, mesh = _setup(run)
        state = init_state(init_params(run.model, run.train.seed, mesh=mesh), tx)
        state = TrainState(state.params, state.opt_state, 2)
        return checkpoint.Saver(tmp_path_factory.mktemp("saved"), run.checkpoint).save(state, run,
                                                                                      loader.position(2))


def faulty(saved: Path, tmp_path: Path, edit) -> tuple[Path, dict]:
    """A copy of saved at tmp_path/checkpoints/step_2 whose index.json `edit` changed in place."""
    ckpt = tmp_path / "checkpoints" / saved.name
    shutil.copytree(saved, ckpt)
    index = json.loads((ckpt / "index.json").read_text())
    edit(index)
    (ckpt / "index.json").write_text(json.dumps(index))
    return ckpt, index


def refused(ckpt: Path, capsys) -> str:
    """What `fnmoe checkpoint verify` says of ckpt: exit 2 and one line naming its index.json."""
    assert main(["checkpoint", "verify", str(ckpt)]) == 2
    err = capsys.readouterr().err
    prefix = f"fnmoe checkpoint: error: {ckpt / 'index.json'}: "
    assert err.startswith(prefix) and err.count("\n") == 1, err
    return err[len(prefix):-1]


def _overlapping(index: dict) -> None:
    """The repro: rank 1's rows of the embedding moved onto rank 0's. The parts still add up to the
    tensor's size, so the old count passed and rows 66..131 were left as torch.empty's memory."""
    entry = index["tensors"][EMBED]
    entry["shards"] = list(checkpoint.parts(entry["shards"]))
    entry["shards"][1]["offset"] = [0, 0]


def test_overlapping_parts_are_refused_by_verify_and_by_the_loader(saved, tmp_path, capsys):
    ckpt, index = faulty(saved, tmp_path, _overlapping)
    line = f"the shards of tensors '{EMBED}' overlap: the parts in {P0} at [0, 0] and in {P1} at [0, 0]"
    assert refused(ckpt, capsys) == line
    with pytest.raises(CheckpointError, match=re.escape(line) + "$"):
        load_params(ckpt)
    # the loader itself, handed the index unverified, refuses too
    run = _run(1, 1)
    tx, loader, _ = _setup(run)
    with pytest.raises(CheckpointError, match=rf"^{ckpt}: tensors '{EMBED}': its shards overlap: the parts in {P0} "
                                              rf"at \[0, 0\] and in {P1} at \[0, 0\] \(reading \[slice\(0, 264"):
        checkpoint.load_state(ckpt, index, run, tx, loader.data.fingerprint)


def _set(keys: list, value):
    def edit(index):
        inner = index
        for k in keys[:-1]:
            inner = inner[k]
        inner[keys[-1]] = value
    return edit


def _rename(old: str, new: str):
    def edit(index):
        index["files"][new] = index["files"].pop(old)
        index["tensors"][BIAS]["shards"][0]["file"] = new
    return edit


@pytest.mark.parametrize("edit,line", [
    (_set(["tensors", STACK, "shards", 0, "grid", 1, "count"], 10**12),
     f"tensors['{STACK}'].shards stand for more parts than the 9 files of the checkpoint"),
    (_set(["tensors", EMBED, "shape"], [10**12, 32]),
     f"tensors['{EMBED}'].shape = [1000000000000, 32] is more float32 values than its files' {{held}} bytes hold"),
    (_set(["tensors", EMBED, "shape"], [-264, 32]), f"tensors['{EMBED}'].shape = [-264, 32] has a negative size"),
    (_set(["tensors", EMBED, "dtype"], "float31"),
     f"tensors['{EMBED}'].dtype = 'float31' is not one of float64, float32, float16, bfloat16, int64, int32, "
     "int16, int8, uint8, bool"),
    (_set(["tensors", BIAS, "shards", 0, "file"], f"../step_2/{P0}"),
     f"tensors['{BIAS}'].shards[0].file = '../step_2/{P0}' is not a file name in the checkpoint's directory"),
    (_rename(P0, f"/tmp/{P0}"), f"files['/tmp/{P0}'] is not a file name in the checkpoint's directory"),
    (_set(["step"], 1), "step = 1 differs from the step of its directory, step_2"),
    (_set(["train", "step"], 3), "train.step = 3 differs from step = 2"),
    (_set(["tensors", BIAS, "shards", 0, "offset"], [1]),
     f"the shards of tensors '{BIAS}' lie outside its shape [8]: the part in {P0} at [1] of shape [8]"),
    (_set(["tensors", BIAS, "shards", 0, "file"], "params-rank00007.safetensors"),
     f"the shards of tensors '{BIAS}' name params-rank00007.safetensors, which is not among its files"),
    (_set(["tensors", EMBED, "shards", 0, "grid", 0, "count"], 3),
     f"the shards of tensors '{EMBED}' hold 6336 of its 8448 values"),
], ids=["grid-count", "huge-shape", "negative-shape", "dtype", "dotdot", "absolute", "step", "train-step",
        "outside", "unlisted-file", "gap"])
def test_a_broken_index_is_refused_in_one_line_naming_the_entry(saved, tmp_path, capsys, edit, line):
    ckpt, index = faulty(saved, tmp_path, edit)
    assert refused(ckpt, capsys) == line.format(held=sum(m["bytes"] for m in index["files"].values()))


def test_a_huge_grid_count_is_refused_at_once_without_allocating(saved, tmp_path):
    """10**12 parts: verify, the index reader and a resume by path answer within a second, their
    Python allocations a few MB (expanding the grid used to grow until the process was killed)."""
    ckpt, _ = faulty(saved, tmp_path, _set(["tensors", STACK, "shards", 0, "grid", 1, "count"], 10**12))
    tracemalloc.start()
    t0 = time.perf_counter()
    for read in (verify, checkpoint.read_index, lambda c: checkpoint.resume_point(str(c), c.parent)):
        with pytest.raises(CheckpointError, match="shards stand for more parts than the 9 files"):
            read(ckpt)
    seconds, (_, peak) = time.perf_counter() - t0, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert seconds < 1 and peak < 8 * 2**20, (seconds, peak)


def test_a_step_that_disagrees_with_its_directory_is_not_resumed_and_nothing_is_deleted(tmp_path):
    """step_2's index says step 1: resumed, the run had continued from step 1 and removed step_2 as
    a checkpoint "after" it, the one it had just loaded. By path it is refused; with auto the run
    continues from step_1, and step_2 is still on disk."""
    train_here(*args(tmp_path, 2, "--checkpoint.every", "1"))
    root = tmp_path / "checkpoints"
    index = json.loads((root / "step_2" / "index.json").read_text())
    bad = json.dumps({**index, "step": 1, "train": {**index["train"], "step": 1}})
    (root / "step_2" / "index.json").write_text(bad)
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="step = 1 differs from the step of its directory, step_2"):
        train_here(*args(tmp_path, 3, "--resume", str(root / "step_2")))
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    train_here(*args(tmp_path, 3, "--checkpoint.every", "1", "--resume", "auto"))
    assert [r.get("from_step") for r in rows(tmp_path) if "event" in r] == [1]
    assert bad in [p.read_text() for p in root.rglob("index.json")]  # set aside, not deleted


@pytest.mark.parametrize("n_ranks", [8, 384])
def test_tiling_is_checked_on_the_parts_as_written_at_any_world_size(n_ranks):
    """The parts of an expert stack on fsdp 4 x ep n/4 (_StridedShard, two-level grids) and of a dense
    leaf split by torch.chunk (the last ranks empty) tile their tensors; a part moved by one row
    overlaps its neighbour, and one dropped leaves a gap. At 384 ranks a sweep, not 384**2 pairs."""
    rows, fsdp = 2 * n_ranks, 4
    ep = n_ranks // fsdp
    per = rows // n_ranks
    layouts = {"strided": [((r % ep) * fsdp * per + (r // ep) * per, per) for r in range(n_ranks)],
               "chunk": [(r * (c := -(-rows // (n_ranks - 3))), max(0, min(c, rows - r * c))) for r in range(n_ranks)]}
    files = {f"params-rank{r:05d}.safetensors": {"writer_rank": r, "bytes": 10**6, "sha256": ""}
             for r in range(n_ranks)}
    for name, layout in layouts.items():
        written = [{"file": f"params-rank{r:05d}.safetensors", "key": "w", "rank": r, "offset": [start, 0],
                    "shape": [n, 3]} for r, (start, n) in enumerate(layout) if n]

        def problem(ps):
            index = {"files": files, "tensors": {"w": {"dtype": "float32", "shape": [rows, 3], "shards": ps}}}
            return tiling_problem(index, "tensors", "w")
        assert problem(compact(written)) is None, name
        moved = [dict(p, offset=[p["offset"][0] + 1, 0]) if p["rank"] == 1 else p for p in written]
        assert "overlap" in problem(compact(moved)), name
        assert "hold" in problem(compact(written[:1] + written[2:])), name


def test_hf_weight_map_names_outside_the_directory_are_refused(tmp_path):
    """A model.safetensors.index.json whose weight_map points at ../ or an absolute path: hf.load
    refuses naming the key, and opens nothing (the file there exists, and used to be read)."""
    cfg = load_config(ROOT / "configs" / "tiny.toml").model
    cfg = dataclasses.replace(cfg, vocab_size=72, dim=40, ffn_hidden=48, max_seq_len=64,
                              moe=dataclasses.replace(cfg.moe, expert_hidden=24))
    src = hf.save(tmp_path / "model", init_params(cfg, seed=0), cfg, max_shard_bytes=20_000)
    index = json.loads((src / hf.INDEX).read_text())
    key, name = next(iter(index["weight_map"].items()))
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(src / name, tmp_path / "elsewhere" / name)
    for outside in (f"../elsewhere/{name}", str(tmp_path / "elsewhere" / name)):
        (src / hf.INDEX).write_text(json.dumps({**index, "weight_map": {**index["weight_map"], key: outside}}))
        with pytest.raises(ValueError, match=rf"^{src / hf.INDEX}: weight_map\['{key}'\] = '{outside}' is not a "
                                             rf"file name in {src}$"):
            hf.load(src)
    (src / hf.INDEX).write_text(json.dumps(index))
    assert torch.equal(hf.load(src)[1]["embed"]["w_VD"], init_params(cfg, seed=0)["embed"]["w_VD"])
