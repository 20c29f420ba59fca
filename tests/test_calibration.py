"""The validation runs (fnmoe/plan/calibration.py), the dgx-b200 profile, and docs/memory_plan.md's
"Validation against measured runs" as tools/calibration_table.py writes it."""
import re
import shlex
import sys
from pathlib import Path

import pytest

from fnmoe.cli.commands import parse_run
from fnmoe.config import PlanConfig
from fnmoe.config.hardware import PROFILES, hardware
from fnmoe.plan.calibration import RUNS, residuals
from fnmoe.plan.search import format_search, row
from fnmoe.plan.summary import plan

ROOT = Path(__file__).resolve().parent.parent
NEMO = RUNS[0]  # 8 x H100, EP 8: compute-bound at the stated and the calibrated rates


@pytest.fixture(scope="module")
def nemo():
    run = parse_run(shlex.split(NEMO.flags), "fnmoe plan")
    return run, plan(run, as_built=False)


def test_every_profile_parses_from_the_command_line_and_names_its_figures():
    for name, figures in PROFILES.items():
        run = parse_run(["--plan.hardware", name], "fnmoe plan")
        assert hardware(run.plan) == figures
    b200 = hardware(PlanConfig(hardware="dgx-b200"))
    assert (b200.gpus_per_node, b200.hbm_gb, b200.matmul_tflops, b200.nvlink_gbps) == (8, 179.0, 2250.0 * 0.55, 720.0)


def test_a_runs_residual_is_measured_over_planned_at_each_rates(nemo):
    """No factor is fitted: the residual divides the measurement by each rates' projection (the serial
    one where no proxy step was recorded)."""
    run, p = nemo
    res = residuals(run, p, NEMO.tokens_per_s_per_gpu)
    assert res["stated"] == pytest.approx(NEMO.tokens_per_s_per_gpu / p["step_time"]["tokens_per_s_per_gpu_serial"])
    assert res["measured"] == pytest.approx(
        NEMO.tokens_per_s_per_gpu / p["step_time_beside"]["tokens_per_s_per_gpu_serial"])
    assert res["measured"] != res["stated"]  # H100 takes the H200's measured rows


def test_the_search_table_prints_the_calibrated_column(nemo):
    run, p = nemo
    r = row("full, replay exchange", run, p)
    assert r["tokens_per_s_per_gpu_beside"] == p["step_time_beside"]["tokens_per_s_per_gpu_serial"]
    s = {"config": run.name, "world": 8, "hardware": "dgx-h100", "hbm_gb": 80, "host_gb": 200, "network_gbps": 40,
         "candidates": 1, "fitting": 1, "as_built_planned": 0, "max_global_tokens": 1, "seq_len": 4096,
         "ranking": [r]}
    header, line = format_search(s).splitlines()[1:3]
    assert "other" in header and f"{r['tokens_per_s_per_gpu_beside']:,.0f}" in line


def test_the_page_is_the_tools():
    """docs/memory_plan.md's validation blocks are what tools/calibration_table.py prints (the runs
    planned as built: their proxy steps recorded once per code path)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import calibration_table

    doc = calibration_table.DOC.read_text()
    for name, make in calibration_table.BLOCKS.items():
        found = re.search(rf"<!-- calibration:{name} -->\n(.*?)\n<!-- /calibration:{name} -->", doc, re.S)
        assert found and found.group(1) == make(), \
            f"block {name} of docs/memory_plan.md is stale: run python tools/calibration_table.py --write"
