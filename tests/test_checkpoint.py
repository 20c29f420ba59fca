"""Checkpoints: the index format, verify, bit-exact resume, metrics rewind, and faults with real
processes (kill -9 mid-save, corrupt and truncated shards, a full disk, Ctrl-C, torchrun restarts)."""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fnmoe import checkpoint, optim
from fnmoe.checkpoint import CheckpointError, load_params, shards, verify
from fnmoe.cli import main, parse_run
from fnmoe.config import load_config
from fnmoe.data.loader import Loader, load_data
from fnmoe.run.faults import KILL_AT_STEP_ENV, SAVE_DELAY_ENV
from fnmoe.training.loop import train
from fnmoe.run.metrics import drop_rows_after
from fnmoe.models.params import draw_leaf, init_params, leaf_inits
from fnmoe.training.step import init_state
from fnmoe.training.state import TrainState
from fnmoe.tree import flatten_dict
from conftest import tiny_flags

SMALL = tiny_flags(2, "--train.eval-every", "0")
PARAMS, STATE = "params-rank00000.safetensors", "state-rank00000.safetensors"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """In-process runs use one thread, as the spawned ones do (OMP_NUM_THREADS=1), so their losses
    can be compared bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def args(run_dir, steps, *extra):
    return [*SMALL, "--train.steps", str(steps), "--train.run-dir", str(run_dir), *extra]


def train_here(*argv):
    return train(parse_run(list(argv), "fnmoe train"))


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows(run_dir) if "loss" in r}


def spawn_env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", **extra)


def fnmoe_cmd(*argv):
    return [sys.executable, "-m", "fnmoe", *argv]


def ckpts(run_dir):
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())


# ---------------------------------------------------------------- format

def test_expert_ids_in_files_are_global(tmp_path):
    """Each shard of an expert stack holds experts offset[0] + k: checked against each global
    expert's own init values, shard by shard, so the test holds for any number of ranks."""
    run = parse_run(SMALL, "fnmoe train")
    params = init_params(run.model, seed=run.train.seed)
    tx = optim.from_config(run.optim, run.train.steps)
    data = load_data(run.data, run.model.vocab_size)
    loader = Loader(data, run.data.seq_len, run.train.batch_size, 1, run.train.seed)
    ckpt = checkpoint.write(checkpoint.snapshot(init_state(params, tx), run, loader.position(0)), tmp_path, keep_last=1)
    index = verify(ckpt)
    inits = flatten_dict(leaf_inits(run.model))
    stacks = [p for p in index["tensors"] if len(suffix := p.rsplit("_", 1)[-1]) == 3 and suffix[0] == "E"]
    assert stacks
    for path in stacks:
        entry, covered = index["tensors"][path], []
        for shard in checkpoint.parts(entry["shards"]):
            with safe_open(ckpt / shard["file"], framework="pt") as f:
                experts = f.get_tensor(shard["key"])
            for k in range(experts.shape[0]):
                g = shard["offset"][0] + k
                want = draw_leaf(inits[path], run.train.seed, path, (slice(g, g + 1),))[0]
                assert torch.equal(experts[k], want), f"{path}: stored expert {k} is not global expert {g}"
                covered.append(g)
        assert sorted(covered) == list(range(entry["shape"][0]))


def test_a_checkpoint_with_an_earlier_leaf_name_loads_and_resumes(tmp_path):
    """A checkpoint whose index names the router weight by its earlier name (router_DE, now
    w_router_DE; fnmoe.models.params.RENAMED) loads for export and resumes: params and optimizer state."""
    run = parse_run(SMALL, "fnmoe train")
    params = init_params(run.model, seed=run.train.seed)
    tx = optim.from_config(run.optim, run.train.steps)
    loader = Loader(load_data(run.data, run.model.vocab_size), run.data.seq_len, run.train.batch_size, 1,
                    run.train.seed)
    ckpt = checkpoint.write(checkpoint.snapshot(init_state(params, tx), run, loader.position(0)), tmp_path, keep_last=1)
    index_file = ckpt / "index.json"
    index = json.loads(index_file.read_text())
    for section in ("tensors", "opt_state"):
        index[section] = {k.replace(".w_router_DE", ".router_DE"): v for k, v in index[section].items()}
    assert any(k.endswith(".router_DE") for k in index["tensors"])
    assert any(k.endswith(".router_DE") for k in index["opt_state"])
    index_file.write_text(json.dumps(index))
    _, loaded = load_params(ckpt)
    want = flatten_dict(params)
    assert flatten_dict(loaded).keys() == want.keys()
    assert all(torch.equal(flatten_dict(loaded)[k], want[k]) for k in want)
    state = checkpoint.load_state(ckpt, verify(ckpt), run, tx, loader.data.fingerprint)
    assert all(torch.equal(flatten_dict(state.params)[k], want[k]) for k in want)


def test_resume_restores_the_saved_rng_state(tmp_path):
    """The global RNG after `fnmoe train --resume` is the state the checkpoint holds, byte for byte,
    not the seeded one: checked with a state that seeding cannot give (nothing draws from the global
    RNG during a step today, so a bit-exact resume alone cannot tell)."""
    run = parse_run(args(tmp_path, 1), "fnmoe train")
    params = init_params(run.model, seed=run.train.seed)
    tx = optim.from_config(run.optim, run.train.steps)
    loader = Loader(load_data(run.data, run.model.vocab_size), run.data.seq_len, run.train.batch_size, 1,
                    run.train.seed)
    torch.manual_seed(1234)
    torch.rand(77)  # a state 77 draws into seed 1234's stream
    before = torch.get_rng_state()
    state = init_state(params, tx)
    ckpt = checkpoint.write(checkpoint.snapshot(TrainState(state.params, state.opt_state, 1), run, loader.position(1)),
                            tmp_path / "checkpoints", keep_last=1)
    (shard,) = checkpoint.parts(verify(ckpt)["rng"]["rank0.torch_cpu"]["shards"])
    with safe_open(ckpt / shard["file"], framework="pt") as f:
        saved = f.get_tensor(shard["key"])
    assert torch.equal(saved, before)
    summary = train_here(*args(tmp_path, 1, "--resume", "auto"))  # at train.steps already: loads, returns
    assert summary["checkpoint"] == str(ckpt)
    assert torch.equal(torch.get_rng_state(), saved)


def test_index_lists_files_with_checksums_and_tensors_with_global_shapes(tmp_path):
    summary = train_here(*args(tmp_path, 2))
    ckpt = Path(summary["checkpoint"])
    index = verify(ckpt)
    assert index["step"] == 2 and set(index["files"]) == {PARAMS, STATE, "config.toml"}
    assert all(m["writer_rank"] == 0 and len(m["sha256"]) == 64 for m in index["files"].values())
    entry = index["tensors"]["embed.w_VD"]
    assert entry["shape"] == [264, 32] and entry["dtype"] == "float32" and len(entry["placement"]) == 2
    assert entry["shards"] == [{"file": PARAMS, "key": "embed.w_VD", "offset": [0, 0], "shape": [264, 32]}]
    assert entry["file"] == PARAMS and index["model"]["dim"] == 32  # readable as a native tree index
    assert index["train"]["data"]["samples_seen"] == 8 and index["train"]["data"]["corpus_fingerprint"]
    assert "rank0.torch_cpu" in index["rng"]
    run, params = load_params(ckpt)
    assert run.model.dim == 32 and run.train.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(flatten_dict(params).values(),
                                                  flatten_dict(summary["params"]).values()))


def _parts_of(layout, n_ranks):
    """Every rank's part {file, key, rank, offset, shape} of a [64, 3] leaf; layout(rank) -> (start, rows)."""
    out = []
    for r in range(n_ranks):
        start, rows = layout(r)
        if rows:
            out.append({"file": f"params-rank{r:05d}.safetensors", "key": "w", "rank": r, "offset": [start, 0],
                        "shape": [rows, 3]})
    return out


@pytest.mark.parametrize("layout,n_ranks,most", [
    (lambda r: ((r % 8) * 8 + (r // 8) * 2, 2), 32, 1),  # an expert stack on fsdp 4 x ep 8 (_StridedShard)
    (lambda r: (r * 11, min(11, max(0, 64 - r * 11))), 8, 2),  # torch.chunk of 64 rows on 8 ranks: 5 x 11, 9, none
    (lambda r: (0, 64 if r == 0 else 0), 384, 1),  # a replicated leaf, written by rank 0
    (lambda r: ((r * 7) % 64, 1), 40, 40)])  # no linear step: every part listed as version 1 did
def test_index_grids_stand_for_every_rank_part(layout, n_ranks, most):
    """format.compact writes an entry's parts as grids (the index no longer grows with the world:
    97 MB at 384 ranks listed part by part); format.parts gives back every part, in rank order."""
    written = _parts_of(layout, n_ranks)
    shards = checkpoint.format.compact(written)
    assert len(shards) <= most, shards
    assert list(checkpoint.parts(shards)) == [{k: v for k, v in p.items() if k != "rank"} for p in written]
    assert all(("grid" in s) == ("{rank}" in s["file"]) for s in shards)


def test_version_1_indexes_still_load_and_bad_grids_are_named(tmp_path, capsys):
    train_here(*args(tmp_path, 2))
    ckpt = tmp_path / "checkpoints" / "step_2"
    index = json.loads((ckpt / "index.json").read_text())
    assert index["version"] == 2
    v1 = {**index, "version": 1, **{s: {p: {**e, "shards": list(checkpoint.parts(e["shards"]))}
                                        for p, e in index[s].items()} for s in checkpoint.SECTIONS}}
    (ckpt / "index.json").write_text(json.dumps(v1))
    run, params = load_params(ckpt)
    assert run.model.dim == 32
    leaf = next(iter(index["tensors"]))
    shard = index["tensors"][leaf]["shards"][0]
    bad = [({"version": 3}, "is not an fnmoe checkpoint index of version 1 or 2"),
           ({"tensors": {**index["tensors"], leaf: {**index["tensors"][leaf], "shards": [
               {**shard, "file": "params-rank{rank}.safetensors", "rank": 0,
                "grid": [{"count": "2", "rank_step": 1, "offset_step": [0, 0]}]}]}}},
            f"tensors['{leaf}'].shards[0].grid[0].count = \"2\" is a str, expected int")]
    for edit, line in bad:
        (ckpt / "index.json").write_text(json.dumps({**index, **edit}))
        assert main(["checkpoint", "verify", str(ckpt)]) == 2
        assert line in capsys.readouterr().err


def test_keep_last_defaults_to_three(tmp_path):
    """README: a run keeps the newest --checkpoint.keep-last checkpoints, 3 unless told: the default of
    the flag and of the tiny preset, and what 5 saves (one a step) leave."""
    assert parse_run([], "fnmoe train").checkpoint.keep_last == 3
    assert load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml").checkpoint.keep_last == 3
    train_here(*args(tmp_path, 5, "--checkpoint.every", "1"))
    assert ckpts(tmp_path) == ["step_3", "step_4", "step_5"]


# ---------------------------------------------------------------- resume

def test_resume_is_bit_exact_async_save_does_not_block_and_metrics_rewind(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(SAVE_DELAY_ENV, "1.0")  # every write takes >= 1 s
    staging = []  # the copies of the state to the CPU are made off the training thread
    monkeypatch.setattr(checkpoint.save, "staged", lambda snap, after: (
        staging.append(threading.current_thread().name), shards.staged(snap, after))[1])
    train_here(*args(a, 6, "--checkpoint.every", "3", "--checkpoint.async-save", "--train.log-every", "1"))
    monkeypatch.delenv(SAVE_DELAY_ENV)
    assert staging == ["fnmoe-checkpoint"]  # step 3's (step 6, the last, is saved blocking)
    by_step = {r["step"]: r for r in rows(a) if "loss" in r}
    assert by_step[4]["time_s"] - by_step[3]["time_s"] < 0.8, "step 4 waited for the async save of step 3"
    assert ckpts(a) == ["step_3", "step_6"]

    # b: the run killed after step 6 was logged but before step 6 was saved
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_6")
    try:
        train_here(*args(b, 6, "--checkpoint.every", "3", "--resume", "auto", "--train.deterministic"))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert losses(b) == losses(a)  # loss and grad norm, bit for bit, steps 1..6
    marks = [r.get("step", r.get("event")) for r in rows(b)]
    assert marks == [1, 2, 3, "resume", 4, 5, 6, 6] and rows(b)[3] == {"event": "resume", "from_step": 3}
    ia, ib = (verify(d / "checkpoints" / "step_6") for d in (a, b))
    for name in (PARAMS, STATE):  # params, optimizer state and RNG: the same bytes
        assert ia["files"][name]["sha256"] == ib["files"][name]["sha256"]


def test_resume_of_a_data_mixture_is_bit_exact(tmp_path):
    """A 3-source mixture (data.mix) resumed from step 3 equals the run that was never stopped."""
    from test_mixture import prepared_sources

    mix = ["--data.mix", *prepared_sources(tmp_path), "--train.eval-every", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    train_here(*args(a, 6, "--checkpoint.every", "3", *mix))
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_6")
    train_here(*args(b, 6, "--checkpoint.every", "3", "--resume", "auto", *mix))
    assert losses(b) == losses(a)  # loss and grad norm, bit for bit, steps 1..6
    evals = lambda d: {r["step"]: r for r in rows(d) if "val_loss" in r}  # noqa: E731
    assert evals(b) == evals(a) and {"val_loss/web", "val_loss/code", "val_loss/math"} <= evals(a)[6].keys()
    ia, ib = (verify(d / "checkpoints" / "step_6") for d in (a, b))
    assert ia["files"][PARAMS]["sha256"] == ib["files"][PARAMS]["sha256"]


def test_resume_refuses_model_changes_and_warns_about_others(tmp_path, warnings_text, capsys):
    train_here(*args(tmp_path, 2))
    before = (tmp_path / "metrics.jsonl").read_text()
    assert main(["train", *args(tmp_path, 4, "--resume", "auto", "--model.dim", "64", "--model.n-layers", "3")]) == 2
    err = capsys.readouterr().err
    assert "model fields differ" in err and "model.dim 32 -> 64" in err and "model.n_layers 4 -> 3" in err
    assert main(["train", *args(tmp_path, 4)]) == 2  # a fresh start would replace the checkpoints
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == before

    train_here(*args(tmp_path, 4, "--resume", "auto", "--optim.weight-decay", "0.2",
                     "--model.compute-dtype", "bfloat16"))
    warned = warnings_text()
    assert "\n  --optim.weight-decay: 0.1 -> 0.2" in warned and "\n  --train.steps: 2 -> 4" in warned
    assert "\n  --model.compute-dtype: 'float32' -> 'bfloat16'" in warned
    assert [r["step"] for r in rows(tmp_path) if "loss" in r] == [1, 2, 3, 4]

    run = parse_run(args(tmp_path, 6, "--optim.weight-decay", "0.3"), "fnmoe train")
    tx = optim.from_config(run.optim, 6)
    loader = Loader(load_data(run.data, run.model.vocab_size), 32, 4, 1, 0)
    ckpt = tmp_path / "checkpoints" / "step_4"
    state = checkpoint.load_state(ckpt, verify(ckpt), run, tx, loader.data.fingerprint)
    assert state.step == 4 and state.opt_state[1]["adamw"].weight_decay.item() == 0.3  # the new value applies
    assert state.opt_state[1]["adamw"].count.item() == 4
    muon_run = parse_run(args(tmp_path, 6, "--optim.name", "muon"), "fnmoe train")
    fresh = checkpoint.load_state(ckpt, verify(ckpt), muon_run, optim.from_config(muon_run.optim, 6),
                                   loader.data.fingerprint)
    assert fresh.opt_state[1]["adamw"].count.item() == 0 and "does not fit the configured optimizer" in warnings_text()
    # resumed with that fresh state, the logged lr is the one the optimizer used: its schedule restarts
    train_here(*args(tmp_path, 6, "--optim.name", "muon", "--resume", "auto"))
    schedule = optim.schedule_from_config(muon_run.optim, muon_run.optim.lr, 6)
    assert [r["lr"] for r in rows(tmp_path) if "loss" in r][4:] == [schedule(torch.tensor(i)).item() for i in (0, 1)]


def test_drop_rows_after_keeps_earlier_rows_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 1.0}, {"step": 2, "val_loss": 2.0}, {"event": "resume", "from_step": 1},
             {"step": 2, "loss": 2.0}, {"event": "resume", "from_step": 3}, {"step": 4, "loss": 4.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "lo')
    drop_rows_after(path, 2)
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:4]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


# ---------------------------------------------------------------- faults

def test_corrupt_or_truncated_files_are_named_and_auto_falls_back(tmp_path, warnings_text, capsys):
    train_here(*args(tmp_path, 4, "--checkpoint.every", "1", "--checkpoint.keep-last", "2"))
    assert ckpts(tmp_path) == ["step_3", "step_4"]  # keep-last pruned steps 1 and 2
    first = losses(tmp_path)
    root = tmp_path / "checkpoints"

    truncated = tmp_path / "truncated"
    shutil.copytree(root / "step_3", truncated)
    with open(truncated / STATE, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointError, match=f"{STATE} has 1000 bytes.*truncated"):
        verify(truncated)

    bad = root / "step_4" / PARAMS
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{PARAMS} does not match its sha256"):
        load_params(root / "step_4")
    assert main(["checkpoint", "verify", str(root / "step_4")]) == 2
    assert str(bad) in capsys.readouterr().err
    assert main(["checkpoint", "verify", str(root / "step_3")]) == 0
    assert "ok:" in capsys.readouterr().out

    train_here(*args(tmp_path, 4, "--checkpoint.every", "1", "--checkpoint.keep-last", "2", "--resume", "auto"))
    assert "resuming from step_3, the newest checkpoint that verifies" in warnings_text()
    assert f"step_4: {bad}" in warnings_text()
    assert losses(tmp_path) == first
    assert [r.get("from_step") for r in rows(tmp_path) if "event" in r] == [3]
    verify(root / "step_4")
    assert (root / "set_aside" / "step_4" / PARAMS).read_bytes() == bytes(data)  # set aside, not deleted


@pytest.mark.launch
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen(fnmoe_cmd("train", *args(tmp_path, 4, "--checkpoint.every", "2")), cwd=tmp_path,
                            env=spawn_env(**{SAVE_DELAY_ENV: "2"}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline, partial = time.time() + 60, []
        while time.time() < deadline and not partial:
            partial = [p for p in root.glob(".tmp-step_4-*") if (p / STATE).exists()] if root.exists() else []
            time.sleep(0.02)
        assert partial, "the save of step 4 never started"
        proc.kill()  # SIGKILL while step 4's files are written but its index.json is not
    finally:
        proc.kill()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == -signal.SIGKILL, out
    assert ckpts(tmp_path) == [partial[0].name, "step_2"] and not (partial[0] / "index.json").exists()
    assert checkpoint.find_latest(root)[0] == root / "step_2"
    killed = losses(tmp_path)
    assert sorted(killed) == [1, 2, 3, 4]

    train_here(*args(tmp_path, 4, "--checkpoint.every", "2", "--resume", "auto"))
    assert ckpts(tmp_path) == ["step_2", "step_4"]  # the partial save is gone
    assert losses(tmp_path) == killed
    assert [r.get("step", r.get("event")) for r in rows(tmp_path)] == [1, 2, "resume", 3, 4, 4]


@pytest.mark.launch
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_gives_a_clear_error_and_no_partial_checkpoint(tmp_path, mode):
    train_here(*args(tmp_path, 2))
    limit = 200_000  # bytes per file: metrics and configs fit, a params shard (~440 kB) does not

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    extra = ["--checkpoint.async-save"] if mode == "async" else []
    r = subprocess.run(fnmoe_cmd("train", *args(tmp_path, 6, "--checkpoint.every", "2", "--resume", "auto", *extra)),
                       cwd=tmp_path, env=spawn_env(), preexec_fn=small_files, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "fnmoe train: error: could not save checkpoint step 4" in r.stderr
    assert "File too large" in r.stderr and "Traceback" not in r.stderr
    assert ckpts(tmp_path) == ["step_2"]
    verify(tmp_path / "checkpoints" / "step_2")


@pytest.mark.launch
def test_ctrl_c_saves_a_checkpoint_then_exits_saying_so(tmp_path):
    proc = subprocess.Popen(fnmoe_cmd("train", *args(tmp_path, 100000)), cwd=tmp_path, env=spawn_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, metrics = time.time() + 60, tmp_path / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    (name,) = ckpts(tmp_path)
    step = verify(tmp_path / "checkpoints" / name)["step"]
    assert f"interrupted at step {step} of 100000; saved checkpoint" in out and "--resume auto" in out
    # Ctrl-C during a step's metrics write leaves that row one step ahead of the saved state;
    # resume drops it
    assert step >= 1 and max(losses(tmp_path)) in (step, step + 1)


@pytest.mark.launch
def test_torchrun_restarts_a_killed_worker_and_ends_with_the_same_loss(tmp_path):
    ref, run_dir = tmp_path / "ref", tmp_path / "elastic"
    train_here(*args(ref, 6, "--checkpoint.every", "2"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "--max-restarts", "2", "-m", "fnmoe", "train",
           *args(run_dir, 6, "--checkpoint.every", "2", "--resume", "auto")]
    res = subprocess.run(cmd, cwd=tmp_path, env=spawn_env(**{KILL_AT_STEP_ENV: "3"}), capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r.get("step", r.get("event")) for r in rows(run_dir)] == [1, 2, "resume", 3, 4, 5, 6, 6]
    assert losses(run_dir) == losses(ref)


def test_index_fields_are_typed_and_generate_names_the_checkpoint_it_used(tmp_path, capsys):
    """A hand-edited index.json with a field of the wrong type fails `checkpoint verify` naming the
    field (it used to pass and fail on resume); generate from a run whose newest checkpoint is
    corrupt warns once and says, on stderr, which checkpoint it used."""
    train_here(*args(tmp_path, 2, "--checkpoint.every", "1"))
    capsys.readouterr()  # the training's log
    root = tmp_path / "checkpoints"
    index = json.loads((root / "step_2" / "index.json").read_text())
    leaf = next(iter(index["tensors"]))
    edits = [(["step"], "2", 'step = "2" is a str, expected int'),
             (["files", PARAMS, "bytes"], 1.5, f"files['{PARAMS}'].bytes = 1.5 is a float, expected int"),
             (["tensors", leaf, "shape"], [2, "3"], f"tensors['{leaf}'].shape[1] = \"3\" is a str, expected int"),
             (["tensors", leaf, "shards"], {}, f"tensors['{leaf}'].shards = {{}} is a dict, expected a list"),
             (["train", "data", "seed"], True, "train.data.seed = true is a bool, expected int"),
             (["mesh"], {"fsdp": 1}, "mesh has no field 'ep'")]
    for keys, value, line in edits:
        bad = tmp_path / "edited"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(root / "step_2", bad)
        edited = json.loads(json.dumps(index))
        inner = edited
        for k in keys[:-1]:
            inner = inner[k]
        inner[keys[-1]] = value
        (bad / "index.json").write_text(json.dumps(edited))
        assert main(["checkpoint", "verify", str(bad)]) == 2
        assert capsys.readouterr().err == f"fnmoe checkpoint: error: {bad / 'index.json'}: {line}\n"

    data = bytearray((root / "step_2" / PARAMS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (root / "step_2" / PARAMS).write_bytes(bytes(data))
    assert main(["generate", "--from", str(tmp_path), "--prompt", "a", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert err.count("skipping checkpoint step_2") == 1 and f"using {root / 'step_1'} (step 1)" in err
    assert out.startswith("a") and "skipping" not in out
