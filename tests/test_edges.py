"""The library's edges (issue 35): token ids of any integer dtype; n_global <= 0, non-finite learning
rates and hf.save of non-finite weights refused with one clear error; ranges that overflow refused by
the config check; `fnmoe checkpoint verify` as strict as a resume."""
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import fnmoe
from fnmoe import checkpoint, hf, optim
from fnmoe.cli import main
from fnmoe.config import (DataConfig, DistConfig, MixSource, ModelConfig, MoEConfig, OptimConfig, RunConfig,
                          TrainConfig, validate)
from fnmoe.data.loader import Loader, check_token_ids, load_data, val_batches
from fnmoe.data.prepare import prepare
from fnmoe.sampling.generate import generate
from fnmoe.memory.policies import train_runner
from fnmoe.models.params import init_params
from fnmoe.training.step import init_state, loss_fn, make_train_step
from fnmoe.tree import flatten_dict

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1))
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64]


# ---------------------------------------------------------------- token dtypes

@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_token_ids_of_any_integer_dtype_give_the_int64_results(dtype):
    """uint8 / int8 / int16 failed in the embedding, uint16 / uint32 / uint64 in the id check, and
    int32 or narrower labels in the loss: each now computes what int64 ids do."""
    params = init_params(CFG, seed=0)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ref_logits, _ = fnmoe.forward(params, inputs, CFG)
    ref_loss, _ = loss_fn(params, inputs, labels, CFG, labels.numel())
    logits, _ = fnmoe.forward(params, inputs.to(dtype), CFG)
    loss, _ = loss_fn(params, inputs.to(dtype), labels.to(dtype), CFG, labels.numel())
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    out = generate(params, inputs[:, :4].to(dtype), CFG, 3)
    assert torch.equal(out, generate(params, inputs[:, :4], CFG, 3))
    with pytest.raises(ValueError, match=r"token id 64 at position \[0, 2\] is outside 0\.\.model\.vocab_size-1=63"):
        fnmoe.forward(params, inputs.index_put((torch.tensor(0), torch.tensor(2)), torch.tensor(64)).to(dtype), CFG)
    check_token_ids(tokens.to(dtype), 64, "a test stream")


def test_float_token_ids_are_refused():
    with pytest.raises(TypeError, match="tokens must be an integer tensor of token ids, got torch.float32"):
        fnmoe.forward(init_params(CFG), torch.zeros(1, 4), CFG)
    with pytest.raises(ValueError, match=r"^a test stream: token ids must be integers, got torch\.float32$"):
        check_token_ids(torch.zeros(4), 64, "a test stream")


def _as_dtype(src: Path, dst: Path, dtype: str, vocab: int | None = None) -> Path:
    """The prepared directory src with its token files rewritten in dtype (another tool's files)."""
    index = json.loads((src / "index.json").read_text())
    dst.mkdir()
    index["dtype"] = dtype
    if vocab is not None:
        index["vocab_size"] = vocab
    for entry in index["splits"].values():
        data = np.fromfile(src / entry["file"], dtype="<u2").astype(np.dtype(dtype).newbyteorder("<")).tobytes()
        (dst / entry["file"]).write_bytes(data)
        entry["sha256"] = hashlib.sha256(data).hexdigest()
    (dst / "index.json").write_text(json.dumps(index))
    return dst


def test_prepared_token_files_of_any_integer_dtype_read_alike_and_floats_are_refused(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 12}) + "\n" for i in range(30)))
    prepare([str(src)], "byte", tmp_path / "u16")
    ref = load_data(DataConfig(corpus=str(tmp_path / "u16"), seq_len=16), 264)
    want = Loader(ref, 16, 4, 1, 0).batch_at(1, 0, 1, 0)
    for dtype in ("int16", "int32", "uint32", "int64"):
        data = load_data(DataConfig(corpus=str(_as_dtype(tmp_path / "u16", tmp_path / dtype, dtype)), seq_len=16), 264)
        got = Loader(data, 16, 4, 1, 0).batch_at(1, 0, 1, 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), dtype
        assert all(torch.equal(a, b) for a, b in zip(val_batches(data, 16, 2, 1)[0], val_batches(ref, 16, 2, 1)[0]))
    bad = _as_dtype(tmp_path / "u16", tmp_path / "f32", "float32")
    with pytest.raises(ValueError, match=rf"^{bad / 'index.json'}: token dtype 'float32' is not an integer type$"):
        load_data(DataConfig(corpus=str(bad), seq_len=16), 264)
    narrow = _as_dtype(tmp_path / "u16", tmp_path / "u8", "uint8")  # the byte tokenizer's EOS is 256
    with pytest.raises(ValueError, match=r"token dtype 'uint8' holds ids up to 255, fewer than its vocab_size=257$"):
        load_data(DataConfig(corpus=str(narrow), seq_len=16), 264)


# ---------------------------------------------------------------- n_global, learning rates

@pytest.mark.parametrize("n_global", [0, -3, float("nan"), torch.tensor(0)], ids=str)
def test_a_label_count_that_is_not_positive_is_refused(n_global):
    """It divides the loss: 0 gave inf, a negative count ascended the gradient silently."""
    tokens = torch.randint(0, 64, (1, 5))
    with pytest.raises(ValueError, match=r"^n_global must be > 0: the step's count of labels that are not -100 "):
        loss_fn(init_params(CFG), tokens[:, :-1], tokens[:, 1:], CFG, n_global)


@pytest.mark.parametrize("make, what", [
    (lambda: optim.adamw(float("nan")), "adamw: learning rate"),
    (lambda: optim.adamw(1e-3, eps=float("nan")), "adamw: eps"),
    (lambda: optim.adamw(1e-3, b1=1.0), "adamw: b1"),
    (lambda: optim.muon(float("nan")), "muon: learning rate"),
    (lambda: optim.muon(0.02, adamw_lr=float("inf")), "muon: adamw_lr"),
    (lambda: optim.scale_by_learning_rate(-1e-3), "learning rate"),
    (lambda: optim.warmup_cosine(float("nan"), 10, 100), "warmup_cosine: peak"),
    (lambda: optim.wsd(float("inf"), 10, 100), "wsd: peak"),
    (lambda: optim.constant(float("nan")), "constant schedule: value"),
    (lambda: optim.set_hyperparams(optim.adamw(1e-3).init({"w": torch.ones(2)}), lr=float("nan")),
     "set_hyperparams: lr"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_non_finite_or_out_of_range_hyperparameters_are_refused_where_the_optimizer_is_made(make, what):
    """An lr of NaN trained on as skipped steps; now the optimizer is not made."""
    with pytest.raises(ValueError, match=rf"^{what} must be a finite number "):
        make()
    optim.adamw(optim.warmup_cosine(1e-3, 10, 100))  # a schedule passes, its peak checked when it was made


# ---------------------------------------------------------------- hf.save

def test_hf_save_refuses_non_finite_weights_and_writes_nothing(tmp_path):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48, qk_norm=True,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1))
    params = init_params(cfg)
    flatten_dict(params)["layers.1.moe.w_down_EFD"][2, 0, 1] = float("inf")
    with pytest.raises(ValueError, match=rf"^hf\.save: refusing to write {tmp_path / 'hf'}: the weights hold "
                                         r"non-finite values \(NaN or inf\) in 1 leaves, e\.g\. "
                                         r"\['layers\.1\.moe\.w_down_EFD'\]; nothing was written$"):
        hf.save(tmp_path / "hf", params, cfg)
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- the config check

@pytest.mark.parametrize("run, message", [
    (RunConfig(dist=DistConfig(timeout_s=1e300)), "dist.timeout_s must be in (0, 3.1536e+07], got 1e+300"),
    (RunConfig(model=ModelConfig(moe=MoEConfig(capacity_factor=1e300))),
     "model.moe.capacity_factor must be in [0, 1e+06], got 1e+300"),
    (RunConfig(data=DataConfig(mix=(MixSource("a", 1e308), MixSource("b", 1e308)))),
     "data.mix weights sum to inf (an overflow): give them on a smaller scale, e.g. as fractions"),
], ids=["timeout", "capacity", "mix"])
def test_ranges_that_overflow_are_refused_by_the_config_check(run, message):
    """timeout 1e300 overflowed Python's timedelta at the process group's start (gloo refuses past
    ~9e9 s); a capacity factor of 1e300 overflowed the row count in the first step; mixture
    weights summing to inf made every share 0 and the weighted val_loss 0.0."""
    with pytest.raises(ValueError, match="invalid config") as e:
        validate(run)
    assert message in str(e.value)


def test_the_timeout_flag_out_of_range_is_one_line(capsys, tmp_path):
    assert main(["train", "--dist.timeout-s", "1e300", "--train.run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip() == (
        "fnmoe train: error: invalid config: dist.timeout_s must be in (0, 3.1536e+07], got 1e+300")


# ---------------------------------------------------------------- checkpoint verify

BYTES = ModelConfig(**{**CFG.__dict__, "vocab_size": 264})  # the bundled corpus's byte tokens
RUN = RunConfig(model=BYTES, train=TrainConfig(steps=4, batch_size=2), data=DataConfig(seq_len=12),
                optim=OptimConfig(lr=1e-2, warmup_steps=0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    tx = optim.adamw(1e-2)
    state = init_state(init_params(BYTES), tx)
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    state, _ = make_train_step(RUN, tx, train_runner(RUN))(state, [(tokens[:, :-1], tokens[:, 1:])])
    loader = Loader(load_data(RUN.data, BYTES.vocab_size), 12, 2, 1, 0)
    return checkpoint.Saver(root, RUN.checkpoint).save(state, RUN, loader.position(state.step), blocking=True)


def _edit_index(ckpt: Path, fn) -> None:
    index = json.loads((ckpt / "index.json").read_text())
    fn(index)
    (ckpt / "index.json").write_text(json.dumps(index))


def _drop_shards(index):
    e = index["tensors"]["final_norm.w_D"]
    e["shards"], _ = [], e.pop("file", None)


@pytest.mark.parametrize("edit, problem", [
    (lambda i: i["tensors"].pop("layers.1.moe.w_up_EDF"),
     "its params do not fit the model of its config.toml: layers.1.moe.w_up_EDF: missing (expected [4, 32, 16])"),
    (lambda i: i["tensors"]["final_norm.w_D"].update(shape=[64]),
     "its params do not fit the model of its config.toml: final_norm.w_D: shape [64], expected [32]"),
    (_drop_shards, "the shards of tensors 'final_norm.w_D' hold 0 of its 32 values"),
], ids=["missing", "shape", "shards"])
def test_verify_refuses_what_a_resume_refuses(saved, tmp_path, capsys, edit, problem):
    """Three indexes whose files all check out but which a resume could not read: verify passed them
    (exit 0) and the resume failed; now both say the same."""
    ckpt = tmp_path / "step_1"
    shutil.copytree(saved, ckpt)
    _edit_index(ckpt, edit)
    assert main(["checkpoint", "verify", str(ckpt)]) == 2
    assert capsys.readouterr().err.strip() == f"fnmoe checkpoint: error: {ckpt / 'index.json'}: {problem}"
    with pytest.raises(checkpoint.CheckpointError, match="^" + str(ckpt / "index.json").replace(".", r"\.")):
        checkpoint.resume_point(str(ckpt), tmp_path)


def test_verify_refuses_non_finite_params_as_a_resume_does(saved, tmp_path, capsys):
    """A checkpoint whose params file holds a NaN, its checksum updated (written by another tool):
    every file checks out, but a run refuses to start from it (fnmoe.run.guards)."""
    ckpt = tmp_path / "step_1"
    shutil.copytree(saved, ckpt)
    path = ckpt / "params-rank00000.safetensors"
    tensors = load_file(path)
    tensors["embed.w_VD"][3, 3] = float("nan")
    save_file(tensors, path)
    data = path.read_bytes()
    _edit_index(ckpt, lambda i: i["files"][path.name].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
    checkpoint.verify(ckpt)  # the files are whole
    assert main(["checkpoint", "verify", str(ckpt)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"fnmoe checkpoint: error: {ckpt}: its params hold non-finite values (NaN or inf) in 1 leaves, e.g. "
        "['embed.w_VD']: a run cannot resume from it")
    assert main(["checkpoint", "verify", str(saved)]) == 0
    assert "their model and finite params" in capsys.readouterr().out
