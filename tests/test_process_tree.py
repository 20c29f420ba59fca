"""Many processes behave like one (issue 35): SLURM's warning signal reaches every worker through
tools/slurm_train.sh and stops them after one step with one checkpoint, a deliberate stop is no
failure to torchrun and a restart does not undo it, SIGHUP stops like SIGTERM, and torchrun's
restarts work on a mesh (each attempt's ranks meet in store keys of their own)."""
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fnmoe.checkpoint import verify
from fnmoe.parallel import dist as fdist
from fnmoe.run import stop
from fnmoe.run.faults import CRASH_AFTER_STOP_ENV, KILL_AT_STEP_ENV, KILL_RANK_ENV, SIGNAL_AT_STEP_ENV, SIGNAL_ENV
from fnmoe.run.rundir import LOCK

from test_checkpoint import args, ckpts, losses, one_thread, rows, spawn_env, train_here  # noqa: F401 (a fixture)
from conftest import free_port
from test_signals import _close

ROOT = Path(__file__).resolve().parents[1]

# stand-ins for SLURM's commands on one node: srun runs its task and passes on the signals srun
# passes on (man srun: "Signals sent to the srun command are automatically forwarded to the tasks")
FAKE_SRUN = """#!/bin/bash
"$@" &
task=$!
for sig in USR1 USR2 TERM INT HUP; do trap "kill -$sig $task 2>/dev/null" $sig; done
while :; do status=0; wait $task || status=$?; kill -0 $task 2>/dev/null || break; done
exit $status
"""
FAKE_SCONTROL = "#!/bin/bash\necho localhost\n"


def slurm_job(tmp_path, srun: str, nodes: int, workers: int) -> tuple[int, str, Path]:
    """(exit status, output, run dir) of tools/slurm_train.sh under the stand-in `srun` (its node count
    and workers a node, --max-restarts 1, rank 1 dying on its way out of a stop), sent SIGUSR1 once
    two steps are written."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    for name, text in (("srun", srun), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = spawn_env(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(ROOT),
                    SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_ID="4242",
                    NPROC_PER_NODE=str(workers), RDZV_PORT=str(free_port()), MAX_RESTARTS="1",
                    **{CRASH_AFTER_STOP_ENV: "1"})
    cmd = ["bash", str(ROOT / "tools" / "slurm_train.sh"),
           *args(run_dir, 200, "--mesh.fsdp", "2", "--dist.timeout-s", "10")]
    log = tmp_path / "job.out"  # a file, not a pipe: nothing blocks on a full pipe before the end
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, metrics = time.monotonic() + 90, run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and job.poll() is None and not (
                metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.1)
        assert job.poll() is None, log.read_text()[-3000:]
        job.send_signal(signal.SIGUSR1)
        job.wait(timeout=100)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return job.returncode, log.read_text(), run_dir


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_slurm_warning_stops_every_worker_after_one_step_and_a_restart_keeps_the_stop(tmp_path):
    """tools/slurm_train.sh under a stand-in srun (one node, 2 workers, --max-restarts 1): SIGUSR1
    to the batch script, as `--signal=B:USR1@300` sends it, reaches both workers (torchrun ignores
    it), which stop after the same step with one checkpoint and exit 0; rank 1 then dies on its
    way out (a test hook), torchrun restarts both, and the restarted workers find the stop and
    end at once: no resume, no step past it, the job exits 0. (Before: the script died of the
    signal at once, leaving srun, torchrun and the workers training on.)"""
    rc, out, run_dir = slurm_job(tmp_path, FAKE_SRUN, nodes=1, workers=2)
    assert rc == 0, out[-4000:]
    assert "slurm_train.sh: SIGUSR1: asking every worker to stop after the step in progress and save" in out
    (name,) = ckpts(run_dir)
    step = verify(run_dir / "checkpoints" / name)["step"]
    saved = run_dir / "checkpoints" / f"step_{step}"
    assert f"SIGUSR1: interrupted at step {step} of 200; saved checkpoint {saved}" in out, out[-4000:]
    assert [r.get("step", r.get("event")) for r in rows(run_dir)] == list(range(1, step + 1))  # no resume
    assert "test hook: rank 1 (pid " in out and "failed (exitcode: -9) local_rank: 1" in out  # torchrun restarts
    assert (f"SIGUSR1 stopped this run after step {step} (saved checkpoint {saved}); this is torchrun restarting "
            "it, which ends here rather than train past the stop") in out, out[-4000:]
    assert json.loads((run_dir / stop.STOPPED).read_text())["step"] == step
    assert "Traceback" not in out and not (run_dir / LOCK).exists()


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_torchrun_restarts_a_killed_rank_of_a_mesh_and_ends_at_the_one_process_losses(tmp_path):
    """2 ranks (fsdp 2), --max-restarts 2, rank 1 SIGKILLed after step 3: torchrun restarts both,
    which meet in fresh store keys (the agent's store still holds the first attempt's, whose
    addresses are dead: before, the restart failed in gloo's connect after ~60 s, twice), resume
    from step 2 and end at the one-process curve."""
    ref, run_dir = tmp_path / "ref", tmp_path / "mesh"
    train_here(*args(ref, 6, "--checkpoint.every", "2"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", "-m", "fnmoe", "train",
           *args(run_dir, 6, "--checkpoint.every", "2", "--resume", "auto", "--mesh.fsdp", "2",
                 "--dist.timeout-s", "10")]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=tmp_path, env=spawn_env(PYTHONPATH=str(ROOT), **{KILL_AT_STEP_ENV: "3",
                                                                                     KILL_RANK_ENV: "1"}),
                         capture_output=True, text=True, timeout=170)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in out and "Traceback" not in out, out[-4000:]
    assert [r.get("step", r.get("event")) for r in rows(run_dir)] == [1, 2, "resume", 3, 4, 5, 6, 6]
    assert _close(losses(run_dir), losses(ref)), (losses(run_dir), losses(ref))
    assert time.monotonic() - t0 < 120


def _attempt(port: int, n: int) -> list:
    """Each of n ranks' store from attempt_store, the ranks run as threads, each with its own client
    of the store at port (as torchrun's workers have of their agent's)."""
    out: list = [None] * n

    def rank(r: int) -> None:
        client = dist.TCPStore("localhost", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        try:
            out[r] = fdist.attempt_store(client, r, n, datetime.timedelta(seconds=10), poll_s=0.005)
        except Exception as e:  # noqa: BLE001 (reported by the assert below)
            out[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(n))]  # followers first
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(s, dist.PrefixStore) for s in out), out
    return out


def test_the_ranks_of_each_attempt_agree_on_fresh_store_keys_past_an_earlier_attempts():
    """4 ranks, three attempts over one store (torchrun's agent keeps one for all its restarts, and
    each node's agent counts its own restarts): each attempt's ranks share one namespace, which
    holds none of the attempt before's keys (gloo's addresses of dead peers, before), although that
    attempt's hellos and answers are still in the store; a rank whose peers never come gets a
    one-line error naming it."""
    server = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    for attempt in range(3):
        stores = _attempt(server.port, 4)
        assert not any(s.check(["rank_0"]) for s in stores), attempt  # the attempt before's key
        stores[attempt % 4].set("rank_0", str(attempt))
        assert [s.get("rank_0").decode() for s in stores] == [str(attempt)] * 4
    lone = dist.TCPStore("localhost", server.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    with pytest.raises(fdist.CollectiveError, match=r"^rank 1 of 3: the ranks did not all arrive within 1 s "
                                                     r"\(--dist.timeout-s\) to start the process group"):
        fdist.attempt_store(lone, 1, 3, datetime.timedelta(seconds=1))


def test_sighup_stops_like_sigterm_and_the_stop_is_recorded(tmp_path, monkeypatch):
    """SIGHUP (a closed terminal or ssh session) after step 2 stops the run there with a checkpoint,
    as SIGTERM does (before, it killed the process with no checkpoint); stopped.json records it, and
    a later run removes it as it starts."""
    monkeypatch.setenv(SIGNAL_AT_STEP_ENV, "2")
    monkeypatch.setenv(SIGNAL_ENV, "SIGHUP")
    summary = train_here(*args(tmp_path, 5))
    assert summary["interrupted"] and summary["steps"] == 2
    assert ckpts(tmp_path) == ["step_2"] and [r["step"] for r in rows(tmp_path)] == [1, 2]
    stopped = json.loads((tmp_path / stop.STOPPED).read_text())
    assert (stopped["signal"], stopped["step"]) == ("SIGHUP", 2)
    assert stopped["where"] == f"saved checkpoint {tmp_path / 'checkpoints' / 'step_2'}"
    monkeypatch.delenv(SIGNAL_AT_STEP_ENV)
    assert train_here(*args(tmp_path, 3, "--resume", "auto"))["steps"] == 3
    assert not (tmp_path / stop.STOPPED).exists()


def test_one_signal_delivered_twice_is_one_request_and_a_later_one_aborts(monkeypatch):
    """SLURM may signal every process of a step and a launcher forward the same signal again: a
    repeat within FOLLOW_UP_S is the same request; one after it aborts."""
    now = [100.0]
    monkeypatch.setattr(stop.time, "monotonic", lambda: now[0])
    request = stop.Request(speak=False)
    request.handle(signal.SIGUSR1, None)
    now[0] += stop.FOLLOW_UP_S / 2
    request.handle(signal.SIGUSR1, None)
    request.handle(signal.SIGTERM, None)
    assert (request.signum, request.aborted_by) == (signal.SIGUSR1, None)
    now[0] += stop.FOLLOW_UP_S
    with pytest.raises(stop.Aborted, match="SIGUSR1 while stopping: aborted"):
        request.handle(signal.SIGUSR1, None)
    assert signal.SIGHUP in stop.SIGNALS


def test_a_restart_without_the_agents_store_finds_the_stop_in_the_run_directory(tmp_path, monkeypatch):
    """Where torchrun's agent keeps no store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), stopped.json of
    the same torchrun run on a later attempt is the stop a restart keeps; a new launch (attempt 0, or
    another run id) trains on; outside torchrun nothing is honoured."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    stop.record(tmp_path, signal.SIGUSR1, 4, "saved checkpoint X; continue with --resume auto")
    assert stop.honoured(tmp_path) is None  # the same attempt: this is no restart
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert stop.honoured(tmp_path)["step"] == 4 and stop.honoured(tmp_path)["where"] == "saved checkpoint X"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    assert stop.honoured(tmp_path) is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert stop.honoured(tmp_path) is None
