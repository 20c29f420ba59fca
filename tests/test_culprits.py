"""Errors that name the culprit (issue 56, item 5): optimizer updates with a gradient tree that does
not pair with the params name the paths (not a "labels/mask tree"), and a wrong-shape gradient its
path and both shapes (not a raw broadcast error); `--config NAME` with both a preset NAME and a file
./NAME says which it took; `eval` with a broken tokenizer.json says why bits/byte is n/a; a native
tree's dtype field is checked. (A resume with another --data.seq-len: tests/test_resume_safety.py.)"""
import pytest
import torch

from fnmoe import optim
from fnmoe.config import ModelConfig, MoEConfig
from fnmoe.optim.base import global_norm
from fnmoe.optim.in_place import update_in_place
from fnmoe.models.params import init_params
from fnmoe.tree import tree_map

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=16,
                  moe=MoEConfig(n_experts=2, top_k=1, expert_hidden=8, first_k_dense=1))


# ---------------------------------------------------------------- the optimizer's gradient tree

def _grads():
    params = init_params(CFG, seed=0)
    return params, tree_map(torch.ones_like, params)


def _without_embed(g):
    return {k: v for k, v in g.items() if k != "embed"}


def _with_extra(g):
    return {**g, "extra": {"w_D": torch.zeros(3)}}


def _wrong_shape(g):
    g = tree_map(lambda t: t, g)
    g["layers"]["1"]["attn"]["w_q_DN"] = torch.zeros(5, 5)
    return g


CASES = [(_without_embed, "the gradient tree does not match the params: no gradient for embed.w_VD"),
         (_with_extra, "the gradient tree does not match the params: a gradient for extra.w_D, which is not a param"),
         (_wrong_shape, "the gradient of layers.1.attn.w_q_DN has shape [5, 5], its param [16, 16]")]


@pytest.mark.parametrize("name", ["muon", "adamw"])
@pytest.mark.parametrize("bad,said", CASES, ids=["missing", "extra", "shape"])
def test_an_update_with_a_gradient_tree_unlike_the_params_names_the_paths(name, bad, said):
    params, grads = _grads()
    tx = getattr(optim, name)(lr=1e-3)
    state = tx.init(params)
    with torch.no_grad(), pytest.raises(ValueError) as e:
        tx.update(bad(grads), state, params)
    assert str(e.value) == f"{name} update: {said}"
    with torch.no_grad():
        tx.update(grads, state, params)  # the tree that pairs: no error


@pytest.mark.parametrize("bad,said", CASES, ids=["missing", "extra", "shape"])
def test_update_in_place_names_the_paths_too(bad, said):
    params, grads = _grads()
    tx = optim.muon(lr=1e-3)
    state = tx.init(params)
    g = bad(grads)
    with torch.no_grad(), pytest.raises(ValueError) as e:
        update_in_place(tx, g, state, params, torch.tensor(True), global_norm(g))
    assert str(e.value) == f"update_in_place: {said}"


# ---------------------------------------------------------------- --config NAME: a preset or a file

def test_config_name_beside_a_file_of_that_name_says_which_it_took(tmp_path, monkeypatch, caplog):
    from fnmoe.config import RunConfig, load_config, to_toml
    from fnmoe.config.toml import preset_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text(to_toml(RunConfig(name="mine")))
    with caplog.at_level("WARNING", logger="fnmoe"):
        assert load_config("tiny") == RunConfig(name="tiny")
    assert caplog.messages == [f"config 'tiny': took the preset {preset_path('tiny')}, not the file ./tiny here "
                               "(--config ./tiny reads the file)"]
    assert load_config("./tiny").model == RunConfig().model  # the file, by its path
    (tmp_path / "mine").write_text(to_toml(RunConfig(name="mine")))
    assert load_config("mine") == RunConfig(name="mine")  # no preset of that name: the file here
    with pytest.raises(FileNotFoundError) as e:
        load_config("nothing")
    assert str(e.value).endswith(") and no file nothing here; a config file elsewhere is named by its path "
                                 "(dir/nothing.toml)")
    assert "./nothing" not in str(e.value)  # the hint no longer reads as if the file were there


# ---------------------------------------------------------------- eval with a broken tokenizer.json

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared corpus whose index names a tokenizer.json (the byte tokenizer's ids underneath)."""
    import json

    from fnmoe.data.prepare import prepare

    d = tmp_path_factory.mktemp("corpus")
    (d / "in.jsonl").write_text("".join(json.dumps({"text": f"document {i}: " + "words " * 20}) + "\n"
                                        for i in range(200)))
    prepare([str(d / "in.jsonl")], "byte", d / "out", workers=1)
    index = json.loads((d / "out" / "index.json").read_text())
    (d / "out" / "index.json").write_text(json.dumps(index | {"tokenizer": "mine", "tokenizer_file": "tokenizer.json"}))
    return d / "out"


@pytest.mark.parametrize("content,said", [
    (b"{not json", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (b'{"model": {"type": "BPE", "vocab": {}}}', "no model.vocab (a tokenizers tokenizer.json lists its pieces there)"),
    (b"[1, 2]", "no model.vocab"),
], ids=["not-json", "empty-vocab", "a-list"])
def test_eval_with_a_broken_tokenizer_json_says_why_bits_per_byte_is_na(corpus, content, said):
    import dataclasses

    from fnmoe.config import DataConfig, RunConfig, TrainConfig
    from fnmoe.training.evaluate import evaluate, format_eval

    (corpus / "tokenizer.json").write_bytes(content)
    run = RunConfig(model=dataclasses.replace(CFG, vocab_size=264), data=DataConfig(corpus=str(corpus), seq_len=16),
                    train=TrainConfig(batch_size=2, eval_batches=1))
    result = evaluate(init_params(run.model, seed=0), run)
    assert result["bits_per_byte"] is None and result["val_loss"] > 0
    why = f"the tokenizer's bytes per token are unknown: {corpus / 'tokenizer.json'}: {said}"
    assert result["bits_per_byte_why"].startswith(why), result["bits_per_byte_why"]
    assert format_eval(result, "x", run).splitlines()[-1].startswith(f"  bits/byte n/a: {why}")


# ---------------------------------------------------------------- a native tree's dtype field

@pytest.mark.parametrize("field,value,said", [
    ("dtype", "float16", "dtype = \"float16\" differs from the float32 that params.safetensors holds"),
    ("dtype", "floatX", "dtype = \"floatX\" names no torch dtype (params.safetensors holds it as float32)"),
    ("shape", [64, 17], "shape = [64, 17] differs from the [64, 16] that params.safetensors holds"),
])
def test_a_native_trees_dtype_and_shape_fields_are_checked_on_load(tmp_path, capsys, field, value, said):
    import json

    from fnmoe.cli import main
    from fnmoe.tree_io import INDEX, load_tree, save_tree

    tree = save_tree(tmp_path / "tree", init_params(CFG, 0), CFG)
    index = json.loads((tree / INDEX).read_text())
    index["tensors"]["embed.w_VD"][field] = value
    (tree / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError) as e:
        load_tree(tree)
    assert str(e.value) == f"{tree / INDEX}: tensors['embed.w_VD'] {said}"
    assert main(["generate", "--from", str(tree), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"fnmoe generate: error: {tree / INDEX}: "
                                                                f"tensors['embed.w_VD'] {said}")
