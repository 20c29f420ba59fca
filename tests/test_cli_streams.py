"""A subcommand's stdout is its result alone, its log on stderr; train's log is its stdout (fnmoe.cli.commands)."""
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fnmoe.cli import commands, main
from fnmoe.kernels import gemm
from conftest import tiny_flags

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.toml")
SAID = "a log line said while the command runs"

# `fnmoe plan` with the C++ kernels built in argv[1]
PLAN_BUILDING_IN = """import sys
from pathlib import Path
from fnmoe.kernels import gemm
gemm.build_dir = lambda: Path(sys.argv[1])
from fnmoe.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_plan_json_is_stdout_alone_on_a_run_that_builds_the_kernels(tmp_path):
    """The issue's case: a plan of two ranks records a proxy step (none recorded yet in a fresh
    FNMOE_CACHE_DIR), which builds the C++ kernels. The build directory is a copy of the checkout's
    whose library is made older than its sources: the build is said, and only relinks."""
    if not gemm.available():  # builds the checkout's kernels on a first run, so that the copy is no 17 s compile
        pytest.skip("the C++ CPU kernels do not build here")
    build = tmp_path / "build"
    shutil.copytree(gemm.build_dir(), build, ignore=shutil.ignore_patterns(gemm.LOCK, gemm.TORCH_LOCK))
    os.utime(build / f"{gemm.NAME}.so", (0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), FNMOE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", PLAN_BUILDING_IN, str(build), "plan", "--config", TINY,
                        "--mesh.fsdp", "2", "--data.seq-len", "32", "--train.batch-size", "2", "--json"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"building fnmoe's C++ CPU kernels in {build}" in r.stderr, r.stderr[-3000:]
    assert json.loads(r.stdout)["mesh"]["world"] == 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    assert main(["train", "--train.steps", "1", "--train.run-dir", str(path), *tiny_flags(1)]) == 0
    return path


def _saying_first(command):
    """command, with a log line said as it starts (as a first run's kernel build says its own)."""
    def run(argv):
        logging.getLogger("fnmoe").info(SAID)
        return command(argv)
    return run


def _result(capsys, monkeypatch, *argv) -> str:
    """The stdout of `fnmoe *argv`, whose log line was checked to be on stderr."""
    monkeypatch.setitem(commands.COMMANDS, argv[0], _saying_first(commands.COMMANDS[argv[0]]))
    capsys.readouterr()
    assert main(list(argv)) == 0
    out, err = capsys.readouterr()
    assert SAID in err and SAID not in out, (out, err)
    return out


def test_plan_json_is_stdout_alone(capsys, monkeypatch):
    assert json.loads(_result(capsys, monkeypatch, "plan", "--config", TINY, "--json"))["mesh"]["world"] == 1


def test_eval_json_checkpoint_verify_and_generate_print_their_result_alone(run_dir, capsys, monkeypatch):
    assert json.loads(_result(capsys, monkeypatch, "eval", "--from", str(run_dir), "--json"))["step"] == 1
    ckpt = run_dir / "checkpoints" / "step_1"
    assert _result(capsys, monkeypatch, "checkpoint", "verify", str(ckpt)).startswith(f"ok: {ckpt} (step 1)")
    assert _result(capsys, monkeypatch, "generate", "--from", str(ckpt), "--prompt", "Hi",
                   "--max-new-tokens", "2").startswith("Hi")


def test_train_logs_on_stdout(tmp_path, capsys):
    assert main(["train", "--train.steps", "1", "--train.run-dir", str(tmp_path), *tiny_flags(1)]) == 0
    out, err = capsys.readouterr()
    assert f"-> {tmp_path}" in out and "step 1/1" in out, out
    assert "step 1/1" not in err, err
