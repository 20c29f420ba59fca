"""Commands that read a live run, and commands stopped midway (issue 46). `eval`, `generate` and
`convert` read a run's newest checkpoint while its --checkpoint.keep-last may remove it: a
checkpoint removed while it is chosen or read is chosen again, up to 5 times, then one line. Ctrl-C
(SIGINT), SIGTERM or SIGHUP during a subcommand other than train exits 130 with one line on
stderr, naming the signal (130 for each, as `train` and `prepare` exit on any stop), and removes
the output directory it was writing."""
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fnmoe import checkpoint, hf
from fnmoe.checkpoint import resume
from fnmoe.cli import load_model, main
from fnmoe.tree import flatten_dict

from test_checkpoint import args, one_thread, spawn_env, train_here  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A run with a checkpoint after each of 6 steps."""
    run_dir = tmp_path_factory.mktemp("readers") / "run"
    train_here(*args(run_dir, 6, "--checkpoint.every", "1", "--checkpoint.keep-last", "6"))
    return run_dir


@pytest.fixture
def live(six_steps, tmp_path):
    """(a copy of the run holding step_1 and step_2, the directory holding its later checkpoints,
    save): save() is the live run saving step_3 and its keep-last removing the older ones; step_2
    is left half removed, as rmtree leaves it midway (its directory and index.json still there, its
    params file gone)."""
    run_dir, later = tmp_path / "run", tmp_path / "later"
    shutil.copytree(six_steps, run_dir)
    root = run_dir / "checkpoints"
    later.mkdir()
    for step in range(3, 7):
        (root / f"step_{step}").rename(later / f"step_{step}")

    def save():
        (later / "step_3").rename(root / "step_3")
        for f in (root / "step_2").glob("*.safetensors"):
            f.unlink()
        shutil.rmtree(root / "step_1")
    return run_dir, later, save


def _once(fn, save):
    """fn, which saves (the live run's next save) before its first call."""
    saved = []

    def wrapped(*a, **k):
        if not saved:
            saved.append(save())
        return fn(*a, **k)
    return wrapped


READERS = {"eval": lambda run_dir, out: ["eval", "--from", str(run_dir), "--json"],
           "generate": lambda run_dir, out: ["generate", "--from", str(run_dir), "--prompt", "ab",
                                             "--max-new-tokens", "4"],
           "convert": lambda run_dir, out: ["convert", "--to-hf", str(run_dir), "--out", str(out)]}


@pytest.mark.parametrize("when", ["choosing", "reading"])
@pytest.mark.parametrize("cmd", list(READERS))
def test_a_reader_chooses_again_when_the_run_removes_its_checkpoint(live, tmp_path, capsys, monkeypatch, cmd, when):
    """The run saves step_3 and removes step_2 while the reader verifies step_2 (find_latest then
    finds none: an error before) or reads its params (an error, or for eval a FileNotFoundError of
    its index.json after the evaluation): the reader says so, chooses step_3 and gives step_3's
    model, with no traceback."""
    run_dir, _, save = live
    if when == "choosing":
        monkeypatch.setattr(resume, "verify_together", _once(resume.verify_together, save))
    else:
        monkeypatch.setattr(checkpoint, "load_params", _once(checkpoint.load_params, save))
    capsys.readouterr()
    assert main(READERS[cmd](run_dir, tmp_path / "hf")) == 0
    out, err = capsys.readouterr()
    root = run_dir / "checkpoints"
    chosen = root / "step_2" if when == "reading" else f"a checkpoint under {root}"
    assert f"fnmoe: {chosen} vanished while it was read" in err and "Traceback" not in err, err
    assert err.splitlines()[-1] == f"fnmoe: using {root / 'step_3'} (step 3), the newest complete checkpoint of " \
                                   f"{run_dir}", err
    monkeypatch.undo()
    if cmd == "eval":
        assert json.loads(out)["step"] == 3 and json.loads(out)["from"] == str(root / "step_3")
    elif cmd == "generate":
        assert main(READERS[cmd](root / "step_3", None)) == 0 and capsys.readouterr().out == out
    else:
        want, got = flatten_dict(load_model(root / "step_3")[1]), flatten_dict(hf.load(tmp_path / "hf")[1])
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_reader_gives_up_in_one_line_when_each_checkpoint_vanishes(live, capsys, monkeypatch):
    """Each read's checkpoint removed as a newer one appears (a run saving faster than one is
    read), the last with a raw RuntimeError: 5 tries, then one line naming the run."""
    run_dir, later, _ = live
    root = run_dir / "checkpoints"
    (root / "step_2").rename(later / "step_2")

    def overtaken(ckpt):
        step = int(ckpt.name.removeprefix("step_"))
        (later / f"step_{step + 1}").rename(root / f"step_{step + 1}")
        shutil.rmtree(ckpt)
        raise RuntimeError("safetensors: the file vanished")
    monkeypatch.setattr(checkpoint, "load_params", overtaken)
    capsys.readouterr()
    assert main(["generate", "--from", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("vanished while it was read") == 5 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (
        f"fnmoe generate: error: {run_dir}: each of the 5 checkpoints chosen in turn vanished while it was read "
        "(the training run removes them faster than this reads one: raise its --checkpoint.keep-last, or read a "
        "copy)")


STOPPED = [("eval", "fnmoe.training.evaluate.evaluate"), ("generate", "fnmoe.sampling.generate.generate"),
           ("plan", "fnmoe.plan.search.search"), ("rehearse", "fnmoe.plan.rehearse.rehearse")]


@pytest.mark.parametrize("cmd, where", STOPPED)
def test_ctrl_c_in_a_subcommand_is_one_line_and_exit_130(six_steps, capsys, monkeypatch, cmd, where):
    """KeyboardInterrupt in the middle of each subcommand: exit 130 and one line (a traceback
    before); the SIGTERM handler the command had is undone after it."""
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(where, interrupted)
    argv = {"eval": ["eval", "--from", str(six_steps)], "generate": ["generate", "--from", str(six_steps)],
            "plan": ["plan", "--search"], "rehearse": ["rehearse"]}[cmd]
    before = signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    assert main(argv) == 130
    assert capsys.readouterr().err.splitlines()[-1] == f"fnmoe {cmd}: interrupted (SIGINT)"
    assert signal.getsignal(signal.SIGTERM) == before


# `fnmoe convert --to-hf`, whose safetensors write holds on (a marker file says it is written)
SLOW_CONVERT = """
import sys, time
from pathlib import Path
from fnmoe.hf import io
from fnmoe.cli import main

def slow(tensors, path):
    path.write_bytes(b"x" * 1000)
    (Path(sys.argv[2]) / "writing").touch()
    time.sleep(60)
io.save_safetensors = slow
sys.exit(main(["convert", "--to-hf", sys.argv[1], "--out", str(Path(sys.argv[2]) / "hf")]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_to_convert_mid_write_removes_its_partial_output(six_steps, tmp_path, sig):
    """SIGTERM or SIGHUP (which ended the process at once, leaving the hidden temporary directory)
    or SIGINT while convert writes: exit 130, one line naming the signal, and nothing left beside
    the marker."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, str(six_steps), str(tmp_path)], cwd=ROOT,
                            env=spawn_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "writing").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "writing").exists(), proc.communicate(timeout=30)
    proc.send_signal(signal.Signals[sig])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == f"fnmoe convert: interrupted ({sig})" and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["writing"]
