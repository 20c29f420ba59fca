"""fnmoe.optim against torch.optim.AdamW and torch.nn.utils.clip_grad_norm_, plus the
combinators, schedules and from_config."""
import math

import pytest
import torch
import torch._dynamo.testing

from fnmoe import optim
from fnmoe.config import OptimConfig
from conftest import rel

SHAPES = [(64, 32), (17,), (8, 3, 5)]


def leaves(tree) -> list:
    return optim.tree_flatten_with_paths(tree)[1]



def model_like() -> dict:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    return {
        "embed": {"w_VD": r(40, 16)},
        "layers": {"0": {"attn": {"w_q_DN": r(16, 24), "w_o_ND": r(24, 16)}, "attn_norm": {"w_D": torch.ones(16)},
                         "moe": {"w_router_DE": r(16, 4), "w_up_EDF": r(4, 16, 8), "w_down_EFD": r(4, 8, 16)}}},
        "final_norm": {"w_D": torch.ones(16)},
        "head": {"w_DV": r(16, 40)},
        "buffers": {"layers": {"0": {"router_bias_E": torch.tensor([0.5, -0.0, 0.0, -1.0])}}},
    }


def run_torch_adamw(params0, grads, lr, wd, decayed, betas=(0.9, 0.999), eps=1e-8, lr_at=None):
    tps = [torch.nn.Parameter(p.clone()) for p in params0]
    groups = [{"params": [t for t, d in zip(tps, decayed) if d], "weight_decay": wd},
              {"params": [t for t, d in zip(tps, decayed) if not d], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([gr for gr in groups if gr["params"]], lr=lr, betas=betas, eps=eps, foreach=False)
    for step, gs in enumerate(grads):
        if lr_at is not None:
            for gr in opt.param_groups:
                gr["lr"] = lr_at(step)
        for t, g in zip(tps, gs):
            t.grad = g.clone()
        opt.step()
    return [t.detach() for t in tps], [opt.state[t] for t in tps]


def random_grads(shapes, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def run_fnmoe(tx, params, grads_per_step):
    state = tx.init(params)
    for gs in grads_per_step:
        updates, state = tx.update(gs, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


# ------------------------------------------------------------------ AdamW

@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch(wd):
    g = torch.Generator().manual_seed(0)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]
    grads = random_grads(SHAPES, 12)
    ref, ref_state = run_torch_adamw(params0, grads, 1e-2, wd, [True] * 3, betas=(0.9, 0.95))
    tree = {str(i): p for i, p in enumerate(params0)}
    out, state = run_fnmoe(optim.adamw(1e-2, 0.9, 0.95, 1e-8, wd), tree,
                           [{str(i): x for i, x in enumerate(gs)} for gs in grads])
    assert state.count.item() == 12
    for i, r in enumerate(ref):
        assert torch.equal(state.mu[str(i)], ref_state[i]["exp_avg"])
        assert torch.equal(state.nu[str(i)], ref_state[i]["exp_avg_sq"])
        if wd == 0:  # no decay: torch's order of operations, bitwise
            assert torch.equal(out[str(i)], r)
        else:  # decay rounds twice in place in torch, once in p + update here
            assert rel(out[str(i)], r) <= 1e-6


def _one_rank_mesh():
    """A one-rank CPU mesh over torch's fake process group: DTensor shards with real values."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", world_size=1, rank=0, store=FakeStore())
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


def test_fused_adamw_is_two_compiled_graphs_within_an_ulp_of_the_eager_ops():
    """optim.fused 'on' (CPU here; 'auto' fuses on GPUs only): 3 AdamW steps, decayed leaves and not,
    on leaves of many shapes and ranks, plain and as DTensor shards: params and moments within 2^-21
    (relative, a few ulps) of the eager ops', in two compiled graphs for every leaf (with decay and
    without); 'auto' on CPU is the eager path, bitwise."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from fnmoe import compile as fcompile
    from fnmoe.tree import flatten_dict

    fcompile.clear()
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    params = model_like()
    grads = [optim.tree_map(lambda t, k=k: torch.randn(t.shape, generator=torch.Generator().manual_seed(k)), params)
             for k in range(3)]
    ref = run_fnmoe(optim.from_config(OptimConfig(fused="off", warmup_steps=0), 10), params, grads)
    auto = run_fnmoe(optim.from_config(OptimConfig(fused="auto", warmup_steps=0), 10), params, grads)
    fused = run_fnmoe(optim.from_config(OptimConfig(fused="on", warmup_steps=0), 10), params, grads)
    mesh = _one_rank_mesh()
    try:
        shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
        sharded = run_fnmoe(optim.from_config(OptimConfig(fused="on", warmup_steps=0), 10),
                            optim.tree_map(shard, params), [optim.tree_map(shard, g) for g in grads])
    finally:
        dist.destroy_process_group()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
    (want_p, want_s), (auto_p, auto_s) = ref, auto
    assert all(torch.equal(a, b) for a, b in zip(leaves((auto_p, auto_s)), leaves((want_p, want_s))))
    for (got_p, got_s) in (fused, sharded):
        for path, w in flatten_dict({"p": want_p, "mu": want_s[1]["adamw"].mu, "nu": want_s[1]["adamw"].nu}).items():
            g = flatten_dict({"p": got_p, "mu": got_s[1]["adamw"].mu, "nu": got_s[1]["adamw"].nu})[path]
            if isinstance(g, DTensor):
                assert g.placements == (Shard(0),), path
                g = g.to_local()
            assert rel(g, w) <= 2**-21, (path, rel(g, w))


def test_adamw_mask():
    g = torch.Generator().manual_seed(0)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]
    grads = random_grads(SHAPES, 10)
    decayed = [len(s) >= 2 for s in SHAPES]
    ref, _ = run_torch_adamw(params0, grads, 3e-3, 0.1, decayed)
    tree = {"a": {"w": params0[0], "b": params0[1]}, "c": params0[2]}
    to_tree = lambda gs: {"a": {"w": gs[0], "b": gs[1]}, "c": gs[2]}  # noqa: E731
    tx = optim.adamw(3e-3, weight_decay=0.1, mask=optim.decay_mask)
    out, state = run_fnmoe(tx, tree, [to_tree(gs) for gs in grads])
    assert torch.equal(out["a"]["b"], ref[1])  # the undecayed 1-D leaf
    assert rel(out["a"]["w"], ref[0]) <= 1e-6 and rel(out["c"], ref[2]) <= 1e-6
    # a mask given as a tree does the same
    mask = {"a": {"w": True, "b": False}, "c": True}
    out2, _ = run_fnmoe(optim.adamw(3e-3, weight_decay=0.1, mask=mask), tree, [to_tree(gs) for gs in grads])
    assert all(torch.equal(x, y) for x, y in zip(leaves(out), leaves(out2)))


def test_adam_building_blocks_equal_adamw():
    g = torch.Generator().manual_seed(0)
    tree = {str(i): torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}
    grads = [{str(i): x for i, x in enumerate(gs)} for gs in random_grads(SHAPES, 10)]
    fused, _ = run_fnmoe(optim.adamw(1e-2, weight_decay=0.1), tree, grads)
    composed, _ = run_fnmoe(optim.chain(optim.scale_by_adam(), optim.add_decayed_weights(0.1),
                                        optim.scale_by_learning_rate(1e-2)), tree, grads)
    for k in tree:
        assert rel(composed[k], fused[k]) <= 1e-6


def test_lr_change_via_state_matches_torch_and_does_not_recompile():
    g = torch.Generator().manual_seed(0)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]
    grads = random_grads(SHAPES, 6)
    lr_at = lambda step: 1e-2 if step < 3 else 2e-3  # noqa: E731
    ref, _ = run_torch_adamw(params0, grads, 1e-2, 0.0, [True] * 3, lr_at=lr_at)
    tx = optim.adamw(1e-2, weight_decay=0.0)
    counter = torch._dynamo.testing.CompileCounter()
    update = torch.compile(tx.update, backend=counter, fullgraph=True)
    params = {str(i): p for i, p in enumerate(params0)}
    state = tx.init(params)
    for step, gs in enumerate(grads):
        state = optim.set_hyperparams(state, lr=lr_at(step))
        updates, state = update({str(i): x for i, x in enumerate(gs)}, state, params)
        params = optim.apply_updates(params, updates)
    assert counter.frame_count == 1  # one graph for every step and both lrs
    for i, r in enumerate(ref):
        assert torch.equal(params[str(i)], r)


# ------------------------------------------------------------------ combinators

def test_chain_partition_and_frozen():
    params = model_like()
    labels = optim.default_labels(params, muon=False)
    tx = optim.partition({"adamw": optim.chain(optim.identity(), optim.scale_by_learning_rate(0.5)),
                          "frozen": optim.set_to_zero()}, labels)
    state = tx.init(params)
    assert set(state) == {"adamw", "frozen"}
    # the adamw group's state is keyed by path; buffers are not in it
    grads = optim.tree_map(torch.ones_like, params)
    updates, state = tx.update(grads, state, params)
    assert torch.equal(updates["layers"]["0"]["attn"]["w_q_DN"], torch.full((16, 24), -0.5))
    assert state["adamw"][1].count.item() == 1
    new = optim.apply_updates(params, updates)
    bias = params["buffers"]["layers"]["0"]["router_bias_E"]
    new_bias = new["buffers"]["layers"]["0"]["router_bias_E"]
    assert torch.equal(new_bias, bias) and torch.equal(new_bias.signbit(), bias.signbit())  # -0.0 stays -0.0
    # a callable gives the same labels; an unknown label names the leaf
    tx2 = optim.partition({"adamw": optim.scale_by_learning_rate(0.5), "frozen": optim.set_to_zero()},
                          lambda p: optim.default_labels(p, muon=False))
    u2, _ = tx2.update(grads, tx2.init(params), params)
    assert all(torch.equal(a, b) for a, b in zip(leaves(updates), leaves(u2)))
    with pytest.raises(ValueError, match="embed.w_VD"):
        optim.partition({"frozen": optim.set_to_zero()}, lambda p: optim.default_labels(p, muon=False)).init(params)


def test_chain_order_and_state():
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.scale_by_learning_rate(2.0))
    state = tx.init({"w": torch.zeros(3)})
    u, state = tx.update({"w": torch.tensor([3.0, 4.0, 0.0])}, state)
    assert torch.allclose(u["w"], torch.tensor([-1.2, -1.6, 0.0]))  # clipped to norm 1, then * -2
    assert isinstance(state, tuple) and len(state) == 2


def test_apply_updates():
    params = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2, requires_grad=True)}
    a0, b0 = params["a"], params["b"]
    new = optim.apply_updates(params, {"a": torch.full((3,), 0.5), "b": torch.full((2,), -1.0)})
    assert new["a"].dtype == torch.bfloat16 and torch.equal(new["a"], torch.full((3,), 1.5, dtype=torch.bfloat16))
    assert new["b"].requires_grad and new["b"].is_leaf
    assert new["a"] is not a0 and new["b"] is not b0
    assert torch.equal(a0, torch.ones(3, dtype=torch.bfloat16))  # inputs untouched


# ------------------------------------------------------------------ clipping

@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_matches_torch(max_norm):
    grads = random_grads(SHAPES, 1)[0]
    tps = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for t, g in zip(tps, grads):
        t.grad = g.clone()
    norm_ref = torch.nn.utils.clip_grad_norm_(tps, max_norm, foreach=False)
    tree = {str(i): g for i, g in enumerate(grads)}
    tx = optim.clip_by_global_norm(max_norm)
    out, _ = tx.update(tree, tx.init(tree))
    assert torch.equal(optim.global_norm(tree), norm_ref)
    for i, t in enumerate(tps):
        assert torch.equal(out[str(i)], t.grad)


def test_global_norm_accumulates_fp32():
    x = torch.full((4096,), 0.01, dtype=torch.bfloat16)
    n = optim.global_norm({"a": x, "b": x.float()})
    assert n.dtype == torch.float32
    exact = math.sqrt(2 * 4096) * x[0].double().item()
    assert abs(n.item() - exact) / exact < 1e-6


# ------------------------------------------------------------------ schedules

def test_schedules_at_key_steps():
    peak, w, total, m = 1e-3, 10, 100, 0.1
    at = lambda s, step: s(torch.tensor(step)).item()  # noqa: E731
    cos = optim.warmup_cosine(peak, w, total, m)
    assert cos(torch.tensor(0)).dtype == torch.float32
    expect_cos = lambda step: peak * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * (step - 9) / 90)))  # noqa: E731
    for step, want in [(0, peak / 10), (4, peak / 2), (9, peak), (10, expect_cos(10)), (54, expect_cos(54)),
                       (99, peak * m), (150, peak * m)]:
        assert at(cos, step) == pytest.approx(want, rel=1e-6), step
    # no warmup: the first step is at peak
    assert at(optim.warmup_cosine(peak, 0, total, m), 0) == pytest.approx(peak, rel=1e-6)
    w_s_d = optim.wsd(peak, w, total, decay_fraction=0.2, min_ratio=m)
    # 20 decay steps, 80..99; the last stable step is 79
    for step, want in [(0, peak / 10), (9, peak), (50, peak), (79, peak), (80, peak * (1 - 0.9 / 20)),
                       (89, peak * (1 - 0.9 * 10 / 20)), (99, peak * m), (120, peak * m)]:
        assert at(w_s_d, step) == pytest.approx(want, rel=1e-6), step
    assert at(optim.constant(3e-4), 77) == pytest.approx(3e-4)


@pytest.mark.parametrize("total,fraction,last_stable,n_decay", [
    (33, 0.2, 25, 7),    # 6.6 decay steps: rounds up to 7 (floor or int() would give 6)
    (37, 0.25, 27, 9),   # 9.25: rounds down to 9 (ceil would give 10)
])
def test_wsd_decay_length_rounds_a_fractional_step_count(total, fraction, last_stable, n_decay):
    """n = round(decay_fraction x steps) decay steps where that product is not whole, written out by
    hand: the last stable step is at peak, the next one step down, the last step at peak*min_ratio."""
    at = lambda step: optim.wsd(1.0, 3, total, fraction, 0.1)(torch.tensor(step)).item()  # noqa: E731
    for step, want in [(last_stable, 1.0), (last_stable + 1, 1 - 0.9 / n_decay),
                       (last_stable + 3, 1 - 0.9 * 3 / n_decay), (total - 1, 0.1)]:
        assert at(step) == pytest.approx(want, rel=1e-6), step


def test_a_warmup_not_shorter_than_the_run_is_clamped_to_a_tenth_of_it():
    """Issue 37: 50 warmup steps on a 30-step run clamp to 3 (a tenth), with a note naming both; the
    cosine then runs from step 2 (the peak) to step 29 (peak x 0.1), values written out by hand."""
    ocfg = OptimConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.1)
    warmup, note = optim.warmup_of(ocfg, 30)
    assert warmup == 3 and "optim.warmup_steps=50" in note and "train.steps=30" in note and "3 steps" in note
    sched = optim.schedule_from_config(ocfg, ocfg.lr, 30)
    at = lambda step: sched(torch.tensor(step)).item()  # noqa: E731
    cos = lambda step: 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 2) / 27)))  # noqa: E731
    for step, want in [(0, 1e-3), (1, 2e-3), (2, 3e-3), (10, cos(10)), (29, 3e-4)]:
        assert at(step) == pytest.approx(want, rel=1e-6), step
    assert optim.warmup_of(ocfg, 51) == (50, None)  # shorter than the run: as given
    assert optim.warmup_of(OptimConfig(warmup_steps=50, schedule="constant"), 30) == (50, None)


def test_warmup_as_a_fraction_follows_the_run():
    ocfg = OptimConfig(warmup_steps=50, warmup_fraction=0.05)  # the fraction wins over the steps
    assert optim.warmup_of(ocfg, 800) == (40, None) and optim.warmup_of(ocfg, 30) == (2, None)
    sched = optim.schedule_from_config(ocfg, 1.0, 30)
    assert sched(torch.tensor(0)).item() == pytest.approx(0.5) and sched(torch.tensor(1)).item() == pytest.approx(1.0)


def test_resume_names_the_lr_jump_of_a_longer_run():
    """Extending a finished 40-step cosine run to 80 steps: the lr of step 41 goes from the floor
    (peak x 0.1) up to the 80-step cosine's value at index 40, both computed by hand; unchanged
    settings say nothing."""
    from fnmoe.checkpoint.resume import lr_jump
    from fnmoe.config import RunConfig, TrainConfig

    saved = RunConfig(optim=OptimConfig(lr=1e-3, warmup_steps=4), train=TrainConfig(steps=40))
    longer = RunConfig(optim=saved.optim, train=TrainConfig(steps=80))
    new = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (40 - 3) / (79 - 3))))
    msg = lr_jump(saved, longer, 40)
    assert msg.startswith(f"the learning rate jumps up at step 41: {1e-4:.3g} by the checkpoint's schedule") and \
        f"{new:.3g} by this run's (cosine over 80 steps" in msg and "the saved run had ended there" in msg
    assert lr_jump(saved, saved, 40) is None and lr_jump(saved, saved, 12) is None


def test_scheduled_lr_is_used_and_logged():
    sched = optim.warmup_cosine(1.0, 2, 5, 0.0)
    tx = optim.scale_by_learning_rate(sched)
    state = tx.init({"w": torch.zeros(1)})
    for step in range(4):
        u, state = tx.update({"w": torch.ones(1)}, state)
        assert u["w"].item() == pytest.approx(-sched(torch.tensor(step)).item())
        assert state.lr.item() == pytest.approx(sched(torch.tensor(step)).item())


# ------------------------------------------------------------------ from_config

@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_from_config_builds_and_steps(name):
    ocfg = OptimConfig(name=name, lr=0.02, adamw_lr=0.004, warmup_steps=2, schedule="wsd", clip_norm=1.0)
    tx, sched = optim.from_config(ocfg, total_steps=10), optim.schedule_from_config(ocfg, ocfg.lr, total_steps=10)
    assert sched(torch.tensor(1)).item() == pytest.approx(0.02)
    params = model_like()
    state = tx.init(params)
    clip_state, inner = state
    assert isinstance(clip_state, optim.ClipState)
    assert set(inner) == ({"adamw", "muon", "frozen"} if name == "muon" else {"adamw", "frozen"})
    if name == "muon":
        assert "layers.0.moe.w_up_EDF" in inner["muon"][0].mu and "embed.w_VD" in inner["adamw"].mu
        assert inner["adamw"].lr.item() == pytest.approx(0.002)  # adamw_lr on the same schedule, warmup step 0
    grads = optim.tree_map(torch.randn_like, params)
    p = params
    for _ in range(3):
        updates, state = tx.update(grads, state, p)
        p = optim.apply_updates(p, updates)
    assert torch.equal(p["buffers"]["layers"]["0"]["router_bias_E"], params["buffers"]["layers"]["0"]["router_bias_E"])
    assert not torch.equal(p["layers"]["0"]["attn"]["w_q_DN"], params["layers"]["0"]["attn"]["w_q_DN"])
    assert all(torch.isfinite(x).all() for x in leaves(p))
    no_clip = optim.from_config(OptimConfig(name=name, clip_norm=0.0), total_steps=10)
    assert not isinstance(no_clip.init(params), tuple)


def _reordered(tree: dict) -> dict:
    """The same dict (== compares equal) built in reverse insertion order, at every level."""
    return {k: _reordered(v) if isinstance(v, dict) else v for k, v in reversed(tree.items())}


@pytest.mark.parametrize("name", ["adamw", "muon", "chain"])
def test_updates_pair_leaves_by_path_not_by_insertion_order(name):
    """Grads, state and params that are equal dicts built in other insertion orders (a tree read back
    from a safetensors file lists layers "0", "1", "10", "2", ...) give the same update, leaf for leaf;
    before, a leaf's moments met another leaf's gradient (a shape error at best)."""
    torch.manual_seed(0)
    params = {"layers": {str(i): {"w_DF": torch.randn(4, 3), "norm_D": torch.randn(4)} for i in range(3)},
              "head_DV": torch.randn(4, 5)}
    grads = optim.tree_map(torch.randn_like, params)
    tx = {"adamw": lambda: optim.adamw(lr=0.1, weight_decay=0.1, mask=optim.decay_mask),
          "muon": lambda: optim.muon(lr=0.1, weight_decay=0.1),
          "chain": lambda: optim.chain(
              optim.clip_by_global_norm(1.0), optim.add_decayed_weights(0.1, optim.decay_mask),
              optim.partition({"a": optim.scale_by_adam(), "b": optim.scale_by_learning_rate(0.1)},
                              lambda t: optim.tree_map(lambda x: "a" if x.ndim > 1 else "b", t)))}[name]()
    want, _ = tx.update(grads, tx.init(params), params)
    for g, s, p in [(_reordered(grads), params, params), (grads, _reordered(params), params),
                    (grads, params, _reordered(params))]:
        got, _ = tx.update(g, tx.init(s), p)
        flat = dict(zip(*optim.tree_flatten_with_paths(got)[:2]))
        assert all(torch.equal(flat[k], v) for k, v in zip(*optim.tree_flatten_with_paths(want)[:2]))


def test_trees_that_differ_in_a_path_are_refused_naming_it():
    params = {"a_DF": torch.ones(2, 2), "b_D": torch.ones(2)}
    tx = optim.adamw(lr=0.1)
    with pytest.raises(ValueError, match=r"^adamw update: the gradient tree does not match the params: no gradient for "
                                         r"b_D; a gradient for c_D, which is not a param$"):
        tx.update({"a_DF": torch.ones(2, 2), "c_D": torch.ones(2)}, tx.init(params), params)


# ------------------------------------------------------------------ ensembles (torch.func.vmap)

def _members(n: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [optim.tree_map(lambda x: x + 0.01 * torch.randn(x.shape, generator=g) if x.is_floating_point() else x,
                           model_like()) for _ in range(n)]


ENSEMBLE_TX = {
    "adamw": lambda: optim.adamw(lr=3e-3, weight_decay=0.1, mask=optim.decay_mask),
    "muon": lambda: optim.muon(lr=0.02, weight_decay=0.1),
    "from_config muon": lambda: optim.from_config(
        OptimConfig(name="muon", lr=0.02, warmup_steps=2, schedule="wsd", clip_norm=0.5), total_steps=10),
}


@pytest.mark.parametrize("name", ENSEMBLE_TX)
def test_vmap_of_init_and_update_equals_a_loop_over_members(name):
    """An ensemble of optimizers as one batched call: vmap over tx.init and tx.update of stacked
    params, grads and states is each member's own optimizer, bitwise (its 0-D float64
    hyperparameters batched, Newton-Schulz per member)."""
    from fnmoe.func import stack, unstack
    tx, members = ENSEMBLE_TX[name](), _members()
    g = torch.Generator().manual_seed(2)
    grads = [[optim.tree_map(lambda x: torch.randn(x.shape, generator=g) * 0.1, p) for p in members]
             for _ in range(3)]
    params, state = stack(members), torch.func.vmap(tx.init)(stack(members))
    loop_params, loop_states = members, [tx.init(p) for p in members]
    for step_grads in grads:
        updates, state = torch.func.vmap(tx.update)(stack(step_grads), state, params)
        params = optim.apply_updates(params, updates)
        stepped = [tx.update(gr, s, p) for gr, s, p in zip(step_grads, loop_states, loop_params)]
        loop_states = [s for _, s in stepped]
        loop_params = [optim.apply_updates(p, u) for p, (u, _) in zip(loop_params, stepped)]
    for want, got in [(stack(loop_params), params), (stack(loop_states), state)]:
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(leaves(want), leaves(got)))
    assert len(unstack(state)) == 3


def test_an_ensemble_state_holds_one_lr_per_member():
    """A batched state's hyperparameters are the members' own: an lr sweep in one call."""
    from fnmoe.func import stack
    tx, members, lrs = optim.adamw(lr=1e-3), _members(), [1e-3, 3e-3, 1e-2]
    grads = [optim.tree_map(torch.ones_like, p) for p in members]
    state = stack([optim.set_hyperparams(tx.init(p), lr=lr) for p, lr in zip(members, lrs)])
    updates, _ = torch.func.vmap(tx.update)(stack(grads), state, stack(members))
    for m, lr in enumerate(lrs):
        want, _ = tx.update(grads[m], optim.set_hyperparams(tx.init(members[m]), lr=lr), members[m])
        assert all(torch.equal(a, b[m]) for a, b in zip(leaves(want), leaves(updates)))


def test_labels_of_a_stacked_tree_follow_the_leaf_role_not_its_rank():
    """A stacked tree's leaves have one more dim; their names' shape suffixes still say what they are:
    norms stay on AdamW without decay, matrices on Muon with it."""
    from fnmoe.func import stack
    params = model_like()
    stacked = stack([params, params])
    assert optim.default_labels(stacked) == optim.default_labels(params)
    assert optim.default_labels(stacked)["final_norm"]["w_D"] == "adamw"
    assert optim.decay_mask(stacked) == optim.decay_mask(params)
    state = optim.muon(lr=0.02).init(stacked)
    assert "final_norm.w_D" in state["adamw"].mu and "layers.0.attn.w_q_DN" in state["muon"][0].mu
    # names without a shape suffix keep the rank rule
    assert optim.default_labels({"w": torch.ones(2, 2), "b": torch.ones(2)}) == {"w": "muon", "b": "adamw"}


# ------------------------------------------------------------------ state files, schedules, from_config

@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_state_saved_flat_comes_back_with_state_from_flat(name, tmp_path):
    """Saved as checkpoints flatten it (dotted paths, safetensors) and read back into tx.init's
    structure, a state is the one saved and the next update is the same."""
    from safetensors.torch import load_file, save_file
    from fnmoe.tree import flatten_dict
    tx, params = ENSEMBLE_TX[name](), model_like()
    grads = optim.tree_map(torch.randn_like, params)
    _, state = tx.update(grads, tx.init(params), params)
    save_file(flatten_dict(state), tmp_path / "state.safetensors")
    back = optim.state_from_flat(load_file(tmp_path / "state.safetensors"), tx.init(params))
    assert optim.tree_flatten_with_paths(back)[0] == optim.tree_flatten_with_paths(state)[0]
    for want, got in [(state, back), (tx.update(grads, state, params), tx.update(grads, back, params))]:
        assert all(torch.equal(a, b) for a, b in zip(leaves(want), leaves(got)))
    flat = load_file(tmp_path / "state.safetensors")
    with pytest.raises(ValueError, match=r"the flat state and the template differ at \[.*count"):
        optim.state_from_flat({k: v for k, v in flat.items() if not k.endswith("count")}, tx.init(params))


def test_a_schedule_may_return_python_floats():
    params = model_like()
    for tx, lr in [(optim.adamw(lambda step: 1e-3 * 0.5 ** int(step)), 5e-4),  # step 1's
                   (optim.muon(lambda step: 0.02, adamw_lr=lambda step: 1e-3), 0.02)]:
        state = tx.init(params)
        for _ in range(2):
            _, state = tx.update(optim.tree_map(torch.ones_like, params), state, params)
        assert optim.last_lr(state) == pytest.approx(lr)


def test_from_config_returns_a_gradient_transformation_like_the_other_constructors():
    ocfg = OptimConfig(name="muon", lr=0.02, warmup_steps=2)
    tx = optim.from_config(ocfg, total_steps=10)
    assert isinstance(tx, optim.GradientTransformation)
    params = model_like()
    _, state = tx.update(optim.tree_map(torch.ones_like, params), tx.init(params), params)
    assert optim.last_lr(state) == pytest.approx(optim.schedule_from_config(ocfg, ocfg.lr, 10)(torch.tensor(0)).item())


def test_a_bare_adamw_leaves_buffers_frozen():
    """Buffers are frozen under every fnmoe optimizer, a bare adamw too: a router bias is not decayed,
    and a buffer a loss reads (so with a gradient) is not moved."""
    params = {"w_DF": torch.ones(2, 2), "buffers": {"router_bias_E": torch.ones(3), "extra": {"t_D": torch.ones(2)}}}
    grads = {"w_DF": torch.ones(2, 2), "buffers": {"router_bias_E": torch.zeros(3), "extra": {"t_D": torch.ones(2)}}}
    tx = optim.adamw(lr=0.1, weight_decay=0.5)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["w_DF"].abs().min() > 0
    assert not updates["buffers"]["router_bias_E"].any() and not updates["buffers"]["extra"]["t_D"].any()
