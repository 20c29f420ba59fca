"""The optimizer core in the style of optax: `GradientTransformation`, its combinators, and the
small per-leaf transforms every optimizer is chained from.

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

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fnmoe.parallel import sharding
from fnmoe.tree import leaf_kind, leaves_like, tree_flatten_with_paths, tree_map

Tree = Any
"""a nested dict (str keys) of tensors; states also hold NamedTuples and tuples"""
Schedule = Callable[[Tensor], Tensor | float]
"""0-based step (0-D int64) -> lr (a 0-D tensor, fnmoe's schedules float32, or a Python float)"""
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


def leaves_of(tree: Tree, like: Tree | None = None) -> list[Any]:
    """tree's leaves, in like's order when given (paired by path: fnmoe.tree.leaves_like)."""
    return tree_flatten_with_paths(tree)[1] if like is None else leaves_like(tree, like)


def device_of(tree: Tree) -> torch.device:
    leaves = leaves_of(tree)
    return leaves[0].device if leaves else torch.device("cpu")


def hyper_tensor(value: float, device: torch.device) -> Tensor:
    return torch.tensor(value, dtype=torch.float64, device=device)


def hyper(what: str, value: Any, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False) -> Any:
    """value, checked where an optimizer is built: a hyperparameter that is NaN, inf or out of its range
    would make every update non-finite (every step skipped) or turn descent into ascent. A schedule
    (a callable lr) passes as it is: fnmoe's check their peaks when they are built."""
    if callable(value):
        return value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and lo <= value \
        and (value < hi if hi_open else value <= hi)
    if not ok:
        bounds = f">= {lo:g}" if hi == math.inf else f"in [{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"{what} must be a finite number {bounds}, got {value!r}")
    return value


def zero_count(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def per_leaf_values(tree_or_fn: PerLeaf, tree: Tree, order: Tree | None = None) -> list[Any]:
    """Leaves of a per-leaf annotation (labels, masks) given as a tree or as a function of `tree`, in
    the order of `order`'s paths (default tree's)."""
    ann = tree_or_fn(tree) if callable(tree_or_fn) else tree_or_fn
    paths = tree_flatten_with_paths(tree if order is None else order)[0]
    by_path = dict(zip(*tree_flatten_with_paths(ann)[:2]))
    # one leaf at a time (in_place.update_in_place) a tree of annotations covers more than the leaf
    if not set(paths) <= by_path.keys() or (by_path.keys() != set(paths) and not _whole_norm):
        raise ValueError(f"labels/mask tree does not match the params tree at "
                         f"{sorted(by_path.keys() ^ set(paths))[:5]}")
    return [by_path[p] for p in paths]


def check_grads(grads: Tree, params: Tree, who: str) -> None:
    """Raise a ValueError naming what differs where grads do not pair with params leaf for leaf:
    the paths one has and the other lacks, or a leaf's path and both shapes (a raw broadcast error,
    or one blaming a labels tree, came from deep in the update before)."""
    g = dict(zip(*tree_flatten_with_paths(grads)[:2]))
    p = dict(zip(*tree_flatten_with_paths(params)[:2]))
    if g.keys() != p.keys():
        missing, extra = sorted(p.keys() - g.keys()), sorted(g.keys() - p.keys())
        said = [f"no gradient for {_few(missing)}" if missing else "", f"a gradient for {_few(extra)}, which is not a "
                "param" if extra else ""]
        raise ValueError(f"{who}: the gradient tree does not match the params: {'; '.join(w for w in said if w)}")
    for path, leaf in g.items():
        if isinstance(leaf, Tensor) and isinstance(p[path], Tensor) and leaf.shape != p[path].shape:
            raise ValueError(f"{who}: the gradient of {path} has shape {list(leaf.shape)}, its param "
                             f"{list(p[path].shape)}")


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def checked(tx: GradientTransformation, who: str) -> GradientTransformation:
    """tx whose update first checks its gradients against the params it is given (check_grads)."""
    def update(updates: Tree, state: Tree, params: Tree = None) -> tuple[Tree, Tree]:
        if params is not None:
            check_grads(updates, params, who)
        return tx.update(updates, state, params)
    return GradientTransformation(tx.init, update)


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
        groups = split(params, per_leaf_values(labels, params))
        return {name: tx.init(groups[name]) for name, tx in transforms.items()}

    def update(updates: Tree, state: dict[str, Tree], params: Tree = None) -> tuple[Tree, dict[str, Tree]]:
        label_leaves = per_leaf_values(labels, updates)
        paths, _, rebuild = tree_flatten_with_paths(updates)
        u_groups = split(updates, label_leaves)
        p_groups = split(params, per_leaf_values(labels, params)) if params is not None else {}
        out: dict[str, Any] = {}
        new_state = {}
        for name, tx in transforms.items():
            u, new_state[name] = tx.update(u_groups[name], state[name], p_groups.get(name))
            out.update(u)
        return rebuild([out[p] for p in paths]), new_state
    return GradientTransformation(init, update)


@torch.no_grad()
def apply_updates(params: Tree, updates: Tree) -> Tree:
    """params + updates, leaf by leaf, in each param's dtype: new leaves (leaves that required grad
    are fresh leaves that require grad); params are left as they were."""
    return tree_map(lambda p, u: (p + u).to(p.dtype).requires_grad_(p.requires_grad), params, updates)


@torch.no_grad()
def select(ok: Tensor, on_true: Tree, on_false: Tree, in_place: bool = False) -> Tree:
    """torch.where(ok, ., .) leaf by leaf for a 0-D bool `ok`: a decision taken on the device
    (skip a non-finite step) without reading the flag on the host. Leaves come out bitwise
    equal to the chosen tree's, NaNs and signed zeros included.

    in_place writes the choice into on_true's leaves and returns on_true: a train step's new state
    then costs no third copy of params and optimizer state next to the old and the new. on_true's
    leaves must not be views of another leaf's memory (a leaf that is on_false's own is fine)."""
    if not in_place:
        return tree_map(lambda a, b: torch.where(ok.to(a.device), a, b).requires_grad_(a.requires_grad),
                        on_true, on_false)

    def into(a: Tensor, b: Tensor) -> Tensor:
        if a is not b:
            local_a, local_b = (a.to_local(), b.to_local()) if isinstance(a, DTensor) else (a, b)
            with torch.no_grad():
                torch.where(ok.to(local_a.device), local_a, local_b, out=local_a)
        return a
    return tree_map(into, on_true, on_false)


def set_hyperparams(state: Tree, **values: float) -> Tree:
    """A copy of `state` with every NamedTuple field of one of these names set to the value.

    e.g. set_hyperparams(state, lr=3e-4). Scheduled learning rates are recomputed from the
    step count every update, so setting their `lr` (the last lr used) has no effect.
    """
    for name, value in values.items():
        hyper(f"set_hyperparams: {name}", value, lo=-math.inf)
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(
            torch.full_like(v, values[f]) if f in values else set_hyperparams(v, **values)
            for f, v in zip(state._fields, state)))
    if isinstance(state, (tuple, list)):
        return type(state)(set_hyperparams(v, **values) for v in state)
    if isinstance(state, dict):
        return {k: set_hyperparams(v, **values) for k, v in state.items()}
    return state


def state_from_flat(flat: dict[str, Tensor], template: Tree) -> Tree:
    """A state flattened by dotted path (fnmoe.tree.flatten_dict, as checkpoints store it) put back
    in the structure of template (tx.init(params)): its NamedTuples and tuples, which the paths
    alone cannot tell from dicts (fnmoe.tree.unflatten_dict builds dicts). A path that one has and
    the other lacks, or a tensor of another shape, is a ValueError naming it."""
    paths, leaves, rebuild = tree_flatten_with_paths(template)
    differ = sorted(flat.keys() ^ set(paths))
    if differ:
        raise ValueError(f"state_from_flat: the flat state and the template differ at {differ[:4]} "
                         f"({len(differ)} paths)")
    bad = [p for p, x in zip(paths, leaves) if tuple(flat[p].shape) != tuple(x.shape)]
    if bad:
        raise ValueError(f"state_from_flat: '{bad[0]}' has shape {tuple(flat[bad[0]].shape)}, the template's "
                         f"{tuple(dict(zip(paths, leaves))[bad[0]].shape)}")
    return rebuild([flat[p] for p in paths])


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
    leaves = [x for x in leaves_of(tree) if x.is_floating_point()]
    if any(isinstance(x, DTensor) for x in leaves):  # sharded: each mesh's part, summed over its ranks
        return sharding.global_norm_sq(tree).sqrt()
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    norms = [torch.linalg.vector_norm(x, dtype=torch.float32) for x in leaves]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


_whole_norm: list[Tensor] = []
"""the norm of the whole gradient tree while an update runs one leaf at a time (whole_tree_norm)"""


@contextlib.contextmanager
def whole_tree_norm(norm: Tensor) -> Iterator[None]:
    """While fnmoe.optim.in_place runs an update one leaf at a time, clip_by_global_norm clips by the
    whole tree's norm (given: the caller computed it for its finite check), not the leaf's."""
    _whole_norm.append(norm)
    try:
        yield
    finally:
        _whole_norm.pop()


class ClipState(NamedTuple):
    max_norm: Tensor


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_."""
    hyper("clip_by_global_norm: max_norm", max_norm)
    def update(updates: Tree, state: ClipState, params: Tree = None) -> tuple[Tree, ClipState]:
        norm = _whole_norm[-1] if _whole_norm else global_norm(updates)
        # reciprocal-then-multiply is how torch evaluates `max_norm / (norm + 1e-6)`
        coef = torch.clamp((norm + 1e-6).reciprocal() * state.max_norm.to(norm.dtype), max=1.0)
        return tree_map(lambda u: u * coef.to(u.device) if u.is_floating_point() else u, updates), state
    return GradientTransformation(lambda params: ClipState(hyper_tensor(max_norm, device_of(params))), update)


class AddDecayedWeightsState(NamedTuple):
    weight_decay: Tensor


def add_decayed_weights(weight_decay: float, mask: PerLeaf | None = None) -> GradientTransformation:
    """updates + weight_decay * params on the leaves where `mask` (bools, or params -> bools) is True."""
    hyper("add_decayed_weights: weight_decay", weight_decay)
    def update(updates: Tree, state: AddDecayedWeightsState, params: Tree = None) -> tuple[Tree, Any]:
        if params is None:
            raise ValueError("add_decayed_weights needs params")
        paths, u_leaves, rebuild = tree_flatten_with_paths(updates)
        decay = per_leaf_values(mask, params, updates) if mask is not None else [True] * len(paths)
        wd = state.weight_decay
        # wd in the leaf's dtype, as addcmul casts a 0-D one; under vmap a batched wd would promote the update
        out = [torch.addcmul(u, p, wd.to(p.dtype)) if d else u
               for u, p, d in zip(u_leaves, leaves_of(params, updates), decay, strict=True)]
        return rebuild(out), state
    return GradientTransformation(lambda params: AddDecayedWeightsState(hyper_tensor(weight_decay, device_of(params))),
                                  update)


class ScaleByLearningRateState(NamedTuple):
    count: Tensor
    lr: Tensor
    """the constant lr, or with a schedule the lr of the latest step (for logging)"""


def _lr_like(value: Tensor | float, like: Tensor) -> Tensor:
    # a schedule may return a Python float (a user's lambda); full_like also batches under vmap
    return value.to(like) if isinstance(value, Tensor) else torch.full_like(like, value)


def current_lr(lr: ScalarOrSchedule, count: Tensor, state_lr: Tensor) -> Tensor:
    return _lr_like(lr(count), state_lr) if callable(lr) else state_lr


def initial_lr(lr: ScalarOrSchedule, device: torch.device) -> Tensor:
    return _lr_like(lr(zero_count(device)), hyper_tensor(0.0, device)) if callable(lr) else hyper_tensor(lr, device)


def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """updates * -lr; lr a float (kept in the state) or a schedule of the 0-based step."""
    hyper("learning rate", lr)
    def update(updates: Tree, state: ScaleByLearningRateState, params: Tree = None) -> tuple[Tree, Any]:
        lr_now = current_lr(lr, state.count, state.lr)
        return tree_map(lambda u: u * -lr_now, updates), ScaleByLearningRateState(state.count + 1, lr_now)

    def init(params: Tree) -> ScaleByLearningRateState:
        device = device_of(params)
        return ScaleByLearningRateState(zero_count(device), initial_lr(lr, device))
    return GradientTransformation(init, update)


# ------------------------------------------------------------------ labels

def logical_ndim(path: str, ndim: int) -> int:
    """The dims a leaf has by its name's shape suffix (`w_up_EDF` 3, `attn_norm.w_D` 1), so that the
    leading dims a stack adds (an ensemble's members, fnmoe.func.stack) leave its role as it was; ndim
    for a name without one, or one naming more dims than the leaf has."""
    stem, sep, suffix = path.rpartition(".")[2].rpartition("_")
    named = len(suffix) if sep and stem and suffix.isalpha() and suffix.isupper() else ndim
    return min(named, ndim)


def default_label(path: str, ndim: int, muon: bool = True) -> str:
    """A leaf's default label: 'frozen' under `buffers`; with muon, 'muon' for matrices (>= 2 dims by
    logical_ndim) outside the embedding (`embed`) and output head (`head`); everything else 'adamw'
    (the planner counts optimizer state by it)."""
    if leaf_kind(path) == "buffer":
        return "frozen"
    matrix = logical_ndim(path, ndim) >= 2
    return "muon" if muon and matrix and not path.startswith(("embed.", "head.")) else "adamw"


def default_labels(params: Tree, muon: bool = True) -> Tree:
    """default_label of every leaf of params."""
    paths, leaves, rebuild = tree_flatten_with_paths(params)
    return rebuild([default_label(p, x.ndim, muon) for p, x in zip(paths, leaves)])


def decay_mask(params: Tree) -> Tree:
    """Weight decay on matrices (>= 2 dims by logical_ndim), not on norms and biases."""
    paths, leaves, rebuild = tree_flatten_with_paths(params)
    return rebuild([logical_ndim(p, x.ndim) >= 2 for p, x in zip(paths, leaves)])
