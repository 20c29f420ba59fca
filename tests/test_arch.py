"""Architecture variants in isolation, fp32, <= 1e-5: MLA, GQA and RoPE/YaRN against transformers'
modules; routers and MoE blocks against transformers' and per-token references; the auxiliary
losses against naive loops; the router-bias rule; dense-layer placement; presets; FLOPs for MLA."""
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fnmoe import optim
from fnmoe.models.attention import attention, mla_softmax_scale, rope, yarn_inv_freq
from fnmoe.config import ModelConfig, MoEConfig, OptimConfig, RunConfig, DataConfig, TrainConfig, load_config
from fnmoe.plan.flops import flops_per_token, param_counts
from fnmoe.models.transformer import forward
from fnmoe.models.params import init_params, leaf_inits
from fnmoe.models.moe import moe_block, route, seq_balance_loss, update_router_bias, z_loss
from fnmoe.training.step import init_state, loss_fn, make_train_step
from fnmoe.memory.policies import train_runner
from fnmoe.tree import flatten_dict, value_and_grad
from conftest import rel

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402
from transformers.models.mixtral import modeling_mixtral as mx  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as qw  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}



def randomize(module, seed):
    """Weights ~ N(0, 1/fan_in) (norm weights 1 + N(0, 0.1^2)): every part of the output matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else noise / math.sqrt(p.shape[-1]))


def causal_mask(L):
    return torch.full((L, L), float("-inf")).triu(1)[None, None]


def lin(m):  # HF Linear [out, in] -> fnmoe [in, out]
    return m.weight.detach().T.contiguous()


# ---------------------------------------------------------------- MLA

def ds_config(**kw):
    base = dict(vocab_size=64, hidden_size=36, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=2,
                num_attention_heads=3, num_key_value_heads=3, n_shared_experts=2, n_routed_experts=8, n_group=4,
                topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, q_lora_rank=20, kv_lora_rank=14,
                qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=7, max_position_embeddings=128,
                rope_interleave=True, routed_scaling_factor=2.5)
    cfg = transformers.DeepseekV3Config(**(base | kw))
    cfg._attn_implementation = "eager"
    return cfg


def fn_mla_config(hf, **kw) -> ModelConfig:
    rp = hf.rope_parameters
    yarn = {}
    if rp["rope_type"] == "yarn":
        yarn = dict(rope_scaling="yarn", yarn_factor=rp["factor"],
                    yarn_original_max_seq_len=rp["original_max_position_embeddings"],
                    yarn_mscale=rp.get("mscale") or 0.0, yarn_mscale_all_dim=rp.get("mscale_all_dim") or 0.0)
    return ModelConfig(vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers,
                       n_heads=hf.num_attention_heads, n_kv_heads=hf.num_attention_heads, attention="mla",
                       q_lora_rank=hf.q_lora_rank or 0, kv_lora_rank=hf.kv_lora_rank,
                       qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                       v_head_dim=hf.v_head_dim, rope_interleave=hf.rope_interleave,
                       rope_theta=rp["rope_theta"], max_seq_len=hf.max_position_embeddings, **yarn, **kw)


def mla_params(a):
    p = {"w_kv_a_DW": lin(a.kv_a_proj_with_mqa), "kv_a_norm_C": a.kv_a_layernorm.weight.detach(),
         "w_kv_b_CX": lin(a.kv_b_proj), "w_o_YD": lin(a.o_proj)}
    if a.q_proj is not None:
        return p | {"w_q_DN": lin(a.q_proj)}
    return p | {"w_q_a_DQ": lin(a.q_a_proj), "q_a_norm_Q": a.q_a_layernorm.weight.detach(), "w_q_b_QN": lin(a.q_b_proj)}


@pytest.mark.parametrize("q_lora", [20, None])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("yarn", [True, False])
def test_mla_matches_transformers(q_lora, interleave, yarn):
    hf = ds_config(q_lora_rank=q_lora, rope_interleave=interleave, rope_parameters=YARN if yarn else None)
    attn = ds.DeepseekV3Attention(hf, layer_idx=0).eval()
    randomize(attn, 0)
    L = 24
    x = torch.randn(2, L, hf.hidden_size)
    pos = torch.arange(L)[None]
    cos_hf, sin_hf = ds.DeepseekV3RotaryEmbedding(hf)(x, pos)
    with torch.no_grad():
        ref, _ = attn(x, position_embeddings=(cos_hf, sin_hf), attention_mask=causal_mask(L))
    cfg = fn_mla_config(hf)
    cos, sin = rope(cfg, torch.arange(L))
    assert rel(cos, cos_hf[0]) <= 1e-5 and rel(sin, sin_hf[0]) <= 1e-5
    assert math.isclose(mla_softmax_scale(cfg), attn.scaling, rel_tol=1e-12)
    assert rel(attention(mla_params(attn), x, cos, sin, cfg), ref) <= 1e-5


def test_yarn_frequencies_and_factor_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in (YARN, YARN | {"mscale": None, "mscale_all_dim": None},
                   YARN | {"attention_factor": 1.3, "truncate": False}):
        hf = ds_config(rope_parameters=dict(params))
        inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["yarn"](hf)
        cfg = dataclasses.replace(fn_mla_config(hf), yarn_attention_factor=params.get("attention_factor") or 0.0,
                                  yarn_truncate=params.get("truncate", True))
        inv, factor = yarn_inv_freq(cfg)
        assert rel(inv.float(), inv_hf) <= 1e-6 and math.isclose(factor, factor_hf, rel_tol=1e-6)


def test_interleaved_rope_is_the_pairwise_complex_rotation():
    """DeepSeek's reference rotates (x0 + i x1), (x2 + i x3), ... by e^{i pos f}: check the
    attention scores it implies against fnmoe's de-interleaved rotation."""
    from fnmoe.models.attention import apply_rope

    P, L, theta = 8, 10, 10000.0
    q, k = torch.randn(1, L, 2, P), torch.randn(1, L, 2, P)
    cfg = ModelConfig(attention="mla", n_heads=2, qk_rope_head_dim=P, kv_lora_rank=4, v_head_dim=4,
                      rope_interleave=True)
    cos, sin = rope(cfg, torch.arange(L))
    freq = theta ** (-torch.arange(0, P, 2, dtype=torch.float64) / P)
    rot = torch.polar(torch.ones(L, P // 2, dtype=torch.float64), torch.arange(L)[:, None] * freq)[None, :, None]
    qc = torch.view_as_complex(q.double().reshape(1, L, 2, P // 2, 2)) * rot
    kc = torch.view_as_complex(k.double().reshape(1, L, 2, P // 2, 2)) * rot
    ref = torch.einsum("blhp,bmhp->bhlm", torch.view_as_real(qc).flatten(-2), torch.view_as_real(kc).flatten(-2))
    got = torch.einsum("blhp,bmhp->bhlm", apply_rope(q, cos, sin, True), apply_rope(k, cos, sin, True))
    assert rel(got.double(), ref) <= 1e-5


# ---------------------------------------------------------------- GQA

@pytest.mark.parametrize("yarn", [False, True])
def test_qwen3_attention_matches_transformers(yarn):
    hf = transformers.Qwen3MoeConfig(hidden_size=36, num_attention_heads=3, num_key_value_heads=1, head_dim=10,
                                     max_position_embeddings=128, rope_parameters=dict(YARN) if yarn else None)
    hf._attn_implementation = "eager"
    attn = qw.Qwen3MoeAttention(hf, layer_idx=0).eval()
    randomize(attn, 1)
    L = 20
    x = torch.randn(2, L, 36)
    cos_hf, sin_hf = qw.Qwen3MoeRotaryEmbedding(hf)(x, torch.arange(L)[None])
    with torch.no_grad():
        ref, _ = attn(x, position_embeddings=(cos_hf, sin_hf), attention_mask=causal_mask(L))
    yarn_kw = dict(rope_scaling="yarn", yarn_factor=8.0, yarn_original_max_seq_len=16, yarn_mscale=0.9,
                   yarn_mscale_all_dim=0.7) if yarn else {}
    cfg = ModelConfig(dim=36, n_heads=3, n_kv_heads=1, head_dim=10, qk_norm=True, max_seq_len=128, **yarn_kw)
    p = {"w_q_DN": lin(attn.q_proj), "w_k_DM": lin(attn.k_proj), "w_v_DM": lin(attn.v_proj), "w_o_ND": lin(attn.o_proj),
         "q_norm_A": attn.q_norm.weight.detach(), "k_norm_A": attn.k_norm.weight.detach()}
    cos, sin = rope(cfg, torch.arange(L))
    assert rel(attention(p, x, cos, sin, cfg), ref) <= 1e-5


def test_mixtral_attention_matches_transformers():
    hf = transformers.MixtralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    hf._attn_implementation = "eager"
    attn = mx.MixtralAttention(hf, layer_idx=0).eval()
    randomize(attn, 2)
    L = 16
    x = torch.randn(2, L, 32)
    cos_hf, sin_hf = mx.MixtralRotaryEmbedding(hf)(x, torch.arange(L)[None])
    with torch.no_grad():
        ref, _ = attn(x, position_embeddings=(cos_hf, sin_hf), attention_mask=causal_mask(L))
    cfg = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, rope_theta=hf.rope_parameters["rope_theta"])
    p = {"w_q_DN": lin(attn.q_proj), "w_k_DM": lin(attn.k_proj), "w_v_DM": lin(attn.v_proj), "w_o_ND": lin(attn.o_proj)}
    cos, sin = rope(cfg, torch.arange(L))
    assert rel(attention(p, x, cos, sin, cfg), ref) <= 1e-5


# ---------------------------------------------------------------- routers and MoE blocks

def same_routing(w, idx, w_ref, idx_ref):
    """Top-k sets agree per token and each expert gets the same weight (order may differ)."""
    i, order = idx.sort(-1)
    i_ref, order_ref = idx_ref.sort(-1)
    assert torch.equal(i, i_ref)
    assert rel(w.gather(1, order), w_ref.gather(1, order_ref)) <= 1e-5


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("groups", [(4, 2), (1, 1)])
def test_sigmoid_router_matches_deepseek(norm, groups):
    hf = ds_config(norm_topk_prob=norm, n_group=groups[0], topk_group=groups[1])
    router = ds.DeepseekV3TopkRouter(hf)
    with torch.no_grad():
        router.weight.normal_(0, 2 / 6)
        router.e_score_correction_bias.normal_(0, 0.3)  # large: it must change choices, not weights
    x = torch.randn(64, hf.hidden_size)
    with torch.no_grad():
        _, w_ref, idx_ref = router(x)
    cfg = fn_mla_config(hf, moe=MoEConfig(n_experts=8, top_k=3, score_func="sigmoid", norm_topk_prob=norm,
                                          routed_scaling_factor=2.5, n_group=groups[0], topk_group=groups[1],
                                          router_bias=True))
    w, idx, scores, _ = route(x, router.weight.detach().T, cfg, router.e_score_correction_bias)
    same_routing(w, idx, w_ref, idx_ref)
    w_nobias, idx_nobias, _, _ = route(x, router.weight.detach().T, cfg)
    assert not torch.equal(idx.sort(-1).values, idx_nobias.sort(-1).values)  # the bias did change choices


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_routers_match_qwen3_and_mixtral(norm):
    hf = transformers.Qwen3MoeConfig(hidden_size=24, num_experts=7, num_experts_per_tok=3, norm_topk_prob=norm)
    routers = [qw.Qwen3MoeTopKRouter(hf)]
    if norm:  # Mixtral always renormalises
        routers.append(mx.MixtralTopKRouter(transformers.MixtralConfig(hidden_size=24, num_local_experts=7,
                                                                       num_experts_per_tok=3)))
    cfg = ModelConfig(dim=24, moe=MoEConfig(n_experts=7, top_k=3, norm_topk_prob=norm))
    x = torch.randn(50, 24)
    for router in routers:
        with torch.no_grad():
            router.weight.normal_(0, 1)
            _, w_ref, idx_ref = router(x)
        w, idx, _, _ = route(x, router.weight.detach().T, cfg)
        same_routing(w, idx, w_ref, idx_ref)


def expert_stack(experts, n):
    gate_up = experts.gate_up_proj.detach()  # [E, 2F, D]
    F_ = gate_up.shape[1] // 2
    return {"w_gate_EDF": gate_up[:, :F_].transpose(1, 2).contiguous(),
            "w_up_EDF": gate_up[:, F_:].transpose(1, 2).contiguous(),
            "w_down_EFD": experts.down_proj.detach().transpose(1, 2).contiguous()}


def test_deepseek_moe_block_with_shared_experts_matches_transformers():
    hf = ds_config()
    block = ds.DeepseekV3MoE(hf).eval()
    randomize(block, 3)
    with torch.no_grad():
        block.gate.weight.normal_(0, 2 / 6)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(2, 9, hf.hidden_size)
    with torch.no_grad():
        ref = block(x)
    cfg = fn_mla_config(hf, moe=MoEConfig(n_experts=8, top_k=3, expert_hidden=12, n_shared_experts=2,
                                          score_func="sigmoid", routed_scaling_factor=2.5, n_group=4, topk_group=2,
                                          router_bias=True))
    s = block.shared_experts
    p = expert_stack(block.experts, 8) | {
        "w_router_DE": lin(block.gate), "router_bias_E": block.gate.e_score_correction_bias.detach(),
        "shared": {"w_gate_DF": lin(s.gate_proj), "w_up_DF": lin(s.up_proj), "w_down_FD": lin(s.down_proj)}}
    out, stats = moe_block(p, x, cfg, gemm="loop")
    assert rel(out, ref) <= 1e-5 and stats["counts_E"].sum() == 2 * 9 * 3


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_block_matches_transformers(norm):
    hf = transformers.Qwen3MoeConfig(hidden_size=20, moe_intermediate_size=12, num_experts=5, num_experts_per_tok=2,
                                     norm_topk_prob=norm)
    block = qw.Qwen3MoeSparseMoeBlock(hf).eval()
    randomize(block, 4)
    x = torch.randn(3, 7, 20)
    with torch.no_grad():
        ref = block(x)
    ref = ref[0] if isinstance(ref, tuple) else ref
    cfg = ModelConfig(dim=20, moe=MoEConfig(n_experts=5, top_k=2, expert_hidden=12, norm_topk_prob=norm))
    p = expert_stack(block.experts, 5) | {"w_router_DE": lin(block.gate)}
    out, _ = moe_block(p, x, cfg, gemm="loop")
    assert rel(out, ref) <= 1e-5


# ---------------------------------------------------------------- auxiliary losses

def test_seq_balance_loss_and_z_loss_match_naive_loops():
    B, L, E, K = 3, 11, 6, 2
    logits = torch.randn(B * L, E) * 2
    scores = torch.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdim=True)
    idx = torch.topk(scores, K).indices
    ref = 0.0
    for b in range(B):
        rows = range(b * L, (b + 1) * L)
        for e in range(E):
            f = E / (K * L) * sum(int(e in idx[t].tolist()) for t in rows)
            ref += f * sum(probs[t, e] for t in rows) / L / B
    assert abs(seq_balance_loss(probs.view(B, L, E), idx.view(B, L, K)) - ref) <= 1e-6
    zref = sum(math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in logits) / (B * L)
    assert abs(z_loss(logits).item() - zref) <= 1e-5 * zref


def test_loss_fn_adds_each_router_loss_once():
    cfg = ModelConfig(vocab_size=264, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=0, score_func="sigmoid",
                                    aux_loss_coeff=0.01, seq_aux_loss_coeff=0.1, z_loss_coeff=0.001))
    params = init_params(cfg, seed=0)
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    loss, aux = loss_fn(params, x, y, cfg, n_global=32)  # this micro-batch holds half the labels
    want = aux["ce_loss"] + 0.5 * (0.01 * aux["balance_loss"] + 0.1 * aux["seq_balance_loss"] + 0.001 * aux["z_loss"])
    assert abs(loss - want) <= 1e-6


# ---------------------------------------------------------------- router bias rule

BIAS_CFG = ModelConfig(vocab_size=264, dim=32, n_layers=3, n_heads=2, attention="mla", q_lora_rank=0, kv_lora_rank=8,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, ffn_hidden=48,
                       moe=MoEConfig(n_experts=6, top_k=2, expert_hidden=16, score_func="sigmoid", n_group=3,
                                     topk_group=2, router_bias=True, bias_update_coeff=1e-3, first_k_dense=1,
                                     aux_loss_coeff=0.0))


def test_router_bias_moves_exactly_by_its_rule_under_adamw():
    run = RunConfig(model=BIAS_CFG, optim=OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0),
                    train=TrainConfig(batch_size=2), data=DataConfig(seq_len=16))
    params = init_params(BIAS_CFG, seed=0)
    gen = torch.Generator().manual_seed(0)
    for buf in params["buffers"]["layers"].values():
        buf["moe"]["router_bias_E"] = torch.randn(6, generator=gen) * 0.01
    x, y = torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen)
    _, grads = value_and_grad(loss_fn, has_aux=True)(params, x, y, BIAS_CFG, 32)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in flatten_dict(grads["buffers"]).values())
    tx = optim.from_config(run.optim, 10)
    state = init_state(params, tx)
    for step in range(2):
        before = flatten_dict(state.params)
        state, metrics = make_train_step(run, tx, train_runner(run))(state, [(x, y)])
        after = flatten_dict(state.params)
        for n, i in enumerate([1, 2]):
            key = f"buffers.layers.{i}.moe.router_bias_E"
            counts = metrics["expert_counts_NE"][n].double()
            want = before[key] + torch.sign(counts.mean() - counts).float() * torch.tensor(1e-3)
            assert torch.equal(after[key], want), (step, i)
            assert not torch.equal(after[f"layers.{i}.moe.w_router_DE"], before[f"layers.{i}.moe.w_router_DE"])
    frozen = dataclasses.replace(run, model=dataclasses.replace(
        BIAS_CFG, moe=dataclasses.replace(BIAS_CFG.moe, bias_update_coeff=0.0)))
    state2, _ = make_train_step(frozen, tx, train_runner(frozen))(init_state(params, tx), [(x, y)])
    assert torch.equal(state2.params["buffers"]["layers"]["1"]["moe"]["router_bias_E"],
                       params["buffers"]["layers"]["1"]["moe"]["router_bias_E"])


def test_update_router_bias_is_pure():
    params = init_params(BIAS_CFG, seed=1)
    counts = torch.tensor([[5, 1, 3, 3, 0, 12], [4, 4, 4, 4, 4, 4]])
    new = update_router_bias(params, counts, BIAS_CFG)
    assert torch.equal(params["buffers"]["layers"]["1"]["moe"]["router_bias_E"], torch.zeros(6))
    assert torch.equal(new["buffers"]["layers"]["1"]["moe"]["router_bias_E"],
                       torch.tensor([-1.0, 1, 1, 1, 1, -1]) * torch.tensor(1e-3))
    assert torch.equal(new["buffers"]["layers"]["2"]["moe"]["router_bias_E"], torch.zeros(6))  # balanced: no move
    assert new["layers"] is params["layers"]


# ---------------------------------------------------------------- layer placement, FLOPs, presets

def test_dense_layers_first_every_nth_and_listed():
    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=7, n_heads=2, n_kv_heads=1, ffn_hidden=24,
                      moe=MoEConfig(n_experts=4, top_k=1, expert_hidden=8, first_k_dense=2, dense_layers=(5,),
                                    moe_every=2))
    layers = leaf_inits(cfg)["layers"]
    assert [i for i in range(7) if "moe" in layers[str(i)]] == [3]  # i >= 2, i != 5, (i + 1) % 2 == 0
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, first_k_dense=0, dense_layers=(), moe_every=3))
    assert [i for i in range(7) if cfg.is_moe_layer(i)] == [2, 5]
    logits, aux = forward(init_params(cfg), torch.randint(0, 64, (1, 5)), cfg)
    assert aux["expert_counts_NE"].shape == (2, 4)


def test_mla_param_counts_and_flops():
    cfg = BIAS_CFG
    D, H, C, P, J, U = 32, 2, 8, 4, 8, 8
    attn = D * H * (J + P) + D * (C + P) + C + C * H * (J + U) + H * U * D
    moe = D * 6 + 3 * 6 * D * 16
    dense = 3 * D * 48
    total = 264 * D * 2 + 3 * (attn + 2 * D) + dense + 2 * moe + D
    assert param_counts(cfg)[0] == total  # buffers are state, not params
    active = param_counts(cfg)[1]
    assert active == total - 264 * D - 2 * (3 * 6 * D * 16) + 2 * (3 * 2 * D * 16)
    assert flops_per_token(cfg, 128) == 6 * active + 3 * 3 * 128 * H * (J + P + U)


@pytest.mark.parametrize("preset,attn", [("tiny_mla", "mla"), ("tiny_qwen3", "gqa")])
def test_small_presets_validate_and_train(preset, attn, tmp_path):
    import json

    from fnmoe.cli import main

    run = load_config(ROOT / "configs" / f"{preset}.toml")
    assert run.model.attention == attn and run.model.compute_dtype == "float32" and not run.model.compile
    if attn == "mla":
        m = run.model.moe
        assert m.score_func == "sigmoid" and m.router_bias and m.n_group > 1 and m.n_shared_experts and m.first_k_dense
    else:
        assert run.model.qk_norm and run.model.moe.score_func == "softmax"
    args = ["train", "--config", str(ROOT / "configs" / f"{preset}.toml"), "--train.steps", "2", "--model.dim", "32",
            "--model.ffn-hidden", "48", "--model.moe.expert-hidden", "16", "--train.batch-size", "2",
            "--data.seq-len", "16", "--train.eval-batches", "1", "--train.eval-every", "0",
            "--train.run-dir", str(tmp_path)]
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    # step 1's logged loss is the cross-entropy of the initial params on the run's first batch,
    # computed here by forward and F.cross_entropy (the router losses are not part of the logged loss)
    from fnmoe.cli import parse_run
    from fnmoe.data.loader import Loader, load_data

    run = parse_run(args[1:], "fnmoe train")
    inputs_BL, labels_BL = Loader(load_data(run.data, run.model.vocab_size), run.data.seq_len, run.train.batch_size,
                                  1, run.train.seed).batch_at(0, 0, 1, 0)
    logits_BLV, _ = forward(init_params(run.model, run.train.seed), inputs_BL, run.model)
    want = F.cross_entropy(logits_BLV.flatten(0, 1), labels_BL.flatten(), ignore_index=-100).item()
    assert abs(losses[0] - want) <= 1e-5 * want, (losses, want)
    assert math.isfinite(losses[1]) and losses[1] != losses[0]
