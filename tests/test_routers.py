"""Routers beyond (logits_TE, moe_cfg, bias_E): the MoE layer's index (layer=), per-layer leaves of their
own trained by the optimizer (params=, from extra.router.<layer>), and empty slots (idx -1: expert
choice, dynamic k), in one process, under recompute and chunks, and on simulated meshes.

Legend: B batch, L sequence, T tokens (B·L), D model, E experts, K top-k, C tokens an expert picks."""
import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import fnmoe
from fnmoe import optim
from fnmoe.config import DataConfig, MemoryConfig, MeshConfig, ModelConfig, MoEConfig, RunConfig
from fnmoe.memory.policies import Runner
from fnmoe.models import moe, moe_chunks, routing
from fnmoe.models.seams import PLAIN
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.parallel.fsdp import GATHER
from fnmoe.training.step import eval_loss, init_state, loss_fn, make_train_step
from fnmoe.tree import flatten_dict, value_and_grad
from conftest import rel, whole

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1, first_k_dense=1,
                                seq_aux_loss_coeff=0.01))
MOE_LAYERS = [1, 2]


def tokens(B=2, L=8, seed=0):
    return torch.randint(0, CFG.vocab_size, (B, L), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- layer=

def layered(logits_TE, m, bias_E=None, *, layer):
    """Softmax top-k with the logits scaled by the layer's index: a router whose choice depends on it."""
    return routing.softmax_router(logits_TE * (1 + layer), m, bias_E)


def test_a_router_that_names_layer_gets_each_moe_layers_index():
    """Before: route called router(logits_TE, moe_cfg, bias_E), so a router that takes layer failed with a
    TypeError. Now it gets the index of the MoE layer it routes, in every path that routes (a recompute
    in backward, token chunks, block chunks), and 3-argument routers are called as before."""
    seen = []

    def spying(logits_TE, m, bias_E=None, layer=None):  # layer may also be a positional-or-keyword parameter
        seen.append(layer)
        return layered(logits_TE, m, bias_E, layer=layer)
    params, x_BL, y_BL = fnmoe.init_params(CFG, seed=0), tokens(), tokens(seed=1)
    fnmoe.forward(params, x_BL, CFG, router=spying)
    assert seen == MOE_LAYERS
    grads = {}
    for name, mem in {"plain": None, "recompute": MemoryConfig(recompute="full"),
                      "block chunks": MemoryConfig(recompute="full", block_chunks=2)}.items():
        seen.clear()
        runner = Runner(mem, CFG.n_layers) if mem else PLAIN
        grads[name] = flatten_dict(value_and_grad(loss_fn, has_aux=True)(params, x_BL, y_BL, CFG, runner=runner,
                                                                         router=spying)[1])
        assert sorted(set(seen)) == MOE_LAYERS, (name, seen)  # recomputes route again, with the same index
    for name in ("recompute", "block chunks"):
        assert all(rel(grads[name][k], g) <= 1e-6 for k, g in grads["plain"].items()), name
    # the index reaches the choice: layer 2 routes by 3x its logits, so it differs from a layer-blind router
    assert not torch.equal(fnmoe.forward(params, x_BL, CFG, router=layered)[0], fnmoe.forward(params, x_BL, CFG)[0])
    assert routing.router_inputs(routing.softmax_router) == () and routing.router_inputs(spying) == ("layer",)


# ---------------------------------------------------------------- params=

def tempered(logits_TE, m, bias_E=None, *, params):
    """Softmax top-k of the logits times a learned temperature of the layer's own (extra.router.<i>.temp_1)."""
    return routing.softmax_router(logits_TE * params["temp_1"], m, bias_E)


def _with_temps(params, temps):
    return dict(params, extra={"router": {str(i): {"temp_1": t} for i, t in zip(MOE_LAYERS, temps)}})


def test_a_routers_own_leaves_per_layer_get_their_gradients_and_train():
    """A router that takes params= gets its layer's extra.router.<i> subtree: the gradients of those
    leaves are the ones of the same router written as a closure over the two tensors (by layer=),
    under recompute too, and a train step moves them."""
    params, x_BL, y_BL = fnmoe.init_params(CFG, seed=0), tokens(), tokens(seed=1)
    temps = [torch.tensor([1.5]), torch.tensor([0.5])]
    tree = _with_temps(params, temps)
    (loss, _), grads = value_and_grad(loss_fn, has_aux=True)(tree, x_BL, y_BL, CFG, router=tempered)

    closed_temps = {str(i): t.clone().requires_grad_() for i, t in zip(MOE_LAYERS, temps)}

    def closed(logits_TE, m, bias_E=None, *, layer):
        return routing.softmax_router(logits_TE * closed_temps[str(layer)], m, bias_E)
    want_loss = loss_fn(params, x_BL, y_BL, CFG, router=closed)[0]
    want = torch.autograd.grad(want_loss, list(closed_temps.values()))
    assert torch.equal(loss, want_loss.detach())
    for i, g in zip(MOE_LAYERS, want):
        got = grads["extra"]["router"][str(i)]["temp_1"]
        assert g.abs().sum() > 0 and torch.allclose(got, g, rtol=1e-6, atol=0), (i, got, g)
    recomputed = value_and_grad(loss_fn, has_aux=True)(tree, x_BL, y_BL, CFG, router=tempered,
                                                       runner=Runner(MemoryConfig(recompute="full"), CFG.n_layers))[1]
    assert all(torch.equal(recomputed["extra"]["router"][i]["temp_1"], grads["extra"]["router"][i]["temp_1"])
               for i in ("1", "2"))

    run = RunConfig(model=CFG, data=DataConfig(seq_len=8))
    assert eval_loss(tree, [(x_BL, y_BL)], run, router=tempered) == pytest.approx(
        loss_fn(tree, x_BL, y_BL, CFG, router=tempered)[1]["ce_loss"].item(), rel=1e-6)  # evaluated with its leaves
    tx = optim.muon(lr=1e-2)  # a [1] leaf goes to AdamW
    state, _ = make_train_step(run, tx, PLAIN, loss=functools.partial(loss_fn, router=tempered))(
        init_state(tree, tx), [(x_BL, y_BL)])
    for i, t in zip(MOE_LAYERS, temps):
        assert not torch.equal(state.params["extra"]["router"][str(i)]["temp_1"], t)
    # a router that takes params=, without its layer's leaves: one error naming the missing subtree
    with pytest.raises(ValueError, match=r"takes params=.*extra\.router\.<layer>: extra\.router\.2 is missing"):
        fnmoe.forward(dict(params, extra={"router": {"1": {"temp_1": temps[0]}}}), x_BL, CFG, router=tempered)


def scaled(logits_TE, m, bias_E=None, *, params):
    """Softmax top-k of the logits times a learned scale per expert (extra.router.<i>.scale_E)."""
    return routing.softmax_router(logits_TE * params["scale_E"], m, bias_E)


def test_a_routers_own_leaves_on_a_mesh_match_one_process():
    """On a mesh the leaves are sharded as dense leaves (FSDP over every rank), gathered once a forward
    and their gradients reduce-scattered: the loss and every gradient are one process's. A 0-D leaf
    would stay whole on each rank with no sum of its gradient: refused, saying so. (A simulated mesh
    holds the same shapes on every rank: [E] here, where a real one also takes [1].)"""
    x_BL = torch.randint(0, CFG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    scales = {"router": {str(i): {"scale_E": torch.tensor([1.5, 0.5, 1.0, 2.0]) * i} for i in MOE_LAYERS}}
    grad_fn = value_and_grad(loss_fn, has_aux=True)
    (ref_loss, _), ref = grad_fn(dict(fnmoe.init_params(CFG, 0), extra=scales), x_BL[:, :-1], x_BL[:, 1:], CFG,
                                 32, router=scaled)
    ref = flatten_dict(ref)
    assert ref["extra.router.2.scale_E"].abs().min() > 0
    for f, e in ((2, 1), (1, 2)):
        with fdist.simulate(f * e):
            mesh = sharding.make_mesh(MeshConfig(fsdp=f, ep=e))
            extra = sharding.shard_params({"extra": scales}, mesh)["extra"]
            tree = dict(fnmoe.init_params(CFG, 0, mesh=mesh), extra=extra)
            b = x_BL.shape[0] // (f * e)
            x = fdist.rank_map(lambda r: x_BL[r * b:(r + 1) * b].clone())
            (loss, _), grads = grad_fn(tree, x[:, :-1], x[:, 1:], CFG, 32, source=GATHER, router=scaled)
            assert abs(whole(sharding.all_sum(loss)).item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
            for path, g in flatten_dict(grads).items():
                assert rel(whole(g), ref[path]) <= 1e-5, ((f, e), path)
            scalar = dict(tree, extra={"router": dict(extra["router"], **{"1": {"scale_E": torch.tensor(1.5)}})})
            with pytest.raises(ValueError, match=r"extra\.router\.1\.scale_E: on a mesh a router's leaf must be"):
                loss_fn(scalar, x[:, :-1], x[:, 1:], CFG, 32, source=GATHER, router=scaled)


# ---------------------------------------------------------------- empty slots

def expert_choice(logits_TE, m, bias_E=None):
    """Expert choice (Zhou et al. 2022): each expert picks its C = T·K/(2E) highest-scoring tokens; a
    token keeps at most K of the experts that picked it (the best), and its other slots are empty (-1,
    their weights NaN: ignored). So tokens get 0..K experts."""
    T, E = logits_TE.shape
    scores_TE = torch.softmax(logits_TE, dim=-1)
    pick_CE = scores_TE.topk(T * m.top_k // E // 2, dim=0).indices
    picked_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter(0, pick_CE, True)
    w_TK, idx_TK = scores_TE.masked_fill(~picked_TE, -1.0).topk(m.top_k, dim=-1)
    empty_TK = w_TK < 0
    return w_TK.masked_fill(empty_TK, float("nan")), idx_TK.masked_fill(empty_TK, routing.EMPTY), scores_TE


def _by_loop(p, x_BLD, cfg, router):
    """The MoE block's output from router's choice, token by token and slot by slot (the reference);
    under a capacity each expert takes its first filled slots in token order."""
    x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
    w_TK, idx_TK, probs_TE, _ = routing.route(x_TD, p["w_router_DE"], cfg, None, router)
    m = cfg.moe
    capacity = math.ceil(m.capacity_factor * idx_TK.numel() / m.n_experts) if m.capacity_factor else idx_TK.numel()
    taken = [0] * m.n_experts
    out = []
    for t in range(x_TD.shape[0]):
        y_D = moe.swiglu(p["shared"], x_TD[t:t + 1])[0]
        for k in range(m.top_k):
            e = int(idx_TK[t, k])
            if e != routing.EMPTY and taken[e] < capacity:
                taken[e] += 1
                h_F = F.silu(x_TD[t] @ p["w_gate_EDF"][e]) * (x_TD[t] @ p["w_up_EDF"][e])
                y_D = y_D + w_TK[t, k] * (h_F @ p["w_down_EFD"][e])
        out.append(y_D)
    return torch.stack(out).view_as(x_BLD), idx_TK, probs_TE


@pytest.mark.parametrize("gemm,chunks,capacity", [("loop", 1, 0.0), ("padded", 1, 0.0), ("grouped", 1, 0.0),
                                                  ("dense", 1, 0.0), ("grouped", 2, 0.0), ("grouped", 1, 0.25),
                                                  ("grouped", 2, 0.25), ("dense", 1, 0.25), ("loop", 2, 1.0)])
def test_expert_choice_leaves_slots_empty_and_matches_a_loop_over_tokens(gemm, chunks, capacity, monkeypatch):
    """Before: -1 was refused. Now an empty slot is not computed (the rows that reach the expert GEMMs
    are the filled slots), not counted (counts_E, the balance losses) and adds nothing (a NaN weight
    there is ignored): output and gradients are the loop's on every expert path, in token chunks and
    under a capacity (which counts only filled rows against an expert: 0.25 keeps 2 of each expert's 4)."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, token_chunks=chunks, capacity_factor=capacity))
    p = {k: v.requires_grad_() if isinstance(v, torch.Tensor) else {n: s.requires_grad_() for n, s in v.items()}
         for k, v in fnmoe.init_params(cfg, seed=0)["layers"]["1"]["moe"].items()}
    x_BLD = torch.randn(2, 8, cfg.dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
    want, idx_TK, probs_TE = _by_loop(p, x_BLD, cfg, expert_choice)
    filled_E = torch.stack([(idx_TK == e).sum() for e in range(4)])
    assert (idx_TK == routing.EMPTY).sum() == 16 and filled_E.tolist() == [4, 4, 4, 4]  # T·K = 32 slots, 16 filled

    rows = []
    if gemm != "dense":
        gemm_fn = moe.expert_mlp
        monkeypatch.setattr(moe, "expert_mlp", lambda x_RD, *a: rows.append(x_RD.shape[0]) or gemm_fn(x_RD, *a))
    routed = moe_chunks.chunked if chunks > 1 else None
    got, stats = moe.moe_block(p, x_BLD, cfg, gemm, routed, router=expert_choice)
    kept = 8 if capacity == 0.25 else 16
    assert sum(rows) == (kept if gemm != "dense" else 0)  # the filled slots' rows alone reach the experts
    assert rel(got, want) <= 1e-6
    assert torch.equal(stats["counts_E"], filled_E) and stats["dropped"] == 16 - kept
    T, K, E = 16, 2, 4
    assert torch.allclose(stats["balance_loss"], E * (filled_E / (T * K) * probs_TE.mean(0)).sum())
    seq_counts_BE = torch.stack([torch.stack([(idx_TK[b * 8:(b + 1) * 8] == e).sum() for e in range(E)])
                                 for b in range(2)])
    seq_want = (E * seq_counts_BE / (8 * K) * probs_TE.view(2, 8, E).mean(1)).sum(-1).mean()
    assert torch.allclose(stats["seq_balance_loss"], seq_want)

    g_out = torch.randn_like(got)
    leaves = [x_BLD, p["w_router_DE"], p["w_gate_EDF"], p["w_down_EFD"], p["shared"]["w_up_DF"]]
    got_g = torch.autograd.grad(got, leaves, g_out)
    want_g = torch.autograd.grad(_by_loop(p, x_BLD, cfg, expert_choice)[0], leaves, g_out)
    for a, b in zip(got_g, want_g):
        assert torch.isfinite(a).all() and rel(a, b) <= 1e-5


def test_a_token_with_every_slot_empty_gets_the_shared_experts_alone():
    def nobody(logits_TE, m, bias_E=None):
        w_TK, idx_TK, probs_TE = routing.softmax_router(logits_TE, m, bias_E)
        return w_TK, torch.full_like(idx_TK, routing.EMPTY), probs_TE
    p = fnmoe.init_params(CFG, seed=0)["layers"]["1"]["moe"]
    x_BLD = torch.randn(2, 8, CFG.dim)
    out, stats = moe.moe_block(p, x_BLD, CFG, "grouped", router=nobody)
    assert torch.equal(out, moe.swiglu(p["shared"], x_BLD))
    assert stats["counts_E"].tolist() == [0] * 4 and stats["balance_loss"] == 0


def up_to_k(logits_TE, m, bias_E=None, *, layer):
    """Dynamic k, token by token: the top-k softmax experts whose score is at least 0.2 + 0.05 x the
    layer's index, the rest empty."""
    w_TK, idx_TK, probs_TE = routing.softmax_router(logits_TE * 8, m, bias_E)
    return w_TK, idx_TK.masked_fill(w_TK < 0.2 + 0.05 * layer, routing.EMPTY), probs_TE


def test_empty_slots_train_and_match_one_process_on_meshes_with_expert_parallelism():
    """A token-local router that leaves slots empty routes every token as one process does on any
    mesh: the loss (with the Switch balance loss, whose token count a rank no longer derives from
    the expert counts) and every gradient match one process, under expert parallelism too, and with
    block chunks, whose chunks run the exchange as steps (moe_steps: the layer reaches the router
    there too); the step trains."""
    x_BL = torch.randint(0, CFG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    grad_fn = value_and_grad(loss_fn, has_aux=True)
    params = fnmoe.init_params(CFG, 0)
    (ref_loss, aux), ref = grad_fn(params, x_BL[:, :-1], x_BL[:, 1:], CFG, 32, router=up_to_k)
    assert 0 < aux["expert_counts_NE"].sum() < 2 * 32 * 2  # some slots empty, some filled
    ref = flatten_dict(ref)
    chunks = MemoryConfig(recompute="full", block_chunks=2)
    for f, e, mem in ((2, 1, None), (1, 2, None), (2, 2, None), (1, 2, chunks)):
        with fdist.simulate(f * e):
            mesh = sharding.make_mesh(MeshConfig(fsdp=f, ep=e))
            b = x_BL.shape[0] // (f * e)
            x = fdist.rank_map(lambda r: x_BL[r * b:(r + 1) * b].clone())
            runner = Runner(mem, CFG.n_layers) if mem else None
            (loss, _), grads = grad_fn(fnmoe.init_params(CFG, 0, mesh=mesh), x[:, :-1], x[:, 1:], CFG, 32,
                                       runner=runner, source=GATHER, router=up_to_k)
            assert abs(whole(sharding.all_sum(loss)).item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), (f, e)
            for path, g in flatten_dict(grads).items():
                assert rel(whole(g), ref[path]) <= 1e-5, ((f, e), path)

    run = RunConfig(model=CFG, data=DataConfig(seq_len=8))
    tx = optim.muon(lr=1e-2)
    state, metrics = make_train_step(run, tx, PLAIN, loss=functools.partial(loss_fn, router=expert_choice))(
        init_state(params, tx), [(x_BL[:, :-1], x_BL[:, 1:])])
    assert metrics["expert_counts_NE"].tolist() == [[8] * 4] * 2 and torch.isfinite(torch.tensor(metrics["loss"]))


def all_three(logits_TE, m, bias_E=None, *, layer, params):
    """layer=, params= and empty slots at once: scaled logits, the slots under 0.3 empty."""
    w_TK, idx_TK, probs_TE = routing.softmax_router(logits_TE * params["scale_E"] * (1 + layer), m, bias_E)
    return w_TK, idx_TK.masked_fill(w_TK < 0.3, routing.EMPTY), probs_TE


@pytest.mark.slow  # ~2 min of compiling on 2 cores with a cold cache
def test_a_compiled_moe_region_takes_layer_params_and_empty_slots():
    """Under model.compile the MoE region traces the router with its layer (symbolic from the second
    layer on), its leaves and the empty slots' data-dependent rows: the loss, the counts and every
    gradient are eager's."""
    cfg = dataclasses.replace(CFG, n_layers=4)
    params = dict(fnmoe.init_params(cfg, seed=0),
                  extra={"router": {str(i): {"scale_E": torch.tensor([1.5, 0.5, 1.0, 2.0])} for i in (1, 2, 3)}})
    grad_fn = value_and_grad(loss_fn, has_aux=True)
    (loss, aux), grads = grad_fn(params, tokens(), tokens(seed=1), cfg, router=all_three)
    (c_loss, c_aux), c_grads = grad_fn(params, tokens(), tokens(seed=1), dataclasses.replace(cfg, compile=True),
                                       router=all_three)
    assert abs(c_loss.item() - loss.item()) <= 1e-6 * abs(loss.item())
    assert torch.equal(c_aux["expert_counts_NE"], aux["expert_counts_NE"])
    assert aux["expert_counts_NE"].sum() < 3 * 16 * 2  # slots were left empty
    c_grads = flatten_dict(c_grads)
    assert all(rel(c_grads[k], g) <= 1e-5 for k, g in flatten_dict(grads).items())
