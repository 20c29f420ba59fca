"""Stopping on signals, one run per directory, and the run directory's file-system failures, with
real processes: SIGINT and SIGTERM to a 2-rank torchrun job stop both ranks after the same step with
one checkpoint that resumes the uninterrupted curve; a second signal aborts a save, leaving no
partial checkpoint; a second run in a directory is refused naming the first; a lock left by a
killed run is taken over; unwritable paths and a file-size limit on metrics.jsonl end in one line."""
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnmoe.checkpoint import verify
from fnmoe.cli import main
from fnmoe.run.faults import (SAVE_DELAY_ENV, SIGNAL_AT_STEP_ENV, SIGNAL_ENV, SIGNAL_RANK_ENV, SIGNAL_TO_ENV)
from fnmoe.run.metrics import JsonlWriter
from fnmoe.run.plot import plot_run, read_metrics
from fnmoe.run.rundir import LOCK
from fnmoe.run.stop import FOLLOW_UP_S

from test_checkpoint import (args, ckpts, fnmoe_cmd, losses, one_thread, rows, spawn_env,  # noqa: F401 (a fixture)
                             train_here)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted curve: {step: (loss, grad_norm)} of one process, STEPS steps."""
    run_dir = tmp_path_factory.mktemp("reference")
    train_here(*args(run_dir, STEPS))
    return losses(run_dir)


def _close(got: dict, want: dict, rel: float = 1e-6) -> bool:
    """Curves equal up to the reduction order of 2 ranks against 1 process (measured 1.2e-7)."""
    return got.keys() == want.keys() and all(
        abs(g - w) <= rel * abs(w) for k in want for g, w in zip(got[k], want[k]))


@pytest.mark.launch
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, at, sender", [("SIGINT", 2, 0), ("SIGTERM", 3, 1)])
def test_a_signal_to_torchrun_stops_both_ranks_after_one_step_and_resumes_the_curve(tmp_path, reference, sig, at,
                                                                                   sender):
    """torchrun forwards the signal to each worker; the ranks agree on the step (the hook's rank sends
    it after step `at` and waits for it), save once, and exit (0: a stop is no failure to torchrun, which
    reports the signal it got itself) well before torchrun's 30 s SIGKILL;
    resuming (here in one process) continues the uninterrupted curve."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fnmoe",
           "train", *args(run_dir, STEPS, "--mesh.fsdp", "2", "--dist.timeout-s", "10")]
    env = spawn_env(PYTHONPATH=str(ROOT), **{SIGNAL_AT_STEP_ENV: str(at), SIGNAL_ENV: sig, SIGNAL_TO_ENV: "parent",
                                             SIGNAL_RANK_ENV: str(sender)})
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    out = r.stdout + r.stderr
    assert f"Received {signal.Signals[sig].value} death signal" in out, out[-3000:]  # torchrun got it
    assert "Unable to shutdown process" not in out, out[-3000:]  # no worker needed SIGKILL
    assert time.monotonic() - t0 < 90
    step = run_dir / "checkpoints" / f"step_{at}"
    assert f"{sig}: interrupted at step {at} of {STEPS}; saved checkpoint {step}; continue with --resume auto" in out
    assert ckpts(run_dir) == [f"step_{at}"] and verify(step)["step"] == at
    assert [r["step"] for r in rows(run_dir)] == list(range(1, at + 1))
    assert not (run_dir / LOCK).exists()

    train_here(*args(run_dir, STEPS, "--resume", "auto"))
    assert _close(losses(run_dir), reference), (losses(run_dir), reference)


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_a_second_signal_aborts_the_save_and_a_second_run_is_refused_meanwhile(tmp_path, capsys):
    """SIGUSR1 (SLURM's early warning) after step 2 starts the stop's save, which the save-delay hook
    holds open with its files half written; meanwhile a second run in the same directory is refused,
    naming the first; then SIGINT aborts: no step_2, no temp directory, no lock, exit 130."""
    env = spawn_env(**{SIGNAL_AT_STEP_ENV: "2", SIGNAL_ENV: "SIGUSR1", SAVE_DELAY_ENV: "60"})
    proc = subprocess.Popen(fnmoe_cmd("train", *args(tmp_path, 100)), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        root, deadline, partial = tmp_path / "checkpoints", time.time() + 60, []
        while time.time() < deadline and not partial and proc.poll() is None:
            partial = list(root.glob(".tmp-step_2-*/state-rank00000.safetensors")) if root.exists() else []
            time.sleep(0.05)
        assert partial, "the stop's save never started"
        seen = time.monotonic()

        assert main(["train", *args(tmp_path, 100)]) == 2
        err = capsys.readouterr().err
        assert (f"fnmoe train: error: {tmp_path} is in use by another run (pid {proc.pid} on host "
                f"{socket.gethostname()}, started ") in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err

        time.sleep(max(0.0, FOLLOW_UP_S + 0.5 - (time.monotonic() - seen)))  # not the launcher's follow-up
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "fnmoe: SIGUSR1: stopping after this step to save a checkpoint (a second signal aborts)" in out
    assert "SIGINT again while stopping: aborted (a save cut short leaves no partial checkpoint); there is no " \
           "checkpoint" in out, out
    assert "Traceback" not in out, out
    assert list(root.iterdir()) == [] and not (tmp_path / LOCK).exists()
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    """A process that took the lock and died by SIGKILL (no cleanup) leaves the file; the next run
    takes it over, saying whose it was, and removes it when done."""
    take_and_die = ("import os, sys; from pathlib import Path; from fnmoe.run.rundir import acquire; "
                    "acquire(Path(sys.argv[1])); os.kill(os.getpid(), 9)")
    dead = subprocess.Popen([sys.executable, "-c", take_and_die, str(tmp_path)], env=spawn_env(PYTHONPATH=str(ROOT)),
                            stderr=subprocess.PIPE, text=True)
    err = dead.communicate(timeout=50)[1]
    assert dead.returncode == -signal.SIGKILL, err
    holder = json.loads((tmp_path / LOCK).read_text())
    assert (holder["pid"], holder["host"]) == (dead.pid, socket.gethostname())
    train_here(*args(tmp_path, 1))
    assert (f"taking over {tmp_path / LOCK}: its holder (pid {holder['pid']} on host {socket.gethostname()}, "
            "started ") in caplog.text
    assert not (tmp_path / LOCK).exists()


def _one_line_error(capsys, argv) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_unwritable_run_directory_paths_are_one_line_errors(tmp_path, capsys):
    """The run directory a file, under a file, its config.toml or metrics.jsonl a directory: exit 2
    naming the path and the OS's reason, before any step, and no lock left."""
    (tmp_path / "file").write_text("")
    assert _one_line_error(capsys, args(tmp_path / "file", 1)) == (
        f"fnmoe train: error: the run directory {tmp_path / 'file'} is a file; choose another --train.run-dir")
    assert _one_line_error(capsys, args(tmp_path / "file" / "run", 1)) == (
        f"fnmoe train: error: creating the run directory {tmp_path / 'file' / 'run'} failed: Not a directory")
    (tmp_path / "a" / "config.toml").mkdir(parents=True)
    assert _one_line_error(capsys, args(tmp_path / "a", 1)) == (
        f"fnmoe train: error: writing {tmp_path / 'a' / 'config.toml'} failed: Is a directory")
    (tmp_path / "b" / "metrics.jsonl").mkdir(parents=True)
    assert _one_line_error(capsys, args(tmp_path / "b", 1)) == (
        f"fnmoe train: error: opening {tmp_path / 'b' / 'metrics.jsonl'} failed: Is a directory")
    assert not list(tmp_path.glob(f"*/{LOCK}"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_parent_or_run_directory_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "run").mkdir()
    (tmp_path / "ro" / "run").chmod(0o555)
    (tmp_path / "ro").chmod(0o555)
    try:
        assert _one_line_error(capsys, args(tmp_path / "ro" / "new", 1)) == (
            f"fnmoe train: error: creating the run directory {tmp_path / 'ro' / 'new'} failed: Permission denied")
        assert _one_line_error(capsys, args(tmp_path / "ro" / "run", 1)) == (
            f"fnmoe train: error: creating the lock file {tmp_path / 'ro' / 'run' / LOCK} failed: Permission denied")
    finally:
        (tmp_path / "ro").chmod(0o755)
        (tmp_path / "ro" / "run").chmod(0o755)


MICRO = ["--model.dim", "16", "--model.n-layers", "1", "--model.n-heads", "2", "--model.n-kv-heads", "1",
         "--model.ffn-hidden", "16", "--train.batch-size", "1", "--data.seq-len", "8", "--train.eval-batches", "1",
         "--train.eval-every", "0"]


@pytest.mark.launch
@pytest.mark.timeout(90)
def test_metrics_over_a_file_size_limit_stop_after_a_saved_step_with_no_torn_line(tmp_path):
    """Under RLIMIT_FSIZE, metrics.jsonl reaches the limit in the middle of step 4's row: the row is
    cut back, the run stops at that step boundary after saving step 3 (whose files fit), and says so
    in one line naming the file and the reason (exit 2); the file's every line is JSON."""
    limit = 120_000  # bytes per file: a checkpoint's files (~90 kB at most) fit
    run = [*MICRO, "--train.run-dir", str(tmp_path), "--checkpoint.every", "2"]
    train_here(*run, "--train.steps", "2")
    metrics = tmp_path / "metrics.jsonl"
    # room for the resume row, step 3's row (~280 bytes) and half of step 4's
    pad = json.dumps({"event": "padding", "text": ""})
    with open(metrics, "a") as f:
        while metrics.stat().st_size + len(pad) + 1 < limit - 460 - 100:
            f.write(pad + "\n")
            f.flush()
        f.write(json.dumps({"event": "padding", "text": "x" * (limit - 460 - metrics.stat().st_size - len(pad) - 1)})
                + "\n")
    assert metrics.stat().st_size == limit - 460

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    # the functional update: step 3's state outlives step 4 (a donated step 4 writes into it, and the
    # stop then names step 2's checkpoint instead: tests/test_donate.py)
    r = subprocess.run(fnmoe_cmd("train", *run, "--train.steps", "50", "--resume", "auto", "--train.no-donate"),
                       cwd=tmp_path,
                       env=spawn_env(), preexec_fn=small_files, capture_output=True, text=True, timeout=80)
    saved = tmp_path / "checkpoints" / "step_3"
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == (
        f"fnmoe train: error: writing {metrics} failed: File too large (disk full or over a file-size limit); "
        f"stopped after step 3: saved checkpoint {saved}; continue with --resume auto"), r.stdout + r.stderr
    lines = metrics.read_text().splitlines(keepends=True)
    assert all(line.endswith("\n") and json.loads(line) for line in lines)
    assert [json.loads(line).get("step", json.loads(line).get("event")) for line in lines[-2:]] == ["resume", 3]
    assert verify(saved)["step"] == 3 and not (tmp_path / LOCK).exists()


def test_metrics_jsonl_is_strict_json_nonfinite_values_are_null_and_flagged(tmp_path):
    """NaN and Infinity (what a skipped step reports) are written as null and named under
    "nonfinite"; fnmoe plot reads such a file."""
    writer = JsonlWriter(tmp_path / "metrics.jsonl", fresh=True)
    for step in (1, 2, 3):
        bad = step == 2
        writer.write({"step": step, "loss": float("nan") if bad else 1.0 / step, "grad_norm": float("inf") if bad
                      else 1.0, "tokens_per_s": 10.0, "expert_load_by_layer": [1.0, float("nan") if bad else 1.5],
                      "skipped": int(bad)})
    writer.write({"step": 3, "val_loss": float("-inf"), "val_ppl": 0.0})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    parsed = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")) for line in lines]
    assert parsed[1] == {"step": 2, "loss": None, "grad_norm": None, "tokens_per_s": 10.0,
                         "expert_load_by_layer": None, "skipped": 1,
                         "nonfinite": ["loss", "grad_norm", "expert_load_by_layer"]}
    assert parsed[3] == {"step": 3, "val_loss": None, "val_ppl": 0.0, "nonfinite": ["val_loss"]}
    assert "nonfinite" not in parsed[0] and "nonfinite" not in parsed[2]
    steps, _ = read_metrics(tmp_path)
    assert [r["loss"] for r in steps] == [1.0, None, 1.0 / 3]
    pytest.importorskip("matplotlib")
    assert plot_run(tmp_path)["loss.png"]["train"] == ([1, 2, 3], [1.0, None, 1.0 / 3])
