"""The first build of fnmoe's C++ CPU kernels is said to a library user too (no logging set up), and a
training run builds them before step 1, so that step's time and tokens/s are the step's alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnmoe.cli import main
from fnmoe.kernels import gemm
from conftest import tiny_flags
from test_checkpoint import one_thread  # noqa: F401 (the fixture: in-process runs on one thread)

ROOT = Path(__file__).resolve().parent.parent

# a library program (no logging configured) whose first use builds the kernels in argv[1]
LIBRARY_BUILDING_IN = """import sys
from pathlib import Path
from fnmoe.kernels import gemm
gemm.build_dir = lambda: Path(sys.argv[1])
assert gemm.available()
"""


@pytest.mark.launch
def test_a_library_user_is_told_of_the_build(tmp_path):
    if not gemm.available():  # builds the checkout's kernels on a first run, so that the copy only relinks
        pytest.skip("the C++ CPU kernels do not build here")
    build = tmp_path / "build"
    shutil.copytree(gemm.build_dir(), build, ignore=shutil.ignore_patterns(gemm.LOCK, gemm.TORCH_LOCK))
    os.utime(build / f"{gemm.NAME}.so", (0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", LIBRARY_BUILDING_IN, str(build)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"building fnmoe's C++ CPU kernels in {build}" in r.stderr and "minutes while other work" in r.stderr, \
        r.stderr[-3000:]


def test_a_run_builds_the_kernels_before_step_1(tmp_path, monkeypatch):
    """A build of 3 s (simulated: the first build_error call waits) falls before step 1's clock."""
    real, waited = gemm.build_error, []

    def slow_build():
        if not waited:
            waited.append(True)
            time.sleep(3)
        return real()
    monkeypatch.setattr(gemm, "build_error", slow_build)
    assert main(["train", *tiny_flags(1), "--train.steps", "1", "--train.run-dir", str(tmp_path)]) == 0
    assert waited
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["time_s"] < 3, row
