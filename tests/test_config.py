"""Configs: presets, the built-in default, TOML round trip, validation errors naming fields."""
import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Literal

import pytest

from fnmoe.config import MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig, load_config, to_toml, validate
from fnmoe.config.schema import Range

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


def test_an_unknown_reduce_dtype_is_refused_naming_the_field(tmp_path, capsys):
    """mesh.reduce_dtype (the gradients' reduce-scatter) is float32 or bfloat16: any other is refused
    before anything is created, as a flag, in a preset or in the dataclass, naming the field."""
    from fnmoe.cli import main

    with pytest.raises(ValueError, match=r"mesh.reduce_dtype must be one of \('float32', 'bfloat16'\), got 'float16'"):
        validate(RunConfig(mesh=MeshConfig(reduce_dtype="float16")))
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "--train.run-dir", str(run_dir), "--mesh.reduce-dtype", "float16"])
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().err).split())  # tyro's box, unwrapped
    assert e.value.code == 2 and "invalid choice 'float16' for argument '--mesh.reduce-dtype'" in flat, flat
    (tmp_path / "x.toml").write_text('[mesh]\nreduce_dtype = "fp8"\n')
    assert main(["train", "--config", str(tmp_path / "x.toml"), "--train.run-dir", str(run_dir)]) == 2
    assert "mesh.reduce_dtype must be one of ('float32', 'bfloat16'), got 'fp8'" in capsys.readouterr().err
    assert not run_dir.exists()


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


# ---------------------------------------------------------------- every field typed, ranged and finite

def leaf_fields(cls, where=""):
    """(dotted name, annotation) of every leaf field of a config dataclass and those nested in it:
    a field added to the schema is covered here without a word in this file."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaf_fields(hints[f.name], f"{where}{f.name}.")
        else:
            yield f"{where}{f.name}", hints[f.name]


def _base(hint):
    """(type without Annotated, its Range or None, the type's name as errors say it)."""
    base, rng = hint, None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # a plan figure: X | None (the profile's)
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is Annotated:
        base, *extras = typing.get_args(hint)
        rng = next(x for x in extras if isinstance(x, Range))
    if typing.get_origin(base) is Literal:
        return str, rng, "str"
    return base, rng, getattr(base, "__name__", "")


def wrong_types(name, hint):
    """(TOML value, the one error line's tail) for values not of the field's type."""
    base, _, word = _base(hint)
    if typing.get_origin(base) is tuple and dataclasses.is_dataclass(typing.get_args(base)[0]):  # data.mix
        return [('["a"]', f'{name}[0] = "a" is a str, expected a table'),
                ("3", f"{name} = 3 is an int, expected a list of tables")]
    if typing.get_origin(base) is tuple:
        return [('["a"]', f'{name}[0] = "a" is a str, expected int'),
                ("3", f"{name} = 3 is an int, expected a list of int")]
    cases = {int: ['"1"', "2.5", "true"], float: ['"1.0"', "true"], bool: ['"1"', "0", "1"], str: ["5", "[1]"]}[base]
    kinds = {'"': "a str", "2": "a float", "t": "a bool", "0": "an int", "1": "an int", "5": "an int", "[": "a list"}
    return [(v, f"{name} = {v} is {kinds[v[0]]}, expected {word}") for v in cases]


def out_of_range(name, hint):
    """(TOML value, the error line) for values outside the field's Range, and non-finite floats."""
    base, rng, _ = _base(hint)
    out = [(v, f"{name} must be finite, got {v}") for v in ("nan", "inf")] if base is float else []
    step = 1 if base is int else 0.5
    if rng is not None and math.isfinite(rng.lo):
        out.append(rng.lo if rng.lo_open else rng.lo - step)
    if rng is not None and math.isfinite(rng.hi):
        out.append(rng.hi if rng.hi_open else rng.hi + step)
    return [o if isinstance(o, tuple) else (repr(base(o)), f"{name} must be {rng}, got {base(o)}") for o in out]


def toml_with(name, value):
    table, _, key = name.rpartition(".")
    return f"[{table}]\n{key} = {value}\n" if table else f"{key} = {value}\n"


def test_every_field_refuses_a_wrong_type_or_range_through_the_cli(tmp_path, capsys):
    """Each field of the config tree, set in a TOML preset to a value of another type, out of its
    range or (floats) not finite: exit 2 and one line naming the file, field, value and expected
    type, before anything is created. The cases come from the annotations."""
    from fnmoe.cli import main

    path, run_dir, failures, n = tmp_path / "x.toml", tmp_path / "run", [], 0
    for name, hint in leaf_fields(RunConfig):
        cases = [(v, f"{path}: {line}") for v, line in wrong_types(name, hint)] + out_of_range(name, hint)
        for value, line in cases:
            path.write_text(toml_with(name, value))
            code, err = main(["train", "--config", str(path), "--train.run-dir", str(run_dir)]), capsys.readouterr().err
            n += 1
            if code != 2 or not err.endswith(f"{line}\n") or err.count("\n") != 1 or run_dir.exists():
                failures.append(f"{name} = {value}: exit {code}, {err!r}")
    assert not failures, "\n".join(failures)
    assert n > 300  # the tree has ~110 leaves


@pytest.mark.parametrize("text,line", [
    (b'name = "\xff"\n', "not UTF-8 text (byte 8)"),
])
def test_a_toml_that_is_no_utf8_names_the_file(tmp_path, text, line):
    (tmp_path / "x.toml").write_bytes(text)
    with pytest.raises(ValueError, match=f"config {tmp_path / 'x.toml'}: {re.escape(line)}"):
        load_config(tmp_path / "x.toml")
    with pytest.raises(ValueError, match=f"config {tmp_path} is a directory"):
        load_config(tmp_path)


def test_float_fields_take_ints_as_floats(tmp_path):
    (tmp_path / "x.toml").write_text("[optim]\nlr = 1\n")
    lr = load_config(tmp_path / "x.toml").optim.lr
    assert lr == 1.0 and isinstance(lr, float)


def test_configs_made_in_code_are_checked_by_type():
    with pytest.raises(ValueError, match=r'invalid config: model.dim = "128" is a str, expected int'):
        validate(RunConfig(model=ModelConfig(dim="128")))
    with pytest.raises(ValueError, match=r"model.moe.dense_layers\[1\] = 2.5 is a float, expected int"):
        validate(RunConfig(model=ModelConfig(moe=MoEConfig(dense_layers=(0, 2.5)))))


def test_a_bare_name_loads_the_shipped_preset_and_configs_links_to_them():
    assert load_config("tiny") == load_config(ROOT / "configs" / "tiny.toml") == RunConfig(name="tiny")
    # one copy of the presets: the package's, which a checkout's configs/ points at
    assert (ROOT / "configs").resolve() == (ROOT / "fnmoe" / "presets").resolve()
    with pytest.raises(FileNotFoundError, match=r"no preset named 'tinyy' \(presets: .*kimi_k2_1t.*tiny.*\) and no "
                                                r"file tinyy here"):
        load_config("tinyy")


@pytest.mark.launch
@pytest.mark.slow
def test_presets_load_from_a_wheel_installed_outside_the_checkout(tmp_path):
    """A wheel built from the sources, installed into a directory of its own (torch and the rest from
    this environment) and imported from elsewhere, reads every preset by name (~19 s: pip twice)."""
    import os
    import shutil
    import subprocess
    import sys
    src = tmp_path / "src"  # a copy: the build writes build/ and egg-info beside the sources
    shutil.copytree(ROOT / "fnmoe", src / "fnmoe", ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel")],
                   check=True, cwd=tmp_path)
    wheel = next((tmp_path / "wheel").glob("fnmoe-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], check=True)
    names = sorted(p.stem for p in (ROOT / "fnmoe" / "presets").glob("*.toml"))
    code = ("import sys, fnmoe; print(fnmoe.__file__); "
            "print(*[fnmoe.load_config(n).name for n in sys.argv[1:]])")
    out = subprocess.run([sys.executable, "-c", code, *names], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, check=True).stdout
    where, loaded = out.splitlines()
    assert Path(where).is_relative_to(tmp_path / "site") and loaded.split() == names
