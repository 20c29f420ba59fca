"""Bad inputs and faults each end in one line naming the file, field or rank (issue 46, items 8 and 9):
a damaged part of an interrupted prepare, a malformed native index, a prepared corpus without a
split, integers beyond int64, a rank lost while a save checks its params, a tokenizer.json that is not
JSON, a dangling checkpoints link, an OOM before any checkpoint, and error lines written whole."""
import json

import numpy as np
import pytest
import torch

from conftest import tiny_flags
from fnmoe.training import loop
from fnmoe.checkpoint import shards
from fnmoe.cli import main
from fnmoe.config import ModelConfig, MoEConfig, RunConfig, TrainConfig, load_config
from fnmoe.data.prepare import PART_DOCS, prepare, scan
from fnmoe.data.loader import EOS_ID, open_prepared
from fnmoe.hf import tokenizer as hf_tokenizer
from fnmoe.models.params import init_params
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.tree_io import INDEX, load_tree, save_tree

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=16,
                  moe=MoEConfig(n_experts=2, top_k=1, expert_hidden=8, first_k_dense=1))


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------- 1. prepare: a damaged part

def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "wrong dtype"])
def test_a_damaged_part_of_an_interrupted_prepare_is_named_and_redone(tmp_path, capsys, damage):
    docs = [f"doc {i} " * 3 for i in range(2 * PART_DOCS)]
    src = _jsonl(tmp_path / "in.jsonl", docs)
    parts = tmp_path / "out" / "parts"
    parts.mkdir(parents=True)
    (parts / "key.txt").write_text(scan([str(src)], "byte").key)
    part = parts / "000000.npy"
    np.save(part, np.zeros(PART_DOCS * 8, dtype="uint32" if damage == "wrong dtype" else "uint16"))
    if damage == "truncated":  # a disk fault, a copy cut short: the header promises more than is there
        part.write_bytes(part.read_bytes()[:-7])
    elif damage in ("garbage", "empty"):
        part.write_bytes(b"\x00garbage" * 40 if damage == "garbage" else b"")
    prepare([str(src)], "byte", tmp_path / "out", workers=1)
    err = capsys.readouterr().err
    assert f"prepare: {part} is damaged (" in err and "); tokenising it again" in err, err
    _, arrays = open_prepared(tmp_path / "out")
    n_val = round(len(docs) * 0.05)
    assert arrays["train"].tolist() == [t for d in docs[:-n_val] for t in [*d.encode(), EOS_ID]]


# ---------------------------------------------------------------- 2. a malformed native index

@pytest.mark.parametrize("entry,said", [
    (3, "tensors['embed.w_VD'] = 3 is an int, expected an object"),
    ({"dtype": "float32", "shape": [64, 16]}, "tensors['embed.w_VD'] has no field 'file'"),
    ({"file": 5, "dtype": "float32", "shape": [64, 16]}, "tensors['embed.w_VD'] file = 5 is not the name of a file"),
    ({"file": "../params.safetensors", "dtype": "float32", "shape": [64, 16]},
     "tensors['embed.w_VD'] file = \"../params.safetensors\" is not the name of a file"),
    ({"file": "params.safetensors", "dtype": 1, "shape": [64, 16]}, "tensors['embed.w_VD'] dtype = 1 is an int"),
    ({"file": "params.safetensors", "dtype": "float32", "shape": "64x16"},
     "tensors['embed.w_VD'] shape = \"64x16\" is not a list of sizes"),
])
def test_a_malformed_tensor_entry_of_a_native_index_is_named(tmp_path, capsys, entry, said):
    tree = save_tree(tmp_path / "tree", init_params(CFG, 0), CFG)
    index = json.loads((tree / INDEX).read_text())
    assert "embed.w_VD" in index["tensors"]
    index["tensors"]["embed.w_VD"] = entry
    (tree / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError) as e:
        load_tree(tree)
    assert str(e.value).startswith(f"{tree / INDEX}: {said}"), e.value
    assert main(["generate", "--from", str(tree), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith(f"fnmoe generate: error: {tree / INDEX}: {said}")


# ---------------------------------------------------------------- 3. a prepared corpus without splits.val

def test_a_prepared_corpus_without_its_val_split_is_named(tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", [f"d{i} " * 10 for i in range(40)])
    out = tmp_path / "out"
    prepare([str(src)], "byte", out, workers=1)
    index = json.loads((out / "index.json").read_text())
    del index["splits"]["val"]
    (out / "index.json").write_text(json.dumps(index))
    capsys.readouterr()
    assert main(["train", "--data.corpus", str(out), "--train.run-dir", str(tmp_path / "run"), "--train.steps", "1",
                 *tiny_flags()]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"fnmoe train: error: {out / 'index.json'}: no field 'splits.val' "), line
    index["splits"]["val"] = {**index["splits"]["train"], "tokens": "12"}
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json: splits.val.tokens = \"12\" is a str, expected int"):
        open_prepared(out)


# ---------------------------------------------------------------- 4. integers beyond int64

BIG = str(10**23)


@pytest.mark.parametrize("flag,said", [
    ("--train.steps", f"train.steps = {BIG} does not fit in a 64-bit integer"),
    ("--train.seed", f"train.seed = {BIG} does not fit in a 64-bit integer"),
    ("--train.threads", f"train.threads must be in [0, 1024], got {BIG}"),
])
def test_integers_beyond_their_range_name_the_field(tmp_path, capsys, flag, said):
    assert main(["train", "--train.run-dir", str(tmp_path / "run"), flag, BIG]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith(f"fnmoe train: error: invalid config: {said}")
    assert not (tmp_path / "run").exists()


def test_integers_beyond_int64_in_a_preset_and_for_generate_name_the_field(tmp_path, capsys):
    (tmp_path / "big.toml").write_text(f"[train]\nseed = -{BIG}\n")
    with pytest.raises(ValueError, match=f"train.seed = -{BIG} does not fit in a 64-bit integer"):
        load_config(tmp_path / "big.toml")
    assert main(["generate", "--from", str(tmp_path), "--seed", BIG]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"fnmoe generate: error: --seed must be in [-9223372036854775808, 9223372036854775807], got {BIG}")
    RunConfig(train=TrainConfig(seed=2**63 - 1, steps=2**63 - 1))  # the bounds themselves are taken


# ---------------------------------------------------------------- 5. a rank lost during a save

def test_a_rank_lost_while_a_save_checks_its_params_names_the_save(monkeypatch):
    """The all-reduce a save starts with (every rank's count of non-finite params) fails as gloo does
    when a peer is gone: the report names the save and its step, not a bare count."""
    def lost(t, group):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")
    monkeypatch.setattr(sharding.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sharding, "all_reduce_sum", lost)
    monkeypatch.setattr(fdist, "rank", lambda: 0)
    monkeypatch.setattr(fdist, "world", lambda: 2)
    monkeypatch.setattr(fdist, "unresponsive_ranks", lambda wait_s: [1])
    with pytest.raises(RuntimeError) as e:
        shards._refuse_non_finite({"embed": {0: torch.ones(2)}}, step=7)
    report = fdist.failure_report(e.value, 10.0).splitlines()[0]
    assert report.startswith("rank 0 of 2: a collective lost a peer's connection; the last one this rank entered: "
                             "all-reduce of step 7's count of non-finite params (saving its checkpoint) over every "
                             "rank; unresponsive: rank 1 "), report


# ---------------------------------------------------------------- 6. a tokenizer.json that is not JSON

@pytest.mark.parametrize("content,said", [(b"\xff\xfe{not text", "not valid JSON"), (b"{\"model\": ", "not valid JSON"),
                                          (b"[1, 2]", "expected a JSON object, got list"),
                                          (b'{"added_tokens": [1, {"id": 256}], "model": {"vocab": [3]}}',
                                           "no token with id 256")])
def test_a_tokenizer_json_that_is_not_one_is_named(tmp_path, content, said):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"^{path}: {said}") as e:
        hf_tokenizer.from_file(path, EOS_ID, 16)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- 7. a dangling checkpoints symlink

def test_a_dangling_checkpoints_link_is_named_with_its_target(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(tmp_path / "gone" / "ckpts")
    assert main(["train", "--train.run-dir", str(run_dir), "--train.steps", "1", *tiny_flags()]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"fnmoe train: error: cannot write checkpoints: {run_dir / 'checkpoints'} is a dangling "
                           f"symbolic link to {tmp_path / 'gone' / 'ckpts'}, which does not exist"), line
    assert "File exists" not in line


# ---------------------------------------------------------------- 8. OOM before any checkpoint

def test_an_oom_says_a_checkpoint_is_kept_only_when_one_exists(tmp_path, capsys, monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
    monkeypatch.setattr(loop.sharding, "init_params", no_memory)
    run_dir = tmp_path / "run"
    assert main(["train", "--train.run-dir", str(run_dir), "--train.steps", "1", *tiny_flags()]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fnmoe train: out of memory on rank 0: DefaultCPUAllocator: can't allocate memory"), err
    assert err.endswith("no checkpoint was written for the failed step; the run has no checkpoint yet\n"), err
    assert "is kept" not in err
    (run_dir / "checkpoints" / "step_3").mkdir(parents=True)
    run = RunConfig(train=TrainConfig(run_dir=str(run_dir)))
    report = loop._oom_report(run, 0, RuntimeError("can't allocate memory"))
    assert report.endswith(f"the newest complete one, {run_dir / 'checkpoints' / 'step_3'}, is kept (continue "
                           "with --resume auto)"), report


# ---------------------------------------------------------------- 9. error lines written whole

class _Writes:
    """A stderr that records each write() call, and whether a flush followed the last."""

    def __init__(self):
        self.calls, self.flushed = [], False

    def write(self, s: str) -> int:
        self.calls.append(s)
        self.flushed = False
        return len(s)

    def flush(self) -> None:
        self.flushed = True

    def isatty(self) -> bool:
        return False


def test_an_error_line_is_one_write_of_a_whole_line(tmp_path, monkeypatch):
    """Ranks sharing a terminal or a log each write their line with one write() (print wrote the
    newline apart, so two ranks' lines ran together), flushed at once."""
    err = _Writes()
    monkeypatch.setattr("sys.stderr", err)
    assert main(["train", "--train.run-dir", str(tmp_path / "run"), "--train.threads", "-1"]) == 2
    assert err.calls == ["fnmoe train: error: invalid config: train.threads must be in [0, 1024], got -1\n"]
    assert err.flushed
