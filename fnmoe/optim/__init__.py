"""Optimizers as (init, update) pairs over parameter trees, in the style of optax.

    base.py         GradientTransformation, chain, partition, clipping, apply_updates, labels, state_from_flat
    schedules.py    lr schedules of the 0-based step (cosine, wsd, constant)
    adam.py         scale_by_adam, adamw (torch.optim.AdamW's arithmetic)
    muon_update.py  newton_schulz, scale_by_muon, muon (matrices on Muon, the rest on AdamW)
    qk_clipping.py  qk_clip: MuonClip's per-head query/key rescale, after any optimizer's step
    in_place.py     update_in_place: an update written into the params and state it was given, leaf by leaf
    build.py        from_config: the optimizer a RunConfig's `optim` section describes

Modules import one way, in that order; this file only re-exports. A module is never named after
the function it holds, so `fnmoe.optim.muon` and `fnmoe.optim.adamw` are always the functions.

Legend: no shape-suffixed tensors here (see each module).
"""
from fnmoe.optim.adam import AdamWState, ScaleByAdamState, adamw, scale_by_adam
from fnmoe.optim.base import (AddDecayedWeightsState, ClipState, EmptyState, GradientTransformation, PerLeaf,
                              ScalarOrSchedule, ScaleByLearningRateState, Schedule, Tree, add_decayed_weights,
                              apply_updates, chain, clip_by_global_norm, decay_mask, default_labels, global_norm,
                              identity, last_lr, partition, scale_by_learning_rate, select, set_hyperparams,
                              set_to_zero, state_from_flat)
from fnmoe.optim.build import from_config
from fnmoe.optim.muon_update import (NS_COEFFICIENTS, AdjustLR, ScaleByMuonState, lr_scale, muon, newton_schulz,
                                     scale_by_muon)
from fnmoe.optim.qk_clipping import qk_clip
from fnmoe.optim.in_place import update_in_place
from fnmoe.optim.schedules import constant, schedule_from_config, warmup_cosine, warmup_of, wsd
from fnmoe.tree import tree_flatten_with_paths, tree_map  # the tree helpers optimizer code maps with

__all__ = [
    # base
    "GradientTransformation", "EmptyState", "Tree", "Schedule", "ScalarOrSchedule", "PerLeaf",
    "identity", "set_to_zero", "chain", "partition", "apply_updates", "select", "set_hyperparams", "last_lr",
    "state_from_flat",
    "global_norm", "ClipState", "clip_by_global_norm", "AddDecayedWeightsState", "add_decayed_weights",
    "ScaleByLearningRateState", "scale_by_learning_rate", "default_labels", "decay_mask",
    # schedules
    "constant", "warmup_cosine", "wsd", "schedule_from_config", "warmup_of",
    # adam
    "ScaleByAdamState", "scale_by_adam", "AdamWState", "adamw",
    # muon
    "NS_COEFFICIENTS", "AdjustLR", "newton_schulz", "lr_scale", "ScaleByMuonState", "scale_by_muon", "muon",
    # qk-clip, config
    "qk_clip", "from_config", "update_in_place",
    # fnmoe.tree
    "tree_flatten_with_paths", "tree_map",
]
