"""Hugging Face interop: tiny random transformers models loaded by fnmoe.hf give the same fp32 logits
(<= 1e-4 of the logits' scale); fnmoe.hf.save is loaded by transformers with the same logits and
expert ids; load after save is the identity; errors name the key; `fnmoe convert`."""
import dataclasses
import importlib.util
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fnmoe import hf
from fnmoe.config import ModelConfig, MoEConfig, load_config
from fnmoe.models.transformer import forward
from fnmoe.models.params import init_params
from fnmoe.tree import flatten_dict, map_with_path

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM,
    Qwen3MoeConfig, Qwen3MoeForCausalLM)

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def randomize(model, seed):
    """Weights ~ N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2), routers decisive (logits ~ N(0, 4))
    and score-correction biases ~ N(0, 0.1^2): every part matters, routing has no near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(noise * (2.0 if name.endswith("gate.weight") else 1.0) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


def tokens(vocab, L=13, seed=0):
    return torch.randint(0, vocab, (2, L), generator=torch.Generator().manual_seed(seed))


def logits_rel_diff(model, cfg, params, L=13):
    x = tokens(cfg.vocab_size, L)
    with torch.no_grad():
        ref = model(x).logits
    got, _ = forward(params, x, cfg)
    return ((got - ref).abs().max() / ref.abs().max()).item()


def roundtrip(model, path, **save_kw):
    model.save_pretrained(path, **save_kw)
    return hf.load(path)


def qwen3(seed=0, **kw):
    base = dict(vocab_size=70, hidden_size=36, intermediate_size=44, moe_intermediate_size=12, num_hidden_layers=3,
                num_attention_heads=3, num_key_value_heads=1, head_dim=10, num_experts=5, num_experts_per_tok=3,
                max_position_embeddings=64)
    torch.manual_seed(seed)
    return randomize(Qwen3MoeForCausalLM(Qwen3MoeConfig(**(base | kw), attn_implementation="eager")), seed)


def deepseek(seed=0, **kw):
    base = dict(vocab_size=70, hidden_size=36, intermediate_size=44, moe_intermediate_size=12, num_hidden_layers=3,
                num_attention_heads=3, num_key_value_heads=3, n_shared_experts=2, n_routed_experts=8, n_group=4,
                topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, q_lora_rank=20, kv_lora_rank=14,
                qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=7, max_position_embeddings=128,
                routed_scaling_factor=2.5, num_nextn_predict_layers=0)
    torch.manual_seed(seed)
    return randomize(DeepseekV3ForCausalLM(DeepseekV3Config(**(base | kw), attn_implementation="eager")), seed)


def mixtral(seed=0, **kw):
    base = dict(vocab_size=70, hidden_size=32, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return randomize(MixtralForCausalLM(MixtralConfig(**(base | kw), attn_implementation="eager")), seed)


# ---------------------------------------------------------------- transformers -> fnmoe

@pytest.mark.parametrize("norm,tied,sparse_step,mlp_only", [(False, True, 1, [1]), (True, False, 2, [])])
def test_qwen3_moe_logits(norm, tied, sparse_step, mlp_only, tmp_path):
    model = qwen3(norm_topk_prob=norm, tie_word_embeddings=tied, decoder_sparse_step=sparse_step,
                  mlp_only_layers=mlp_only)
    cfg, params = roundtrip(model, tmp_path, max_shard_size="20KB")  # sharded, with an index
    assert (tmp_path / hf.INDEX).is_file()
    assert cfg.qk_norm and cfg.moe.norm_topk_prob == norm and cfg.tie_embeddings == tied and ("head" in params) != tied
    assert [cfg.is_moe_layer(i) for i in range(3)] == [model.model.layers[i].mlp.__class__.__name__.endswith("Block")
                                                        for i in range(3)]
    assert logits_rel_diff(model, cfg, params) <= TOL


DEEPSEEK_CASES = {
    "yarn+interleave+q_lora+groups": dict(rope_parameters=dict(YARN), rope_interleave=True),
    "no_q_lora+half_split+norm_off": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, n_group=1,
                                          topk_group=1, n_shared_experts=1, first_k_dense_replace=2),
}


@pytest.mark.parametrize("case", DEEPSEEK_CASES)
def test_deepseek_v3_logits(case, tmp_path):
    model = deepseek(**DEEPSEEK_CASES[case])
    cfg, params = roundtrip(model, tmp_path)
    assert cfg.attention == "mla" and cfg.moe.score_func == "sigmoid" and cfg.moe.router_bias
    bias = params["buffers"]["layers"]["2"]["moe"]["router_bias_E"]
    assert torch.equal(bias, model.model.layers[2].mlp.gate.e_score_correction_bias)
    assert logits_rel_diff(model, cfg, params, L=40) <= TOL  # past YaRN's original 32 positions


def test_mixtral_logits(tmp_path):
    model = mixtral()
    cfg, params = roundtrip(model, tmp_path)
    assert all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) and not cfg.qk_norm
    assert logits_rel_diff(model, cfg, params) <= TOL


def to_legacy(path: Path, **renames):
    """Rewrite config.json in the published hub dialect: top-level rope_theta, rope_scaling with "type"."""
    c = json.loads((path / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    c["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    for old, new in renames.items():
        c[new] = c.pop(old)
    (path / "config.json").write_text(json.dumps(c))


def test_legacy_config_dialect(tmp_path):
    model = deepseek(rope_parameters=dict(YARN))
    cfg_new, _ = roundtrip(model, tmp_path / "ds")
    to_legacy(tmp_path / "ds")
    cfg, params = hf.load(tmp_path / "ds")
    assert cfg == cfg_new and cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim == 0.8
    assert logits_rel_diff(model, cfg, params, L=40) <= TOL
    model = qwen3(seed=1, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg_new, _ = roundtrip(model, tmp_path / "qw")
    to_legacy(tmp_path / "qw", num_local_experts="num_experts")
    cfg, params = hf.load(tmp_path / "qw")
    assert cfg == cfg_new and cfg.rope_theta == 5e5
    assert logits_rel_diff(model, cfg, params) <= TOL


def naive_dequant(w, s, block):
    out = torch.empty(w.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rs, cs = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rs, cs] = w[rs, cs].float() * s[i, j]
    return out


def test_block_fp8_fixture_and_mtp_layers(tmp_path, caplog):
    tool = _tool("make_fp8_fixture")
    src = tool.make_fixture(tmp_path / "fp8")
    stored = load_file(src / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    with caplog.at_level(logging.INFO, logger="fnmoe"):
        cfg, params = hf.load(src)
    assert "multi-token-prediction layers [2]" in caplog.text
    # the reference: the dequantized weights as a plain checkpoint, loaded by transformers
    block = tuple(json.loads((src / "config.json").read_text())["quantization_config"]["weight_block_size"])
    plain = {k: (naive_dequant(t, stored[k + "_scale_inv"], block) if k + "_scale_inv" in stored else t)
             for k, t in stored.items() if not k.endswith("_scale_inv") and not k.startswith("model.layers.2.")}
    ref_dir = tmp_path / "plain"
    tool.tiny_config(num_nextn_predict_layers=0).save_pretrained(ref_dir)
    save_file(plain, ref_dir / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(ref_dir, attn_implementation="eager").eval()
    q_a = plain["model.layers.1.self_attn.q_a_proj.weight"]
    assert torch.equal(params["layers"]["1"]["attn"]["w_q_a_DQ"], q_a.T)
    assert logits_rel_diff(model, cfg, params) <= TOL


# ---------------------------------------------------------------- fnmoe -> transformers

def fn_model(kind: str) -> tuple[ModelConfig, dict]:
    """A small fnmoe model of each exportable kind, its weights at HF-like scales."""
    small = dict(vocab_size=72, dim=40, ffn_hidden=48, max_seq_len=64)
    if kind == "mla":
        cfg = load_config(ROOT / "configs" / "tiny_mla.toml").model
        cfg = dataclasses.replace(cfg, **small, rope_scaling="yarn", yarn_factor=4.0, yarn_original_max_seq_len=16,
                                  yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
                                  moe=dataclasses.replace(cfg.moe, expert_hidden=24, routed_scaling_factor=1.5))
    elif kind == "qwen3":
        cfg = load_config(ROOT / "configs" / "tiny_qwen3.toml").model
        cfg = dataclasses.replace(cfg, **small, moe=dataclasses.replace(cfg.moe, expert_hidden=24, dense_layers=(2,)))
    elif kind == "ernie":  # the tiny preset's kind (GQA, no q/k norm, a dense first layer), with more in it
        cfg = load_config(ROOT / "configs" / "tiny.toml").model
        cfg = dataclasses.replace(cfg, **small, n_layers=5, moe=dataclasses.replace(
            cfg.moe, expert_hidden=24, n_shared_experts=1, moe_every=2, router_bias=True))
    else:
        cfg = ModelConfig(**small, n_layers=2, n_heads=4, n_kv_heads=2,
                          moe=MoEConfig(n_experts=6, top_k=2, expert_hidden=24, first_k_dense=0))
    g = torch.Generator().manual_seed(0)

    def scale(path, t):
        if "norm" in path and t.ndim == 1:
            return 1 + 0.1 * torch.randn(t.shape, generator=g)
        if path.startswith("buffers."):
            return 0.1 * torch.randn(t.shape, generator=g)
        gain = 2.0 if "router" in path else 1.0
        return gain * torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-2])
    return cfg, map_with_path(scale, init_params(cfg, seed=0))


@pytest.mark.parametrize("kind,arch", [("mla", "DeepseekV3ForCausalLM"), ("qwen3", "Qwen3MoeForCausalLM"),
                                       ("mixtral", "MixtralForCausalLM"), ("ernie", "Ernie4_5_MoeForCausalLM")])
def test_export_loads_in_transformers_with_same_logits_and_expert_ids(kind, arch, tmp_path):
    cfg, params = fn_model(kind)
    hf.save(tmp_path, params, cfg)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [arch]
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", output_loading_info=True)
    assert type(model).__name__ == arch
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert logits_rel_diff(model.eval(), cfg, params, L=30) <= TOL
    layer = next(i for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    w_gate = params["layers"][str(layer)]["moe"]["w_gate_EDF"]  # [E, D, F]
    experts = model.model.layers[layer].mlp.experts
    for k in range(cfg.moe.n_experts):  # HF expert k (fused gate_up [E, 2F, D]) is fnmoe expert k
        assert torch.equal(experts.gate_up_proj[k, :cfg.moe.expert_hidden].detach(), w_gate[k].T)
    cfg2, params2 = hf.load(tmp_path)
    a, b = flatten_dict(params), flatten_dict(params2)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    # config.json has no field for these training knobs, nor a dense hidden size in Mixtral
    assert cfg2 == dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, bias_update_coeff=0.0, z_loss_coeff=0.0),
                                       ffn_hidden=cfg.moe.expert_hidden if kind == "mixtral" else cfg.ffn_hidden)


def test_load_after_save_is_the_identity(tmp_path):
    model = deepseek(seed=3)
    cfg, params = roundtrip(model, tmp_path / "a")
    hf.save(tmp_path / "b", params, cfg, max_shard_bytes=30_000)
    cfg2, params2 = hf.load(tmp_path / "b")
    a, b = flatten_dict(params), flatten_dict(params2)
    assert cfg2 == cfg and list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_models_fnmoe_cannot_export_are_named(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.toml").model  # GQA without qk-norm, a dense first layer
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, routed_scaling_factor=2.0, dense_layers=(2,)))
    with pytest.raises(ValueError, match=r"Ernie4_5_MoeForCausalLM \(or MixtralForCausalLM, with every layer MoE\), "
                       r"which needs: model.moe.routed_scaling_factor must be 1; the MoE layers must be every"):
        hf.save(tmp_path / "x", init_params(cfg), cfg)


def ernie(seed=0, **kw):
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    base = dict(vocab_size=70, hidden_size=32, intermediate_size=44, moe_intermediate_size=12, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, moe_num_experts=6, moe_k=2, moe_num_shared_experts=1,
                moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1, max_position_embeddings=64,
                tie_word_embeddings=False)
    torch.manual_seed(seed)
    return randomize(Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(**(base | kw), attn_implementation="eager")), seed)


def test_ernie_logits(tmp_path):
    """transformers' Ernie 4.5 MoE (interleaved RoPE, moe_statics bias, shared expert, a dense layer
    after the MoE ones) read by hf.load: the same logits, its MoE layers, its bias as the router bias."""
    model = ernie()
    cfg, params = roundtrip(model, tmp_path)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    assert cfg.moe.router_bias and cfg.moe.n_shared_experts == 1 and not cfg.rope_interleave and not cfg.qk_norm
    bias = model.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias
    assert torch.equal(params["buffers"]["layers"]["1"]["moe"]["router_bias_E"], bias[0])
    assert logits_rel_diff(model, cfg, params, L=30) <= TOL


def test_the_tiny_preset_exports_with_its_tokenizer_and_generates_alike(tmp_path):
    """Issue 37: the default preset (GQA without q/k norm, a dense first layer) exports as Ernie 4.5
    MoE, whose logits transformers computes within 1e-5 of fnmoe's in fp32; the export carries a
    tokenizer AutoTokenizer loads that encodes text as fnmoe's byte tokenizer does, the end-of-text id
    in config.json and generation_config.json, and transformers' greedy generate continues a prompt
    as fnmoe.sampling.generate does."""
    from transformers import AutoTokenizer

    from fnmoe.data.loader import EOS_ID, ByteTokenizer
    from fnmoe.sampling.generate import generate

    cfg = load_config(ROOT / "configs" / "tiny.toml").model
    g = torch.Generator().manual_seed(1)

    def scale(path, t):  # HF-like scales, routers decisive
        if t.ndim == 1:
            return 1 + 0.1 * torch.randn(t.shape, generator=g)
        return (2.0 if "router" in path else 1.0) * torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-2])
    params = map_with_path(scale, init_params(cfg, seed=0))
    hf.save(tmp_path, params, cfg, tokenizer=hf.byte_level(cfg.max_seq_len))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(model).__name__ == "Ernie4_5_MoeForCausalLM"
    assert logits_rel_diff(model, cfg, params, L=64) <= 1e-5
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo, wörld\n\t<|endoftext|> 😀"
    assert tok.encode(text) == ByteTokenizer().encode(text) and tok.decode(ByteTokenizer().encode(text)) == text
    assert tok.eos_token_id == EOS_ID == model.config.eos_token_id == model.generation_config.eos_token_id
    prompt = torch.tensor([ByteTokenizer().encode("The list")])
    ours = generate(params, prompt, cfg, 12, stop_id=EOS_ID)
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs[:, :ours.shape[1]])


# ---------------------------------------------------------------- errors name the key

@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    qwen3(seed=5, num_hidden_layers=2).save_pretrained(path)
    return path


def edited(src: Path, dst: Path, config=None, tensors=None) -> Path:
    dst.mkdir()
    c = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(c) if config else c))
    t = load_file(src / "model.safetensors")
    save_file(tensors(t) if tensors else t, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("config,tensors,message", [
    (lambda c: c | {"architectures": ["LlamaForCausalLM"]}, None, r"unknown 'architectures'=\['LlamaForCausalLM'\]"),
    (None, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"},
     r"missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"),
    (None, lambda t: t | {"model.layers.0.self_attn.extra.weight": torch.zeros(2)},
     r"unexpected tensor 'model.layers.0.self_attn.extra.weight'"),
    (None, lambda t: t | {"model.layers.2.input_layernorm.weight": torch.ones(36)},  # past the model, not MTP
     r"unexpected tensor 'model.layers.2.input_layernorm.weight'"),
    (None, lambda t: t | {"model.layers.1.self_attn.k_norm.weight": torch.ones(12)},
     r"tensor 'model.layers.1.self_attn.k_norm.weight' has shape \[12\], expected \[10\]"),
    (lambda c: c | {"hidden_act": "gelu"}, None, r"unsupported option 'hidden_act'='gelu'"),
    (lambda c: c | {"attention_bias": True}, None, r"unsupported option 'attention_bias'=True"),
    (lambda c: c | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, None,
     r"unsupported option 'rope_parameters.rope_type'='llama3'"),
    (lambda c: c | {"use_sliding_window": True, "sliding_window": 16}, None,
     r"unsupported option 'use_sliding_window'"),
    (lambda c: c | {"quantization_config": {"quant_method": "bitsandbytes"}}, None,
     r"unsupported option 'quantization_config.quant_method'='bitsandbytes'"),
])
def test_errors_name_the_key(qwen3_dir, tmp_path, config, tensors, message):
    with pytest.raises(ValueError, match=message):
        hf.load(edited(qwen3_dir, tmp_path / "bad", config, tensors))


def test_damaged_files_are_named(qwen3_dir, tmp_path, capsys):
    """A truncated weights file, a config.json that is no object, a tree whose tensors do not fit
    its config, an output path that is a file: one error naming the file, no traceback."""
    from fnmoe.cli import main

    bad = edited(qwen3_dir, tmp_path / "trunc")
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model.safetensors: unreadable safetensors file"):
        hf.load(bad)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json: expected a JSON object"):
        hf.load(bad)
    assert main(["convert", "--from-hf", str(qwen3_dir), "--out", str(tmp_path / "tree")]) == 0
    assert load_config(tmp_path / "tree" / "config.toml", validate_config=False).name == qwen3_dir.name  # not "run"
    index = json.loads((tmp_path / "tree" / "index.json").read_text())
    index["model"]["n_layers"] = 1  # the tree holds 2: it would have run on half of them
    (tmp_path / "tree" / "index.json").write_text(json.dumps(index))
    assert main(["generate", "--from", str(tmp_path / "tree"), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "its tensors do not fit the model in index.json: layers.1." in err and "not a leaf of this model" in err
    (tmp_path / "file").write_text("x")
    assert main(["convert", "--from-hf", str(qwen3_dir), "--out", str(tmp_path / "file")]) == 2
    assert "--out " + str(tmp_path / "file") + " is a file" in capsys.readouterr().err


def test_a_failed_save_leaves_nothing_behind(qwen3_dir, tmp_path, monkeypatch):
    """A full disk mid-save: no half-written model in --out (a rerun refused it as "not empty"), and
    one error naming the file and the OS's reason."""
    from fnmoe import tree_io

    cfg, params = hf.load(qwen3_dir)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tree_io, "save_file", full)  # hf.save writes through fnmoe.tree_io.save_safetensors
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=f"^writing {tmp_path / 'out' / 'model.safetensors'} failed: No space left "
                                         r"on device \(disk full or over a file-size limit\)$"):
        hf.save(tmp_path / "out", params, cfg)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any((tmp_path / "out").iterdir())
    monkeypatch.undo()
    assert (hf.save(tmp_path / "out", params, cfg) / "config.json").is_file()


def test_convert_command_round_trip(qwen3_dir, tmp_path, capsys):
    from fnmoe.cli import main
    from fnmoe.tree_io import load_tree

    assert main(["convert", "--from-hf", str(qwen3_dir), "--out", str(tmp_path / "tree")]) == 0
    assert load_config(tmp_path / "tree" / "config.toml", validate_config=False).name == qwen3_dir.name  # not "run"
    index = json.loads((tmp_path / "tree" / "index.json").read_text())
    assert index["format"] == "fnmoe-tree" and "layers.1.moe.w_up_EDF" in index["tensors"]
    assert main(["convert", "--to-hf", str(tmp_path / "tree"), "--out", str(tmp_path / "hf")]) == 0
    cfg0, p0 = hf.load(qwen3_dir)
    cfg1, p1 = load_tree(tmp_path / "tree")
    cfg2, p2 = hf.load(tmp_path / "hf")
    assert cfg0 == cfg1 == cfg2
    a, b, c = flatten_dict(p0), flatten_dict(p1), flatten_dict(p2)
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert main(["convert", "--from-hf", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(qwen3_dir), "--out", str(tmp_path / "tree")]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_convert_a_training_checkpoint_to_hf(tmp_path):
    """A checkpoint of a run (tiny Qwen3 preset) exports through the HF interop, and transformers
    loads it with fnmoe's logits."""
    from transformers import AutoModelForCausalLM

    from fnmoe.checkpoint import load_params
    from fnmoe.cli import main

    root = Path(__file__).resolve().parent.parent
    assert main(["train", "--config", str(root / "configs/tiny_qwen3.toml"), "--train.steps", "2",
                 "--train.batch-size", "2", "--data.seq-len", "32", "--train.eval-batches", "1",
                 "--train.run-dir", str(tmp_path / "run")]) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    run, params = load_params(ckpt)
    tokens = torch.randint(0, run.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ours, _ = forward(params, tokens, run.model)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4 * ours.abs().max()


def test_convert_a_run_of_the_default_preset(tmp_path, capsys):
    """`fnmoe convert --to-hf RUN_DIR` of a run of the default preset (small): an Ernie 4.5 MoE with
    fnmoe's logits (1e-5, fp32), the byte tokenizer and generation_config.json, every file and the
    directory as readable as the umask says (027: group may read, others not)."""
    import os
    import stat

    from fnmoe.checkpoint import load_params
    from fnmoe.cli import main
    from conftest import tiny_flags

    assert main(["train", "--train.steps", "2", *tiny_flags(1), "--train.run-dir", str(tmp_path / "run")]) == 0
    old = os.umask(0o027)
    try:
        assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    assert "Ernie4_5_MoeForCausalLM, with its tokenizer" in capsys.readouterr().out
    out = tmp_path / "hf"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert {stat.S_IMODE((out / n).stat().st_mode) for n in names} == {0o640}
    run, params = load_params(tmp_path / "run" / "checkpoints" / "step_2")
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert logits_rel_diff(model, run.model, params, L=32) <= 1e-5
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256


def test_convert_refuses_a_corrupt_training_checkpoint(tmp_path, capsys):
    """README: a training checkpoint is verified before export. One flipped byte in its params file:
    `convert --to-hf` exits 2 naming the file and its checksum, and writes no model."""
    from fnmoe.cli import main

    assert main(["train", "--train.steps", "1", "--model.dim", "32", "--model.ffn-hidden", "64",
                 "--model.moe.expert-hidden", "32", "--train.batch-size", "2", "--data.seq-len", "16",
                 "--train.eval-batches", "1", "--train.run-dir", str(tmp_path / "run")]) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    params_file = ckpt / "params-rank00000.safetensors"
    data = bytearray(params_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    params_file.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"fnmoe convert: error: {params_file} does not match its sha256" in err, err
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())


@pytest.mark.parametrize("kind", ["qwen3", "ernie"])
def test_load_on_a_mesh_reads_only_each_ranks_experts(tmp_path, monkeypatch, kind):
    """Every leaf on a simulated 2x2 mesh equal to one process's load, bitwise; each expert read
    by the one rank that holds it. Ernie: a dense first layer, a shared expert, moe_statics."""
    from torch.distributed.tensor import DTensor

    from fnmoe.parallel import dist as fdist
    from fnmoe.parallel import sharding
    from fnmoe.config import MeshConfig

    if kind == "qwen3":
        qwen3(seed=7, num_experts=8, num_hidden_layers=2).save_pretrained(tmp_path)
    else:
        ernie(seed=7, moe_num_experts=8, num_hidden_layers=3).save_pretrained(tmp_path)
    cfg, ref = hf.load(tmp_path)
    reads: dict[str, int] = {}
    read = hf.HFReader.read

    def counted(self, key, want, index=()):
        reads[key] = reads.get(key, 0) + 1
        return read(self, key, want, index)
    monkeypatch.setattr(hf.HFReader, "read", counted)
    with fdist.simulate(4):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        cfg2, params = hf.load(tmp_path, mesh=mesh)
        got = flatten_dict(params)
        for path, want in flatten_dict(ref).items():
            leaf = got[path]
            whole = leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
            whole = whole.reconcile() if hasattr(whole, "reconcile") else whole
            assert torch.equal(whole, want), path
    assert cfg2 == cfg
    experts = {k: n for k, n in reads.items() if ".experts." in k}
    assert experts and set(experts.values()) == {1}  # 8 experts over 4 ranks: each read by its owner only


def test_train_starts_from_a_hugging_face_checkpoint(tmp_path, capsys):
    from fnmoe.cli import main
    from fnmoe.data.loader import Loader, load_data
    from fnmoe.training.step import loss_fn

    src, conv = tmp_path / "hf", tmp_path / "native"
    qwen3(seed=9, vocab_size=300, num_hidden_layers=2).save_pretrained(src)
    assert main(["convert", "--from-hf", str(src), "--out", str(conv)]) == 0
    args = ["--config", str(conv / "config.toml"), "--train.init-from-hf", str(src), "--train.steps", "2",
            "--train.batch-size", "2", "--data.seq-len", "16", "--train.eval-batches", "1", "--train.log-every", "1",
            "--train.run-dir", str(tmp_path / "run")]
    assert main(["train", *args]) == 0
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    run = load_config(conv / "config.toml")
    cfg, params = hf.load(src)
    data = load_data(dataclasses.replace(run.data, seq_len=16), cfg.vocab_size)
    x, y = Loader(data, 16, 2, 1, run.train.seed).batch_at(0, 0, 1, 0)
    with torch.no_grad():
        _, aux = loss_fn(params, x, y, cfg, y.numel())
    expected = float(aux["ce_loss"])  # metrics report the cross-entropy, without the router's balance loss
    assert abs(first["loss"] - expected) <= 1e-5 * expected
    # a config whose shapes differ is refused, naming the difference
    assert main(["train", "--train.init-from-hf", str(src), "--train.steps", "1",
                 "--train.run-dir", str(tmp_path / "bad")]) == 2
    assert "does not match the config's" in capsys.readouterr().err


# ---------------------------------------------------------------- config.json fields are typed

NOT_READ = {"model_type", "dtype"}
"""fields config_to_hf writes that fnmoe does not read back"""


def json_leaves(d, where=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from json_leaves(v, f"{where}{k}.")
        elif v is not None and k not in NOT_READ:
            yield f"{where}{k}", v


def with_value(d, path, value):
    d = json.loads(json.dumps(d))
    *tables, key = path.split(".")
    inner = d
    for t in tables:
        inner = inner[t]
    inner[key] = value
    return d


def wrong_json_values(v):
    """(a value of another type, its type as errors say it, the expected type) for a field's value v."""
    if isinstance(v, bool):
        return [(1, "an int", "bool"), ("true", "a str", "bool")]
    if isinstance(v, int):
        return [(2.5, "a float", "int"), ("1", "a str", "int")]
    if isinstance(v, float):
        return [("1.0", "a str", "float"), (True, "a bool", "float")]
    if isinstance(v, str):
        return [(5, "an int", "str")]
    return [("x", "a str", f"a list of {type(v[0]).__name__}")]


@pytest.mark.parametrize("kind,arch", [("mla", "DeepseekV3ForCausalLM"), ("qwen3", "Qwen3MoeForCausalLM"),
                                       ("mixtral", "MixtralForCausalLM"), ("ernie", "Ernie4_5_MoeForCausalLM")])
def test_every_config_json_field_is_typed(kind, arch, tmp_path):
    """Every field of a config.json fnmoe reads (those config_to_hf writes, and the optional ones),
    set to a value of another type: one error naming the file, the field, the value and the
    expected type, before any weights are opened (the directory holds none)."""
    cfg, _ = fn_model(kind)
    good = hf.config_to_hf(cfg, arch, torch.float32) | {
        "partial_rotary_factor": 1.0, "quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]},
        "mlp_bias": False}
    if arch == "DeepseekV3ForCausalLM":
        good |= {"seq_aux": True, "aux_loss_alpha": 0.001, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                 "moe_layer_freq": 1}
    path, failures, n = tmp_path / "config.json", [], 0
    path.write_text(json.dumps(good))
    assert hf.config_from_hf(good)[0].dim == cfg.dim and hf.fp8_block(good) == (2, 2)
    for field, v in json_leaves(good):
        for bad, is_a, expected in wrong_json_values(v):
            path.write_text(json.dumps(with_value(good, field, bad)))
            line = f"{path}: {field} = {json.dumps(bad)} is {is_a}, expected {expected}"
            try:
                hf.load(tmp_path)
            except FileNotFoundError:  # passed config.json, went on to the weights
                failures.append(f"{field} = {bad!r}: accepted")
            except ValueError as e:
                n += 1
                if str(e) != line:
                    failures.append(f"{field} = {bad!r}: {e}")
    assert not failures, "\n".join(failures)
    assert n >= 40


def test_save_refuses_a_directory_in_use_unless_told_to_overwrite(tmp_path):
    """An existing model directory is refused with one line saying how to replace it; overwrite=True
    replaces it whole (no stale shard of the old model is left beside the new one)."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16))
    first, second = init_params(cfg, seed=0), init_params(cfg, seed=1)
    out = tmp_path / "model"
    hf.save(out, first, cfg, max_shard_bytes=20_000)
    assert (out / hf.INDEX).is_file()
    with pytest.raises(ValueError, match=r"^hf.save: .*model is not empty; pass overwrite=True to replace it$"):
        hf.save(out, second, cfg)
    assert hf.save(out, second, cfg, overwrite=True) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", hf.SINGLE]  # the old shards are gone
    got = flatten_dict(hf.load(out)[1])
    assert all(torch.equal(got[k], v) for k, v in flatten_dict(second).items())


@pytest.mark.parametrize("target", ["symlink", "file", "dangling"])
def test_save_with_overwrite_checks_its_target_before_writing(tmp_path, monkeypatch, target):
    """overwrite=True onto a symbolic link (to a model directory) or a regular file: one clear error
    before a byte is written, no temporary directory left, what the link names untouched (before:
    a raw library error after the whole model was written, and its temp directory left)."""
    from fnmoe import tree_io

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16))
    params = init_params(cfg, seed=0)
    real = hf.save(tmp_path / "real", params, cfg)
    before = {p.name: p.read_bytes() for p in real.iterdir()}
    out = tmp_path / "out"
    if target == "file":
        out.write_text("a file\n")
        said = f"hf.save: {out} is a file, not a directory; remove it or choose another; nothing was written"
    else:
        out.symlink_to(real if target == "symlink" else tmp_path / "gone")
        said = (f"hf.save: {out} is a symbolic link (to {os.readlink(out)}); name the directory itself or remove the "
                "link; nothing was written")
    writes = []
    monkeypatch.setattr(tree_io, "save_file", lambda *a, **k: writes.append(a))
    with pytest.raises(ValueError) as e:
        hf.save(out, init_params(cfg, seed=1), cfg, overwrite=True)
    assert str(e.value) == said and writes == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "real"]  # no .out.* temp directory
    assert {p.name: p.read_bytes() for p in real.iterdir()} == before


def test_a_save_that_fails_removes_the_directories_it_made(tmp_path, monkeypatch):
    from fnmoe import tree_io

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16))

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tree_io, "save_file", full)
    with pytest.raises(ValueError, match="^writing .*model.safetensors failed: No space left on device"):
        hf.save(tmp_path / "a" / "b" / "out", init_params(cfg), cfg)
    assert list(tmp_path.iterdir()) == []
