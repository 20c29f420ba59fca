"""Cold vs warm compile: wall time from process start to the end of training step 1.

Runs, as a fresh process each time (`python -m fnmoe train`, from the checkout),

    fnmoe train --config configs/tiny.toml --train.steps 1 --model.compile --model.compute-dtype bfloat16
                --train.eval-batches 1 --train.run-dir <tmp>

with TORCHINDUCTOR_CACHE_DIR pointing at an empty directory (cold) and then at the directory
that cold run filled (warm; it also holds fnmoe's saved cache artifacts). The end of step 1 is
when its row appears in <run-dir>/metrics.jsonl (written and fsynced as the step ends; the
script polls it every 10 ms); the whole process's wall time is printed too. Median of
--repeats cold/warm pairs; prints both and warm/cold (DESIGN target: <= 30%).

    python tools/bench_compile.py [--repeats 3] [--config configs/tiny.toml] [--extra "--model.n-layers 2"]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the training processes inherit it: spinning OpenMP threads make a shared, oversubscribed CPU
# many times slower; OMP_WAIT_POLICY=ACTIVE in the environment overrides it
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def step1_row(metrics: Path) -> dict | None:
    try:
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if row.get("step") == 1 and "loss" in row:
                return row
    except (OSError, json.JSONDecodeError):
        pass
    return None


def one_run(cache_dir: Path, run_dir: Path, args) -> dict:
    """{'first_step_s', 'process_s', 'step_time_s'} of one training process."""
    cmd = [sys.executable, "-m", "fnmoe", "train", "--config", args.config, "--train.steps", "1",
           "--train.eval-batches", "1", "--train.run-dir", str(run_dir), "--compile-cache", str(cache_dir)]
    if not args.eager:
        cmd += ["--model.compile", "--model.compute-dtype", "bfloat16"]
    cmd += shlex.split(args.extra)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    metrics = run_dir / "metrics.jsonl"
    log = run_dir.parent / (run_dir.name + ".log")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        first = None
        while proc.poll() is None:
            if first is None and step1_row(metrics) is not None:
                first = time.perf_counter() - t0
            time.sleep(0.01)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n" + "\n".join(tail))
    row = step1_row(metrics)
    if row is None:
        raise RuntimeError(f"no step-1 row in {metrics}")
    if first is None:  # the process ended within one poll of writing the row
        first = total
    return {"first_step_s": first, "process_s": total, "step_time_s": row["time_s"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="cold/warm pairs (medians reported)")
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--extra", default="", help="more `fnmoe train` flags, one string")
    ap.add_argument("--eager", action="store_true", help="without --model.compile (tests the harness only)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories (their paths are printed)")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="fnmoe-bench-compile-"))
    mode = "eager (harness check)" if args.eager else "compile, bf16"
    print(f"time to the end of step 1 of `fnmoe train --config {args.config} --train.steps 1` ({mode}), "
          f"cold vs warm inductor cache, {args.repeats} pair(s) (times are noisy on a shared machine)", flush=True)
    runs = {"cold": [], "warm": []}
    try:
        for i in range(args.repeats):
            cache = tmp / f"cache{i}"
            cache.mkdir()
            for kind in ("cold", "warm"):
                r = one_run(cache, tmp / f"run_{kind}{i}", args)
                runs[kind].append(r)
                print(f"  {kind} #{i + 1}: step 1 ends {r['first_step_s']:6.1f} s after process start "
                      f"(process {r['process_s']:.1f} s, step 1 itself {r['step_time_s']:.1f} s after the loop began)",
                      flush=True)
    finally:
        if args.keep:
            print(f"  kept {tmp}")
        else:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    res = {k: statistics.median(r["first_step_s"] for r in v) for k, v in runs.items()}
    res["process_cold"] = statistics.median(r["process_s"] for r in runs["cold"])
    res["process_warm"] = statistics.median(r["process_s"] for r in runs["warm"])
    res["ratio"] = res["warm"] / res["cold"]
    print(f"cold  {res['cold']:6.1f} s   (whole process {res['process_cold']:.1f} s)")
    print(f"warm  {res['warm']:6.1f} s   (whole process {res['process_warm']:.1f} s)")
    print(f"warm / cold = {res['ratio']:.2f}  (target <= 0.30)")
    return res


if __name__ == "__main__":
    main()
