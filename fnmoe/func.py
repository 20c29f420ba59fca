"""torch.func over fnmoe's pure functions: per-example gradients, Hessian-vector products, ensembles.

Legend: B batch (examples), L sequence, V vocab, M members of an ensemble.

The transforms are torch.func's own (`grad`, `vmap`, `jvp`, ...): they take `fnmoe.forward` and
`fnmoe.loss_fn` as they are, single process, and fnmoe.models.transforms picks model paths that compose
with them. These helpers are the few compositions worth a name. Gradients are taken with respect to
the trainable leaves: `params["buffers"]` (the router bias, moved by its own rule) is held fixed.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import func

from fnmoe.config import ModelConfig
from fnmoe.models.transformer import forward
from fnmoe.training.step import loss_fn
from fnmoe.tree import Tree, tree_leaves, tree_map


def trainable(params: Tree) -> tuple[Tree, Callable[[Tree], Tree]]:
    """(params without "buffers", a function putting a tree of that shape back with the buffers)."""
    buffers = params.get("buffers")
    rest = {k: v for k, v in params.items() if k != "buffers"}
    return rest, (lambda tree: tree if buffers is None else dict(tree, buffers=buffers))


def example_loss(params: Tree, inputs_L: torch.Tensor, labels_L: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """One example's loss: loss_fn over a batch of one, its mean over the example's labels (at least one)."""
    return loss_fn(params, inputs_L[None], labels_L[None], cfg)[0]


def per_example_grads(params: Tree, inputs_BL: torch.Tensor, labels_BL: torch.Tensor, cfg: ModelConfig,
                      chunk_size: int | None = None) -> Tree:
    """The gradient of each example's loss (example_loss) with respect to the trainable params: a
    tree without "buffers" whose leaves have a leading axis B. chunk_size bounds how many examples
    run at once (vmap's chunk_size): memory against speed."""
    rest, full = trainable(params)

    def loss(tree, inputs_L, labels_L):
        return example_loss(full(tree), inputs_L, labels_L, cfg)
    return func.vmap(func.grad(loss), in_dims=(None, 0, 0), chunk_size=chunk_size)(rest, inputs_BL, labels_BL)


def per_example_grad_norms(params: Tree, inputs_BL: torch.Tensor, labels_BL: torch.Tensor, cfg: ModelConfig,
                           chunk_size: int | None = None) -> torch.Tensor:
    """[B] fp32: the global L2 norm of each example's gradient (data selection, DP-SGD clipping)."""
    grads = per_example_grads(params, inputs_BL, labels_BL, cfg, chunk_size)
    return torch.stack([g.float().flatten(1).square().sum(1) for g in tree_leaves(grads)]).sum(0).sqrt()


def hvp(loss: Callable[[Tree], torch.Tensor], params: Tree, v: Tree) -> Tree:
    """The Hessian of loss (a scalar function of a tree) at params times the tree v (same shape):
    forward-over-reverse, jvp of grad, one backward's cost and no Hessian in memory."""
    return func.jvp(func.grad(loss), (params,), (v,))[1]


def _dot(a: Tree, b: Tree) -> torch.Tensor:
    return sum((x.double() * y.double()).sum() for x, y in zip(tree_leaves(a), tree_leaves(b)))


def hessian_eigenvalue(loss: Callable[[Tree], torch.Tensor], params: Tree, shift: float = 0.0, iters: int = 100,
                       tol: float = 1e-3, seed: int = 0,
                       on_iter: Callable[[int, float, float], None] | None = None) -> tuple[float, int]:
    """(lambda, HVPs taken): power iteration on H - shift*I (H loss's Hessian at params, applied by
    hvp) from a seeded random direction; lambda is then the eigenvalue of H farthest from shift.
    It stops once the residual |H v - lambda v| is under tol*|lambda - shift| (v then is an
    eigenvector, not a mix of two eigenvalues of one magnitude, which fools a test of lambda's
    change alone), or after iters HVPs. Converges as (second / first magnitude)^k. on_iter(k, lambda,
    residual) hears each iteration (progress)."""
    gen = torch.Generator().manual_seed(seed)
    v = tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype), params)
    for k in range(1, iters + 1):
        norm = _dot(v, v).sqrt()
        v = tree_map(lambda x: x / norm.to(x.dtype), v)
        hv = tree_map(lambda h, x: h - shift * x, hvp(loss, params, v), v)
        lam = _dot(v, hv).item()
        residual = _dot(*[tree_map(lambda h, x: h - lam * x, hv, v)] * 2).sqrt().item()
        if on_iter:
            on_iter(k, lam + shift, residual)
        if residual <= tol * abs(lam):
            break
        v = hv
    return lam + shift, k


def top_hessian_eigenvalue(loss: Callable[[Tree], torch.Tensor], params: Tree, iters: int = 100,
                           tol: float = 1e-3, seed: int = 0,
                           on_iter: Callable[[int, float, float], None] | None = None) -> tuple[float, int]:
    """(the largest eigenvalue of loss's Hessian at params, HVPs taken): power iteration finds the
    eigenvalue of largest magnitude; when that one is negative, a second run on H - lambda*I finds
    the top one (the farthest from lambda). iters bounds each run; on_iter(k, lambda, residual) hears
    each iteration, k counting on through the second run."""
    lam, n = hessian_eigenvalue(loss, params, 0.0, iters, tol, seed, on_iter)
    if lam >= 0:
        return lam, n
    later = (lambda k, got, r: on_iter(n + k, got, r)) if on_iter else None
    top, m = hessian_eigenvalue(loss, params, lam, iters, tol, seed + 1, later)
    return top, n + m


def stack(trees: list[Tree]) -> Tree:
    """M trees of one shape as one tree whose leaves have a leading axis M (what vmap maps over)."""
    return tree_map(lambda *leaves: torch.stack(leaves), *trees)


def unstack(tree: Tree) -> list[Tree]:
    """stack's inverse: the M trees of a stacked tree."""
    n = len(tree_leaves(tree)[0])
    return [tree_map(lambda leaf, m=m: leaf[m], tree) for m in range(n)]


def ensemble_forward(stacked: Tree, tokens_BL: torch.Tensor, cfg: ModelConfig,
                     chunk_size: int | None = None) -> torch.Tensor:
    """logits_MBLV of the M models of a stacked tree on the same tokens, as one batched call."""
    return func.vmap(lambda p: forward(p, tokens_BL, cfg)[0], chunk_size=chunk_size)(stacked)
