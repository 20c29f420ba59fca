"""Processes of a mesh (issue 45): torchrun restarts a killed rank of a 4-rank 2x2 mesh, which resumes
and ends at the one-process losses; a run directory that one rank other than 0 cannot write stops
every rank before step 1 with that rank's one line.

Tiny model, few steps, no compile, one thread a process, a timeout on every subprocess."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnmoe.run.faults import KILL_AT_STEP_ENV, KILL_RANK_ENV

from test_checkpoint import args, losses, one_thread, rows, spawn_env, train_here  # noqa: F401 (a fixture)
from conftest import free_port
from test_signals import _close

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_torchrun_restarts_a_killed_rank_of_a_2x2_mesh_and_ends_at_the_one_process_losses(tmp_path):
    """4 ranks (fsdp 2 x ep 2), --max-restarts 1, rank 1 SIGKILLed after step 3: torchrun restarts all
    four, which meet in fresh store keys, resume from step 2 and end at the one-process curve."""
    ref, run_dir = tmp_path / "ref", tmp_path / "mesh"
    train_here(*args(ref, 4, "--checkpoint.every", "2"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "--max-restarts", "1", "-m", "fnmoe", "train",
           *args(run_dir, 4, "--checkpoint.every", "2", "--resume", "auto", "--mesh.fsdp", "2", "--mesh.ep", "2",
                 "--dist.timeout-s", "10")]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=tmp_path, env=spawn_env(PYTHONPATH=str(ROOT), **{KILL_AT_STEP_ENV: "3",
                                                                                     KILL_RANK_ENV: "1"}),
                         capture_output=True, text=True, timeout=170)
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in out and "Traceback" not in out, out[-4000:]
    assert [r.get("step", r.get("event")) for r in rows(run_dir)] == [1, 2, "resume", 3, 4, 4]
    assert _close(losses(run_dir), losses(ref)), (losses(run_dir), losses(ref))
    print(f"4-rank job with one restart: {took:.1f} s")


# rank 1's host: every file the preflight tries to create in a directory is refused (a read-only mount there)
READ_ONLY_HOOK = """import errno, os
_open = os.open
def _refusing(path, flags, *a, **k):
    if ".fnmoe-write-test-" in os.fspath(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
    return _open(path, flags, *a, **k)
os.open = _refusing
"""


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_a_run_directory_rank_1_cannot_write_stops_every_rank_before_step_1(tmp_path):
    """Two gloo ranks (the environment torchrun sets); on rank 1's side no file can be created in the
    run directory's checkpoints (sitecustomize on its PYTHONPATH only): both exit 2 with the same
    line naming rank 1, before any step."""
    hook = tmp_path / "read_only_host"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(READ_ONLY_HOOK)
    run_dir = tmp_path / "run"
    env = spawn_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [subprocess.Popen([sys.executable, "-m", "fnmoe", "train", *args(run_dir, 3, "--mesh.fsdp", "2",
                                                                            "--dist.timeout-s", "10")],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r),
                                       PYTHONPATH=os.pathsep.join([str(hook)] * r + [str(ROOT)])))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    checkpoints = run_dir / "checkpoints"
    line = (f"fnmoe train: error: rank 1: cannot write checkpoints: creating a file in {checkpoints} failed: "
            "Permission denied; stopped before step 1")
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 2, out + err
        assert err.strip().splitlines() == [line, f"  fnmoe: raised on rank {r} of 2"], out + err
        assert "step 1/" not in out
    assert not (checkpoints.exists() and any(checkpoints.iterdir()))  # nothing saved
    metrics = run_dir / "metrics.jsonl"
    assert not (metrics.exists() and any("step" in r for r in rows(run_dir)))


# SLURM's srun on two "nodes" of one machine: each node's task started once, the signals srun passes
# on passed to both (tests/test_process_tree.py's stand-in runs one task)
TWO_NODE_SRUN = """#!/bin/bash
"$@" & a=$!
"$@" & b=$!
for sig in USR1 USR2 TERM INT HUP; do trap "kill -$sig $a $b 2>/dev/null" $sig; done
status=0
for task in $a $b; do
    while :; do s=0; wait $task || s=$?; kill -0 $task 2>/dev/null || break; done
    [ $s -ne 0 ] && status=$s
done
exit $status
"""


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_stop_is_recognised_after_a_restart_on_the_other_node(tmp_path):
    """tools/slurm_train.sh on two nodes (two torchrun agents meeting at a c10d rendezvous, one worker
    each, --max-restarts 1): SIGUSR1 stops both workers after the same step with one checkpoint;
    rank 1, alone on the node that is not rank 0's, then dies on its way out. Its agent restarts it
    and rank 0's agent joins the new round (rank 0 lingers after a stop while restarts are left:
    an agent whose workers have all ended cannot join, and the round would wait torchrun's 600 s
    join timeout, then fail); the restarted workers find the stop and end at once. The job exits 0
    within seconds, with no step past the stop."""
    from fnmoe.checkpoint import verify
    from test_checkpoint import ckpts
    from test_process_tree import slurm_job

    t0 = time.monotonic()
    rc, out, run_dir = slurm_job(tmp_path, TWO_NODE_SRUN, nodes=2, workers=1)
    took = time.monotonic() - t0
    assert rc == 0, out[-4000:]
    (name,) = ckpts(run_dir)
    step = verify(run_dir / "checkpoints" / name)["step"]
    saved = run_dir / "checkpoints" / f"step_{step}"
    assert "test hook: rank 1 (pid " in out and "failed (exitcode: -9) local_rank: 0" in out, out[-4000:]
    assert (f"SIGUSR1 stopped this run after step {step} (saved checkpoint {saved}); this is torchrun restarting "
            "it, which ends here rather than train past the stop") in out, out[-4000:]
    assert [r.get("step", r.get("event")) for r in rows(run_dir)] == list(range(1, step + 1))  # no resume
    assert "Traceback" not in out
    print(f"two-node job, stopped, restarted and ended: {took:.1f} s")
