"""The steps of tools/gpu_check.sh, one per process: `python tools/gpu_check.py --step NAME --results DIR`.

Steps (in the priority order gpu_check.sh runs them):
  correctness   CUDA against the CPU reference: grouped and padded vs loop expert GEMMs (forward and
                gradients) and the compiled MoE block; 3 fp32 eager training steps of the tiny
                preset on the device vs on CPU; every memory policy fnmoe.config.MemoryConfig offers
                (recompute, offload, per-region) against none, or a skip row with the reason this
                build refuses it (e.g. offload on CUDA not built yet); the levers: fp8 expert-gather
                blocks quantised bitwise as on CPU, whole-block token chunks against none, the
                fused AdamW against its eager ops, the donated update bitwise the pure one (3 Muon steps)
  k2layer       one MoE layer of the Kimi-K2 preset at its per-GPU shapes (expert_mlp alone, then
                moe_block; balanced and at plan.imbalance) and then its whole block, eager and compiled,
                each beside the planner's time (tools/gpu_checks/k2layer.py says what and how)
  moe           tools/bench_moe.py on the device (against TorchTitan when it imports, else fnmoe alone),
                then tools/bench_adamw.py (fnmoe's AdamW eager and fused against torch.optim.AdamW
                foreach and fused, on a DeepSeek-V3-16B model's leaves cut to 2 layers)
  model         a DeepSeek-V3-16B-shaped model cut to 4 layers (MLA), bf16, compiled, AdamW, 2 x 4096
                tokens, donated update (as `fnmoe train`), per memory policy: tokens/s, MFU (989 TFLOP/s
                peak), peak memory, and with no policy the eager AdamW (optim.fused=off) beside; policies
                that would not finish in the step's time are skipped with a row saying so. Offload's
                proofs: each offload policy's CUDA peak below its policy without offload by the bytes
                it offloaded less two blocks, and one step's profiler trace with the offload copies
                on a side stream while the compute stream runs (copy_overlap)
  determinism   tokens/s of the same model with and without torch.use_deterministic_algorithms,
                and a deterministic replay check
  summary       the table of every step's rows, also written to $OUT/gpu_check.txt when $OUT is set
                (tools/gpu_checks/summary.py; gpu_check.sh runs it directly)

One file a check, in tools/gpu_checks/ (correctness.py, k2layer.py, moe.py, model.py, determinism.py;
summary.py the table), sharing gpu_checks/common.py (the Recorder, the deadline, the train step);
this runner imports only the step it runs.

Each step appends rows (section, check, result, status) to DIR/<step>.json as it goes, so a
step that times out still reports what it finished. --dry-run runs the same code on CPU at tiny
sizes (CI runs it, with tyro blocked as on the GPU image): steps 1 and 3 compile the MoE block as
the GPU run does (once: step 1 compiles it under bench_moe's inductor settings, so step 3 loads it
from the inductor cache); steps 4 and 5 run their model eager there (a cold compile of it per
memory policy took ~45 s each on 2 CPU cores). The summary is tools/gpu_checks/summary.py (no torch).

Needs only torch and fnmoe (no tyro, no torchtitan, no network): Python functions of fnmoe
are called directly, never the `fnmoe` CLI. If safetensors is missing, it is stubbed (no step
reads or writes checkpoints).

"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path[:0] = [str(ROOT), str(TOOLS)]

from gpu_checks.summary import STEPS, summary  # noqa: E402 (torch-free)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step", required=True, choices=STEPS + ["summary"])
    ap.add_argument("--results", required=True, help="directory of the per-step JSON files")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--timeout", type=float, default=0, help="this step's time limit in s (later sub-steps are "
                    "skipped rather than cut off)")
    args = ap.parse_args(argv)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    if args.step == "summary":
        return summary(results, args.dry_run)
    from gpu_checks import common  # stubs safetensors where missing, before torch and fnmoe load
    import torch

    from fnmoe import compile as fcompile

    if args.timeout:
        common.DEADLINE[0] = time.monotonic() + args.timeout - 5
    common.RESULTS_DIR[0] = results
    if args.dry_run:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        rec = common.Recorder(results, args.step)
        rec.row("device", "no CUDA device (use --dry-run on CPU)", "FAIL")
        return 1
    fcompile.setup_cache()  # TORCHINDUCTOR_CACHE_DIR when set, else the checkout's compile_cache/
    rec = common.Recorder(results, args.step)
    t0 = time.perf_counter()
    print(f"== gpu_check step {args.step} on {device}: {rec.env}", flush=True)
    check = importlib.import_module(f"gpu_checks.{args.step}")
    getattr(check, f"step_{args.step}")(rec, device, args.dry_run)
    print(f"== step {args.step} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
