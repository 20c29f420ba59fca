"""Step 5 of tools/gpu_check.sh, determinism: the cost of deterministic mode.

Tokens/s of step 4's model (gpu_checks.model.ModelBench) with and without
torch.use_deterministic_algorithms, and a deterministic replay check: one step twice from the same
state, the same loss and gradient norm.
"""
from __future__ import annotations

# first: it stubs safetensors where missing, before fnmoe loads
from gpu_checks.common import Recorder, build_step, status

import torch

from fnmoe import optim
from gpu_checks.model import ModelBench, fmt_perf


def step_determinism(rec: Recorder, device: str, dry: bool) -> None:
    mb = ModelBench(dry, device)
    rec.row(*mb.describe(), "info")
    base = rec.guarded("default kernels", mb.measure)
    if base:
        rec.row("default kernels", fmt_perf(base))
    torch.use_deterministic_algorithms(True)
    det = rec.guarded("deterministic", mb.measure)
    if det:
        rec.row("use_deterministic_algorithms(True)", fmt_perf(det))
    if base and det:
        rec.row("cost of deterministic mode", f"tokens/s ratio det/default {det['tps'] / base['tps']:.2f}")
        run = mb.run_cfg({})
        tx = optim.from_config(run.optim, run.train.steps)
        step_fn, _ = build_step(run, tx)
        _, m1 = step_fn(mb.state, mb.batch)
        _, m2 = step_fn(mb.state, mb.batch)
        same = m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
        rec.row("deterministic replay of one step", f"loss {m1['loss']!r} vs {m2['loss']!r}, grad norm equal "
                f"{m1['grad_norm'] == m2['grad_norm']}", status(same))
