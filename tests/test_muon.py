"""fnmoe.muon against torch.optim.Muon (and torch.optim.AdamW for Muon's AdamW leaves).

Our weights are [in, out]; torch.optim.Muon's are [out, in], so each reference runs on W.T
and is transposed back. Momentum buffers and Newton-Schulz outputs match bitwise; params
match to ~1 ulp per step (torch rounds twice in place, p + update once), checked at 1e-6.

Legend: E experts, I in, O out.
"""
import pytest
import torch
import torch._dynamo.testing

import fnmoe.muon as fmuon
from fnmoe import optim

SHAPES = {"tall": (64, 24), "wide": (24, 64), "square": (32, 32)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


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
