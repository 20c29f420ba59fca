"""The public entry points check their inputs: init_params validates its config as the CLI does;
forward and loss_fn check the config, that params have exactly the config's leaves and shapes,
and the tokens and labels they are given. Legend: B batch, L sequence."""
import dataclasses

import numpy as np
import pytest
import torch

import fnmoe
from fnmoe.config import ModelConfig, MoEConfig
from fnmoe.models.params import check_params, init_params

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1))
TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("change, field", [
    ({"dim": 0}, "model.dim must be > 0"),
    ({"n_heads": 3}, "model.n_heads=3 must be divisible by model.n_kv_heads=2"),
    ({"moe": dataclasses.replace(CFG.moe, top_k=5)}, "model.moe.top_k=5 must be in 1..model.moe.n_experts=4"),
    ({"attention": "nope"}, "model.attention must be one of"),
])
def test_init_params_and_forward_refuse_a_config_the_cli_refuses(change, field):
    bad = dataclasses.replace(CFG, **change)
    with pytest.raises(ValueError, match=field):
        init_params(bad)
    with pytest.raises(ValueError, match=field):
        fnmoe.forward(init_params(CFG), TOKENS, bad)
    with pytest.raises(TypeError, match="must be a fnmoe.ModelConfig, got dict"):
        init_params({"dim": 32})


def test_params_of_another_shape_are_named_leaf_by_leaf():
    params = init_params(CFG)
    fewer = dict(params, layers={"0": params["layers"]["0"]})  # a subset of the layers once ran silently
    with pytest.raises(ValueError, match=r"layers\.1\.attn_norm\.w_D: missing \(expected \[32\]\)"):
        fnmoe.forward(fewer, TOKENS, CFG)
    more = dict(params, layers=dict(params["layers"], **{"2": params["layers"]["1"]}))
    with pytest.raises(ValueError, match=r"layers\.2\.\S+: not a leaf of this model"):
        fnmoe.loss_fn(more, TOKENS, TOKENS, CFG, 16)
    wide = init_params(dataclasses.replace(CFG, ffn_hidden=64))
    with pytest.raises(ValueError, match=r"\(3 leaves differ\): layers\.0\.mlp\.w_gate_DF: shape \[32, 64\], "
                                         r"expected \[32, 48\]"):
        fnmoe.forward(wide, TOKENS, CFG)
    with pytest.raises(TypeError, match="params must be a dict tree"):
        fnmoe.forward([params], TOKENS, CFG)
    check_params(params, CFG)  # the tree init_params gives passes


@pytest.mark.parametrize("tokens, error, message", [
    (torch.arange(8), ValueError, r"tokens must be a non-empty 2-D tensor \[batch, seq\], got shape \(8,\)"),
    (torch.zeros(2, 2, 4, dtype=torch.long), ValueError, r"got shape \(2, 2, 4\)"),
    (torch.zeros(2, 0, dtype=torch.long), ValueError, r"got shape \(2, 0\)"),
    (torch.zeros(2, 8), TypeError, "tokens must be an integer tensor of token ids, got torch.float32"),
    ([[1, 2, 3]], TypeError, "tokens must be a torch.Tensor of token ids .batch, seq., got list"),
    (np.zeros((2, 8), dtype=np.int64), TypeError, "got ndarray"),
    (torch.full((2, 8), 64), ValueError, "token id 64 at position .0, 0. is outside 0..model.vocab_size-1=63"),
])
def test_tokens_are_checked_at_forward_and_loss_fn(tokens, error, message):
    params = init_params(CFG)
    with pytest.raises(error, match=message):
        fnmoe.forward(params, tokens, CFG)
    with pytest.raises(error, match=message):
        fnmoe.loss_fn(params, tokens, tokens, CFG, 16)


def test_labels_are_checked_at_loss_fn():
    params = init_params(CFG)
    with pytest.raises(ValueError, match=r"labels must be a tensor of the inputs' shape \(2, 8\), got \(2, 7\)"):
        fnmoe.loss_fn(params, TOKENS, TOKENS[:, 1:], CFG, 14)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        fnmoe.loss_fn(params, TOKENS, TOKENS.float(), CFG, 16)
