"""An optimizer's update written into the params and state it was given, one leaf at a time: the
donated update of a train step (JAX's donate_argnums; `inplace=True` in fnmoe's words).

The pure update (`tx.update(grads, state, params)`, then `apply_updates`) makes a whole new state,
new params and the updates beside the old ones: the optimizer state and ~2-3.5x the params more at
once. `update_in_place` runs the same transform on one leaf's subtrees at a time (the leaf's
gradient, param and state entries, with the state's shared scalars: step counts, lr, betas), then
writes the new leaf and its state entries over the old ones: what it holds beyond the state is one
leaf's workspace. The arithmetic is the pure update's own, so the result is the same bitwise where
a transform's per-leaf values do not depend on which other leaves share its call (every fnmoe
transform; Muon's batched Newton-Schulz is bitwise the same alone on CPU, where a batched GEMM's
matrices do not depend on the batch, see muon_update's module docstring).

The one whole-tree quantity of fnmoe's optimizers is clip_by_global_norm's norm: the caller has it
(the step's finite check) and passes it, and the clip reads it while the leaves run
(base.whole_tree_norm), so a clip at the head of the chain, as from_config builds it, clips every
leaf as the pure update does; a clip nested inside a partition would clip by the whole tree's norm
instead of its group's, so such a transform must take the pure update.

Shared scalars advance once: every leaf's call reads the old ones (they depend on no leaf, so every
call computes the same new ones), and the last call's are written at the end.

The finite check: `ok`, the caller's flag on what is known before any write (the loss, the gradients'
norm, QK-clip's logits), gates every write. A new leaf is also checked before it is written (a huge
lr can overflow a finite gradient's update): one that is not finite is not written, nor are the
leaves after it, and the result says so. Leaves written before it keep their step (an in-place
write is not undone: that would take the old state's copy the donation exists to avoid), so only a
skip decided by `ok` leaves everything bitwise as it was; a non-finite update leaves every param
finite, some advanced.

Gradients may come in a narrower dtype than their params (bf16 reduce-scatters, kept as they arrived
by fnmoe.parallel.gather): each is cast to its param's dtype where its leaf runs, into a copy that
goes with the leaf, the value the pure update would have read.

Legend: no shape-suffixed tensors here; every function maps trees leaf by leaf. "owner" of a state
entry: the param path it belongs to (its path ends in that path: mu.layers.0.attn.w_q_DN); entries
with no owner are "shared" (0-D counters and hyperparameters).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fnmoe import _torch
from fnmoe.optim.base import GradientTransformation, Tree, check_grads, whole_tree_norm
from fnmoe.tree import tree_flatten_with_paths


def _is_node(x: Any) -> bool:
    return isinstance(x, (dict, tuple, list))


def _items(node) -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [(str(k), v) for k, v in node.items()]
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return list(zip(node._fields, node))
    return [(str(i), v) for i, v in enumerate(node)]


def _owner(path: str, param_paths: set[str]) -> str | None:
    """The longest param path that path ends in (at a dot), or None."""
    parts = path.split(".")
    return next((s for i in range(len(parts)) if (s := ".".join(parts[i:])) in param_paths), None)


def _names(key: str, owner: str) -> bool:
    """Whether a dict key is (part of) its owner's path: a params-shaped dict, whose other leaves'
    entries a restriction drops; other keys (partition's labels) are always kept."""
    return key == owner or key in owner.split(".")


class _Index:
    """Which param paths own the leaves under each node of a tree, so that a one-leaf restriction
    visits only the nodes on the way to that leaf's entries, the shared ones and labels."""

    def __init__(self, tree: Tree, param_paths: set[str]):
        self.owners: dict[int, frozenset] = {}
        self.keys: dict[int, dict[str | None, list]] = {}  # dict nodes: owner (None: always) -> keys
        self.order: dict[int, dict] = {}  # dict nodes: key -> its place
        self._walk(tree, "", param_paths)

    def _walk(self, node, path: str, param_paths: set[str]) -> frozenset:
        if not _is_node(node):
            o = _owner(path, param_paths)
            return frozenset() if o is None else frozenset([o])
        owners: set[str] = set()
        by_owner: dict[str | None, list] = {}
        pairs = list(node.items()) if isinstance(node, dict) else _items(node)
        for k, child in pairs:
            o = self._walk(child, f"{path}.{k}" if path else str(k), param_paths)
            owners |= o
            if isinstance(node, dict):
                named = bool(o) and all(_names(str(k), x) for x in o)
                for key in sorted(o) if named else [None]:
                    by_owner.setdefault(key, []).append(k)
        self.owners[id(node)] = frozenset(owners)
        if isinstance(node, dict):
            self.keys[id(node)] = by_owner
            self.order[id(node)] = {k: i for i, (k, _) in enumerate(pairs)}
        return self.owners[id(node)]

    def restrict(self, node, p: str):
        """node with p's own entries, the shared leaves and the labels' subtrees (restricted): other
        leaves' entries of params-shaped dicts dropped, tuples and NamedTuples kept whole in shape."""
        if not _is_node(node) or self.owners[id(node)] <= {p}:
            return node
        if isinstance(node, dict):
            by_owner, order = self.keys[id(node)], self.order[id(node)]
            wanted = sorted({*by_owner.get(None, ()), *by_owner.get(p, ())}, key=order.__getitem__)
            return {k: self.restrict(node[k], p) for k in wanted}
        kept = [self.restrict(v, p) for v in node]
        return type(node)(*kept) if hasattr(node, "_fields") else type(node)(kept)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def _write(ok: Tensor, new: Tensor, old: Tensor) -> None:
    """old = new where ok, bitwise (NaNs and signed zeros included), in old's own memory."""
    if new is old:
        return
    o = _local(old)
    torch.where(ok.to(o.device), _local(new).to(o.dtype), o, out=o)


def _all_finite(t: Tensor) -> Tensor:
    return torch.isfinite(_local(t)).all() if t.is_floating_point() else torch.ones((), dtype=torch.bool,
                                                                                       device=t.device)


def check_no_aliases(tree: Tree, what: str) -> None:
    """A donated tree's leaves must not overlap in memory: two leaves on the same bytes (tied or
    viewed leaves) would each be written, the second over the first's new values. Leaves that are
    disjoint parts of one storage (a loaded file's) are fine."""
    spans = []
    paths, leaves, _ = tree_flatten_with_paths(tree)
    for path, x in zip(paths, leaves):
        local = _local(x) if isinstance(x, Tensor) else None
        # plain tensors only: a fake tensor's (rehearse) or a simulated rank's has no memory to share
        if type(local) in (Tensor, torch.nn.Parameter) and x.numel():
            extent = 1 + sum((n - 1) * abs(s) for n, s in zip(local.shape, local.stride()))
            start = local.data_ptr()
            spans.append((local.device, start, start + extent * local.element_size(), path))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for (d0, _, end0, p0), (d1, start1, _, p1) in zip(spans, spans[1:]):
        if d0 == d1 and start1 < end0:
            raise ValueError(f"cannot update {what} in place: '{p1}' shares its memory with '{p0}' (tied or viewed "
                             "leaves); take the pure update (donate=False, --train.no-donate)")


@torch.no_grad()
def update_in_place(tx: GradientTransformation, grads: Tree, state: Tree, params: Tree, ok: Tensor,
                    grad_norm: Tensor) -> Tensor:
    """tx's update written into params' and state's own leaves, one leaf at a time, where ok (0-D
    bool: the step is finite so far) holds; grad_norm is optim.global_norm(grads), which a
    clip_by_global_norm at the head of tx reads. Returns the 0-D bool "every new leaf was finite and
    written" (ok and it). Leaves must not alias each other (check_no_aliases)."""
    g_paths, g_leaves, _ = tree_flatten_with_paths(grads)
    p_by_path = dict(zip(*tree_flatten_with_paths(params)[:2]))
    s_paths, s_leaves, _ = tree_flatten_with_paths(state)
    check_grads(grads, params, "update_in_place")
    param_paths = set(g_paths)
    s_old = dict(zip(s_paths, s_leaves))
    s_index, g_index, p_index = _Index(state, param_paths), _Index(grads, param_paths), _Index(params, param_paths)
    running = ok.clone()
    shared_new: dict[str, Tensor] = {}
    with whole_tree_norm(grad_norm):
        for path, g in zip(g_paths, g_leaves):
            p = p_by_path[path]
            g1 = g_index.restrict(grads, path)
            if g.is_floating_point() and p.is_floating_point() and (read := _read_as(g, p.dtype)) is not g:
                g1 = _replace_leaf(g1, read)
            running = _step_leaf(tx, g1, s_index.restrict(state, path), p_index.restrict(params, path), running,
                                 s_old, shared_new, param_paths)
    for q, x in shared_new.items():  # the step counts advance once the step is taken
        _write(ok, x, s_old[q])
    return running


def _read_as(g: Tensor, dtype: torch.dtype) -> Tensor:
    """g in dtype for its leaf's update (g itself where it is that already). A gradient kept as its
    bf16 reduce-scatter delivered it (fnmoe.parallel.gather) is cast into a copy that goes with the
    leaf's workspace: cast in place of it, every gradient would be float32 by the update's end."""
    local = g.to_local() if isinstance(g, DTensor) else g
    arrived = _torch.as_arrived(local)
    if arrived is local:
        return g.to(dtype)
    if isinstance(g, DTensor):
        return DTensor.from_local(arrived.to(dtype), g.device_mesh, g.placements, shape=g.shape, stride=g.stride())
    return arrived.to(dtype)


def _step_leaf(tx: GradientTransformation, g1: Tree, s1: Tree, p1: Tree, running: Tensor, s_old: dict,
               shared_new: dict, param_paths: set[str]) -> Tensor:
    """One leaf's update (its one-leaf trees g1, s1, p1) written where running holds and its new value
    is finite; the new running flag. Every temporary is let go on return: the next leaf starts clean."""
    (path,), (p,), _ = tree_flatten_with_paths(p1)
    u1, new_s1 = tx.update(g1, s1, p1)
    (u,) = tree_flatten_with_paths(u1)[1]
    new_p = (p + u).to(p.dtype)  # apply_updates' arithmetic
    del u1, u
    running = running & _all_finite(new_p)  # the pure step's check: the new params' (its norm)
    _write(running, new_p, p)
    for q, x in zip(*tree_flatten_with_paths(new_s1)[:2]):
        owner = _owner(q, param_paths)
        if owner is None:
            shared_new[q] = x
        elif owner == path:
            _write(running, x, s_old[q])
    return running


def _replace_leaf(tree: Tree, leaf: Tensor) -> Tree:
    """A one-leaf tree with its leaf replaced."""
    return tree_flatten_with_paths(tree)[2]([leaf])


@torch.no_grad()
def write_changed(ok: Tensor, new: Tree, old: Tree) -> None:
    """Every leaf of new that is not old's own written into old's where ok: a pure rule's result
    (the router bias's, QK-clip's) taken in place."""
    old_by_path = dict(zip(*tree_flatten_with_paths(old)[:2]))
    for path, x in zip(*tree_flatten_with_paths(new)[:2]):
        _write(ok, x, old_by_path[path])
