"""One config for every rank (fnmoe.parallel.same_config): ranks given different configs stop before
step 1, every rank with one line naming the first field that differs; fields a rank may set for
itself (PER_RANK) do not count.

The comparison runs in one process over simulated ranks (rank 1's gathered values replaced by
another config's), and once with two real gloo processes whose flags differ in the lr."""
import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fnmoe.config import RunConfig
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import same_config
from fnmoe.parallel.same_config import ConfigMismatch, check_same_config, flat_config, mismatch

from conftest import tiny_flags

ROOT = Path(__file__).resolve().parents[1]
RUN = RunConfig(name="tiny")


def _with(run: RunConfig, **sections) -> RunConfig:
    return dataclasses.replace(run, **{k: dataclasses.replace(getattr(run, k), **v) for k, v in sections.items()})


def test_the_first_differing_field_is_named_with_both_values_and_per_rank_fields_do_not_count():
    lr = _with(RUN, optim={"lr": 1e-3})
    assert mismatch([flat_config(RUN), flat_config(RUN)]) is None
    assert mismatch([flat_config(RUN), flat_config(lr)]) == (
        "the ranks were given different configs: optim.lr is 0.003 on rank 0 and 0.001 on rank 1; every rank must "
        "run the same config (the same --config file and flags); stopped before step 1")
    # several fields, several ranks: the first in the config's order, the count, the ranks
    both = _with(lr, train={"steps": 7}, mesh={"fsdp": 2})
    msg = mismatch([flat_config(RUN), flat_config(RUN), flat_config(both), flat_config(lr)])
    assert msg.startswith("the ranks were given different configs: mesh.fsdp is 1 on rank 0 and 2 on rank 2; "
                          "3 fields differ: mesh.fsdp, optim.lr, train.steps (ranks 2, 3 of 4 differ from rank 0)")
    # a host's own compile cache and thread count are not the job's config
    own = _with(dataclasses.replace(RUN, compile_cache="/node7/cache"), train={"threads": 3})
    assert mismatch([flat_config(RUN), flat_config(own)]) is None
    assert set(same_config.PER_RANK) == {"compile_cache", "train.threads"}


def test_on_simulated_ranks_one_other_config_stops_every_rank(monkeypatch):
    """Two simulated ranks: rank 1's gathered hash and config replaced by those of a run with another
    step count (which used to end in a false 'non-finite values in params of another rank')."""
    other = flat_config(_with(RUN, train={"steps": 9}))
    gather = dist.all_gather_object
    calls = []

    def rank1_differs(out, obj, group=None):
        gather(out, obj, group)
        out[1] = same_config.digest(other) if isinstance(obj, str) else other
        calls.append(type(obj).__name__)

    with fdist.simulate(2):
        check_same_config(RUN)  # the same config: one gather of the hashes, nothing raised
        monkeypatch.setattr(same_config.dist, "all_gather_object", rank1_differs)
        with pytest.raises(ConfigMismatch, match=r"^the ranks were given different configs: train\.steps is 800 on "
                                                 r"rank 0 and 9 on rank 1; every rank must run the same config"):
            check_same_config(RUN)
    assert calls == ["str", "dict"]  # the configs are gathered only once the hashes differ
    assert fdist.last_entered() == "all-gather of the configs over every rank"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_two_real_ranks_given_other_lrs_both_exit_2_with_one_line_before_step_1(tmp_path):
    """Two gloo processes of one job (the environment torchrun sets), rank 1 with --optim.lr 1e-3:
    each exits 2 with the same one line naming optim.lr, before any step and before the run
    directory is touched."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    run_dir = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, "-m", "fnmoe", "train", *tiny_flags(), "--train.steps", "3",
                               "--mesh.fsdp", "2", "--dist.timeout-s", "10", "--train.run-dir", str(run_dir),
                               "--optim.lr", lr], cwd=tmp_path, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, lr in enumerate(["3e-3", "1e-3"])]
    t0 = time.monotonic()
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    line = ("fnmoe train: error: the ranks were given different configs: optim.lr is 0.003 on rank 0 and 0.001 on "
            "rank 1; every rank must run the same config (the same --config file and flags); stopped before step 1")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2, out + err
        assert err.strip() == line, out + err
        assert "step 1" not in out
    assert not run_dir.exists()
    print(f"both ranks stopped {time.monotonic() - t0:.1f} s after they were started")
