"""fnmoe rehearse: one rank of a full mesh, one real step on fake tensors, against the planner.

The truth at small scale (the rehearsal's bytes against a real gloo run of the same config) is in
tests/test_mesh_memory.py, which has the 2x2 launch."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from fnmoe import cli
from fnmoe.config import MemoryConfig, MeshConfig, load_config
from fnmoe.plan.rehearse import compare, held_bytes, rehearse, rehearsed_bytes, rehearsed_comm

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _tiny(fsdp: int, ep: int, **memory):
    run = load_config(ROOT / "configs" / "tiny.toml")
    return dataclasses.replace(run, mesh=MeshConfig(fsdp=fsdp, ep=ep), memory=MemoryConfig(**memory),
                               train=dataclasses.replace(run.train, batch_size=fsdp * ep * 2))


@pytest.mark.parametrize("fsdp,ep,memory,accum,opt", [(2, 2, {}, 2, "adamw"),
                                                      (4, 2, {"recompute": "full", "offload": True}, 1, "adamw"),
                                                      (1, 8, {"recompute": "full"}, 1, "muon")])
@pytest.mark.launch
def test_tiny_rehearsal_agrees_with_the_plan(fsdp, ep, memory, accum, opt):
    """Three meshes, policies and optimizers; with 2 micro-batches the gradients live twice (they
    lived three times before the step summed them leaf by leaf), and Muon's update holds more."""
    run = _tiny(fsdp, ep, **memory)
    run = dataclasses.replace(run, optim=dataclasses.replace(run.optim, name=opt),
                              train=dataclasses.replace(run.train, batch_size=fsdp * ep * 2 * accum, grad_accum=accum))
    report = rehearse(run, "worst")
    assert not dist.is_initialized()  # the fake group is gone after
    cmp = compare(report)
    assert cmp["ok"], cmp
    got, planned = rehearsed_bytes(report), report["plan"]["per_rank_bytes"]
    # state is exact: the same shards the planner counts (gradients peak a padded reduce-scatter higher)
    assert got["params"] == planned["params"]
    assert 0 <= got["grads"] - planned["grads"] <= 0.02 * planned["grads"], (got["grads"], planned["grads"])
    assert abs(got["optim"] - planned["optim"]) <= 128, (got["optim"], planned["optim"])  # + the scalars (step, lr)
    comm = rehearsed_comm(report)
    assert comm["fsdp"] == report["plan"]["comm_bytes_detail"]["fsdp"]
    assert comm["ep"] == report["plan"]["comm_bytes_detail"]["ep"]
    if memory.get("offload"):
        assert got["offload_host"] > 0
        assert abs(got["offload_host"] / planned["offload_host"] - 1) < 0.1, (got, planned)


@pytest.mark.launch
@pytest.mark.slow
def test_worst_rank_holds_the_most_and_ranks_differ():
    """torch.chunk gives leading ranks the larger shards when a dim does not divide (5 ranks): rank 0
    is the worst. Two rehearsals of different ranks in one process, each in its own (DTensor caches
    plans by mesh value: in one process the second took the first rank's local shapes)."""
    run = _tiny(5, 1)
    held = held_bytes(run)
    assert held[0] == max(held) > held[4]
    worst, last = rehearse(run, "worst"), rehearse(run, 4)
    assert (worst["rank"], last["rank"]) == (0, 4)
    assert worst["memory"]["end"]["params"] == held[0] and last["memory"]["end"]["params"] == held[4]


@pytest.mark.launch
@pytest.mark.slow
def test_checkpoint_index_grows_with_the_world_only_by_its_files():
    """index.json of 4 and of 32 ranks: each rank adds its two files and its RNG entry (0.53 kB),
    not a part per leaf (version 1 added 16 kB a rank here, 250 kB a rank for the 1T preset)."""
    small, big = rehearse(_tiny(2, 2), 0), rehearse(_tiny(16, 2), 0)
    per_rank = (big["index_json_bytes"] - small["index_json_bytes"]) / (32 - 4)
    assert 0 < per_rank < 800, per_rank


def test_bad_input_is_named():
    run = _tiny(2, 2)
    with pytest.raises(ValueError, match="--rank 4 is out of range: the mesh has ranks 0..3"):
        rehearse(run, 4)
    with pytest.raises(ValueError, match="--rank -1 is out of range"):
        rehearse(run, -1)
    with pytest.raises(ValueError, match="at most"):
        rehearse(dataclasses.replace(run, mesh=MeshConfig(fsdp=1 << 14, ep=8)), 0)
    with pytest.raises(ValueError, match="n_experts=8 must be a positive multiple of mesh.ep=3"):
        rehearse(_tiny(1, 3), 0)
    assert cli.main(["rehearse", "--config", str(ROOT / "configs" / "tiny.toml"), "--rank", "x"]) == 2


def test_cli_json_and_exit_code(capsys):
    code = cli.main(["rehearse", "--config", str(ROOT / "configs" / "tiny.toml"), "--mesh.fsdp", "2", "--mesh.ep", "2",
                     "--json"])
    got = capsys.readouterr()
    out = json.loads(got.out)  # stdout is the report alone; the phases are said on stderr as they begin
    assert code == 0 and out["compare"]["ok"] and out["world"] == 4
    phases = [line.split("...")[0] for line in got.err.splitlines() if line.startswith("rehearse: ")]
    assert phases == ["rehearse: init: rank 0 of 4 (fsdp 2 x ep 2), its param shards and optimizer state "
                      "(fake tensors)", "rehearse: forward of micro-batch 1 of 1",
                      "rehearse: backward of micro-batch 1 of 1",
                      "rehearse: update: reduce-scatters, optimizer",
                      "rehearse: index: the checkpoint's index.json of every rank's shards"] + phases[-1:], got.err
    assert phases[-1].startswith("rehearse: done in ") and "(index took " in phases[-1]
    assert {r["kind"] for r in out["collectives"]} >= {"all_gather", "reduce_scatter", "all_to_all"}


@pytest.mark.launch
def test_a_mid_size_preset_at_64_ranks_agrees_with_the_plan():
    """deepseek_v3_16b's shapes (cut to 4 layers: 3 MoE) on fsdp 8 x ep 8 = 64 ranks, its memory
    policy, the worst rank: every category and collective within the rehearsal's tolerance."""
    run = load_config(ROOT / "configs" / "deepseek_v3_16b.toml")
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, n_layers=4), mesh=MeshConfig(fsdp=8, ep=8),
                              train=dataclasses.replace(run.train, grad_accum=1))
    report = rehearse(run, "worst")
    cmp = compare(report)
    assert report["world"] == 64 and cmp["ok"], cmp
    kinds = {(r["kind"], r["axis"]) for r in report["collectives"]}
    assert {("all_gather", "fsdp"), ("all_gather", "dp"), ("all_to_all", "ep"), ("reduce_scatter", "dp")} <= kinds


@pytest.mark.launch
@pytest.mark.slow
def test_k2s_layout_cut_to_3_layers_agrees_in_its_recompute_transient():
    """K2's shapes on its JUPITER mesh (fsdp 96 x ep 4 = 384 ranks), full recompute replaying the
    exchange, offload, the MoE layer in token chunks, rank 0: differentiated chunk by chunk, the MoE
    layer holds each expert stack's gradient summed over the chunks beside one chunk's new one (four
    stacks' worth, 10.6 GB), and its norm and routing whole. The planner once counted one leaf and a
    chunk's routing: 8.1 GB short of ~20 GB at these 8k tokens a rank."""
    run = load_config(ROOT / "configs" / "kimi_k2_1t.toml")
    model = dataclasses.replace(run.model, n_layers=3, moe=dataclasses.replace(run.model.moe, token_chunks=4))
    run = dataclasses.replace(run, model=model, train=dataclasses.replace(run.train, batch_size=2 * 384),
                              memory=dataclasses.replace(run.memory, block_chunks=1))
    report = rehearse(run, 0)
    got, planned = rehearsed_bytes(report), report["plan"]["per_rank_bytes"]
    assert abs(got["recompute_transient"] / planned["recompute_transient"] - 1) < 0.03, (got, planned)
    assert abs(got["offload_host"] / planned["offload_host"] - 1) < 0.03, (got, planned)


@pytest.mark.launch
@pytest.mark.slow
def test_k2s_layout_in_block_chunks_agrees_in_its_recompute_transient():
    """K2 cut to 3 layers on its JUPITER mesh with its 14 sequences a GPU in 7 whole-block chunks
    (memory.block_chunks, the MoE region unchunked inside) and fp8 expert GEMMs: each chunk's
    recompute, the block's weight gradients summed over the chunks and the earlier chunks' input
    gradients (rehearsed 33.2 GB). fp8 GEMMs add only their operands' tiles: backward's regathered
    stacks take their packs (each was quantised again there once, +12 GB of float32 temporaries),
    and the CPU emulation's float32 operands, which no GPU makes, are booked apart."""
    run = load_config(ROOT / "configs" / "kimi_k2_1t.toml")
    model = dataclasses.replace(run.model, n_layers=3, moe=dataclasses.replace(run.model.moe, token_chunks=1))
    run = dataclasses.replace(run, model=model, memory=dataclasses.replace(run.memory, block_chunks=7),
                              train=dataclasses.replace(run.train, batch_size=14 * 384),
                              mesh=dataclasses.replace(run.mesh, expert_gemm_dtype="float8_e4m3fn"))
    report = rehearse(run, 0)
    got, planned = rehearsed_bytes(report), report["plan"]["per_rank_bytes"]
    assert abs(got["recompute_transient"] / planned["recompute_transient"] - 1) < 0.05, (got, planned)
    assert abs(got["offload_host"] / planned["offload_host"] - 1) < 0.03, (got, planned)
    assert report["memory"]["category_peak"]["emulation"] > 0
