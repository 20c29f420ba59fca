"""Routers beyond (logits_TE, moe_cfg, bias_E): the MoE layer's index (layer=) and per-layer leaves of
their own trained by the optimizer (params=, from extra.router.<layer>), in one process, under
recompute and chunks, and on simulated meshes.

Legend: B batch, L sequence, T tokens (B·L), D model, E experts, K top-k."""
import functools

import pytest
import torch

import fnmoe
from fnmoe import optim
from fnmoe.config import DataConfig, MemoryConfig, MeshConfig, ModelConfig, MoEConfig, RunConfig
from fnmoe.memory.policies import Runner
from fnmoe.models import routing
from fnmoe.models.seams import PLAIN
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.parallel.fsdp import GATHER
from fnmoe.training.step import init_state, loss_fn, make_train_step
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
