"""Learning-rate schedules: each maps a 0-based step (0-D int tensor) to an fp32 0-D lr.

They use tensor ops only, so a compiled update that calls one never recompiles as the step
advances. Warmup is linear, from peak/warmup_steps at step 0 to peak at step warmup_steps-1;
the decay runs to peak*min_ratio at the last step, total_steps-1, and stays there.

A config's warmup follows the run (`warmup_of`): optim.warmup_fraction of train.steps when set,
else optim.warmup_steps, clamped to a tenth of the run (with a note the loop logs) when it is not
shorter than the run, which would otherwise end in the warmup without a word.

Legend: no shape-suffixed tensors here; every tensor is 0-D (a step or an lr).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from fnmoe.config import OptimConfig
from fnmoe.optim.base import Schedule, hyper


def constant(value: float) -> Schedule:
    hyper("constant schedule: value", value)
    return lambda step: torch.full((), value, dtype=torch.float32, device=step.device)


def _warmup(s: Tensor, warmup_steps: int) -> Tensor:
    return torch.clamp((s + 1) / warmup_steps, max=1.0) if warmup_steps > 0 else torch.ones_like(s)


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Schedule:
    """Linear warmup, then cosine from peak at step max(warmup-1, 0) to peak*min_ratio at total_steps-1."""
    hyper("warmup_cosine: peak", peak)
    hyper("warmup_cosine: min_ratio", min_ratio, hi=1.0)
    start = max(warmup_steps - 1, 0)
    span = max(total_steps - 1 - start, 1)

    def schedule(step: Tensor) -> Tensor:
        s = step.to(torch.float64)
        progress = torch.clamp((s - start) / span, 0.0, 1.0)
        cosine = min_ratio + (1 - min_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
        return (peak * torch.minimum(_warmup(s, warmup_steps), cosine)).to(torch.float32)
    return schedule


def wsd(peak: float, warmup_steps: int, total_steps: int, decay_fraction: float = 0.2,
        min_ratio: float = 0.1) -> Schedule:
    """Warmup-stable-decay: linear warmup, peak, then a linear decay over the last
    n = max(1, round(decay_fraction*total_steps)) steps, reaching peak*min_ratio at total_steps-1."""
    hyper("wsd: peak", peak)
    hyper("wsd: min_ratio", min_ratio, hi=1.0)
    hyper("wsd: decay_fraction", decay_fraction, hi=1.0)
    n_decay = max(1, round(decay_fraction * total_steps))
    last_stable = total_steps - 1 - n_decay

    def schedule(step: Tensor) -> Tensor:
        s = step.to(torch.float64)
        decay = 1 - (1 - min_ratio) * torch.clamp((s - last_stable) / n_decay, 0.0, 1.0)
        return (peak * torch.minimum(_warmup(s, warmup_steps), decay)).to(torch.float32)
    return schedule


WARMUP_CLAMP = 0.1
"""a warmup not shorter than the run is clamped to this fraction of it (rounded down)"""


def warmup_of(ocfg: OptimConfig, total_steps: int) -> tuple[int, str | None]:
    """(warmup steps of a run of total_steps, a note when optim.warmup_steps was clamped): the
    rounded fraction when optim.warmup_fraction > 0, else optim.warmup_steps while it is shorter
    than the run, else a tenth of the run."""
    if ocfg.warmup_fraction > 0:
        return round(ocfg.warmup_fraction * total_steps), None
    if ocfg.warmup_steps < total_steps or ocfg.schedule == "constant":
        return ocfg.warmup_steps, None
    clamped = int(WARMUP_CLAMP * total_steps)
    steps = f"{clamped} step{'' if clamped == 1 else 's'}"
    return clamped, (f"optim.warmup_steps={ocfg.warmup_steps} is not shorter than the run (train.steps="
                     f"{total_steps}): the warmup is clamped to {steps}, a tenth of the run, so the lr reaches its "
                     "peak and decays; set --optim.warmup-fraction F (or a smaller --optim.warmup-steps) to choose")


def schedule_from_config(ocfg: OptimConfig, peak: float, total_steps: int) -> Schedule:
    """ocfg's schedule shape with this peak (Muon's AdamW leaves use their own peak), its warmup
    from warmup_of."""
    warmup, _ = warmup_of(ocfg, total_steps)
    if ocfg.schedule == "constant":
        return constant(peak)
    if ocfg.schedule == "cosine":
        return warmup_cosine(peak, warmup, total_steps, ocfg.min_lr_ratio)
    if ocfg.schedule == "wsd":
        return wsd(peak, warmup, total_steps, ocfg.decay_fraction, ocfg.min_lr_ratio)
    raise ValueError(f"optim.schedule must be 'cosine', 'wsd' or 'constant', got {ocfg.schedule!r}")
