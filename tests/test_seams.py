"""The seams for MoE research: a router of one's own, router logits and counts in aux, forward with a
runner, make_train_step with a loss, the user's own leaves (extra.*, buffers.extra.*), unknown GEMM paths
and memory policies under torch.func refused.

Legend: B batch, L sequence, T tokens (B·L), D model, E experts, K top-k, N MoE layers, V vocab."""
import dataclasses
import functools

import pytest
import torch

import fnmoe
from fnmoe import optim
from fnmoe.models import routing
from fnmoe.config import DataConfig, MemoryConfig, ModelConfig, MoEConfig, RunConfig
from fnmoe.memory.policies import Runner
from fnmoe.models.moe import expert_mlp, moe_block
from fnmoe.models.seams import PLAIN
from fnmoe.training.step import init_state, loss_fn, make_train_step
from fnmoe.tree import flatten_dict, value_and_grad

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1, first_k_dense=1))
SIGMOID = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, score_func="sigmoid", router_bias=True,
                                                           n_group=2, topk_group=1, routed_scaling_factor=2.5))
N_MOE = 2  # layers 1 and 2


def tokens(B=2, L=8, seed=0):
    return torch.randint(0, CFG.vocab_size, (B, L), generator=torch.Generator().manual_seed(seed))


def round_robin(logits_TE, m, bias_E=None):
    """A user's router: token t goes to experts t, t+1, ... (mod E) whatever its logits, weighted by
    their softmax scores, so the router still learns."""
    T, E = logits_TE.shape
    idx_TK = (torch.arange(T)[:, None] + torch.arange(m.top_k)) % E
    scores_TE = torch.softmax(logits_TE, dim=-1)
    return scores_TE.gather(1, idx_TK), idx_TK, scores_TE


def _reference_route(logits_TE, m, bias_E, sigmoid):
    """The routing formula before the router seam (DeepSeek-V3 / Qwen3), written out here."""
    scores_TE = torch.sigmoid(logits_TE) if sigmoid else torch.softmax(logits_TE, dim=-1)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    if m.n_group > 1:
        T, E = choice_TE.shape
        groups_TGS = choice_TE.view(T, m.n_group, -1)
        best_TG = groups_TGS.topk(2, dim=-1).values.sum(-1).topk(m.topk_group, dim=-1).indices
        keep_TG = torch.zeros(T, m.n_group, dtype=torch.bool).scatter(1, best_TG, True)
        choice_TE = groups_TGS.masked_fill(~keep_TG[:, :, None], float("-inf")).view(T, E)
    idx_TK = choice_TE.topk(m.top_k, dim=-1).indices
    w_TK = scores_TE.gather(1, idx_TK)
    w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
    probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True) if sigmoid else scores_TE
    return w_TK * m.routed_scaling_factor, idx_TK, probs_TE


@pytest.mark.parametrize("cfg", [CFG, SIGMOID], ids=["softmax", "sigmoid"])
def test_builtin_routers_are_the_reference_formula_bitwise(cfg):
    x_TD, w_DE = torch.randn(32, cfg.dim), torch.randn(cfg.dim, 4)
    bias_E = torch.randn(4) if cfg.moe.router_bias else None
    w_TK, idx_TK, probs_TE, logits_TE = routing.route(x_TD, w_DE, cfg, bias_E)
    ref = _reference_route(x_TD @ w_DE, cfg.moe, bias_E, cfg.moe.score_func == "sigmoid")
    for got, want in zip((w_TK, idx_TK, probs_TE), ref, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(logits_TE, x_TD @ w_DE)
    # the built-in named by score_func is what runs when no router is given
    builtin = routing.ROUTERS[cfg.moe.score_func]
    params = fnmoe.init_params(cfg, seed=0)
    assert torch.equal(fnmoe.forward(params, tokens(), cfg)[0], fnmoe.forward(params, tokens(), cfg, router=builtin)[0])


def test_a_users_router_routes_and_trains():
    params, x_BL = fnmoe.init_params(CFG, seed=0), tokens(B=2, L=8)
    logits, aux = fnmoe.forward(params, x_BL, CFG, router=round_robin)
    T, K, E = 16, CFG.moe.top_k, CFG.moe.n_experts
    assert aux["expert_counts_NE"].tolist() == [[T * K // E] * E] * N_MOE  # exactly balanced, as it routes
    assert not torch.equal(logits, fnmoe.forward(params, x_BL, CFG)[0])
    # backward's recompute runs the router again: the same gradients as without recompute

    def grads(runner):
        return flatten_dict(value_and_grad(loss_fn, has_aux=True)(params, x_BL, tokens(seed=1), CFG, 16, runner=runner,
                                                                  router=round_robin)[1])
    plain, recomputed = grads(PLAIN), grads(Runner(MemoryConfig(recompute="full"), CFG.n_layers))
    assert all(torch.equal(plain[k], recomputed[k]) for k in plain)
    run = RunConfig(model=CFG, data=DataConfig(seq_len=8))
    tx = optim.muon(lr=1e-2)
    step = make_train_step(run, tx, PLAIN, loss=functools.partial(loss_fn, router=round_robin))
    state, metrics = step(init_state(params, tx), [(x_BL, tokens(seed=1))])
    assert metrics["expert_counts_NE"].tolist() == [[T * K // E] * E] * N_MOE
    w_old, w_new = params["layers"]["1"]["moe"]["w_router_DE"], state.params["layers"]["1"]["moe"]["w_router_DE"]
    assert torch.isfinite(torch.tensor(metrics["loss"])) and not torch.equal(w_old, w_new)


def test_a_router_of_the_wrong_shape_is_refused():
    def one_expert(logits_TE, m, bias_E=None):
        idx_TK = logits_TE.argmax(-1, keepdim=True)
        return torch.ones_like(idx_TK, dtype=logits_TE.dtype), idx_TK, logits_TE.softmax(-1)
    with pytest.raises(ValueError, match=r"a router returns .* shapes \[16, 2\]"):
        fnmoe.forward(fnmoe.init_params(CFG, seed=0), tokens(), CFG, router=one_expert)


def past_the_last_expert(logits_TE, m, bias_E=None):
    w_TK, idx_TK, probs_TE = routing.softmax_router(logits_TE, m, bias_E)
    return w_TK, idx_TK + 1, probs_TE  # expert E for some tokens


def two_outputs(logits_TE, m, bias_E=None):
    return routing.softmax_router(logits_TE, m, bias_E)[:2]


@pytest.mark.parametrize("router,said", [
    (past_the_last_expert, "returned expert index 4 in idx_TK; the model has 4 experts, so indices must be in [0, 3]"),
    (lambda logits_TE, m, bias_E=None: (logits_TE[:, :2], torch.full((16, 2), -2), logits_TE),
     "returned expert index -2 in idx_TK; the model has 4 experts, so indices must be in [0, 3], or -1 for an "
     "empty slot"),
    (two_outputs, "returned 2 values; a router returns 3: (weights_TK, idx_TK, probs_TE)"),
    (lambda logits_TE, m, bias_E=None: None, "returned a NoneType; a router returns 3"),
], ids=["past-E", "negative", "two-outputs", "none"])
def test_a_users_router_that_returns_nonsense_is_named(router, said):
    """Before: an out-of-range index failed deep in the MoE block with a raw torch error, and a wrong
    count with "not enough values to unpack"; now one error naming the router and what was wrong."""
    name = f"{router.__module__}.{router.__qualname__}"
    with pytest.raises(ValueError) as e:
        fnmoe.forward(fnmoe.init_params(CFG, seed=0), tokens(), CFG, router=router)
    assert str(e.value).startswith(f"router {name} {said}"), str(e.value)


def test_aux_has_router_logits_only_when_asked_and_the_counts():
    params, x_BL = fnmoe.init_params(SIGMOID, seed=0), tokens()
    seen = []

    def spying(logits_TE, m, bias_E=None):
        seen.append(logits_TE)
        return routing.sigmoid_router(logits_TE, m, bias_E)
    assert "router_logits_NTE" not in fnmoe.forward(params, x_BL, SIGMOID)[1]
    _, aux = fnmoe.forward(params, x_BL, SIGMOID, router=spying, record_router_logits=True)
    logits_NTE = aux["router_logits_NTE"]
    assert logits_NTE.shape == (N_MOE, 16, 4) and logits_NTE.dtype == torch.float32
    assert torch.equal(logits_NTE, torch.stack(seen))
    counts_NE = aux["expert_counts_NE"]
    biases_E = [params["buffers"]["layers"][i]["moe"]["router_bias_E"] for i in ("1", "2")]
    chosen = [routing.sigmoid_router(logits_TE, SIGMOID.moe, bias_E)[1] for logits_TE, bias_E in zip(seen, biases_E)]
    assert counts_NE.tolist() == [torch.bincount(idx_TK.flatten(), minlength=4).tolist() for idx_TK in chosen]
    # in training they are detached: the loss's graph does not hold them
    (_, aux), _ = value_and_grad(loss_fn, has_aux=True)(params, x_BL, tokens(seed=1), SIGMOID, 16,
                                                        record_router_logits=True)
    assert not aux["router_logits_NTE"].requires_grad


def test_forward_with_a_runner_equals_the_default():
    params, x_BL = fnmoe.init_params(CFG, seed=0), tokens()
    logits, aux = fnmoe.forward(params, x_BL, CFG)
    for runner in (PLAIN, Runner(MemoryConfig(recompute="full"), CFG.n_layers),
                   Runner(MemoryConfig(moe="selective", attention="full"), CFG.n_layers)):
        got, got_aux = fnmoe.forward(params, x_BL, CFG, runner=runner)
        assert torch.equal(got, logits) and torch.equal(got_aux["expert_counts_NE"], aux["expert_counts_NE"])


def test_memory_policies_under_vmap_are_refused_and_plain_runs():
    params, x_BL = fnmoe.init_params(CFG, seed=0), tokens(B=3)

    def per_row(runner):
        return torch.func.vmap(lambda x_L: fnmoe.forward(params, x_L[None], CFG, runner=runner)[0])(x_BL)
    assert per_row(PLAIN).shape == (3, 1, 8, CFG.vocab_size)
    with pytest.raises(ValueError, match="memory policies .* do not run under torch.func's transforms \\(vmap\\)"):
        per_row(Runner(MemoryConfig(recompute="full"), CFG.n_layers))


def test_make_train_step_differentiates_the_loss_it_is_given():
    """A loss with an extra term (an L2 penalty on the embedding): the step's update, SGD at lr 1,
    is exactly that loss's gradient."""
    def penalised(params, *args, **kwargs):
        loss, aux = loss_fn(params, *args, **kwargs)
        return loss + 1e-2 * params["embed"]["w_VD"].square().sum(), aux
    params, x_BL, y_BL = fnmoe.init_params(CFG, seed=0), tokens(), tokens(seed=1)
    run = RunConfig(model=CFG, data=DataConfig(seq_len=8))
    tx = optim.scale_by_learning_rate(1.0)
    state, _ = make_train_step(run, tx, PLAIN, loss=penalised)(init_state(params, tx), [(x_BL, y_BL)])
    _, grads = value_and_grad(penalised, has_aux=True)(params, x_BL, y_BL, CFG, 16)
    plain_state, _ = make_train_step(run, tx, PLAIN)(init_state(params, tx), [(x_BL, y_BL)])
    for path, p in flatten_dict(params).items():
        assert torch.equal(flatten_dict(state.params)[path], p - flatten_dict(grads)[path]), path
    assert not torch.equal(state.params["embed"]["w_VD"], plain_state.params["embed"]["w_VD"])


def test_extra_leaves_are_carried_trainable_under_extra_frozen_under_buffers_extra():
    params = fnmoe.init_params(CFG, seed=0)
    adapter_V, target_V = torch.zeros(CFG.vocab_size), torch.linspace(-1, 1, CFG.vocab_size)
    tree = dict(params, extra={"logit_bias_V": adapter_V}, buffers={"extra": {"target_V": target_V}})
    x_BL, y_BL = tokens(), tokens(seed=1)
    assert torch.equal(fnmoe.forward(tree, x_BL, CFG)[0], fnmoe.forward(params, x_BL, CFG)[0])  # the model ignores them

    def pulled(p, *args, **kwargs):  # the adapter learns toward the frozen target
        loss, aux = loss_fn(p, *args, **kwargs)
        return loss + (p["extra"]["logit_bias_V"] - p["buffers"]["extra"]["target_V"]).square().sum(), aux
    run = RunConfig(model=CFG, data=DataConfig(seq_len=8))
    tx = optim.muon(lr=1e-2)  # Muon on matrices, AdamW on the rest, buffers frozen: labelled by path
    assert optim.default_labels(tree)["buffers"]["extra"]["target_V"] == "frozen"
    state, _ = make_train_step(run, tx, PLAIN, loss=pulled)(init_state(tree, tx), [(x_BL, y_BL)])
    assert torch.equal(state.params["buffers"]["extra"]["target_V"], target_V)
    moved_V = state.params["extra"]["logit_bias_V"]
    assert (moved_V.sign() == target_V.sign())[target_V != 0].all()  # one step toward the target
    with pytest.raises(ValueError, match=r"adapter_V: not a leaf of this model \(the user's own leaves go under extra"):
        fnmoe.forward(dict(params, adapter_V=adapter_V), x_BL, CFG)


def test_an_unknown_gemm_path_is_refused():
    p = fnmoe.init_params(CFG, seed=0)["layers"]["1"]["moe"]
    x_BLD = torch.randn(2, 8, CFG.dim)
    with pytest.raises(ValueError, match="gemm='grouped_mm': one of 'grouped', 'padded', 'loop', 'dense'"):
        moe_block(p, x_BLD, CFG, "grouped_mm")
    counts_E = torch.tensor([8, 8, 8, 8])
    with pytest.raises(ValueError, match="expert_mlp takes 'grouped', 'padded' or 'loop'"):
        expert_mlp(torch.randn(32, CFG.dim), p["w_gate_EDF"], p["w_up_EDF"], p["w_down_EFD"], counts_E, "dense")


def test_eval_loss_takes_the_router_the_model_trained_with():
    """eval_loss(..., router=) evaluates with that router (it used to take none and evaluate with the
    built-in silently): its loss is loss_fn's cross-entropy under the same router, batch by batch."""
    from fnmoe.training.step import eval_loss

    params, run = fnmoe.init_params(CFG, seed=0), RunConfig(model=CFG, data=DataConfig(seq_len=8))
    batches = [(tokens(seed=s)[:, :8], tokens(seed=s + 10)[:, :8]) for s in range(2)]

    def reference(router):
        ce = [loss_fn(params, x, y, CFG, router=router)[1]["ce_loss"] for x, y in batches]
        return (sum(ce) / len(ce)).item()  # equal label counts: the mean of the batches' means
    got = eval_loss(params, batches, run, router=round_robin)
    assert got == pytest.approx(reference(round_robin), rel=1e-6)
    assert got != pytest.approx(eval_loss(params, batches, run), rel=1e-6)
    assert eval_loss(params, batches, run) == pytest.approx(reference(None), rel=1e-6)


def test_a_users_loss_takes_the_router_logits_with_their_gradients():
    """With record_router_logits the logits in aux carry their graph inside the loss: a term of them
    reaches the routers and what feeds them. For the last MoE layer, d sum(logits_TE) / d w_router_DE
    is sum_t x_t for every expert (its columns equal; an earlier layer's routing weights also feed the
    later layers' logits), and a z-loss-like term changes the router's gradient."""
    params, x_BL, y_BL = fnmoe.init_params(CFG, seed=0), tokens(), tokens(seed=1)

    def logits_only(p, *args, **kwargs):
        _, aux = loss_fn(p, *args, record_router_logits=True, **kwargs)
        return aux["router_logits_NTE"].sum(), aux
    (_, aux), grads = value_and_grad(logits_only, has_aux=True)(params, x_BL, y_BL, CFG, 16)
    assert not aux["router_logits_NTE"].requires_grad  # value_and_grad's aux comes back detached
    g_DE = grads["layers"]["2"]["moe"]["w_router_DE"]
    assert g_DE.abs().sum() > 0 and torch.allclose(g_DE, g_DE[:, :1].expand_as(g_DE))
    assert grads["layers"]["1"]["moe"]["w_router_DE"].abs().sum() > 0
    assert grads["embed"]["w_VD"].abs().sum() > 0  # through the blocks below the routers

    def pulled(p, *args, **kwargs):
        loss, aux = loss_fn(p, *args, record_router_logits=True, **kwargs)
        return loss + 0.1 * aux["router_logits_NTE"].square().mean(), aux
    plain = value_and_grad(loss_fn, has_aux=True)(params, x_BL, y_BL, CFG, 16)[1]
    pulled_g = value_and_grad(pulled, has_aux=True)(params, x_BL, y_BL, CFG, 16)[1]
    w = ("layers", "1", "moe", "w_router_DE")
    assert not torch.equal(plain[w[0]][w[1]][w[2]][w[3]], pulled_g[w[0]][w[1]][w[2]][w[3]])
