"""CPU threading of `fnmoe train` on a quiet and on a busy machine: tokens/s of the tiny default model
for each way of running its OpenMP threads, each choice in a fresh `python -m fnmoe train` process
(OMP_WAIT_POLICY and GOMP_SPINCOUNT are read once, when torch loads OpenMP).

    python tools/bench_threads.py                   # 20 steps a run, quiet and under 2 busy loops
    python tools/bench_threads.py --steps 30 --loads 0,1,2 --repeats 2

Choices (torch's OpenMP is GNU libgomp):

  auto        what `fnmoe train` does with no flag and no OpenMP variable set (fnmoe/threads.py:
              GOMP_SPINCOUNT=1000, a waiting thread spins ~10 us, then sleeps)
  spin        libgomp's own default: a waiting thread spins 300,000 times (~3 ms) before it sleeps
              (GOMP_SPINCOUNT=300000: what fnmoe did before it chose)
  active      OMP_WAIT_POLICY=ACTIVE: waiting threads never sleep
  passive     OMP_WAIT_POLICY=PASSIVE: waiting threads sleep at once
  1 spin      --train.threads 1, libgomp's default waiting
  1 passive   --train.threads 1 and OMP_WAIT_POLICY=PASSIVE
  spin=N      GOMP_SPINCOUNT=N: a waiting thread spins N times, then sleeps (not run unless named)

A load of N starts N busy-loop processes (one Python `while True` each) before the choice's runs
and stops them after. tokens/s is a run's tokens over its step time, steps 3..N (step 1 and 2
warm up); each row also gives the slowest step and the process's wall time. The load average
(`os.getloadavg`) before each run is printed, and the machine's before and after: other work on
the machine shows there, and every number holds only with it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHOICES = {  # name -> (environment, flags)
    "auto": ({}, []),
    "spin": ({"GOMP_SPINCOUNT": "300000"}, []),
    "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, []),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "1 spin": ({"GOMP_SPINCOUNT": "300000"}, ["--train.threads", "1"]),
    "1 passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--train.threads", "1"]),
}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_DYNAMIC", "OMP_PROC_BIND")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def busy(n: int) -> list[subprocess.Popen]:
    """n busy-loop processes (the synthetic load); stop them with `stop`."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=30)


def choice(name: str) -> tuple[dict, list]:
    """(environment, flags) of a choice: one of CHOICES or spin=N."""
    if name.startswith("spin=") and name[5:].isdigit():
        return {"GOMP_SPINCOUNT": name[5:]}, []
    return CHOICES[name]


def run_choice(name: str, steps: int, timeout: float, extra: list[str]) -> dict:
    """One `fnmoe train` of `steps` steps under choice `name`: tokens/s over steps 3.., the slowest
    step, the process's wall time, and the threads line it logged."""
    env_set, flags = choice(name)
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(env_set)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fnmoe", "train", "--train.steps", str(steps), "--train.run-dir", tmp,
               "--train.eval-every", "0", "--train.eval-batches", "1", "--train.log-every", str(steps),
               "--optim.warmup-steps", "1", *flags, *extra]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r and "tokens_per_s" in r]
    tokens = rows[0]["tokens"]  # one step's tokens
    times = [tokens / r["tokens_per_s"] for r in rows[2:]] or [tokens / r["tokens_per_s"] for r in rows]
    said = next((line for line in done.stdout.splitlines() if line.startswith("threads:")), "")
    return {"tokens_per_s": tokens * len(times) / sum(times), "slowest_s": max(times),
            "median_s": statistics.median(times), "wall_s": wall, "said": said}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--loads", default="0,2", help="busy-loop processes per condition, comma-separated")
    parser.add_argument("--choices", default=",".join(CHOICES), help=f"of {', '.join(CHOICES)}, spin=N")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each choice per condition (interleaved)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one training process may take")
    parser.add_argument("extra", nargs="*", help="more `fnmoe train` flags (after --)")
    args = parser.parse_args(argv)
    choices = [c.strip() for c in args.choices.split(",")]
    unknown = [c for c in choices if c not in CHOICES and not (c.startswith("spin=") and c[5:].isdigit())]
    if unknown:
        parser.error(f"unknown choices {unknown}; known: {list(CHOICES)}")
    loads = [int(x) for x in args.loads.split(",")]
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; {args.steps} steps of the tiny default model a run; "
          f"load average (1/5/15 min) {load()} before", flush=True)
    results: dict[tuple[int, str], list[dict]] = {}
    for n in loads:
        procs = busy(n)
        try:
            time.sleep(1.0 if n else 0.0)
            for _ in range(args.repeats):
                for name in choices:
                    before = load()
                    got = run_choice(name, args.steps, args.timeout, args.extra)
                    results.setdefault((n, name), []).append(got)
                    print(f"  load +{n}  {name:<10} {got['tokens_per_s']:>8,.0f} tok/s  median step "
                          f"{got['median_s']:.3f} s, slowest {got['slowest_s']:.3f} s, wall {got['wall_s']:.1f} s "
                          f"(load avg {before}) {got['said']}", flush=True)
        finally:
            stop(procs)
    print(f"\nload average {load()} after\n")
    base = loads[0]
    head = "".join(f"{f'+{n} busy':>12}" for n in loads)
    ratios = "".join(f"{f'+{n}/+{base}':>10}" for n in loads[1:])
    print(f"{'choice':<10}{head}{ratios}   (tokens/s; median of repeats)")
    for name in choices:
        tps = [statistics.median(r["tokens_per_s"] for r in results[(n, name)]) for n in loads]
        print(f"{name:<10}" + "".join(f"{x:>12,.0f}" for x in tps)
              + "".join(f"{x / tps[0]:>10.2f}" for x in tps[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
