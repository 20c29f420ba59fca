"""Trees of tensors: where the rest of fnmoe gets torch's pytree functions, and value_and_grad.

A params tree is a nested `dict[str, Tensor]`; a leaf's path is its dotted key
("layers.0.attn.w_q_DN"). `value_and_grad` has JAX's signature and runs on autograd, so it
passes compiled regions, checkpointing and saved-tensor hooks (torch.func's grad does not).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fnmoe._torch import pytree as _pytree

Tree = Any

tree_map = _pytree.tree_map
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_leaves = _pytree.tree_leaves


def _key_str(k: Any) -> str:
    if isinstance(k, _pytree.MappingKey):
        return str(k.key)
    return str(k.idx) if isinstance(k, _pytree.SequenceKey) else k.name


def tree_flatten_with_paths(tree: Tree) -> tuple[list[str], list[Any], Callable[[list[Any]], Tree]]:
    """(dotted paths, leaves, rebuild) in traversal order; rebuild(new_leaves) gives a tree of the same shape."""
    pairs, spec = _pytree.tree_flatten_with_path(tree)
    paths = [".".join(_key_str(k) for k in kp) for kp, _ in pairs]
    return paths, [leaf for _, leaf in pairs], spec.unflatten


def leaves_like(tree: Tree, like: Tree) -> list[Any]:
    """tree's leaves in like's order. torch's pytree flattens a dict in its insertion order (JAX sorts
    the keys), so two dicts that compare equal can flatten differently: grads, optimizer state and
    params are paired by path through this, never by position. A path one tree has and the other
    lacks is a ValueError naming it."""
    differ = sorted(set(tree_flatten_with_paths(tree)[0]) ^ set(tree_flatten_with_paths(like)[0]))
    if differ:
        raise ValueError(f"trees do not pair leaf for leaf by path: {differ[0]!r} is in one and not the other "
                         f"({len(differ)} paths differ: {differ[:4]})")
    return _pytree.tree_flatten(like)[1].flatten_up_to(tree)


def map_with_path(fn: Callable[[str, Any], Any], tree: Tree) -> Tree:
    paths, leaves, rebuild = tree_flatten_with_paths(tree)
    return rebuild([fn(p, leaf) for p, leaf in zip(paths, leaves)])


def leaf_kind(path: str) -> str:
    """What the params tree's leaf at a dotted path is, from the path alone (the one rule: sharding,
    the optimizer's labels and the planner read it): "buffer" (state under `buffers`, never
    trained), "expert" (an expert stack [E, ...], named ..._EDF or ..._EFD), else "dense"."""
    if path.startswith("buffers."):
        return "buffer"
    return "expert" if path.endswith(("_EDF", "_EFD")) else "dense"


def flatten_dict(tree: Tree) -> dict[str, Any]:
    paths, leaves, _ = tree_flatten_with_paths(tree)
    return dict(zip(paths, leaves))


def unflatten_dict(flat: dict[str, Any]) -> dict[str, Any]:
    """flatten_dict's inverse for nested dicts (params); an optimizer state's NamedTuples and tuples
    come back with fnmoe.optim.state_from_flat."""
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = out
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def value_and_grad(fn: Callable, argnums: int = 0, has_aux: bool = False) -> Callable:
    """JAX's value_and_grad on autograd: grads of fn's 0-D output w.r.t. the tree args[argnums].

    Leaves that the output does not depend on (buffers, integer leaves) get zero gradients so
    the grads tree always matches the params tree. The aux comes back detached, values as in JAX:
    its tensors (the router losses) would otherwise hold the spent graph's nodes alive.
    """

    def wrapped(*args: Any, **kwargs: Any):
        leaves, spec = tree_flatten(args[argnums])
        diff = [x.detach().requires_grad_(x.is_floating_point()) for x in leaves]
        args = (*args[:argnums], tree_unflatten(diff, spec), *args[argnums + 1:])
        out = fn(*args, **kwargs)
        value = out[0] if has_aux else out
        wrt = [x for x in diff if x.requires_grad]
        got = iter(torch.autograd.grad(value, wrt, allow_unused=True))
        grads = [(next(got) if x.requires_grad else None) for x in diff]
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(diff, grads)]
        value = value.detach()
        out = (value, tree_map(_detached, out[1])) if has_aux else value
        return out, tree_unflatten(grads, spec)

    return wrapped
