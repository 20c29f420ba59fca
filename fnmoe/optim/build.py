"""The optimizer a RunConfig's `optim` section describes: the one place that knows every
optimizer of the package, so AdamW and Muon need not know each other.

Legend: no shape-suffixed tensors here; optimizers map trees leaf by leaf.
"""
from __future__ import annotations

from fnmoe.config import OptimConfig
from fnmoe.dtypes import DTYPE
from fnmoe.optim.adam import adamw
from fnmoe.optim.base import (GradientTransformation, chain, clip_by_global_norm, decay_mask, default_labels,
                              partition, set_to_zero)
from fnmoe.optim.muon_update import muon
from fnmoe.optim.schedules import schedule_from_config


def from_config(ocfg: OptimConfig, total_steps: int) -> GradientTransformation:
    """The optimizer a RunConfig's `optim` section describes, for a run of total_steps.

    Gradients are clipped by global norm first (clip_norm > 0), then AdamW or Muon; buffers
    are frozen. The lr follows schedule_from_config(ocfg, ocfg.lr, total_steps) (the lr of each
    update is also in the state: last_lr); Muon's AdamW leaves follow the same schedule shape with
    peak adamw_lr (0: lr).
    """
    schedule = schedule_from_config(ocfg, ocfg.lr, total_steps)
    if ocfg.name == "muon":
        tx = muon(schedule, weight_decay=ocfg.weight_decay, momentum=ocfg.momentum, nesterov=ocfg.nesterov,
                  ns_steps=ocfg.ns_steps, adjust_lr=ocfg.adjust_lr,
                  adamw_lr=schedule_from_config(ocfg, ocfg.adamw_lr or ocfg.lr, total_steps),
                  adamw_betas=(ocfg.beta1, ocfg.beta2), adamw_eps=ocfg.eps,
                  momentum_dtype=DTYPE[ocfg.momentum_dtype], ns_dtype=DTYPE[ocfg.ns_dtype], fused=ocfg.fused)
    elif ocfg.name == "adamw":
        tx = partition({"adamw": adamw(schedule, ocfg.beta1, ocfg.beta2, ocfg.eps, ocfg.weight_decay, mask=decay_mask,
                                       fused=ocfg.fused),
                        "frozen": set_to_zero()},
                       lambda params: default_labels(params, muon=False))
    else:
        raise ValueError(f"optim.name must be 'adamw' or 'muon', got {ocfg.name!r}")
    if ocfg.clip_norm > 0:
        tx = chain(clip_by_global_norm(ocfg.clip_norm), tx)
    return tx
