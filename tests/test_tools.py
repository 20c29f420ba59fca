"""The benchmark and GPU-check tools run on CPU at tiny sizes, so none is first run on a GPU lease.

tools/gpu_check.sh --dry-run runs every step of the GPU check on CPU; the bench scripts' main
functions run at tiny sizes (the MoE benchmark compiled, at the dry run's shape, so the inductor
cache of this test run is warm for it).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
TINY_MOE = "256,64,32,8,2"  # tools/gpu_checks/common.py DRY_SHAPES[0]


def load_tool(name: str):
    """A tools/<name>.py script as a module (tools/ is not a package)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def load_check(name: str):
    """tools/gpu_checks/<name>.py, one check of tools/gpu_check.sh (or common.py, what they share)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(f"gpu_checks.{name}")


def has_torchtitan() -> bool:
    try:
        import torchtitan.models.common.moe  # noqa: F401
        return True
    except Exception:
        return False


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_dry_run(tmp_path):
    """Every step of the GPU check on CPU, in the GPU image's state: tyro does not import there (a
    tyro.py that raises ImportError comes first on PYTHONPATH), so no step may import fnmoe.cli."""
    blocked = tmp_path / "no_tyro"
    blocked.mkdir()
    (blocked / "tyro.py").write_text('raise ImportError("tyro is blocked here: the GPU image has no tyro")\n')
    path = os.pathsep.join(p for p in (str(blocked), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OUT=str(tmp_path / "out"), TMPDIR=str(tmp_path), PYTHONPATH=path)
    probe = subprocess.run([sys.executable, "-c", "import tyro"], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "tyro is blocked" in probe.stderr, probe.stderr  # the block holds
    proc = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=880)
    out = proc.stdout + proc.stderr
    tail = (proc.stdout[proc.stdout.find("GPU CHECK SUMMARY") - 3000:] if "GPU CHECK SUMMARY" in proc.stdout
            else out[-6000:])
    assert proc.returncode == 0, tail
    summary = proc.stdout.split("GPU CHECK SUMMARY", 1)
    assert len(summary) == 2, out[-3000:]
    table = summary[1]
    for section in ("1 correctness", "2 K2 MoE layer", "3 moe bench", "4 model 16B-cut", "5 determinism"):
        assert section in table, f"section {section!r} missing from the summary:\n{table}"
    for check in ("grouped GEMM", "compiled MoE block", "tiny preset", "offload", "memory none",
                  "memory recompute=full", "deterministic replay", "K2 layer work", "K2 expert_mlp, balanced",
                  "K2 expert_mlp, imbalance 1.25", "K2 moe_block, balanced", "K2 moe_block, imbalance 1.25"):
        assert check in table, f"{check!r} missing:\n{table}"
    assert " FAIL" not in table and "TIMEOUT" not in table, table
    written = (tmp_path / "out" / "gpu_check.txt").read_text()
    assert "GPU CHECK SUMMARY" in written and "5 determinism" in written
    # the K2 layer's rows print a measured rate beside the planner's
    assert re.search(r"K2 expert_mlp, balanced .* TFLOP/s; planner [0-9.e+-]+ ms", table), table


@pytest.mark.launch
def test_gpu_check_imports_without_tyro_torchtitan_or_safetensors():
    """The GPU image has no tyro and no torchtitan (and maybe no safetensors): the check must still load."""
    code = ("import sys\n"
            "for m in ('tyro', 'torchtitan', 'safetensors', 'safetensors.torch'): sys.modules[m] = None\n"
            "sys.path.insert(0, 'tools')\n"
            "import gpu_check, bench_moe\n"
            "from gpu_checks import common, correctness, determinism, k2layer, model, moe, summary\n"
            "assert 'tyro' not in sys.modules or sys.modules['tyro'] is None\n"
            "print('NOTES', common.NOTES)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "safetensors not installed: stubbed" in proc.stdout


def test_gpu_check_helpers():
    gc = load_check("common")
    assert gc.recompute_policies()[0] == "none"
    policies = gc.memory_policies()
    assert policies[0] == ("none", {}) and ("recompute=full", {"recompute": "full"}) in policies
    assert gc.offload_variant() == ({"offload": True}, "offload=True")  # MemoryConfig.offload, a bool
    bm = load_tool("bench_moe")
    assert bm.classify("aten::mm") == "gemm"
    assert bm.classify("aten::_grouped_mm") == "gemm"
    assert bm.classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "gemm"
    assert bm.classify("graph_0_cpp_fused__softmax_topk_1") == "routing+permute"
    assert bm.classify("aten::scatter_add") == "routing+permute"
    assert bm.classify("graph_0_cpp_fused_mul_silu_6") == "elementwise"
    assert bm.classify("CompiledFunction") == "other"
    assert bm.Shape.parse("4096,512,256,32,4").flops == 18 * 4096 * 4 * 512 * 256


def test_gpu_check_reads_copy_overlap_from_a_trace():
    """copy_overlap, which the GPU run applies to the offload step's profiler trace: the compute
    stream is the one with the most kernel time; of each copy, the time a compute kernel ran too."""
    gc = load_check("model")
    ev = lambda cat, name, ts, dur, stream: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                             "args": {"stream": stream}}
    trace = {"traceEvents": [ev("kernel", "gemm", 0, 100, 7), ev("kernel", "gemm", 100, 50, 7),
                             ev("kernel", "small", 0, 10, 20),
                             ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 120, 60, 20),  # 30 us over gemm
                             ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 200, 10, 20),  # after compute
                             ev("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 500, 7),  # not offload's
                             {"ph": "i", "name": "marker", "ts": 5}]}
    o = gc.copy_overlap(trace)
    assert o == {"compute_stream": 7, "copy_streams": [20], "copy_ms": 0.07, "overlap_ms": 0.03}
    assert gc.copy_overlap({"traceEvents": []})["copy_ms"] == 0


def test_gpu_check_compiles_the_moe_block_under_bench_moes_inductor_config(monkeypatch):
    """Step 1 compiles the MoE block under the inductor config bench_moe.main runs in, on each device,
    so step 2's benchmark of the same block finds it in the inductor cache (the dry run's one compile)."""
    gc, bm = load_check("correctness"), load_tool("bench_moe")
    inductor = torch._inductor.config
    seen = []
    monkeypatch.setattr(bm, "_run", lambda args: seen.append(inductor.get_config_copy()) or [])
    for device in ("cpu", "cuda"):
        bm.main(["--device", device, "--shapes", TINY_MOE])
        with inductor.patch(gc.bm_inductor_patch(device)):
            assert inductor.get_config_copy() == seen[-1], device
    assert seen[0] != seen[1]  # the setting differs by device (a kernel profile on CPU), and is matched


@pytest.mark.timeout(300)
def test_bench_moe_tiny(capsys):
    bm = load_tool("bench_moe")
    kernel_profile = torch._inductor.config.cpp.enable_kernel_profile
    res = bm.main(["--shapes", TINY_MOE, "--iters", "1", "--warmup", "0", "--profile-iters", "1"])
    assert len(res) == 1
    impls = res[0]["impls"]
    assert impls["fnmoe"]["ms"] > 0 and impls["fnmoe"]["gflops"] > 0
    assert set(impls["fnmoe"]["split"]) == set(bm.CATEGORIES)
    if has_torchtitan():
        assert "torchtitan" in impls and res[0]["parity"]["torchtitan"] == []
        assert res[0]["ratio"]["fnmoe"] == impls["fnmoe"]["ms"] / impls["torchtitan"]["ms"] > 0
        assert "ratio fnmoe / torchtitan" in capsys.readouterr().out
    assert torch._inductor.config.cpp.enable_kernel_profile == kernel_profile  # the benchmark restores it


@pytest.mark.timeout(300)
def test_bench_moe_skips_torchtitan_when_it_does_not_import(monkeypatch, capsys):
    bm = load_tool("bench_moe")
    monkeypatch.setitem(sys.modules, "torchtitan.models.common.moe", None)  # import fails
    res = bm.main(["--shapes", TINY_MOE, "--iters", "1", "--warmup", "0", "--profile-iters", "0"])
    assert list(res[0]["impls"]) == ["fnmoe"]
    assert "TorchTitan skipped" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_bench_model_tiny(capsys):
    pytest.importorskip("transformers")
    bmod = load_tool("bench_model")
    res = bmod.main(["--layers", "2", "--dim", "64", "--head-dim", "32", "--ffn", "32", "--experts", "4",
                     "--top-k", "2", "--vocab", "128", "--batch", "2", "--seq", "32", "--iters", "1", "--warmup", "0",
                     "--no-compile"])
    out = capsys.readouterr().out
    assert res is not None, out
    assert res["ratio"]["fnmoe bf16 eager"] == res["ms"]["transformers fp32"] / res["ms"]["fnmoe bf16 eager"] > 0
    assert "MISMATCH" not in out, out
    for name in ("transformers fp32", "fnmoe bf16 eager"):
        assert res["gflops"][name] > 0 and set(res["split"][name]) == set(bmod.bench_moe.CATEGORIES)
        assert abs(sum(res["split"][name].values()) - res["ms"][name]) < 1e-6 * res["ms"][name]


def test_bench_model_skips_without_fnmoe_hf(monkeypatch, capsys):
    bmod = load_tool("bench_model")
    monkeypatch.setitem(sys.modules, "fnmoe.hf", None)
    assert bmod.main(["--iters", "1"]) is None
    assert "SKIP" in capsys.readouterr().out


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_compile_harness(capsys):
    """The two sides of the benchmark run the same training step (their step-1 rows have the same
    loss and grad norm), the time to step 1 is within each process's time, and the ratio is the one
    of the reported times. How long anything takes is not this test's to judge."""
    bc = load_tool("bench_compile")
    res = bc.main(["--repeats", "1", "--eager", "--keep", "--extra", "--train.batch-size 2 --data.seq-len 32"])
    kept = Path(re.search(r"^  kept (.+)$", capsys.readouterr().out, re.M).group(1))
    try:
        cold, warm = (bc.step1_row(kept / f"run_{kind}0" / "metrics.jsonl") for kind in ("cold", "warm"))
        assert (cold["loss"], cold["grad_norm"]) == (warm["loss"], warm["grad_norm"])
    finally:
        shutil.rmtree(kept)
    assert 0 < res["cold"] <= res["process_cold"] and 0 < res["warm"] <= res["process_warm"]
    assert res["ratio"] == res["warm"] / res["cold"]


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_bench_threads_tiny(capsys):
    """A choice trains in a fresh process with its own OpenMP settings and flags (the run's threads
    line says which), quiet and beside a busy loop the tool starts and stops; the table has its
    tokens/s per load and their ratio."""
    from conftest import tiny_flags

    bt = load_tool("bench_threads")
    assert bt.main(["--steps", "3", "--loads", "0,1", "--choices", "1 passive", "--timeout", "120", "--",
                    *tiny_flags(1)]) == 0
    out = capsys.readouterr().out
    for n in (0, 1):
        assert re.search(rf"load \+{n}  1 passive .* tok/s .*threads: 1 intra-op .*sleep at once", out), out
    row = re.search(r"^1 passive +([\d,. ]+)$", out, re.M)
    tps = [float(x.replace(",", "")) for x in row.group(1).split()]
    assert len(tps) == 3 and tps[2] == pytest.approx(tps[1] / tps[0], abs=0.01), out
    assert bt.choice("spin=5") == ({"GOMP_SPINCOUNT": "5"}, [])
