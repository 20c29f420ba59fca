"""fnmoe's CPU threading (fnmoe/threads.py): OpenMP threads spin briefly, then sleep, unless the user
says otherwise, set before torch loads OpenMP, for the command and a library import alike; a program
that loaded torch first is told how."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fnmoe.threads import describe, passive, too_late, wait_settings
from conftest import tiny_flags

ROOT = Path(__file__).resolve().parent.parent


def test_the_command_and_the_library_spin_briefly_unless_told():
    assert wait_settings({}, torch_loaded=False) == {"GOMP_SPINCOUNT": "1000"}
    assert wait_settings({"OMP_WAIT_POLICY": "active"}, False) == {}  # the user's choice is kept
    assert wait_settings({"GOMP_SPINCOUNT": "300000"}, False) == {}
    assert wait_settings({}, torch_loaded=True) == {}  # too late: OpenMP has read its variables
    assert "import fnmoe before torch, or set GOMP_SPINCOUNT=1000" in too_late({}, True, 2)
    assert too_late({}, False, 2) is None and too_late({"OMP_WAIT_POLICY": "PASSIVE"}, True, 2) is None
    assert too_late({}, True, 1) is None  # one core: no thread waits for another
    assert "waiting threads spin 1000 turns, then sleep" in describe({"GOMP_SPINCOUNT": "1000"})
    assert "sleep at once" in describe({"OMP_WAIT_POLICY": "passive"}) and passive({"GOMP_SPINCOUNT": "0"})
    assert not passive({"GOMP_SPINCOUNT": "1000"}) and not passive({})


def _env(**more) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    return dict(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(ROOT), **more)  # libgomp prints what it read


@pytest.mark.launch
def test_a_fresh_train_process_spins_briefly(tmp_path):
    """`python -m fnmoe train` with no OpenMP variable set: libgomp itself reports the spin count it
    read, 1000, and the run's header says so."""
    r = subprocess.run([sys.executable, "-m", "fnmoe", "train", "--train.steps", "1", "--train.run-dir",
                        str(tmp_path / "run"), *tiny_flags(1)], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GOMP_SPINCOUNT = '1000'" in r.stderr, r.stderr[-3000:]
    assert re.search(r"^threads: \d+ intra-op \(--train.threads\); waiting threads spin 1000 turns, then sleep "
                     r"\(GOMP_SPINCOUNT=1000\)$", r.stdout, re.M), r.stdout


@pytest.mark.launch
def test_the_users_choice_is_kept_and_a_library_import_spins_briefly(tmp_path):
    def spin_count(args: list[str], **env) -> tuple[str, str]:
        r = subprocess.run([sys.executable, *args], cwd=tmp_path, env=_env(**env), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        return next(line.split("=")[1].strip() for line in r.stderr.splitlines() if "GOMP_SPINCOUNT =" in line), \
            r.stderr
    plan = ["-m", "fnmoe", "plan"]  # a command that loads torch (its help does not)
    assert spin_count(plan, OMP_WAIT_POLICY="ACTIVE")[0] == "'30000000000'"
    assert spin_count(plan, GOMP_SPINCOUNT="300000")[0] == "'300000'"
    assert spin_count(["-c", "import fnmoe, torch; torch.ones(4).sum()"])[0] == "'1000'"  # as the command
    count, err = spin_count(["-c", "import torch, fnmoe; torch.ones(4).sum()"])  # too late: said how
    assert count == "'300000'" and "torch was imported before fnmoe" in err and (os.cpu_count() or 1) > 1
