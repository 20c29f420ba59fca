"""torch.func over fnmoe.forward and fnmoe.loss_fn, against independent references: per-example
gradients against a loop of autograd gradients (the fast paths: SDPA, fnmoe's grouped GEMM), jvp
and Hessian-vector products against central differences in fp64 with routing pinned, ensembles
against separate forwards. Legend: B batch, L sequence, V vocab, M ensemble members.
"""
import dataclasses
import json

import pytest
import torch
from torch import func

from fnmoe import func as ffunc
from fnmoe.models import moe, transforms
from fnmoe.parallel import sharding
from fnmoe.parallel import dist as fdist
from fnmoe.config import MeshConfig, ModelConfig, MoEConfig
from fnmoe.models.transformer import forward
from fnmoe.parallel.sharding import init_params
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict, tree_map, unflatten_dict, value_and_grad
from conftest import rel, tiny_flags

GQA = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1, first_k_dense=1,
                                aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01, z_loss_coeff=1e-3))
MLA = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, attention="mla", q_lora_rank=16, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=0, score_func="sigmoid",
                                n_group=2, topk_group=1, router_bias=True, routed_scaling_factor=2.5,
                                capacity_factor=1.5))
CONFIGS = {"gqa-softmax-shared-dense": GQA, "mla-sigmoid-grouped-biased-capacity": MLA}
B, L = 3, 8


def _batch(cfg, seed=1):
    tokens = torch.randint(0, cfg.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(seed))
    labels = tokens[:, 1:].clone()
    labels[0, :3] = -100  # uneven ignored labels: each example's mean has its own count
    return tokens[:, :-1], labels


def _params(cfg, seed=0, dtype=None):
    params = init_params(cfg, seed)
    if cfg.moe.router_bias:  # a non-zero bias, so that it takes part in the choice
        flat = flatten_dict(params)
        for k in flat:
            if k.endswith("router_bias_E"):
                flat[k].copy_(torch.randn(flat[k].shape, generator=torch.Generator().manual_seed(7)) * 0.1)
    return params if dtype is None else tree_map(lambda t: t.to(dtype) if t.is_floating_point() else t, params)


def _pin_routing(monkeypatch):
    """Routing decided by a fixed per-token table (gaps of 10 over scores in [0, 1], passed where the
    score-correction bias goes), so a finite-difference step cannot flip an expert choice."""
    route = moe.route

    def pinned(x_TD, w_router_DE, cfg, bias_E=None, router=None, **given):
        T, E = x_TD.shape[0], w_router_DE.shape[1]
        pin_TE = (torch.arange(T, device=x_TD.device)[:, None] * 5 + torch.arange(E, device=x_TD.device) * 3) % E
        return route(x_TD, w_router_DE, cfg, pin_TE.to(x_TD.dtype) * 10, router, **given)
    monkeypatch.setattr(moe, "route", pinned)


def _max_rel(a: dict, b: dict) -> float:
    return max(rel(a[k], b[k]) for k in b)


@pytest.mark.parametrize("name", CONFIGS)
def test_per_example_grads_from_vmap_equal_a_loop_of_autograd_grads(name):
    cfg = CONFIGS[name]
    params, (inputs, labels) = _params(cfg), _batch(cfg)
    got = ffunc.per_example_grads(params, inputs, labels, cfg)
    assert "buffers" not in got
    norms = ffunc.per_example_grad_norms(params, inputs, labels, cfg)
    for b in range(B):  # the reference: autograd on the fast paths (SDPA, grouped GEMM), one example at a time
        n = (labels[b] != -100).sum()
        _, want = value_and_grad(loss_fn, has_aux=True)(params, inputs[b:b + 1], labels[b:b + 1], cfg, n)
        want = {k: v for k, v in flatten_dict(want).items() if not k.startswith("buffers")}
        mine = {k: v[b] for k, v in flatten_dict(got).items()}
        assert mine.keys() == want.keys()
        assert _max_rel(mine, want) < 1e-5, name  # measured 6.4e-7 at most
        want_norm = torch.stack([g.square().sum() for g in want.values()]).sum().sqrt()
        assert rel(norms[b], want_norm) < 1e-6  # measured 8.3e-8


@pytest.mark.parametrize("name", CONFIGS)
def test_jvp_and_hvp_equal_central_differences_in_fp64(name, monkeypatch):
    _pin_routing(monkeypatch)
    cfg = dataclasses.replace(CONFIGS[name], compute_dtype="float64")
    params, (inputs, labels) = _params(cfg, dtype=torch.float64), _batch(cfg)
    rest, full = ffunc.trainable(params)
    t = tree_map(lambda x: torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(3)), rest)

    def loss(tree):
        return loss_fn(full(tree), inputs, labels, cfg, (labels != -100).sum())[0]

    def shifted(h):
        return tree_map(lambda p, v: p + h * v, rest, t)
    h = 1e-6  # the difference converges as h^2 here (tangents of unit scale): 2.6e-6 at 1e-5, 2.4e-8 at 1e-6
    value, tangent = func.jvp(loss, (rest,), (t,))
    assert rel(value, loss(rest)) < 1e-12
    fd = (loss(shifted(h)) - loss(shifted(-h))) / (2 * h)
    assert rel(tangent, fd) < 1e-6  # measured 2.4e-8

    _, linear = func.linearize(loss, rest)
    assert rel(linear(t), tangent) < 1e-10

    def grads(tree):  # the reference: autograd's gradient (value_and_grad), not torch.func's
        return flatten_dict(value_and_grad(loss)(tree)[1])
    hv = flatten_dict(ffunc.hvp(loss, rest, t))
    g_plus, g_minus = grads(shifted(h)), grads(shifted(-h))
    fd_hv = {k: (g_plus[k] - g_minus[k]) / (2 * h) for k in g_plus}
    assert _max_rel(hv, fd_hv) < 1e-6  # measured 2.1e-8

    def along_t(tree):  # reverse-over-reverse: grad of <grad, t> is H t too (the composite paths again)
        return sum((g * v).sum() for g, v in zip(flatten_dict(func.grad(loss)(tree)).values(),
                                                 flatten_dict(t).values()))
    assert _max_rel(flatten_dict(func.grad(along_t)(rest)), hv) < 1e-10


@pytest.mark.parametrize("name", CONFIGS)
def test_vmap_over_stacked_params_and_over_tokens_equals_separate_forwards(name):
    cfg = CONFIGS[name]
    members = [_params(cfg, seed) for seed in range(4)]
    inputs, _ = _batch(cfg)
    logits_MBLV = ffunc.ensemble_forward(ffunc.stack(members), inputs, cfg)
    for m, p in enumerate(members):
        assert rel(logits_MBLV[m], forward(p, inputs, cfg)[0]) < 1e-5  # measured 2.2e-7
    assert all(rel(a, b) == 0 for a, b in zip(flatten_dict(ffunc.unstack(ffunc.stack(members))[2]).values(),
                                              flatten_dict(members[2]).values()))

    # each row on its own (with capacity drops, a row's routing is not the whole batch's)
    per_row = func.vmap(lambda x_L: forward(members[0], x_L[None], cfg)[0][0])(inputs)
    for b in range(B):
        assert rel(per_row[b], forward(members[0], inputs[b:b + 1], cfg)[0][0]) < 1e-5  # measured 1.8e-7


def test_grad_and_value_and_vjp_equal_value_and_grad_and_bf16_per_example_grads_are_close():
    cfg = GQA
    params, (inputs, labels) = _params(cfg), _batch(cfg)
    n = (labels != -100).sum()
    (want_value, _), want = value_and_grad(loss_fn, has_aux=True)(params, inputs, labels, cfg, n)
    got, (value, _) = func.grad_and_value(loss_fn, has_aux=True)(params, inputs, labels, cfg, n)
    assert rel(value, want_value) < 1e-6 and _max_rel(flatten_dict(got), flatten_dict(want)) < 1e-5
    out, pullback = func.vjp(lambda p: loss_fn(p, inputs, labels, cfg, n)[0], params)
    assert _max_rel(flatten_dict(pullback(torch.ones_like(out))[0]), flatten_dict(want)) < 1e-5

    bf16 = dataclasses.replace(cfg, compute_dtype="bfloat16")
    norms_fp32 = ffunc.per_example_grad_norms(params, inputs, labels, cfg)
    norms_bf16 = ffunc.per_example_grad_norms(params, inputs, labels, bf16)
    assert rel(norms_bf16, norms_fp32) < 5e-3  # bf16 compute under vmap: measured 3.7e-4


def test_dense_experts_equal_the_routed_paths_with_capacity_drops():
    """moe.impl='dense' (what vmap and jvp run) against the loop, the reference path, with rows
    over capacity dropped: the same output, counts and drops."""
    cfg = dataclasses.replace(MLA, moe=dataclasses.replace(MLA.moe, capacity_factor=0.75))
    params, (inputs, _) = _params(cfg), _batch(cfg)
    want, want_aux = forward(params, inputs, dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl="loop")))
    got, got_aux = forward(params, inputs, dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl="dense")))
    assert want_aux["dropped_N"].sum() > 0
    assert rel(got, want) < 1e-5  # measured 7.2e-8
    for k in ("expert_counts_NE", "dropped_N"):
        assert torch.equal(got_aux[k], want_aux[k])


def test_paths_change_only_under_transforms_and_sharded_params_refuse_them():
    cfg = dataclasses.replace(GQA, compile=True)
    assert transforms.model_config(cfg) is cfg  # no transform: the config as it is, no cost

    def seen(x):
        seen.cfg = transforms.model_config(cfg)
        return x.sum()
    func.grad(seen)(torch.ones(2))
    assert (seen.cfg.compile, seen.cfg.attention_impl, seen.cfg.moe.impl) == (False, "auto", "auto")
    func.vmap(seen)(torch.ones(2, 2))
    assert (seen.cfg.attention_impl, seen.cfg.moe.impl) == ("math", "dense")
    func.jvp(seen, (torch.ones(2),), (torch.ones(2),))
    assert (seen.cfg.attention_impl, seen.cfg.moe.impl) == ("math", "dense")

    with fdist.simulate(2):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=1))
        params = init_params(GQA, 0, mesh=mesh)
        inputs, labels = _batch(GQA)
        with pytest.raises(ValueError, match="do not run over sharded params"):
            func.grad(lambda p: loss_fn(p, inputs, labels, GQA, 24)[0])(params)


def test_repeat_and_gather_rows_functions_batch():
    """The MoE permutation's autograd Functions under vmap (and vmap of grad), against plain indexing."""
    x_BTD = torch.randn(2, 5, 3, dtype=torch.float64)
    idx_TK = torch.tensor([[1, 0], [2, 1], [0, 2], [1, 1], [2, 0]])
    order_R = torch.argsort(idx_TK.reshape(-1), stable=True)
    inverse_R = torch.argsort(order_R)

    def repeat(x_TD):
        return moe._RepeatRows.apply(x_TD, order_R, inverse_R, 2)
    assert torch.equal(func.vmap(repeat)(x_BTD), x_BTD[:, order_R // 2])

    def gather(x_RD):
        return moe._GatherRows.apply(x_RD, inverse_R, order_R, False, False)
    x_BRD = torch.randn(2, 10, 3, dtype=torch.float64)
    assert torch.equal(func.vmap(gather)(x_BRD), x_BRD[:, inverse_R])
    g = func.vmap(func.grad(lambda x: (gather(x) * torch.arange(30.).view(10, 3)).sum()))(x_BRD)
    assert torch.equal(g[0], torch.arange(30., dtype=torch.float64).view(10, 3)[order_R])


def test_top_hessian_eigenvalue_from_hvps_equals_the_dense_hessians():
    """Power iteration with fnmoe.func.hvp (forward-over-reverse) on a model of ~2,900 parameters
    after 30 gradient steps, against the eigenvalues of its whole Hessian from reverse-over-reverse
    plain autograd (on the composite paths, set in the config: autograd cannot know at forward time
    that it will differentiate a backward). The negated loss has a negative eigenvalue of largest
    magnitude: the shifted second run must still find the top one."""
    cfg = ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=16, max_seq_len=8,
                      compute_dtype="float64", attention_impl="math",
                      moe=MoEConfig(n_experts=2, top_k=1, expert_hidden=16, first_k_dense=0, aux_loss_coeff=0.01,
                                    impl="dense"))
    rest, full = ffunc.trainable(_params(cfg, dtype=torch.float64))
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(5))

    def loss(tree):
        return loss_fn(full(tree), tokens[:, :-1], tokens[:, 1:], cfg, 16)[0]
    for _ in range(30):  # at init the spectrum's two ends have one magnitude (13.39, -13.08): too slow to tell apart
        rest = tree_map(lambda p, g: p - 0.5 * g, rest, value_and_grad(loss)(rest)[1])
    flat = flatten_dict(rest)
    x = torch.cat([v.flatten() for v in flat.values()])
    assert 2000 < x.numel() < 4000

    def loss_flat(x):
        parts = x.split([v.numel() for v in flat.values()])
        return loss(unflatten_dict({k: p.view(v.shape) for (k, v), p in zip(flat.items(), parts)}))
    eig = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss_flat, x, vectorize=True))
    got, hvps = ffunc.top_hessian_eigenvalue(loss, rest, iters=100, tol=1e-3)
    assert abs(got - eig[-1].item()) <= 0.01 * abs(eig[-1].item()), (got, eig[-3:], hvps)  # 6.5613 vs 6.5614, 14 HVPs
    got, hvps = ffunc.top_hessian_eigenvalue(lambda t: -loss(t), rest, iters=200, tol=1e-3)
    assert abs(got + eig[0].item()) <= 0.01 * abs(eig[0].item()), (got, eig[:3], hvps)  # 1.68807 vs 1.68816, 81 HVPs


def test_sharpness_tool_on_a_checkpoint(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    from fnmoe.cli import main

    assert main(["train", "--train.steps", "2", "--train.run-dir", str(tmp_path), *tiny_flags(1)]) == 0
    spec = importlib.util.spec_from_file_location("sharpness", Path(__file__).parents[1] / "tools" / "sharpness.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    capsys.readouterr()
    got = tool.sharpness(tmp_path, batch_size=4, iters=8, tol=1e-3)  # the estimate's accuracy: the test above
    assert got["hvps"] <= 2 * 8 and got["tokens"] == 4 * 32
    # the tool's loss is the run's own final held-out loss: the same params and windows (eval: 1 x 4)
    val_loss = [json.loads(row)["val_loss"] for row in (tmp_path / "metrics.jsonl").read_text().splitlines()
                if "val_loss" in json.loads(row)][-1]
    assert abs(got["loss"] - val_loss) < 1e-5
    assert tool.main(["--from", str(tmp_path), "--batch-size", "2", "--iters", "2", "--every", "2"]) == 0
    got = capsys.readouterr()
    assert "top Hessian eigenvalue" in got.out
    # progress on stderr: the first iteration, then every --every-th
    assert "iteration 1 (at most 2 a run): eigenvalue " in got.err and "iteration 2 (at most 2" in got.err, got.err
    assert tool.main(["--from", str(tmp_path / "nowhere")]) == 2
