"""--memory.no-keep-exchange: full recompute that sends the EP exchange's rows again in backward.

On a simulated 2x2 (fsdp x ep) mesh, fp32, routing pinned to an exactly balanced table: the loss
and every gradient equal keep-exchange's bitwise; CommMeter counts 2 all-to-all passes a MoE layer
in forward and 4 in backward (the recompute's dispatch and combine, then their backward) against
2, and the count exchange never again; the bytes live after the forward (every storage the forward
made, held weakly: fnmoe.plan.memory_report.NewStorages) drop by the exchange's two outputs, exactly, as
the planner counts. The same on real gloo ranks: tests/test_mesh_memory.py's comm check.
Legend: B batch, L sequence, T tokens a rank, K top-k, D model.
"""
import dataclasses
from pathlib import Path

import pytest
import torch

from fnmoe.config import (DataConfig, MemoryConfig, MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig,
                          load_config, validate)
from fnmoe.memory import policies as memory
from fnmoe.parallel.fsdp import GATHER
from fnmoe.plan.memory_report import NewStorages
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.parallel.sharding import init_params
from fnmoe.plan.meters import CommMeter
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict, tree_map

from conftest import pin_routing, whole

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1), compute_dtype="float32",
                  compile=False)
B, L, WORLD = 8, 16, 4
N_MOE = CFG.n_layers - CFG.moe.first_k_dense
TOKENS_BL = torch.randint(0, CFG.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(0))


def _a2a(meter: CommMeter) -> dict[str, int]:
    """all-to-all calls on ep by kind ("all_to_all": rows, "all_to_all counts")."""
    return {r["kind"]: r["calls"] for r in meter.rows() if r["kind"].startswith("all_to_all")}


def _step(keep: bool) -> dict:
    """Loss, gradients, all-to-all calls and live bytes after the forward of one 2x2 step under full
    recompute (resharding on, as train_runner runs a mesh)."""
    with fdist.simulate(WORLD):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        params = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), init_params(CFG, 0, mesh=mesh))
        b = B // WORLD
        x_BL = fdist.rank_map(lambda r: TOKENS_BL[r * b:(r + 1) * b].clone())
        runner = memory.block_runner(MemoryConfig(recompute="full", keep_exchange=keep), CFG.n_layers, reshard=True)
        live = NewStorages(set())
        with CommMeter(sharding.group_axes(mesh)) as forward, live:
            loss, _ = loss_fn(params, x_BL[:, :-1], x_BL[:, 1:], CFG, B * L, runner=runner, source=GATHER)
            live_bytes = live.live_bytes()  # every rank's, summed
        with CommMeter(sharding.group_axes(mesh)) as backward:
            loss.backward()
        grads = {k: whole(v.grad) for k, v in flatten_dict(params).items() if v.grad is not None}
        return {"loss": whole(sharding.all_sum(loss)), "grads": grads, "forward": _a2a(forward),
                "backward": _a2a(backward), "live": live_bytes}


def _planned_activations(keep: bool) -> int:
    """fnmoe plan's device activation bytes a rank for this config (read only)."""
    from fnmoe.plan.summary import plan

    run = RunConfig(model=CFG, mesh=MeshConfig(fsdp=2, ep=2), train=TrainConfig(batch_size=B),
                    data=DataConfig(seq_len=L), memory=MemoryConfig(recompute="full", keep_exchange=keep))
    # check=False: the test model's 64-token vocabulary, which the byte tokenizer's data would refuse, plans alike
    return plan(run, as_built=False, check=False)["per_rank_bytes"]["activations"]


def test_replayed_exchange_matches_kept_with_six_passes_and_less_memory(monkeypatch):
    pin_routing(monkeypatch)
    kept, replayed = _step(True), _step(False)
    assert torch.equal(kept["loss"], replayed["loss"])
    assert kept["grads"].keys() == replayed["grads"].keys() and len(kept["grads"]) > 0
    assert all(torch.equal(kept["grads"][k], replayed["grads"][k]) for k in kept["grads"])
    # a MoE layer: forward dispatch + combine and one count exchange; backward 2 kept, 4 replayed
    for got in (kept, replayed):
        assert got["forward"] == {"all_to_all": 2 * N_MOE, "all_to_all counts": N_MOE}, got["forward"]
    assert kept["backward"] == {"all_to_all": 2 * N_MOE}, kept["backward"]
    assert replayed["backward"] == {"all_to_all": 4 * N_MOE}, replayed["backward"]
    # balanced: a rank's experts receive T·K rows and T·K come back, D floats each
    T, K, D = B * L // WORLD, CFG.moe.top_k, CFG.dim
    exchange = WORLD * N_MOE * 2 * T * K * D * 4
    saved = kept["live"] - replayed["live"]
    print(f"live after forward over {WORLD} ranks: kept {kept['live']} B, replayed {replayed['live']} B, "
          f"saved {saved} B (exchange outputs {exchange} B)")
    assert saved == exchange
    assert (_planned_activations(True) - _planned_activations(False)) * WORLD == exchange


def test_no_keep_exchange_needs_full_recompute():
    """Region policies always keep the exchange (fnmoe.memory.policies): the flag alone would do nothing."""
    run = load_config(ROOT / "configs" / "tiny.toml")
    with pytest.raises(ValueError, match=r"keep_exchange=false .* needs memory.recompute='full'"):
        validate(dataclasses.replace(run, memory=MemoryConfig(moe="full", keep_exchange=False)))
    assert validate(dataclasses.replace(run, memory=MemoryConfig(recompute="full", keep_exchange=False)))
