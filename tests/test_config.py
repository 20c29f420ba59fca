"""Configs: presets, the built-in default, TOML round trip, validation errors naming fields."""
import dataclasses
from pathlib import Path

import pytest

from fnmoe.config import ModelConfig, MoEConfig, RunConfig, TrainConfig, load_config, to_toml, validate

ROOT = Path(__file__).resolve().parent.parent


def test_tiny_preset_is_the_builtin_default():
    assert load_config(ROOT / "configs" / "tiny.toml") == RunConfig(name="tiny")


def test_tiny_preset_states_dtype_and_compile():
    text = (ROOT / "configs" / "tiny.toml").read_text()
    assert 'compute_dtype = "float32"' in text and "compile = false" in text


def test_toml_round_trip(tmp_path):
    run = dataclasses.replace(RunConfig(name="x"), model=dataclasses.replace(
        ModelConfig(), qk_norm=True, moe=dataclasses.replace(MoEConfig(), dense_layers=(0, 2))))
    path = tmp_path / "x.toml"
    path.write_text(to_toml(run))
    assert load_config(path) == run


@pytest.mark.parametrize("change,message", [
    (dict(model=ModelConfig(moe=MoEConfig(n_experts=4, top_k=5))),
     r"model.moe.top_k=5 must be in 1..model.moe.n_experts=4"),
    (dict(model=ModelConfig(n_heads=4, n_kv_heads=3)), r"model.n_heads=4 must be divisible by model.n_kv_heads=3"),
    (dict(train=TrainConfig(batch_size=10, grad_accum=4)),
     r"train.batch_size=10 must be divisible .* train.grad_accum=4"),
    (dict(model=ModelConfig(vocab_size=100)), r"model.vocab_size=100 is too small for the byte tokenizer"),
    (dict(model=ModelConfig(compute_dtype="float16")), r"model.compute_dtype must be one of"),
    (dict(train=TrainConfig(steps=0)), r"train.steps must be > 0, got 0"),
])
def test_validation_names_fields_and_values(change, message):
    with pytest.raises(ValueError, match=message):
        validate(dataclasses.replace(RunConfig(), **change))


def test_validation_lists_every_problem():
    bad = dataclasses.replace(RunConfig(), train=TrainConfig(steps=0, ce_chunks=0))
    with pytest.raises(ValueError) as e:
        validate(bad)
    assert "train.steps" in str(e.value) and "train.ce_chunks" in str(e.value)


def test_unknown_key_and_bad_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[model]\ndimm = 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'model.dimm'"):
        load_config(p)
    p.write_text("[model\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(p)
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_config(tmp_path / "nope.toml")
