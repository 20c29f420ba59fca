"""Optimizers as (init, update) pairs over parameter trees, in the style of optax.

A `GradientTransformation` turns a tree of gradients into a tree of updates that
`apply_updates` adds to the params (updates carry the minus sign, as in optax). Small
transforms compose with `chain`; `partition` gives each labelled group of leaves its own
transform (Muon for matrices, AdamW for the rest, nothing for `buffers`).

States are trees of tensors, so they checkpoint like params. Hyperparameters (lr, betas,
eps, weight decay, momentum, clip norm) and the step count live in the state as 0-D
tensors: a compiled update reads them as data, so changing one (`set_hyperparams`) never
recompiles. They are float64 because torch.optim computes its scalars in Python doubles
and casts them to the param dtype inside each kernel; float64 tensors reproduce that.

Functions never mutate their inputs; in-place ops appear only on temporaries a function has
just made, since fresh large tensors are costly in eager mode on CPU. Run updates under
`torch.no_grad()` (as `torch.optim` steps do); `apply_updates` does.

Legend: no shape-suffixed tensors here; every function maps trees leaf by leaf. "0-D" is a
scalar tensor, "leaf" a tensor of a tree, "path" a leaf's dotted key ("layers.0.attn.w_q_DN").
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fnmoe import sharding
from fnmoe.config import OptimConfig
from fnmoe.tree import tree_flatten_with_paths, tree_map

Tree = Any
"""a nested dict (str keys) of tensors; states also hold NamedTuples and tuples"""
Schedule = Callable[[Tensor], Tensor]
"""0-based step (0-D int64) -> lr (0-D float32)"""
ScalarOrSchedule = float | Schedule
PerLeaf = Any
"""a per-leaf annotation (labels, decay mask): a tree shaped like the params, or params -> that tree"""


# ------------------------------------------------------------------ core

class GradientTransformation(NamedTuple):
    init: Callable[[Tree], Tree]
    """params -> state"""
    update: Callable[..., tuple[Tree, Tree]]
    """(updates, state, params=None) -> (updates, state)"""


class EmptyState(NamedTuple):
    pass


def _leaves(tree: Tree) -> list[Any]:
    return tree_flatten_with_paths(tree)[1]


def _device(tree: Tree) -> torch.device:
    leaves = _leaves(tree)
    return leaves[0].device if leaves else torch.device("cpu")


def _scalar(value: float, device: torch.device) -> Tensor:
    return torch.tensor(value, dtype=torch.float64, device=device)


def _count(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def _resolve(tree_or_fn: PerLeaf, tree: Tree) -> list[Any]:
    """Leaves of a per-leaf annotation (labels, masks) given as a tree or as a function of `tree`."""
    ann = tree_or_fn(tree) if callable(tree_or_fn) else tree_or_fn
    paths = tree_flatten_with_paths(tree)[0]
    by_path = dict(zip(*tree_flatten_with_paths(ann)[:2]))
    if by_path.keys() != set(paths):
        raise ValueError(f"labels/mask tree does not match the params tree at {sorted(by_path.keys() ^ set(paths))[:5]}")
    return [by_path[p] for p in paths]


def identity() -> GradientTransformation:
    return GradientTransformation(lambda params: EmptyState(), lambda updates, state, params=None: (updates, state))


def set_to_zero() -> GradientTransformation:
    """Updates of zero: the leaves stay bitwise unchanged (frozen buffers)."""
    def update(updates: Tree, state: EmptyState, params: Tree = None) -> tuple[Tree, EmptyState]:
        # -0.0, not 0.0: x + (-0.0) == x for every x, while -0.0 + 0.0 would give +0.0
        return tree_map(lambda u: torch.full_like(u, -0.0), updates), state
    return GradientTransformation(lambda params: EmptyState(), update)


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply transforms in order; the state is the tuple of their states."""
    def init(params: Tree) -> tuple:
        return tuple(tx.init(params) for tx in txs)

    def update(updates: Tree, state: tuple, params: Tree = None) -> tuple[Tree, tuple]:
        new_state = []
        for tx, s in zip(txs, state, strict=True):
            updates, s = tx.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)
    return GradientTransformation(init, update)


def partition(transforms: dict[str, GradientTransformation], labels: PerLeaf) -> GradientTransformation:
    """Give each leaf the transform named by its label.

    `labels` is a tree of strings shaped like the params, or a function params -> that tree
    (at update time it is called on the updates, which have the params' paths and shapes).
    Each transform sees a flat dict {path: leaf} of its own leaves, so its state is keyed
    by path; the state of the partition is {label: state}.
    """
    def split(tree: Tree, label_leaves: list[str]) -> dict[str, dict[str, Any]]:
        paths, leaves, _ = tree_flatten_with_paths(tree)
        groups: dict[str, dict[str, Any]] = {name: {} for name in transforms}
        for path, leaf, label in zip(paths, leaves, label_leaves, strict=True):
            if label not in groups:
                raise ValueError(f"leaf '{path}' has label {label!r}; transforms are {sorted(transforms)}")
            groups[label][path] = leaf
        return groups

    def init(params: Tree) -> dict[str, Tree]:
        groups = split(params, _resolve(labels, params))
        return {name: tx.init(groups[name]) for name, tx in transforms.items()}

    def update(updates: Tree, state: dict[str, Tree], params: Tree = None) -> tuple[Tree, dict[str, Tree]]:
        label_leaves = _resolve(labels, updates)
        paths, _, rebuild = tree_flatten_with_paths(updates)
        u_groups = split(updates, label_leaves)
        p_groups = split(params, label_leaves) if params is not None else {}
        out: dict[str, Any] = {}
        new_state = {}
        for name, tx in transforms.items():
            u, new_state[name] = tx.update(u_groups[name], state[name], p_groups.get(name))
            out.update(u)
        return rebuild([out[p] for p in paths]), new_state
    return GradientTransformation(init, update)


@torch.no_grad()
def apply_updates(params: Tree, updates: Tree, inplace: bool = False) -> Tree:
    """params + updates, leaf by leaf, in each param's dtype.

    inplace=False returns new leaves (leaves that required grad are fresh leaves that
    require grad); inplace=True adds into the given tensors and returns the same tree.
    """
    if inplace:
        return tree_map(lambda p, u: p.add_(u), params, updates)
    return tree_map(lambda p, u: (p + u).to(p.dtype).requires_grad_(p.requires_grad), params, updates)


@torch.no_grad()
def select(ok: Tensor, on_true: Tree, on_false: Tree) -> Tree:
    """torch.where(ok, ., .) leaf by leaf for a 0-D bool `ok`: a decision taken on the device
    (skip a non-finite step) without reading the flag on the host. Leaves come out bitwise
    equal to the chosen tree's, NaNs and signed zeros included."""
    return tree_map(lambda a, b: torch.where(ok.to(a.device), a, b).requires_grad_(a.requires_grad),
                    on_true, on_false)


def set_hyperparams(state: Tree, **values: float) -> Tree:
    """A copy of `state` with every NamedTuple field of one of these names set to the value.

    e.g. set_hyperparams(state, lr=3e-4). Scheduled learning rates are recomputed from the
    step count every update, so setting their `lr` (the last lr used) has no effect.
    """
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(
            torch.full_like(v, values[f]) if f in values else set_hyperparams(v, **values)
            for f, v in zip(state._fields, state)))
    if isinstance(state, (tuple, list)):
        return type(state)(set_hyperparams(v, **values) for v in state)
    if isinstance(state, dict):
        return {k: set_hyperparams(v, **values) for k, v in state.items()}
    return state


def last_lr(state: Tree) -> float:
    """The lr of the optimizer's latest update: its first `lr` state field (Muon's matrix group,
    AdamW's only one). It follows the optimizer's own step count, which a fresh optimizer state
    (another optimizer on resume) restarts."""
    paths, leaves, _ = tree_flatten_with_paths(state)
    return next(float(x) for p, x in zip(paths, leaves) if p.rsplit(".", 1)[-1] == "lr")


# ------------------------------------------------------------------ building blocks

def global_norm(tree: Tree) -> Tensor:
    """L2 norm of all floating leaves together, accumulated in fp32 (a norm of per-leaf
    norms, as torch.nn.utils.clip_grad_norm_ computes it). Integer leaves (counters under
    `buffers`) carry no gradient and are skipped."""
    leaves = [x for x in _leaves(tree) if x.is_floating_point()]
    if any(isinstance(x, DTensor) for x in leaves):  # sharded: each mesh's part, summed over its ranks
        return sharding.global_norm_sq(tree).sqrt()
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    norms = [torch.linalg.vector_norm(x, dtype=torch.float32) for x in leaves]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


class ClipState(NamedTuple):
    max_norm: Tensor


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_."""
    def update(updates: Tree, state: ClipState, params: Tree = None) -> tuple[Tree, ClipState]:
        norm = global_norm(updates)
        # reciprocal-then-multiply is how torch evaluates `max_norm / (norm + 1e-6)`
        coef = torch.clamp((norm + 1e-6).reciprocal() * state.max_norm.to(norm.dtype), max=1.0)
        return tree_map(lambda u: u * coef.to(u.device) if u.is_floating_point() else u, updates), state
    return GradientTransformation(lambda params: ClipState(_scalar(max_norm, _device(params))), update)


class ScaleByAdamState(NamedTuple):
    count: Tensor
    b1: Tensor
    b2: Tensor
    eps: Tensor
    mu: Tree
    nu: Tree


def _adam_moments(g: Tensor, mu: Tensor, nu: Tensor, b1: Tensor, b2: Tensor) -> tuple[Tensor, Tensor]:
    # torch: exp_avg.lerp_(g, 1-b1); exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2). Pre-scaling
    # one factor and calling addcmul keeps torch's fused multiply-add, so the moments are bitwise equal.
    return mu.lerp(g, 1 - b1), (nu * b2).addcmul_(g * (1 - b2), g)


def _adam_denom(nu: Tensor, bc2: Tensor, eps: Tensor) -> Tensor:
    return nu.sqrt().div_(bc2.sqrt()).add_(eps)


def _adam_init(params: Tree, b1: float, b2: float, eps: float) -> tuple[Tensor, ...]:
    device = _device(params)
    return (_count(device), _scalar(b1, device), _scalar(b2, device), _scalar(eps, device),
            tree_map(torch.zeros_like, params), tree_map(torch.zeros_like, params))


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Bias-corrected m / (sqrt(v) + eps), with torch.optim.Adam's order of operations."""
    def update(updates: Tree, state: ScaleByAdamState, params: Tree = None) -> tuple[Tree, ScaleByAdamState]:
        _, g_leaves, rebuild = tree_flatten_with_paths(updates)
        count = state.count + 1
        bc1, bc2 = 1 - state.b1 ** count, 1 - state.b2 ** count
        out, mus, nus = [], [], []
        for g, m, v in zip(g_leaves, _leaves(state.mu), _leaves(state.nu), strict=True):
            m, v = _adam_moments(g, m, v, state.b1, state.b2)
            out.append((m / bc1).div_(_adam_denom(v, bc2, state.eps)))
            mus.append(m)
            nus.append(v)
        # built field by field: torch 2.11's dynamo returns NamedTuple._replace's result empty
        return rebuild(out), ScaleByAdamState(count, state.b1, state.b2, state.eps, rebuild(mus), rebuild(nus))
    return GradientTransformation(lambda params: ScaleByAdamState(*_adam_init(params, b1, b2, eps)), update)


class AddDecayedWeightsState(NamedTuple):
    weight_decay: Tensor


def add_decayed_weights(weight_decay: float, mask: PerLeaf | None = None) -> GradientTransformation:
    """updates + weight_decay * params on the leaves where `mask` (bools, or params -> bools) is True."""
    def update(updates: Tree, state: AddDecayedWeightsState, params: Tree = None) -> tuple[Tree, Any]:
        if params is None:
            raise ValueError("add_decayed_weights needs params")
        paths, u_leaves, rebuild = tree_flatten_with_paths(updates)
        decay = _resolve(mask, params) if mask is not None else [True] * len(paths)
        wd = state.weight_decay
        out = [torch.addcmul(u, p, wd) if d else u for u, p, d in zip(u_leaves, _leaves(params), decay, strict=True)]
        return rebuild(out), state
    return GradientTransformation(lambda params: AddDecayedWeightsState(_scalar(weight_decay, _device(params))), update)


class ScaleByLearningRateState(NamedTuple):
    count: Tensor
    lr: Tensor
    """the constant lr, or with a schedule the lr of the latest step (for logging)"""


def _lr_now(lr: ScalarOrSchedule, count: Tensor, state_lr: Tensor) -> Tensor:
    return lr(count).to(state_lr) if callable(lr) else state_lr


def _lr_init(lr: ScalarOrSchedule, device: torch.device) -> Tensor:
    return lr(_count(device)).to(torch.float64) if callable(lr) else _scalar(lr, device)


def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """updates * -lr; lr a float (kept in the state) or a schedule of the 0-based step."""
    def update(updates: Tree, state: ScaleByLearningRateState, params: Tree = None) -> tuple[Tree, Any]:
        lr_now = _lr_now(lr, state.count, state.lr)
        return tree_map(lambda u: u * -lr_now, updates), ScaleByLearningRateState(state.count + 1, lr_now)

    def init(params: Tree) -> ScaleByLearningRateState:
        device = _device(params)
        return ScaleByLearningRateState(_count(device), _lr_init(lr, device))
    return GradientTransformation(init, update)


# ------------------------------------------------------------------ AdamW

class AdamWState(NamedTuple):
    count: Tensor
    lr: Tensor
    b1: Tensor
    b2: Tensor
    eps: Tensor
    weight_decay: Tensor
    mu: Tree
    nu: Tree


def adamw(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.01, mask: PerLeaf | None = None) -> GradientTransformation:
    """torch.optim.AdamW as one transform: decoupled decay p*(1 - lr*wd), bias correction,
    eps added after sqrt(v)/sqrt(bc2). `mask` (bools, or params -> bools) picks the decayed
    leaves; None decays all.

    Exactness: the moments and the step term (lr/bc1)*m/denom are computed in torch's order
    and are bitwise equal, so leaves without decay match torch.optim.AdamW bitwise. With
    decay, torch rounds twice in place (p*(1-lr*wd), then + step) where p + update rounds
    once, so decayed leaves agree to about 1 ulp per step, not bitwise.
    """
    def update(grads: Tree, state: AdamWState, params: Tree = None) -> tuple[Tree, AdamWState]:
        if params is None:
            raise ValueError("adamw needs params")
        paths, g_leaves, rebuild = tree_flatten_with_paths(grads)
        decay = _resolve(mask, params) if mask is not None else [True] * len(paths)
        count = state.count + 1
        lr_now = _lr_now(lr, state.count, state.lr)
        neg_step_size = -(lr_now / (1 - state.b1 ** count))
        bc2 = 1 - state.b2 ** count
        neg_decay = -(lr_now * state.weight_decay)
        out, mus, nus = [], [], []
        for g, p, m, v, d in zip(g_leaves, _leaves(params), _leaves(state.mu), _leaves(state.nu), decay, strict=True):
            m, v = _adam_moments(g, m, v, state.b1, state.b2)
            step = (neg_step_size * m).div_(_adam_denom(v, bc2, state.eps))
            out.append(torch.addcmul(step, p, neg_decay) if d else step)
            mus.append(m)
            nus.append(v)
        return rebuild(out), AdamWState(count, lr_now, state.b1, state.b2, state.eps, state.weight_decay,
                                        rebuild(mus), rebuild(nus))  # not _replace: see scale_by_adam

    def init(params: Tree) -> AdamWState:
        count, b1_, b2_, eps_, mu, nu = _adam_init(params, b1, b2, eps)
        device = _device(params)
        return AdamWState(count, _lr_init(lr, device), b1_, b2_, eps_, _scalar(weight_decay, device), mu, nu)
    return GradientTransformation(init, update)


# ------------------------------------------------------------------ schedules
# Each maps a 0-based step (0-D int tensor) to an fp32 0-D lr using tensor ops only, so a
# compiled update that calls it never recompiles. Warmup is linear, from peak/warmup_steps at
# step 0 to peak at step warmup_steps-1; the decay runs to peak*min_ratio at the last step,
# total_steps-1, and stays there.

def constant(value: float) -> Schedule:
    return lambda step: torch.full((), value, dtype=torch.float32, device=step.device)


def _warmup(s: Tensor, warmup_steps: int) -> Tensor:
    return torch.clamp((s + 1) / warmup_steps, max=1.0) if warmup_steps > 0 else torch.ones_like(s)


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Schedule:
    """Linear warmup, then cosine from peak at step max(warmup-1, 0) to peak*min_ratio at total_steps-1."""
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
    n_decay = max(1, round(decay_fraction * total_steps))
    last_stable = total_steps - 1 - n_decay

    def schedule(step: Tensor) -> Tensor:
        s = step.to(torch.float64)
        decay = 1 - (1 - min_ratio) * torch.clamp((s - last_stable) / n_decay, 0.0, 1.0)
        return (peak * torch.minimum(_warmup(s, warmup_steps), decay)).to(torch.float32)
    return schedule


def schedule_from_config(ocfg: OptimConfig, peak: float, total_steps: int) -> Schedule:
    """ocfg's schedule shape with this peak (Muon's AdamW leaves use their own peak)."""
    if ocfg.schedule == "constant":
        return constant(peak)
    if ocfg.schedule == "cosine":
        return warmup_cosine(peak, ocfg.warmup_steps, total_steps, ocfg.min_lr_ratio)
    if ocfg.schedule == "wsd":
        return wsd(peak, ocfg.warmup_steps, total_steps, ocfg.decay_fraction, ocfg.min_lr_ratio)
    raise ValueError(f"optim.schedule must be 'cosine', 'wsd' or 'constant', got {ocfg.schedule!r}")


# ------------------------------------------------------------------ labels and configs

def default_labels(params: Tree, muon: bool = True) -> Tree:
    """'frozen' under `buffers`; with muon, 'muon' for leaves of >= 2 dims outside the
    embedding (`embed`) and output head (`head`); everything else 'adamw'."""
    paths, leaves, rebuild = tree_flatten_with_paths(params)

    def label(path: str, leaf: Tensor) -> str:
        top = path.split(".", 1)[0]
        if top == "buffers":
            return "frozen"
        return "muon" if muon and leaf.ndim >= 2 and top not in ("embed", "head") else "adamw"
    return rebuild([label(p, x) for p, x in zip(paths, leaves)])


def decay_mask(params: Tree) -> Tree:
    """Weight decay on matrices (>= 2 dims), not on norms and biases."""
    return tree_map(lambda x: x.ndim >= 2, params)


def from_config(ocfg: OptimConfig, total_steps: int) -> tuple[GradientTransformation, Schedule]:
    """The optimizer a RunConfig's `optim` section describes, and its lr schedule (for logging).

    Gradients are clipped by global norm first (clip_norm > 0), then AdamW or Muon; buffers
    are frozen. Muon's AdamW leaves follow the same schedule shape with peak adamw_lr (0: lr).
    """
    schedule = schedule_from_config(ocfg, ocfg.lr, total_steps)
    if ocfg.name == "muon":
        tx = muon(schedule, weight_decay=ocfg.weight_decay, momentum=ocfg.momentum, nesterov=ocfg.nesterov,
                  ns_steps=ocfg.ns_steps, adjust_lr=ocfg.adjust_lr,
                  adamw_lr=schedule_from_config(ocfg, ocfg.adamw_lr or ocfg.lr, total_steps),
                  adamw_betas=(ocfg.beta1, ocfg.beta2), adamw_eps=ocfg.eps,
                  momentum_dtype=getattr(torch, ocfg.momentum_dtype), ns_dtype=getattr(torch, ocfg.ns_dtype))
    elif ocfg.name == "adamw":
        tx = partition({"adamw": adamw(schedule, ocfg.beta1, ocfg.beta2, ocfg.eps, ocfg.weight_decay, mask=decay_mask),
                        "frozen": set_to_zero()},
                       lambda params: default_labels(params, muon=False))
    else:
        raise ValueError(f"optim.name must be 'adamw' or 'muon', got {ocfg.name!r}")
    if ocfg.clip_norm > 0:
        tx = chain(clip_by_global_norm(ocfg.clip_norm), tx)
    return tx, schedule


from fnmoe.muon import muon, newton_schulz, scale_by_muon  # noqa: E402, F401  (re-exported)
