"""`fnmoe eval`: held-out loss and bits per byte of a checkpoint, per source, against cross-entropy
computed here from fnmoe.forward's logits on the same held-out windows; `--train.sample-every`
against fnmoe.sampling.generate."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from fnmoe.checkpoint import load_params
from fnmoe.cli import main
from fnmoe.config import DataConfig
from fnmoe.data.loader import IGNORE, load_data, read_documents, val_batches
from fnmoe.data.prepare import prepare
from fnmoe.models.transformer import forward
from conftest import tiny_flags


def manual(params, cfg, batches) -> tuple[float, int, torch.Tensor]:
    """(mean cross-entropy, labelled tokens, the labels) over batches: logits from forward, F.cross_entropy."""
    total, labels = 0.0, []
    with torch.no_grad():
        for inputs_BL, labels_BL in batches:
            logits_BLV, _ = forward(params, inputs_BL, cfg)
            total += F.cross_entropy(logits_BLV.flatten(0, 1).double(), labels_BL.flatten(), ignore_index=IGNORE,
                                     reduction="sum").item()
            labels.append(labels_BL[labels_BL != IGNORE])
    labels = torch.cat(labels)
    return total / labels.numel(), labels.numel(), labels


def eval_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run of the default preset, small, on the bundled corpus."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", "--train.steps", "3", *tiny_flags(3), "--train.run-dir", str(run_dir)]) == 0
    return run_dir


def test_eval_of_a_run_is_the_cross_entropy_of_its_held_out_windows(trained, capsys):
    """The loss `fnmoe eval --from RUN` prints is the final val_loss of the run's metrics.jsonl and
    the mean cross-entropy of forward's logits over the same windows (the first 3 batches of 4 of
    the held-out stream); bits per byte are that loss's nats over ln 2 over the labelled tokens that
    are bytes (the byte tokenizer's end-of-text stands for none)."""
    got = eval_json(capsys, "--from", str(trained))
    run, params = load_params(trained / "checkpoints" / "step_3")
    batches = val_batches(load_data(run.data, run.model.vocab_size), run.data.seq_len, 4, 3)
    loss, tokens, labels = manual(params, run.model, batches)
    src = got["sources"][""]
    assert got["step"] == 3 and src["batches"] == 3 and src["tokens"] == tokens == 3 * 4 * 32
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)
    last = json.loads((trained / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and got["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    n_bytes = int((labels < 256).sum())
    assert src["bytes"] == n_bytes and got["bits_per_byte"] == pytest.approx(loss * tokens / math.log(2) / n_bytes,
                                                                             rel=1e-5)
    assert main(["eval", "--from", str(trained)]) == 0  # the table
    table = capsys.readouterr().out
    assert "bundled corpus" in table and f"{loss:.4f}" in table


def test_eval_per_source_of_a_mixture_and_of_an_exported_model(trained, tmp_path, capsys):
    """--data.mix: each source's loss is the cross-entropy of its own held-out windows, the whole
    their mean weighted 0.7 / 0.3; the model exported to Hugging Face evaluates as its checkpoint."""
    docs = read_documents("bundled")
    for name, part in (("prose", docs[:40]), ("rest", docs[40:80])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        prepare([str(tmp_path / f"{name}.jsonl")], "byte", tmp_path / name, workers=1)
    mix = ["--data.mix", f"a={tmp_path / 'prose'}:0.7", f"b={tmp_path / 'rest'}:0.3", "--train.eval-batches", "2"]
    got = eval_json(capsys, "--from", str(trained), *mix)
    run, params = load_params(trained / "checkpoints" / "step_3")
    want = {}
    for name, corpus in (("a", "prose"), ("b", "rest")):
        data = load_data(DataConfig(corpus=str(tmp_path / corpus)), run.model.vocab_size)
        want[name] = manual(params, run.model, val_batches(data, run.data.seq_len, 4, 2))[0]
        assert got["sources"][name]["loss"] == pytest.approx(want[name], rel=1e-5)
    assert got["val_loss"] == pytest.approx(0.7 * want["a"] + 0.3 * want["b"], rel=1e-5)
    assert main(["convert", "--to-hf", str(trained), "--out", str(tmp_path / "hf")]) == 0
    flags = ["--train.eval-batches", "3", "--train.batch-size", "4", "--data.seq-len", "32"]
    assert eval_json(capsys, "--from", str(tmp_path / "hf"), *flags)["val_loss"] == pytest.approx(
        eval_json(capsys, "--from", str(trained))["val_loss"], rel=1e-5)


def test_eval_refuses_a_changed_model_and_a_missing_source(trained, tmp_path, capsys):
    assert main(["eval", "--from", str(trained), "--model.dim", "64"]) == 2
    assert "change the shape" in capsys.readouterr().err
    assert main(["eval", "--from", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sample_every_logs_the_greedy_continuation(tmp_path, capsys):
    """--train.sample-every 2 on a 4-step run: samples after steps 2 and 4, the last one what
    fnmoe.sampling.generate continues the prompt with from the final checkpoint (greedy, byte tokens)."""
    from fnmoe.data.loader import EOS_ID, ByteTokenizer
    from fnmoe.sampling.generate import generate

    assert main(["train", "--train.steps", "4", *tiny_flags(1), "--train.sample-every", "2",
                 "--train.sample-prompt", "The ", "--train.sample-tokens", "12",
                 "--train.run-dir", str(tmp_path / "run")]) == 0
    samples = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sample at step")]
    assert [s.split(":")[0] for s in samples] == ["sample at step 2", "sample at step 4"]
    run, params = load_params(tmp_path / "run" / "checkpoints" / "step_4")
    tok = ByteTokenizer()
    prompt = tok.encode("The ")
    out = generate(params, torch.tensor([prompt]), run.model, 12, stop_id=EOS_ID)
    assert samples[-1] == f"sample at step 4: {'The ' + tok.decode(out[0, len(prompt):].tolist())!r}"


def test_a_sample_on_a_mesh_is_one_process_sample(caplog):
    """--train.sample-every on a sharded run (a simulated 2x2 mesh, experts over ep): every rank
    takes part in gathering the params, rank 0 logs what one process's greedy sample of the same
    weights is (sharded init draws each rank's slice of the one-process tensors)."""
    from fnmoe.config import MeshConfig, RunConfig, TrainConfig
    from fnmoe.parallel.sharding import init_params
    from fnmoe.parallel import dist as fdist
    from fnmoe.parallel import sharding
    from fnmoe.sampling.text import log_sample, run_codec, sample_text

    run = RunConfig(train=TrainConfig(sample_prompt="The ", sample_tokens=12))
    want = sample_text(init_params(run.model, 0), run, run_codec(run.data))
    with fdist.simulate(4), caplog.at_level("INFO", logger="fnmoe"):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        log_sample(3, init_params(run.model, 0, mesh=mesh), run, rank=0)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("sample")] == [
        f"sample at step 3: {want!r}"]
