"""The donated update (issue 43 item 6): a step that owns its state updates params and optimizer
state in place, leaf by leaf, with the values of the pure update bit for bit; a skipped step changes
nothing; a donated state used again is refused; bf16 gradients give the same update; a background
checkpoint is not torn by the step after it; the planner counts one leaf's workspace and the
rehearsal agrees."""
import dataclasses

import pytest
import torch

from fnmoe import optim
from fnmoe.config import DataConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig, TrainConfig
from fnmoe.memory.policies import train_runner
from fnmoe.optim.in_place import check_no_aliases, update_in_place
from fnmoe.parallel.sharding import init_params
from fnmoe.training.step import init_state, make_train_step
from fnmoe.training.state import DonatedError, TrainState
from fnmoe.tree import flatten_dict, tree_map

CFG = ModelConfig(vocab_size=264, dim=32, n_layers=3, n_heads=4, n_kv_heads=4, ffn_hidden=64,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1, router_bias=True,
                                bias_update_coeff=1e-3))


def _run(name: str, qk_clip: bool = True) -> RunConfig:
    # clip_norm well under the gradients' norm and a low tau: the clip and QK-clip act on every step
    return RunConfig(model=CFG, train=TrainConfig(steps=8, batch_size=2), data=DataConfig(seq_len=12),
                     optim=OptimConfig(name=name, lr=2e-2, warmup_steps=0, weight_decay=0.1, clip_norm=0.05,
                                       qk_clip=qk_clip, qk_clip_tau=1e-3))


def _batch(seed: int):
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(seed))
    return [(tokens[:, :-1], tokens[:, 1:])]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _bitwise(a, b) -> bool:
    fa, fb = flatten_dict(a), flatten_dict(b)
    return fa.keys() == fb.keys() and all(torch.equal(_bits(fa[k]), _bits(fb[k])) for k in fa)


def _copy(tree):
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), tree)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_donated_steps_equal_the_pure_steps_bitwise(name):
    """4 steps with weight decay, a clip that scales every step, the router bias's rule and QK-clip:
    params and optimizer state of the donated steps equal the pure ones bit for bit, and the donated
    step's state holds the tensors it was given (no second copy)."""
    run = _run(name)
    tx = optim.from_config(run.optim, run.train.steps)
    params = init_params(CFG, seed=3)
    pure, donated = init_state(_copy(params), tx), init_state(_copy(params), tx)
    pure_step = make_train_step(run, tx, train_runner(run))
    donated_step = make_train_step(run, tx, train_runner(run), donate=True)
    first = {k: id(v) for k, v in flatten_dict(donated.params).items()}
    clipped = scaled = 0
    for step in range(4):
        before = flatten_dict(pure.params)
        pure, m_pure = pure_step(pure, _batch(step))
        donated, m_donated = donated_step(donated, _batch(step))
        assert torch.equal(m_pure.pop("expert_counts_NE"), m_donated.pop("expert_counts_NE"))
        assert m_pure == m_donated and m_pure["skipped"] == 0
        assert _bitwise(pure.params, donated.params) and _bitwise(pure.opt_state, donated.opt_state)
        clipped += m_pure["grad_norm"] > run.optim.clip_norm
        after = flatten_dict(pure.params)
        scaled += not torch.equal(before["buffers.layers.1.moe.router_bias_E"],
                                  after["buffers.layers.1.moe.router_bias_E"])
    assert clipped == 4 and scaled >= 3  # the bias moves unless every expert got the mean count
    assert {k: id(v) for k, v in flatten_dict(donated.params).items()} == first  # written where they were
    assert donated.step == pure.step == 4
    assert optim.last_lr(donated.opt_state) == optim.last_lr(pure.opt_state)


def test_qk_clip_acts_in_the_compared_steps():
    """The comparison above covers QK-clip: with tau 1e-3 its factor is below 1 on the first step, so a
    step without it gives other attention weights (a donated step that skipped the clip would fail there)."""
    params = init_params(CFG, seed=3)
    out = {}
    for qk in (True, False):
        run = _run("adamw", qk)
        tx = optim.from_config(run.optim, run.train.steps)
        state, _ = make_train_step(run, tx, train_runner(run), donate=True)(init_state(_copy(params), tx), _batch(0))
        out[qk] = flatten_dict(state.params)
    assert not torch.equal(out[True]["layers.0.attn.w_q_DN"], out[False]["layers.0.attn.w_q_DN"])
    assert torch.equal(out[True]["layers.0.attn.w_v_DM"], out[False]["layers.0.attn.w_v_DM"])


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_non_finite_gradient_leaves_the_donated_state_bitwise_unchanged(name):
    """A NaN loss scale: every gradient is NaN; nothing is written (params, moments, step counts, the
    router bias, QK-clip's weights), the step is counted and said skipped."""
    run = _run(name)
    tx = optim.from_config(run.optim, run.train.steps)
    state = init_state(init_params(CFG, seed=3), tx)
    state, _ = make_train_step(run, tx, train_runner(run), donate=True)(state, _batch(0))  # moments non-zero

    def nan_loss(*args, **kwargs):
        from fnmoe.training.step import loss_fn
        loss, aux = loss_fn(*args, **kwargs)
        return loss * float("nan"), aux
    before = (_copy(state.params), _copy(state.opt_state))
    new, m = make_train_step(run, tx, train_runner(run), nan_loss, donate=True)(state, _batch(1))
    assert m["skipped"] == 1 and m["skipped_why"] == "non-finite loss or gradients"
    assert _bitwise(new.params, before[0]) and _bitwise(new.opt_state, before[1]) and new.step == 2


def test_a_non_finite_update_writes_no_non_finite_param():
    """Finite gradients whose update is not (eps 0: Adam's 0/0 on embedding rows no token touches):
    the pure step keeps all; the donated one writes no non-finite value, says so, and the leaves
    from the first bad one on are unchanged."""
    run = _run("adamw", qk_clip=False)
    tx = optim.adamw(lr=1e-2, eps=0.0, weight_decay=0.1)
    state = init_state(init_params(CFG, seed=3), tx)
    before = flatten_dict(_copy(state.params))
    new, m = make_train_step(run, tx, train_runner(run), donate=True)(state, _batch(0))
    assert m["skipped"] == 1 and m["skipped_why"] == "non-finite update"
    after = flatten_dict(new.params)
    assert all(torch.isfinite(t).all() for t in after.values())
    assert torch.equal(after["embed.w_VD"], before["embed.w_VD"])  # the first leaf, and the bad one


def test_a_donated_state_used_again_is_refused():
    run = _run("adamw", qk_clip=False)
    tx = optim.from_config(run.optim, run.train.steps)
    step = make_train_step(run, tx, train_runner(run), donate=True)
    old = init_state(init_params(CFG, seed=3), tx)
    new, _ = step(old, _batch(0))
    with pytest.raises(DonatedError, match=r"this TrainState \(step 0\) was donated to a train step"):
        step(old, _batch(1))
    with pytest.raises(DonatedError, match=r"params or opt_state were donated to the previous step"):
        step(TrainState(old.params, new.opt_state, new.step), _batch(1))
    with pytest.raises(DonatedError, match=r"params or opt_state were donated"):
        step(TrainState(new.params, old.opt_state, new.step), _batch(1))
    newer, m = step(new, _batch(1))  # the state the step returned goes on
    assert m["skipped"] == 0 and newer.step == 2
    # the pure step takes any state, again and again
    pure = make_train_step(run, tx, train_runner(run))
    a, _ = pure(newer, _batch(2))
    b, _ = pure(newer, _batch(2))
    assert _bitwise(a.params, b.params)


def test_aliased_leaves_are_refused_before_any_write():
    params = {"a": torch.zeros(4), "b": torch.zeros(8)}
    params["c"] = params["b"][:4]  # a view: written twice in place
    with pytest.raises(ValueError, match=r"'c' shares its memory with 'b'"):
        check_no_aliases(params, "the params")


def _grads_like(params, seed: int, bf16_exact: bool):
    g = torch.Generator().manual_seed(seed)
    out = tree_map(lambda p: torch.randn(p.shape, generator=g) * 0.3, params)
    return tree_map(lambda t: t.bfloat16().float(), out) if bf16_exact else out


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_gradients_update_bitwise_as_their_fp32_values(name):
    """A bf16 reduce-scatter's gradient cast to fp32 is exact (bf16 is fp32 with 16 low bits zero): so
    keeping the shard's gradient in bf16 and casting it leaf by leaf in the update gives the pure
    update of today's fp32 gradient bit for bit, clip (its norm of the bf16 leaves) included."""
    run = _run(name)
    tx = optim.from_config(run.optim, run.train.steps)
    params = {k: v for k, v in init_params(CFG, seed=3).items() if k != "buffers"}
    g32 = _grads_like(params, 0, bf16_exact=True)
    g16 = tree_map(lambda t: t.bfloat16(), g32)
    assert _bitwise(tree_map(lambda t: t.float(), g16), g32)
    n32, n16 = optim.global_norm(g32), optim.global_norm(g16)
    assert torch.equal(n32, n16)
    state = tx.init(params)
    updates, pure_state = tx.update(g32, state, params)
    pure_params = optim.apply_updates(params, updates)
    p, s = _copy(params), _copy(state)
    ok = torch.ones((), dtype=torch.bool)
    assert bool(update_in_place(tx, g16, s, p, ok, n16))
    assert _bitwise(p, pure_params) and _bitwise(s, pure_state)


def test_the_in_place_update_clips_by_the_whole_trees_norm():
    """The planted bug it guards against: clipping each leaf by its own norm (the leaf's tree is all a
    one-leaf call sees). With a clip at 1e-3 every leaf's own norm is far above it, so a per-leaf clip
    would give every leaf an update of norm ~1e-3 where the whole tree's gives less to each."""
    tx = optim.chain(optim.clip_by_global_norm(1e-3), optim.scale_by_learning_rate(1.0))
    params = {"a": torch.zeros(16), "b": {"c": torch.zeros(4, 4)}}
    grads = _grads_like(params, 1, bf16_exact=False)
    norm = optim.global_norm(grads)
    updates, _ = tx.update(grads, tx.init(params), params)
    p, s = _copy(params), tx.init(params)
    update_in_place(tx, grads, s, p, torch.ones((), dtype=torch.bool), norm)
    assert _bitwise(p, optim.apply_updates(params, updates))
    assert torch.linalg.vector_norm(p["a"]) < 0.9e-3


def test_a_background_save_is_not_torn_by_the_donated_step_after_it(tmp_path, monkeypatch):
    """checkpoint.async_save stages the state's CPU copies on its thread while training goes on: the
    loop waits for them before a donated step writes into that state. With staging slowed (2 s, longer than a step),
    step 2's checkpoint of the donated run has the bytes of the pure run's (--train.no-donate)."""
    import threading
    import time

    from conftest import tiny_flags
    from fnmoe import checkpoint
    from fnmoe.checkpoint import shards, verify
    from fnmoe.cli import parse_run
    from fnmoe.training.loop import train

    threads = []

    def slow_staged(snap, after):
        threads.append(threading.current_thread().name)
        time.sleep(2.0)
        return shards.staged(snap, after)
    monkeypatch.setattr(checkpoint.save, "staged", slow_staged)
    digests = {}
    for mode in ("--train.donate", "--train.no-donate"):
        run_dir = tmp_path / mode
        train(parse_run([*tiny_flags(1, "--train.eval-every", "0"), "--train.steps", "3", "--train.run-dir",
                         str(run_dir), "--checkpoint.every", "2", "--checkpoint.async-save", mode], "fnmoe train"))
        files = verify(run_dir / "checkpoints" / "step_2")["files"]
        digests[mode] = {name: f["sha256"] for name, f in files.items() if name != "config.toml"}
    assert threads == ["fnmoe-checkpoint"] * 2  # step 2's save staged in the background, both runs
    assert digests["--train.donate"] == digests["--train.no-donate"]


def test_a_stop_does_not_save_a_state_a_donated_step_wrote_into(tmp_path):
    """A step cut short (Ctrl-C) or whose metrics row failed to write leaves the loop holding the state
    it gave that step: with donation its tensors are partly or wholly the next step's, so the stop
    saves nothing and names the newest checkpoint instead of saving a torn one under the old step."""
    from fnmoe import checkpoint
    from fnmoe.data.loader import Loader, load_data
    from fnmoe.training.loop_steps import _save_on_interrupt
    from fnmoe.training.state import donate

    run = _run("adamw", qk_clip=False)
    tx = optim.from_config(run.optim, run.train.steps)
    state = TrainState(init_params(CFG, seed=3), tx.init(init_params(CFG, seed=3)), 3)
    loader = Loader(load_data(run.data, CFG.vocab_size), 12, 2, 1, 0)
    saver = checkpoint.Saver(tmp_path, run.checkpoint, last_step=2)
    donate(state)
    said = _save_on_interrupt(saver, state, run, loader)
    assert said == (f"step 4 wrote into step 3's state in place (train.donate), so that is not saved: checkpoint "
                    f"{tmp_path / 'step_2'} holds step 2; continue with --resume auto")
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
    live = TrainState(state.params, state.opt_state, 3)  # the same tensors, not donated: saved
    assert "saved checkpoint" in _save_on_interrupt(saver, live, run, loader)


@pytest.mark.launch
@pytest.mark.parametrize("fsdp,ep,opt,donate", [(1, 4, "muon", True), (2, 2, "adamw", True), (2, 2, "adamw", False)])
def test_the_planned_update_transient_is_the_rehearsed_one(fsdp, ep, opt, donate):
    """`fnmoe rehearse` (one step on fake tensors, the step the loop builds) against the planner's
    update_transient: donated, the largest leaf's workspace (Muon's dense matrices whole on their owner
    on 1 x 4; AdamW's clipped gradient, moments and step on an expert stack's shard on 2 x 2) within 1%,
    a third of the functional update's or less on this small model (a leaf is a large part of it);
    functional, its optim + 2 x params within 10%."""
    import dataclasses as dc
    from pathlib import Path

    from fnmoe.config import MeshConfig, load_config
    from fnmoe.plan.rehearse import rehearse, rehearsed_bytes
    from fnmoe.plan.summary import per_rank_bytes

    run = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")
    model = dc.replace(run.model, dim=64, n_layers=2, ffn_hidden=256, moe=dc.replace(run.model.moe, expert_hidden=128))
    run = dc.replace(run, model=model, mesh=MeshConfig(fsdp=fsdp, ep=ep), data=dc.replace(run.data, seq_len=16),
                     optim=dc.replace(run.optim, name=opt),
                     train=dc.replace(run.train, batch_size=fsdp * ep, donate=donate))
    report = rehearse(run, "worst")
    got, planned = rehearsed_bytes(report)["update_transient"], report["plan"]["per_rank_bytes"]["update_transient"]
    assert abs(got / planned - 1) < (0.01 if donate else 0.10), (got, planned)
    other = per_rank_bytes(dc.replace(run, train=dc.replace(run.train, donate=not donate)))["update_transient"]
    assert (planned < other / 3) if donate else (other < planned / 3), (planned, other)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_in_place_update_equals_the_pure_one_on_a_simulated_2x2_mesh(name):
    """DTensor params on fsdp 2 x ep 2 (4 simulated ranks): the in-place update writes each rank's shard,
    Muon's dense matrices made whole on their owners by the all-to-alls one leaf at a time, the clip by
    the mesh-wide norm; every rank's params and optimizer state equal the pure update's bit for bit over
    3 updates. (Gradients made from the params: two train steps on a simulated mesh are not bitwise
    alike run to run, so the step itself is compared in one process above.)"""
    from test_sharding import CFG as MESH_CFG

    from fnmoe import _torch
    from fnmoe.config import MeshConfig
    from fnmoe.parallel import dist as fdist
    from fnmoe.parallel import sharding
    from torch.distributed.tensor import DTensor

    def per_rank(tree) -> dict:
        out = {}
        for k, t in flatten_dict(tree).items():
            local = t.to_local() if isinstance(t, DTensor) else t
            for r, x in (_torch.local_tensors(local).items() if type(local) is not torch.Tensor else [(0, local)]):
                out[(k, r)] = _bits(x.contiguous())
        return out

    ocfg = OptimConfig(name=name, lr=2e-2, warmup_steps=0, weight_decay=0.1, clip_norm=0.05)
    tx = optim.from_config(ocfg, 3)
    with fdist.simulate(4):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2), None)
        params = init_params(MESH_CFG, 0, mesh=mesh)
        pure = (params, tx.init(params))
        donated = (_copy(params), tx.init(params))
        for s in range(3):
            grads = tree_map(lambda p: torch.sin(p * (7.0 + s) + 1.0) * 0.3, pure[0])
            norm = optim.global_norm(grads)
            updates, opt_state = tx.update(grads, pure[1], pure[0])
            pure = (optim.apply_updates(pure[0], updates), opt_state)
            ok = torch.ones((), dtype=torch.bool)
            assert bool(fdist.rank_values(update_in_place(tx, grads, donated[1], donated[0], ok, norm))[0])
        got = (per_rank(pure[0]), per_rank(pure[1])), (per_rank(donated[0]), per_rank(donated[1]))
    for a, b in zip(*got):
        assert a.keys() == b.keys() and len({r for _, r in a}) == 4
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:4]


def test_k2_fits_256_dgx_h100_with_the_donated_update_and_not_without():
    """Issue 43 item 9: K2 on 256 x dgx-h100 (80 GB), a layout of docs/memory_plan.md's dgx-h100 search
    (fsdp 32 x ep 8, full recompute + offload replaying the exchange, 16 sequences a GPU):
    the donated update's peak is params + grads + optim + one leaf's workspace and the step's peak
    fits; the functional update's transient (optim + 3.5 x params, 72 GB) does not."""
    from pathlib import Path

    from fnmoe.config import load_config
    from fnmoe.plan.search import fitted, with_layout
    from fnmoe.plan.summary import per_rank_bytes

    run = load_config(Path(__file__).resolve().parents[1] / "configs" / "kimi_k2_1t.toml")
    run = dataclasses.replace(run, plan=dataclasses.replace(run.plan, hardware="dgx-h100"))
    layout = with_layout(run, 32, 8, "full+offload, replay exchange", 16, 16, "bfloat16", 1, check=False,
                         expert_gather="compute")
    donated, b, ok = fitted(layout)
    assert all(ok) and b["total_device"] <= 80e9, b["total_device"]
    assert b["update_transient"] < 2e9 and b["params"] + b["grads"] + b["optim"] + b["update_transient"] < 55e9
    functional = per_rank_bytes(dataclasses.replace(donated, train=dataclasses.replace(donated.train, donate=False)))
    assert functional["total_device"] > 115e9, functional["total_device"]
