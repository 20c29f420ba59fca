"""The suite's pytest settings (pyproject.toml) report a test that runs out of time by name, under
xdist too: pytest-timeout's alarm firing while xdist formatted a slow failure's report used to end
the run in an INTERNALERROR that lost the test's name (a loaded 2-core machine, issue 57)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SLOW_FAILURE = '''import time

def deep(n):
    if n == 0:
        time.sleep(1.5)  # near the limit: formatting the deep traceback below takes the rest
        raise ValueError("deep")
    return deep(n - 1)

def test_a_deep_failure_near_the_limit():
    deep(900)

def test_over_the_limit():
    time.sleep(30)

def test_fine():
    pass
'''


@pytest.mark.launch
def test_a_timed_out_or_slow_failing_test_is_named_under_xdist(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW_FAILURE)
    r = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
                        "-p", "no:cacheprovider", "--timeout", "2", "-q", str(tmp_path / "test_slow.py")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "INTERNALERROR" not in out, out[-3000:]
    assert "FAILED test_slow.py::test_a_deep_failure_near_the_limit - ValueError: deep" in out, out[-3000:]
    assert "FAILED test_slow.py::test_over_the_limit - Failed: Timeout (>2.0s)" in out, out[-3000:]
    assert "2 failed, 1 passed" in out, out[-3000:]
