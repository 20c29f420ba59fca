"""fnmoe.optim's Muon against torch.optim.Muon (and torch.optim.AdamW for Muon's AdamW leaves).

Our weights are [in, out]; torch.optim.Muon's are [out, in], so each reference runs on W.T
and is transposed back. Momentum buffers and Newton-Schulz outputs match bitwise; params
match to ~1 ulp per step (torch rounds twice in place, p + update once), checked at 1e-6.

Legend: E experts, I in, O out; MuonClip: B batch, L sequence (or layers in _LH), H query heads,
G kv heads, I q/k head dim.
"""
import json

import pytest
import torch
import torch._dynamo.testing

import fnmoe.optim.muon_update as fmuon
from fnmoe import optim
from fnmoe.models.attention import gqa_qk, max_logits_H, mla_qkv, mla_softmax_scale, rope
from fnmoe.config import DataConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig, TrainConfig, validate
from fnmoe.models.transformer import hidden_states
from fnmoe.models.params import init_params
from fnmoe.training.step import init_state, make_train_step
from fnmoe.memory.policies import train_runner
from fnmoe.tree import flatten_dict
from conftest import rel, tiny_flags

SHAPES = {"tall": (64, 24), "wide": (24, 64), "square": (32, 32)}



def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grads_for(tree: dict, steps: int, seed: int = 1) -> list[dict]:
    g = gen(seed)
    return [optim.tree_map(lambda x: torch.randn(x.shape, generator=g), tree) for _ in range(steps)]


def torch_muon(W_list, grads_list, lr_at, **kw):
    """torch.optim.Muon on W.T for each W_IO; returns final W_IO and, per step, the buffers as [I, O]."""
    tps = [torch.nn.Parameter(W.T.clone()) for W in W_list]
    opt = torch.optim.Muon(tps, lr=lr_at(0), **kw)
    bufs = []
    for step, gs in enumerate(grads_list):
        opt.param_groups[0]["lr"] = lr_at(step)
        for t, G in zip(tps, gs):
            t.grad = G.T.clone()
        opt.step()
        bufs.append([opt.state[t]["momentum_buffer"].T.clone() for t in tps])
    return [t.detach().T for t in tps], bufs


def fnmoe_run(tx, params, grads, before_step=None):
    state = tx.init(params)
    states = []
    for step, g in enumerate(grads):
        if before_step is not None:
            state = before_step(step, state)
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
        states.append(state)
    return params, states


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_2d(adjust_lr, nesterov):
    g = gen(0)
    params = {k: torch.randn(s, generator=g) * 0.02 for k, s in SHAPES.items()}
    grads = grads_for(params, 6)
    kw = dict(weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    ref, ref_bufs = torch_muon(list(params.values()), [list(x.values()) for x in grads], lambda s: 0.02,
                               adjust_lr_fn=adjust_lr, **kw)
    out, states = fnmoe_run(fmuon.muon(0.02, adjust_lr=adjust_lr, **kw), params, grads)
    for step, st in enumerate(states):
        for k, buf in zip(params, ref_bufs[step]):
            assert torch.equal(st["muon"][0].mu[k], buf), (step, k)
    for k, r in zip(params, ref):
        assert rel(out[k], r) <= 1e-6, k


def test_newton_schulz_bitwise_with_torch():
    zeropower = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz
    for I, O in SHAPES.values():
        G_EIO = torch.randn(3, I, O, generator=gen(I * O))
        want = torch.stack([zeropower(G.T, fmuon.NS_COEFFICIENTS, 5, 1e-7).T for G in G_EIO])
        assert torch.equal(fmuon.newton_schulz(G_EIO), want)
        assert torch.equal(fmuon.newton_schulz(G_EIO[0]), want[0])


def test_expert_stack_equals_per_expert_torch():
    params = {"w_up_EIO": torch.randn(4, 16, 40, generator=gen(0)) * 0.02,
              "w_down_EIO": torch.randn(4, 40, 16, generator=gen(1)) * 0.02}
    grads = grads_for(params, 5)
    out, _ = fnmoe_run(fmuon.muon(0.01, weight_decay=0.1), params, grads)
    for k, W_EIO in params.items():
        ref, _ = torch_muon(list(W_EIO), [list(g[k]) for g in grads], lambda s: 0.01, weight_decay=0.1,
                            adjust_lr_fn="match_rms_adamw")
        assert rel(out[k], torch.stack(ref)) <= 1e-6, k


def model_like() -> dict:
    g = gen(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    return {
        "embed": {"w_VD": r(40, 16)},
        "layers": {"0": {"attn": {"w_q_DN": r(16, 24), "w_o_ND": r(24, 16)}, "attn_norm": {"w_D": 1 + r(16)},
                         "moe": {"w_router_DE": r(16, 4), "w_up_EDF": r(4, 16, 8)}}},
        "final_norm": {"w_D": 1 + r(16)},
        "head": {"w_DV": r(16, 40)},
        "buffers": {"router_bias_E": torch.tensor([0.5, -0.0, 0.0, -1.0])},
    }


def test_labels_and_whole_tree_against_torch():
    params = model_like()
    labels = optim.default_labels(params)
    assert labels["embed"]["w_VD"] == "adamw" and labels["head"]["w_DV"] == "adamw"
    assert labels["final_norm"]["w_D"] == "adamw" and labels["buffers"]["router_bias_E"] == "frozen"
    assert labels["layers"]["0"]["attn"]["w_q_DN"] == "muon" and labels["layers"]["0"]["moe"]["w_up_EDF"] == "muon"

    grads = grads_for(params, 5)
    grads = [{**gr, "buffers": optim.tree_map(torch.zeros_like, gr["buffers"])} for gr in grads]
    tx = fmuon.muon(0.02, weight_decay=0.1, adamw_lr=3e-3)
    out, states = fnmoe_run(tx, params, grads)
    assert set(states[-1]["adamw"].mu) == {"embed.w_VD", "layers.0.attn_norm.w_D", "final_norm.w_D", "head.w_DV"}

    L = params["layers"]["0"]
    lg = lambda gr: gr["layers"]["0"]  # noqa: E731
    mats = [L["attn"]["w_q_DN"], L["attn"]["w_o_ND"], L["moe"]["w_router_DE"], *L["moe"]["w_up_EDF"]]
    mat_grads = [[lg(gr)["attn"]["w_q_DN"], lg(gr)["attn"]["w_o_ND"], lg(gr)["moe"]["w_router_DE"],
                  *lg(gr)["moe"]["w_up_EDF"]] for gr in grads]
    ref_mats, _ = torch_muon(mats, mat_grads, lambda s: 0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    Lo = out["layers"]["0"]
    assert rel(Lo["attn"]["w_q_DN"], ref_mats[0]) <= 1e-6 and rel(Lo["attn"]["w_o_ND"], ref_mats[1]) <= 1e-6
    assert rel(Lo["moe"]["w_router_DE"], ref_mats[2]) <= 1e-6
    assert rel(Lo["moe"]["w_up_EDF"], torch.stack(ref_mats[3:])) <= 1e-6

    decayed = [params["embed"]["w_VD"], params["head"]["w_DV"]]
    norms = [L["attn_norm"]["w_D"], params["final_norm"]["w_D"]]
    tps = [torch.nn.Parameter(p.clone()) for p in decayed + norms]
    opt = torch.optim.AdamW([{"params": tps[:2], "weight_decay": 0.1}, {"params": tps[2:], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for gr in grads:
        gs = [gr["embed"]["w_VD"], gr["head"]["w_DV"], lg(gr)["attn_norm"]["w_D"], gr["final_norm"]["w_D"]]
        for t, G in zip(tps, gs):
            t.grad = G.clone()
        opt.step()
    assert rel(out["embed"]["w_VD"], tps[0].detach()) <= 1e-6 and rel(out["head"]["w_DV"], tps[1].detach()) <= 1e-6
    assert torch.equal(Lo["attn_norm"]["w_D"], tps[2].detach())  # no decay: bitwise
    assert torch.equal(out["final_norm"]["w_D"], tps[3].detach())

    bias, new_bias = params["buffers"]["router_bias_E"], out["buffers"]["router_bias_E"]
    assert torch.equal(new_bias, bias) and torch.equal(new_bias.signbit(), bias.signbit())


def test_labels_override():
    params = model_like()
    labels = optim.default_labels(params)
    labels["layers"]["0"]["attn"]["w_q_DN"] = "adamw"
    labels["embed"]["w_VD"] = "muon"
    state = fmuon.muon(0.02, labels=labels).init(params)
    assert "layers.0.attn.w_q_DN" in state["adamw"].mu and "embed.w_VD" in state["muon"][0].mu
    labels["final_norm"]["w_D"] = "muon"
    tx = fmuon.muon(0.02, labels=labels)
    with pytest.raises(ValueError, match="final_norm.w_D"):
        tx.update(grads_for(params, 1)[0], tx.init(params), params)


def test_same_shape_leaves_batched_once_and_equal_to_one_at_a_time(monkeypatch):
    g = gen(0)
    params = {"a": torch.randn(32, 48, generator=g), "b": torch.randn(32, 48, generator=g),
              "e": torch.randn(3, 32, 48, generator=g), "c": torch.randn(48, 32, generator=g)}
    grads = grads_for(params, 3)
    calls = []
    real_ns = fmuon.newton_schulz
    monkeypatch.setattr(fmuon, "newton_schulz", lambda G, *a: calls.append(tuple(G.shape)) or real_ns(G, *a))
    together, _ = fnmoe_run(fmuon.muon(0.02), params, grads)
    assert sorted(calls[:2]) == sorted([(5, 32, 48), (1, 48, 32)])  # a, b and the 3 experts in one call
    for k in params:
        alone, _ = fnmoe_run(fmuon.muon(0.02), {k: params[k]}, [{k: gr[k]} for gr in grads])
        assert torch.equal(together[k], alone[k]), k


def test_lr_change_via_state_matches_torch_without_recompiling():
    params = {k: torch.randn(s, generator=gen(0)) * 0.02 for k, s in SHAPES.items()}
    grads = grads_for(params, 6)
    lr_at = lambda step: 0.02 if step < 3 else 0.005  # noqa: E731
    ref, _ = torch_muon(list(params.values()), [list(x.values()) for x in grads], lr_at, weight_decay=0.1,
                        adjust_lr_fn="match_rms_adamw")
    tx = fmuon.muon(0.02, weight_decay=0.1)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = optim.GradientTransformation(tx.init, torch.compile(tx.update, backend=counter, fullgraph=True))
    out, states = fnmoe_run(compiled, params, grads, before_step=lambda s, st: optim.set_hyperparams(st, lr=lr_at(s)))
    assert counter.frame_count == 1
    assert states[-1]["muon"][2].lr.item() == 0.005
    for k, r in zip(params, ref):
        assert rel(out[k], r) <= 1e-6, k


def test_lr_scale_and_options():
    assert fmuon.lr_scale(64, 16, "original") == 1.0 and fmuon.lr_scale(16, 64, "original") == 2.0
    assert fmuon.lr_scale(16, 64, "match_rms_adamw") == pytest.approx(0.2 * 8)
    assert fmuon.lr_scale(64, 16, "spectral") == 0.5 and fmuon.lr_scale(16, 64, "spectral") == 2.0
    with pytest.raises(ValueError, match="adjust_lr"):
        fmuon.scale_by_muon(adjust_lr="bogus")
    params = {"w": torch.randn(8, 16, generator=gen(0))}
    out, states = fnmoe_run(fmuon.muon(0.02, momentum_dtype=torch.bfloat16), params, grads_for(params, 2))
    assert states[-1]["muon"][0].mu["w"].dtype == torch.bfloat16 and out["w"].dtype == torch.float32
    assert optim.muon is fmuon.muon  # re-exported


# ------------------------------------------------------------------ MuonClip (qk_clip)

DENSE = dict(vocab_size=264, dim=32, n_layers=2, ffn_hidden=64, init_std=0.3, moe=MoEConfig(n_experts=0))
MLA = dict(attention="mla", n_heads=4, n_kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8)
CLIP_CFGS = {
    "gqa_shared_kv": ModelConfig(n_heads=4, n_kv_heads=2, **DENSE),
    "gqa_one_q_per_kv": ModelConfig(n_heads=4, n_kv_heads=4, **DENSE),
    "mla": ModelConfig(**MLA, **DENSE),
    "mla_q_lora": ModelConfig(**MLA, q_lora_rank=16, **DENSE),
}


def recorded_max_logits(params, tokens_BL, cfg):
    return hidden_states(params, tokens_BL, cfg, record_max_logits=True)[1]["max_logits_NH"]


def test_max_logits_match_full_scores_and_chunking():
    for cfg in CLIP_CFGS.values():
        p = init_params(cfg, seed=0)["layers"]["0"]["attn"]
        x_BLD = torch.randn(2, 10, cfg.dim, generator=gen(1))
        cos, sin = rope(cfg, torch.arange(10))
        if cfg.attention == "mla":
            q_BLHI, k_BLHI, _ = mla_qkv(p, x_BLD, cos, sin, cfg)
            scale = mla_softmax_scale(cfg)
        else:
            q_BLHI, k_BLGI = gqa_qk(p, x_BLD, cos, sin, cfg)
            k_BLHI, scale = k_BLGI.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=2), cfg.head_dim_ ** -0.5
        s_BHLL = torch.einsum("bqhi,bkhi->bhqk", q_BLHI, k_BLHI) * scale
        s_BHLL = s_BHLL.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), -torch.inf)
        want_H = s_BHLL.amax(dim=(0, 2, 3))
        assert torch.allclose(max_logits_H(p, x_BLD, cos, sin, cfg), want_H, rtol=1e-5, atol=1e-6)
        assert torch.allclose(max_logits_H(p, x_BLD, cos, sin, cfg, chunk=3), want_H, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gqa_shared_kv", "mla"])
def test_max_logits_of_packed_documents_match_each_document_alone(name):
    """With doc masks, attention never computes a logit across documents, so MuonClip must not
    read one: the packed rows' max logits equal the max over each document run as its own row."""
    cfg = CLIP_CFGS[name]
    params = init_params(cfg, seed=0)
    docs = [[5, 7, 4], [9, 7]]  # document lengths of each packed row of 16 tokens
    tokens_BL = torch.randint(0, 256, (2, 16), generator=gen(5))
    positions_BL = torch.tensor([[i for n in row for i in range(n)] for row in docs])
    _, aux = hidden_states(params, tokens_BL, cfg, record_max_logits=True, positions_BL=positions_BL)
    got_NH = aux["max_logits_NH"]
    want_NH = torch.full_like(got_NH, -torch.inf)
    for b, row in enumerate(docs):
        start = 0
        for n in row:
            want_NH = torch.maximum(want_NH, recorded_max_logits(params, tokens_BL[b:b + 1, start:start + n], cfg))
            start += n
    assert torch.allclose(got_NH, want_NH, rtol=1e-5, atol=1e-6), (got_NH, want_NH)


def head_columns(cfg) -> dict[int, list[tuple[str, slice, str]]]:
    """Per query head h, (leaf, columns, expected factor name) of the weights the clip may scale."""
    H = cfg.n_heads
    if cfg.attention == "mla":
        J, P, U = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = "w_q_b_QN" if cfg.q_lora_rank else "w_q_DN"
        I, X = J + P, J + U
        return {h: [(q, slice(h * I, h * I + J), "sqrt"), (q, slice(h * I + J, (h + 1) * I), "gamma"),
                    ("w_kv_b_CX", slice(h * X, h * X + J), "sqrt"),
                    ("w_kv_b_CX", slice(h * X + J, (h + 1) * X), "one")] for h in range(H)}
    A = cfg.head_dim_
    cols = lambda h: slice(h * A, (h + 1) * A)  # noqa: E731
    if cfg.n_kv_heads == H:
        return {h: [("w_q_DN", cols(h), "sqrt"), ("w_k_DM", cols(h), "sqrt")] for h in range(H)}
    return {h: [("w_q_DN", cols(h), "gamma")] for h in range(H)}


@pytest.mark.parametrize("name", CLIP_CFGS)
def test_qk_clip_brings_max_logits_to_tau_and_leaves_other_heads_bitwise(name):
    cfg = CLIP_CFGS[name]
    params = init_params(cfg, seed=0)
    tokens_BL = torch.randint(0, 256, (2, 16), generator=gen(2))
    before_LH = recorded_max_logits(params, tokens_BL, cfg)
    tau = before_LH.median().item()
    clipped_LH = before_LH > tau
    assert clipped_LH.any() and not clipped_LH.all()
    new = optim.qk_clip(params, before_LH, cfg, tau)

    # layer 0 sees the same input: clipped heads now peak at tau, the others exactly as before
    after_H, before_H = recorded_max_logits(new, tokens_BL, cfg)[0], before_LH[0]
    c = clipped_LH[0]
    assert (after_H[c] <= tau * (1 + 1e-5)).all() and torch.allclose(after_H[c], torch.full_like(after_H[c], tau),
                                                                      rtol=1e-5)
    assert torch.equal(after_H[~c], before_H[~c])

    scaled = {leaf for parts in head_columns(cfg).values() for leaf, _, _ in parts}
    old_flat, new_flat = flatten_dict(params), flatten_dict(new)
    for path in old_flat:  # every leaf the clip does not touch is the same tensor
        if not (path.startswith("layers.") and ".attn." in path and path.rsplit(".", 1)[1] in scaled):
            assert new_flat[path] is old_flat[path], path
    for i, layer in params["layers"].items():
        for h, parts in head_columns(cfg).items():
            gamma = tau / before_LH[int(i), h].item()
            for leaf, cols, kind in parts:
                old, got = layer["attn"][leaf][:, cols], new["layers"][i]["attn"][leaf][:, cols]
                if not clipped_LH[int(i), h] or kind == "one":
                    assert torch.equal(got, old), (i, h, leaf)
                else:
                    factor = gamma if kind == "gamma" else gamma ** 0.5
                    assert torch.allclose(got, old * factor, rtol=1e-6, atol=0), (i, h, leaf, kind)
    if cfg.attention == "mla":  # the rope key, shared by all heads, is never scaled
        assert new["layers"]["0"]["attn"]["w_kv_a_DW"] is params["layers"]["0"]["attn"]["w_kv_a_DW"]


def test_train_step_clips_after_the_update():
    """train_step with optim.qk_clip == the step without it, then qk_clip with the step's recorded max logits."""
    cfg = CLIP_CFGS["gqa_shared_kv"]
    params = init_params(cfg, seed=1)
    micro = [(torch.randint(0, 256, (2, 12), generator=gen(s)), torch.randint(0, 256, (2, 12), generator=gen(s + 9)))
             for s in (3, 4)]
    before_LH = torch.maximum(*(recorded_max_logits(params, x, cfg) for x, _ in micro))
    tau = before_LH.median().item()
    runs = [RunConfig(model=cfg, train=TrainConfig(batch_size=4, grad_accum=2), data=DataConfig(seq_len=12),
                      optim=OptimConfig(name="muon", warmup_steps=0, qk_clip=clip, qk_clip_tau=tau))
            for clip in (False, True)]
    tx = optim.from_config(runs[0].optim, 10)
    plain, clipped = (make_train_step(run, tx, train_runner(run))(init_state(params, tx), micro)[0] for run in runs)
    want = optim.qk_clip(plain.params, before_LH, cfg, tau)
    assert all(torch.equal(a, b) for a, b in zip(flatten_dict(clipped.params).values(), flatten_dict(want).values()))
    q_key = "layers.0.attn.w_q_DN"
    assert not torch.equal(flatten_dict(clipped.params)[q_key], flatten_dict(plain.params)[q_key])


def test_qk_clip_config_checks():
    with pytest.raises(ValueError, match="qk_clip_tau"):
        validate(RunConfig(optim=OptimConfig(qk_clip=True, qk_clip_tau=0.0)))
    with pytest.raises(ValueError, match="qk_norm"):
        validate(RunConfig(model=ModelConfig(qk_norm=True), optim=OptimConfig(qk_clip=True)))


def test_fnmoe_train_with_muon_end_to_end(tmp_path):
    """`fnmoe train --optim.name muon` (with MuonClip and bf16 momentum) on a tiny model: the loss falls."""
    from fnmoe.cli import main

    rc = main(["train", "--optim.name", "muon", "--optim.qk-clip", "--optim.momentum-dtype", "bfloat16",
               "--optim.warmup-steps", "0", "--optim.lr", "0.01", "--train.steps", "8", *tiny_flags(1),
               "--train.run-dir", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5 and not any(r["skipped"] for r in rows if "loss" in r)


def test_an_owner_makes_each_matrix_whole_from_every_ranks_pieces_and_cuts_its_answer_back():
    """_owner_step against a piece-by-piece reference of its wire format: by source rank, then
    matrix, each piece row-major; matrices in runs of one shape and split dim (rows and columns),
    split over 7 ranks evenly, unevenly, and into fewer rows than ranks (empty pieces)."""
    from fnmoe.parallel.sharding import chunk_lengths

    S = 7
    mine = [((14, 9), 0)] * 2 + [((20, 6), 0)] + [((5, 21), 1)] * 3 + [((3, 8), 0)] + [((14, 9), 0)]
    whole = [torch.randn(shape, generator=gen(j)).to(torch.bfloat16) for j, (shape, _) in enumerate(mine)]
    cuts = [m.split(chunk_lengths(m.shape[d], S), dim=d) for m, (_, d) in zip(whole, mine)]
    recv_Z = torch.cat([c[s].reshape(-1) for s in range(S) for c in cuts])
    out_Z = fmuon._owner_step(recv_Z, mine, S, 5, 1e-7, torch.bfloat16)
    ortho = [fmuon.newton_schulz(m, 5, 1e-7, torch.bfloat16) for m in whole]
    back = [o.split(chunk_lengths(o.shape[d], S), dim=d) for o, (_, d) in zip(ortho, mine)]
    assert torch.equal(out_Z, torch.cat([c[s].reshape(-1) for s in range(S) for c in back]))
