"""The calibrated projection (fnmoe/plan/calibration.py), the dgx-b200 profile, and
docs/memory_plan.md's "Calibration against measured runs" as tools/calibration_table.py writes it."""
import dataclasses
import re
import shlex
import sys
from pathlib import Path

import pytest

from fnmoe.cli.commands import parse_run
from fnmoe.config import PlanConfig
from fnmoe.config.hardware import PROFILES, hardware
from fnmoe.plan.calibration import RATE_FACTOR, RUNS, implied_factor, with_rates
from fnmoe.plan.search import format_search, row
from fnmoe.plan.step_time import step_time
from fnmoe.plan.summary import format_plan, plan

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


def test_the_calibrated_projection_is_the_stated_one_times_the_factor_when_compute_bound(nemo):
    _, p = nemo
    stated, cal = p["step_time"], p["calibrated"]
    assert stated["bound"] == cal["bound"] == "compute"
    overlapped = stated["tokens_per_s_per_gpu_overlapped"]
    assert cal["tokens_per_s_per_gpu_overlapped"] == pytest.approx(overlapped * RATE_FACTOR)
    assert cal["matmul_tflops"] == pytest.approx(p["hardware"]["matmul_tflops"] * RATE_FACTOR)
    assert "tokens_per_s_per_gpu_as_built" not in cal  # no proxy step recorded: no as-built figure
    assert f"calibrated rates ({RATE_FACTOR:g} x" in format_plan(p).splitlines()[-1]


def test_the_implied_factor_inverts_the_projection(nemo):
    run, p = nemo
    p = dict(p, step_time=dict(p["step_time"], exposed_fractions={}))  # every collective waited for
    measured = step_time(with_rates(run, 0.6), p["flops_per_token"], p["comm_bytes_detail"],
                         p["per_rank_bytes"]["offload_host"], {})["tokens_per_s_per_gpu_as_built"]
    assert implied_factor(run, p, measured) == pytest.approx(0.6, rel=1e-9)
    with pytest.raises(ValueError, match="past"):  # no GEMM rate hides the exchanges waited for
        implied_factor(run, p, 1e9)


def test_the_search_table_prints_the_calibrated_column(nemo):
    run, p = nemo
    r = row("full, replay exchange", run, p)
    assert r["tokens_per_s_per_gpu_calibrated"] == p["calibrated"]["tokens_per_s_per_gpu_serial"]
    s = {"config": run.name, "world": 8, "hardware": "dgx-h100", "hbm_gb": 80, "host_gb": 200, "network_gbps": 40,
         "candidates": 1, "fitting": 1, "as_built_planned": 0, "max_global_tokens": 1, "seq_len": 4096,
         "ranking": [r]}
    header, line = format_search(s).splitlines()[1:3]
    assert "calib" in header and f"{r['tokens_per_s_per_gpu_calibrated']:,.0f}" in line


def test_the_page_is_the_tools_and_the_factor_is_the_runs():
    """docs/memory_plan.md's calibration blocks are what tools/calibration_table.py prints (two runs
    planned as built: their proxy steps recorded once per code path), and RATE_FACTOR is the
    geometric mean of the factors the runs imply, to its two digits."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import calibration_table

    doc = calibration_table.DOC.read_text()
    for name, make in calibration_table.BLOCKS.items():
        found = re.search(rf"<!-- calibration:{name} -->\n(.*?)\n<!-- /calibration:{name} -->", doc, re.S)
        assert found and found.group(1) == make(), \
            f"block {name} of docs/memory_plan.md is stale: run python tools/calibration_table.py --write"
    mean = float(re.search(r"geometric mean of the implied factors is ([\d.]+)", doc).group(1))
    assert round(mean, 2) == RATE_FACTOR


def test_with_rates_changes_only_the_gemm_and_attention_rates(nemo):
    run, _ = nemo
    before, after = hardware(run.plan), hardware(with_rates(run, 0.5).plan)
    assert dataclasses.replace(after, matmul_tflops=before.matmul_tflops,
                               attention_tflops=before.attention_tflops) == before
    assert (after.matmul_tflops, after.attention_tflops) == (before.matmul_tflops / 2, before.attention_tflops / 2)
