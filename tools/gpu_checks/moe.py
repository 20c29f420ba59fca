"""Step 3 of tools/gpu_check.sh, moe: the MoE benchmark and the AdamW benchmark on the device.

tools/bench_moe.py on the device (against TorchTitan when it imports, else fnmoe alone),
then tools/bench_adamw.py (fnmoe's AdamW eager and fused against torch.optim.AdamW
foreach and fused, on a DeepSeek-V3-16B model's leaves cut to 2 layers).
"""
from __future__ import annotations

# first: it stubs safetensors where missing, before fnmoe loads
from gpu_checks.common import DRY_SHAPES, GPU_SHAPES, ROOT, Recorder, status


def step_moe(rec: Recorder, device: str, dry: bool) -> None:
    import bench_moe as bm

    try:
        import torchtitan  # noqa: F401
        have_tt = True
    except Exception:
        have_tt = False
    if not have_tt:
        rec.row("torchtitan", "does not import here: fnmoe timed alone", "skip")
    argv = ["--device", device]
    argv += ["--iters", "2", "--warmup", "1", "--profile-iters", "1"] if dry else ["--iters", "20", "--warmup", "3",
                                                                                  "--profile-iters", "3"]
    for spec in DRY_SHAPES if dry else GPU_SHAPES:
        res = rec.guarded(f"moe bench {spec}", bm.main,
                          argv + ["--shapes", spec] + ([] if have_tt else ["--no-torchtitan"]))
        if not res:
            continue
        r = res[0]
        for name, v in r["impls"].items():
            split = (" ".join(f"{k.split('+')[0]} {100 * x / v['ms']:.0f}%" for k, x in v["split"].items())
                     if v["split"] else "")
            rec.row(f"{r['shape']} {name}", f"{v['ms']:.2f} ms, {v['gflops']:.0f} GFLOP/s; {split}")
        for name, ratio in r.get("ratio", {}).items():
            # a timing, not a correctness check: "slower" is reported, never a failure
            rec.row(f"{r['shape']} {name}/torchtitan", f"{ratio:.2f} (<1: fnmoe faster)",
                    "ok" if ratio <= 1.0 else "slower")
        for name, problems in r["parity"].items():
            if problems:
                rec.row(f"{r['shape']} parity vs {name}", "; ".join(problems)[:200], "FAIL")
    rec.guarded("adamw bench", _adamw_rows, rec, device, dry)


def _adamw_rows(rec: Recorder, device: str, dry: bool) -> None:
    """tools/bench_adamw.py: fnmoe's AdamW (eager ops, fused) against torch.optim.AdamW (foreach, fused)
    on a DeepSeek-V3-16B model's leaves cut to 2 layers (1.1 B params; tiny widths in the dry run)."""
    import bench_adamw as ba

    cfg, layers, experts = ("tiny.toml", 2, 8) if dry else ("deepseek_v3_16b.toml", 2, 64)
    # the dry run leaves out fnmoe's fused variant: step 1 compiles and checks it, and CPU compiles are slow
    r = ba.run(str(ROOT / "configs" / cfg), layers, experts, 2 if dry else 10, device, fused=not dry)
    rec.row("adamw bench", r["what"], "info")
    for name, ms, gbps, x, first, err in r["rows"]:
        rec.row(name, f"{ms:.3g} ms, {gbps:.0f} GB/s, {x:.2f}x torch foreach, first call {first:.1f} s; "
                f"vs torch single-tensor {err:.1e}", status(err < 1e-5))
