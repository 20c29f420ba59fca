"""Host memory is a limit: a run whose offload pool passes plan.host_gb or this host's available
memory stops before step 1, naming the figures and the flags (fnmoe.plan.host_limit)."""
import dataclasses
from pathlib import Path

import pytest

from fnmoe import loop
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
