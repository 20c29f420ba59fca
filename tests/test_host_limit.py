"""Host memory is a limit: a run whose offload pool passes plan.host_gb or this host's available
memory stops before step 1, naming the figures and the flags (fnmoe.plan.host_limit)."""
import dataclasses
from pathlib import Path

import pytest

from fnmoe.training import loop
from fnmoe.cli import main
from fnmoe.config import MemoryConfig, load_config
from fnmoe.memory.host_pool import pool_segments
from fnmoe.plan import host_limit
from fnmoe.plan.activations import pool_bytes
from fnmoe.parallel import dist as fdist

ROOT = Path(__file__).resolve().parents[1]
RUN = load_config(ROOT / "configs" / "tiny.toml")
OFFLOAD = dataclasses.replace(RUN, memory=MemoryConfig(recompute="full", offload=True))


def test_offload_past_plan_host_gb_stops_before_step_one(capsys, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", "--memory.recompute", "full", "--memory.offload", "--plan.host-gb", "0.001",
                 "--train.steps", "2", "--train.run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    print(err)
    pinned = sum(pool_segments(pool_bytes(OFFLOAD))) / 1e9
    assert f"offload needs {pinned:.4g} GB of host memory a GPU" in err
    assert "more than plan.host_gb = 0.001 GB a GPU (given)" in err and "raise --plan.host-gb" in err
    assert "stopped before step 1" in err
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_offload_past_available_memory_stops_before_step_one(monkeypatch, tmp_path):
    """The profile's host_gb fits; the machine (its MemAvailable, faked small here) does not."""
    pinned = sum(pool_segments(pool_bytes(OFFLOAD)))
    monkeypatch.setattr(host_limit, "available_bytes", lambda: pinned - 1)
    built = []
    monkeypatch.setattr(loop, "make_train_step", lambda *a: built.append(a))
    run = dataclasses.replace(OFFLOAD, train=dataclasses.replace(OFFLOAD.train, steps=2, run_dir=str(tmp_path / "run")))
    with pytest.raises(host_limit.HostMemoryError, match=r"this host has .* GB available \(MemAvailable\) for 1 pool"):
        loop.train(run)
    assert not built and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_pools_that_fit_pass_and_simulated_ranks_each_count():
    pinned = sum(pool_segments(pool_bytes(OFFLOAD)))
    assert host_limit.host_memory_error(RUN) is None  # nothing offloaded: nothing to fit
    assert host_limit.host_memory_error(OFFLOAD, available=pinned) is None
    assert 0 < host_limit.available_bytes()
    with fdist.simulate(4):  # four ranks in this process: four pools
        assert host_limit.host_memory_error(OFFLOAD, available=4 * pinned) is None
        assert "for 4 pool(s)" in host_limit.host_memory_error(OFFLOAD, available=4 * pinned - 1)


def test_the_pool_takes_its_margin_on_the_routed_bytes_only():
    """Replaying the exchange, a block keeps its input and its routing: nothing on the host depends on
    how tokens route, so the pool is the planned bytes (+ 1 MiB) in whole segments, no margin. Keeping
    the exchange, its outputs (sized by the routing) take the 1.25 margin and the rest does not. A
    rehearsal of the replaying run fills its pool without overflowing it."""
    from fnmoe.config import MeshConfig
    from fnmoe.memory.host_pool import POOL_MARGIN
    from fnmoe.plan.activations import activation_plan, exchange_bytes, tokens_per_rank
    from fnmoe.plan.rehearse import rehearse, rehearsed_bytes

    k2 = load_config(ROOT / "configs" / "kimi_k2_1t.toml")  # GBs a GPU: the margin is whole segments
    mesh = dataclasses.replace(k2, memory=dataclasses.replace(k2.memory, keep_exchange=True))
    replay = dataclasses.replace(k2, memory=dataclasses.replace(k2.memory, keep_exchange=False))
    acts = activation_plan(replay)
    assert acts["host_routed"] == 0
    assert pool_bytes(replay) == sum(pool_segments(acts["host"] + (1 << 20)))
    keep = activation_plan(mesh)
    moe_blocks = sum(mesh.model.is_moe_layer(i) for i in range(mesh.model.n_layers - 1))  # the last stays
    assert keep["host_routed"] == moe_blocks * exchange_bytes(mesh, tokens_per_rank(mesh)) > 0
    assert pool_bytes(mesh) == sum(pool_segments(int(keep["host"] + keep["host_routed"] * (POOL_MARGIN - 1))
                                                 + (1 << 20)))
    assert pool_bytes(mesh) > pool_bytes(replay) * 1.5  # the kept exchange: T·K·(1 + imbalance) rows a layer
    tiny = dataclasses.replace(OFFLOAD, mesh=MeshConfig(fsdp=2, ep=2),
                               memory=dataclasses.replace(replay.memory, block_chunks=2),
                               train=dataclasses.replace(OFFLOAD.train, batch_size=16))
    got = rehearsed_bytes(rehearse(tiny, 0, fresh_process=False))["offload_host"]
    assert activation_plan(tiny)["host"] * 0.99 <= got <= pool_bytes(tiny), (got, pool_bytes(tiny))
