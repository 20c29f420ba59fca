"""Data mixtures (data.mix): exact proportions, rows as a pure function of (step, rank), wrap-around
with a warning, one tokenizer, the flag and TOML forms, per-source evaluation and plots."""
import dataclasses
import json
import logging

import pytest
import torch

from fnmoe.cli import main, parse_run
from fnmoe.config import DataConfig, MixSource, load_config
from fnmoe.data.loader import read_documents
from fnmoe.data.mixture import MixtureLoader, assign_rows, load_mixture, source_counts
from conftest import tiny_flags

NAMES = ("web", "code", "math")
SMALL = tiny_flags(2)


def prepared_sources(root, names=NAMES):
    """The bundled corpus split in len(names) parts, each prepared (`fnmoe prepare`) into root/<name>;
    the --data.mix arguments NAME=DIR:WEIGHT with weights 0.7, 0.2, 0.1."""
    docs = read_documents("bundled")
    n = len(docs) // len(names)
    for i, name in enumerate(names):
        part = docs[i * n:(i + 1) * n] if i < len(names) - 1 else docs[i * n:]
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        if not (root / name / "index.json").is_file():
            assert main(["prepare", "--input", str(src), "--out", str(root / name), "--workers", "1"]) == 0
    return [f"{name}={root / name}:{w}" for name, w in zip(names, (0.7, 0.2, 0.1))]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return prepared_sources(tmp_path_factory.mktemp("mix"))


def mixture(flags, **data):
    return load_mixture(DataConfig(mix=tuple(map(MixSource.parse, flags)), **data), 257)


@pytest.mark.parametrize("weights", [(0.7, 0.2, 0.1), (0.5, 0.3, 0.2), (1 / 3, 1 / 3, 1 / 3), (0.05, 0.9, 0.05)])
def test_proportions_over_1000_steps_are_the_weights_and_each_source_is_read_in_order(weights):
    B, steps = 16, 1000
    source_G, k_G = assign_rows(torch.arange(B * steps), weights)
    counts = torch.bincount(source_G, minlength=3)
    assert counts.tolist() == source_counts(B * steps, weights)
    for i, w in enumerate(weights):
        assert abs(counts[i] / (B * steps) - w) < 0.01 * w  # within 1% of the weight (here exact to a row)
        assert abs(counts[i] - B * steps * w) <= 1.5
        # the k-th row a source takes is its sample k: none skipped, none twice
        assert torch.equal(k_G[source_G == i], torch.arange(int(counts[i])))
    per_step = torch.stack([torch.bincount(s, minlength=3) for s in source_G.view(steps, B)])
    assert ((per_step - B * torch.tensor(weights)).abs() <= 2).all()  # every batch holds the proportions too


def test_any_rank_computes_its_rows_of_any_step(sources):
    mix = mixture(sources)
    whole = MixtureLoader(mix, 32, 8, 1, 0)
    split = MixtureLoader(mix, 32, 8, 2, 0)
    for step in (0, 7, 123):
        x, y = whole.batch_at(step, 0, 1, 0)
        parts = [split.batch_at(step, r, 2, m) for m in range(2) for r in range(2)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])
    again = MixtureLoader(mixture(sources), 32, 8, 1, 0)
    assert all(torch.equal(a, b) for a, b in zip(again.batch_at(5, 0, 1, 0), whole.batch_at(5, 0, 1, 0)))
    other = MixtureLoader(mix, 32, 8, 1, 1)
    assert not torch.equal(other.batch_at(5, 0, 1, 0)[0], whole.batch_at(5, 0, 1, 0)[0])
    # each row is a window of the source the assignment names
    source_B, window_B = whole.rows(3, 0, 1, 0)
    x, _ = whole.batch_at(3, 0, 1, 0)
    for b in range(8):
        stream_T = mix.sources[int(source_B[b])].train_T
        assert torch.equal(x[b], stream_T[int(window_B[b]) * 32:][:32].long())


def test_a_source_that_runs_out_repeats_with_a_warning_naming_it(sources, caplog):
    mix = mixture(sources)
    loader = MixtureLoader(mix, 2048, 64, 1, 0)  # long windows: few of them, so an epoch is a few dozen steps
    n_math = loader.sizes[2]
    steps = -(-n_math * 10 // 64) + 2  # math has 10% of the rows: just past its first epoch
    with caplog.at_level(logging.WARNING, logger="fnmoe"):
        seen = [loader.rows(s, 0, 1, 0) for s in range(steps)]
    said = [r.getMessage() for r in caplog.records if "math" in r.getMessage()]
    assert len(said) == 1 and "data.mix source 'math' ran out of data after" in said[0] and "epoch 2" in said[0]
    math_windows = torch.cat([w[s == 2] for s, w in seen])
    assert sorted(math_windows[:n_math].tolist()) == list(range(n_math))  # epoch 1: each window once
    said_web = [r.getMessage() for r in caplog.records if "'web'" in r.getMessage()]
    assert len(said_web) == steps * 64 * 7 // 10 // loader.sizes[0]  # web: one warning per epoch it began


def test_sources_must_share_a_tokenizer(sources, tmp_path):
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(sources[1].split("=", 1)[1].rsplit(":", 1)[0], odd)
    index = json.loads((odd / "index.json").read_text())
    (odd / "index.json").write_text(json.dumps({**index, "tokenizer": "tokenizers:0123456789abcdef"}))
    with pytest.raises(ValueError, match=r"sources 'web' \(.*tokenizer byte.*\) and 'odd' \(.*tokenizer "
                                         r"tokenizers:0123456789abcdef.*different tokenizers"):
        mixture([sources[0], f"{odd}:0.3"])
    with pytest.raises(FileNotFoundError, match=r"data.mix source 'nope': corpus directory not found"):
        mixture([sources[0], f"nope={tmp_path / 'nope'}:0.3"])


def test_flag_and_toml_forms(tmp_path, sources, capsys):
    run = parse_run(["--data.mix", *sources[:2], f"{tmp_path / 'x'}:2"], "fnmoe train")
    assert [(s.label, s.weight) for s in run.data.mix] == [("web", 0.7), ("code", 0.2), ("x", 2.0)]
    toml = tmp_path / "mix.toml"
    toml.write_text('[data]\nmix = [{corpus = "d/web", weight = 3}, {name = "c", corpus = "d/code", weight = 1}]\n')
    assert load_config(toml).data.mix == (MixSource("d/web", 3.0), MixSource("d/code", 1.0, "c"))
    again = tmp_path / "again.toml"  # the resolved config (run-dir/config.toml) reads back the same
    from fnmoe.config import to_toml
    again.write_text(to_toml(load_config(toml)))
    assert load_config(again).data.mix == load_config(toml).data.mix
    for argv, message in [
        (["--data.mix", "a=d/a:1", "a=d/b:1"], "data.mix names must differ; a appear"),
        (["--data.mix", "d/a:1", "--data.corpus", "x.jsonl"], "data.corpus='x.jsonl' and data.mix both name"),
        (["--data.mix", "d/a:0"], "data.mix[0].weight must be > 0, got 0.0"),
    ]:
        assert main(["train", "--train.run-dir", str(tmp_path / "r"), *argv]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_run(["--data.mix", "web=d/web"], "fnmoe train")
    assert "expected NAME=DIR:WEIGHT" in capsys.readouterr().err


def test_training_on_a_mixture_logs_each_source_and_plots_it(tmp_path, sources, capsys):
    pytest.importorskip("matplotlib")
    from fnmoe.run.plot import plot_run

    run_dir = tmp_path / "run"
    assert main(["train", "--data.mix", *sources, "--train.steps", "4", "--train.eval-every", "2",
                 "--train.log-every", "2", "--train.run-dir", str(run_dir), *SMALL]) == 0
    out = capsys.readouterr().out
    vals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [v["step"] for v in vals] == [2, 4]
    for v in vals:
        assert v.keys() == {"step", "val_loss", "val_ppl", *(f"val_loss/{n}" for n in NAMES)}
        weighted = 0.7 * v["val_loss/web"] + 0.2 * v["val_loss/code"] + 0.1 * v["val_loss/math"]
        assert abs(v["val_loss"] - weighted) < 1e-9
        assert f"eval step {v['step']}: val_loss {v['val_loss']:.4f} (weighted) | web {v['val_loss/web']:.4f}" in out
    drawn = plot_run(run_dir)
    for n in NAMES:
        assert drawn["loss.png"][f"held-out {n}"] == ([2, 4], [v[f"val_loss/{n}"] for v in vals])
    assert drawn["loss.png"]["held-out"] == ([2, 4], [v["val_loss"] for v in vals])
    run = load_config(run_dir / "config.toml")
    assert [s.label for s in run.data.mix] == list(NAMES)


def test_the_default_run_is_unchanged_by_mixtures():
    run = parse_run([], "fnmoe train")
    assert run.data.mix == () and run == dataclasses.replace(run, data=DataConfig())
