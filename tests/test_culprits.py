"""Errors that name the culprit (issue 56, item 5): optimizer updates with a gradient tree that does
not pair with the params name the paths (not a "labels/mask tree"), and a wrong-shape gradient its
path and both shapes (not a raw broadcast error); `--config NAME` with both a preset NAME and a file
./NAME says which it took; `eval` with a broken tokenizer.json says why bits/byte is n/a; a native
tree's dtype field is checked; a resume with another --data.seq-len is refused, saying why."""
import pytest
import torch

from fnmoe import optim
from fnmoe.config import ModelConfig, MoEConfig
from fnmoe.optim.base import global_norm
from fnmoe.optim.in_place import update_in_place
from fnmoe.params import init_params
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
