"""bf16 compute on this CPU: torch's bf16 GEMMs (native) against fnmoe's fp32 GEMMs of the bf16 values
(fnmoe.kernels.bf16: one fp32 GEMM, the result rounded once to bf16), side by side, ratio printed.

    python tools/bench_bf16_cpu.py                   # the tiny default model's GEMM shapes and step
    python tools/bench_bf16_cpu.py --repeats 5 --threads 1

First the GEMMs of the default tiny model (16 x 128 tokens, dim 128, experts 256, head 264): the
median of --repeats runs of each. Then one training step (value_and_grad of loss_fn, batch 16 x 128,
bf16 compute) with FNMOE_BF16_GEMMS=native and =fp32, and with fp32 compute for scale. It names
the CPU and the flags that decide (avx2, avx512f, avx512_bf16, amx_bf16) and the load average
before and after: other work on the machine shows there, and every number holds only with it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from pathlib import Path


def cpu() -> tuple[str, list[str]]:
    """(the CPU's model name, which of the flags that decide bf16 speed it has)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                platform.processor() or "unknown")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return name, [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemms(repeats: int) -> None:
    import torch

    T, D, F, V, E = 16 * 128, 128, 256, 264, 8
    shapes = {"attention q/k/v/o [T,D]x[D,D]": (T, D, D), "dense MLP up [T,D]x[D,512]": (T, D, 512),
              "expert up [T*2/E,D]x[D,F]": (T * 2 // E, D, F), "expert down [T*2/E,F]x[F,D]": (T * 2 // E, F, D),
              "head [T,D]x[D,V]": (T, D, V), "head grad [D,T]x[T,V]": (D, T, V)}
    g = torch.Generator().manual_seed(0)
    print(f"{'GEMM':34} {'bf16 native':>12} {'fp32 path':>10} {'ratio':>7}  max |diff| in bf16 ulps")
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(k, n, generator=g).bfloat16()
        native = timed(lambda: a @ b, repeats)
        up = timed(lambda: (a.float() @ b.float()).bfloat16(), repeats)
        x, y = a @ b, (a.float() @ b.float()).bfloat16()
        ulp = torch.finfo(torch.bfloat16).eps * y.float().abs().clamp_min(1e-30)
        diff = ((x.float() - y.float()).abs() / ulp).max().item()
        print(f"{name:34} {native * 1e3:9.2f} ms {up * 1e3:7.2f} ms {native / up:6.1f}x  {diff:.1f}")


def step(repeats: int) -> None:
    import torch

    from fnmoe.config import ModelConfig
    from fnmoe.models.params import init_params
    from fnmoe.training.step import loss_fn
    from fnmoe.tree import value_and_grad

    tok = torch.randint(0, 256, (16, 129), generator=torch.Generator().manual_seed(0))
    times = {}
    for label, dtype, choice in (("bf16, torch's bf16 GEMMs", "bfloat16", "native"),
                                 ("bf16, fp32 GEMMs (fnmoe)", "bfloat16", "fp32"), ("fp32 compute", "float32", "")):
        os.environ["FNMOE_BF16_GEMMS"] = choice
        cfg = dataclasses.replace(ModelConfig(), compute_dtype=dtype)
        params = init_params(cfg, 0)
        grad = value_and_grad(loss_fn, has_aux=True)
        times[label] = timed(lambda: grad(params, tok[:, :-1], tok[:, 1:], cfg), repeats)
        print(f"train step (tiny default, 16 x 128 tokens), {label:26} {times[label]:7.3f} s")
    native, up = times["bf16, torch's bf16 GEMMs"], times["bf16, fp32 GEMMs (fnmoe)"]
    print(f"bf16 step: native / fp32 path = {native / up:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    name, flags = cpu()
    print(f"CPU: {name}; {os.cpu_count()} cores; flags: {', '.join(flags) or 'none of avx2/avx512'}; torch "
          f"{torch.__version__} (capability {torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} "
          f"threads; load average {os.getloadavg()[0]:.1f}")
    gemms(args.repeats)
    step(args.repeats)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
