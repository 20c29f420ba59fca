"""Adam and AdamW as transforms, with torch.optim.Adam(W)'s order of operations.

The moments and the step term are computed in torch's order, so they are bitwise equal to
torch.optim's; only AdamW's decayed leaves differ, by rounding (see `adamw`).

Legend: no shape-suffixed tensors here; every function maps trees leaf by leaf. g a gradient,
mu / m the first moment, nu / v the second, bc1 / bc2 the bias corrections 1 - b^count.
"""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fnmoe.optim.base import (GradientTransformation, PerLeaf, ScalarOrSchedule, Tree, check_grads, current_lr,
                              device_of, hyper, hyper_tensor, initial_lr, leaves_of, per_leaf_values, zero_count)
from fnmoe.tree import leaf_kind, tree_flatten_with_paths, tree_map


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
    # lerp's weight in mu's dtype: lerp casts a 0-D weight so anyway, and under vmap (an ensemble of
    # optimizers) a batched weight is no longer 0-D and must match.
    return mu.lerp(g, (1 - b1).to(mu.dtype)), (nu * b2).addcmul_(g * (1 - b2), g)


def _adam_denom(nu: Tensor, bc2: Tensor, eps: Tensor) -> Tensor:
    # the 0-D float64 scalars in nu's dtype, as torch casts them; under vmap in-place ops would
    # otherwise divide in float64 and round once more
    return nu.sqrt().div_(bc2.sqrt().to(nu.dtype)).add_(eps.to(nu.dtype))


def _adam_init(params: Tree, b1: float, b2: float, eps: float) -> tuple[Tensor, ...]:
    device = device_of(params)
    return (zero_count(device), hyper_tensor(b1, device), hyper_tensor(b2, device), hyper_tensor(eps, device),
            tree_map(torch.zeros_like, params), tree_map(torch.zeros_like, params))


def _check_adam(who: str, b1: float, b2: float, eps: float) -> None:
    hyper(f"{who}: b1", b1, hi=1.0, hi_open=True)
    hyper(f"{who}: b2", b2, hi=1.0, hi_open=True)
    hyper(f"{who}: eps", eps)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Bias-corrected m / (sqrt(v) + eps), with torch.optim.Adam's order of operations."""
    _check_adam("scale_by_adam", b1, b2, eps)
    def update(updates: Tree, state: ScaleByAdamState, params: Tree = None) -> tuple[Tree, ScaleByAdamState]:
        _, g_leaves, rebuild = tree_flatten_with_paths(updates)
        count = state.count + 1
        bc1, bc2 = 1 - state.b1 ** count, 1 - state.b2 ** count
        out, mus, nus = [], [], []
        for g, m, v in zip(g_leaves, leaves_of(state.mu, updates), leaves_of(state.nu, updates), strict=True):
            m, v = _adam_moments(g, m, v, state.b1, state.b2)
            out.append((m / bc1).div_(_adam_denom(v, bc2, state.eps)))
            mus.append(m)
            nus.append(v)
        # built field by field: torch 2.11's dynamo returns NamedTuple._replace's result empty
        return rebuild(out), ScaleByAdamState(count, state.b1, state.b2, state.eps, rebuild(mus), rebuild(nus))
    return GradientTransformation(lambda params: ScaleByAdamState(*_adam_init(params, b1, b2, eps)), update)


class AdamWState(NamedTuple):
    count: Tensor
    lr: Tensor
    b1: Tensor
    b2: Tensor
    eps: Tensor
    weight_decay: Tensor
    mu: Tree
    nu: Tree


def _adamw_leaf(g: Tensor, p: Tensor, m: Tensor, v: Tensor, b1: Tensor, b2: Tensor, eps: Tensor, bc2: Tensor,
                neg_step_size: Tensor, neg_decay: Tensor, decay: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One leaf's AdamW: (its update, new mu, new nu)."""
    m, v = _adam_moments(g, m, v, b1, b2)
    step = (neg_step_size * m).div_(_adam_denom(v, bc2, eps))
    return (torch.addcmul(step, p, neg_decay.to(p.dtype)) if decay else step), m, v  # dtype: see _adam_moments


Fused = Literal["auto", "on", "off"]


def _fusing(fused: Fused, g: Tensor) -> bool:
    """Whether this leaf's AdamW runs as one compiled kernel: "auto" on a GPU only; never for a fake
    tensor, under a trace or vmap (a tensor subclass other than DTensor, whose shards it takes)."""
    if fused == "off" or (fused == "auto" and g.device.type != "cuda"):
        return False
    local = g.to_local() if isinstance(g, DTensor) else g
    return type(local) is Tensor and not torch.compiler.is_compiling()


def _fused_leaf(g: Tensor, p: Tensor, m: Tensor, v: Tensor, *scalars_and_decay) -> tuple[Tensor, Tensor, Tensor]:
    """_adamw_leaf compiled: its ~10 elementwise passes over the leaf fused into one read of g, p, mu and nu
    and one write of the update and the moments. One graph for every leaf (their shards, flattened, with a
    symbolic length; two with decay and without). Rounding may differ from the eager ops by an ulp (fused
    multiply-adds): torch.optim.AdamW's bitwise equality is the eager path's."""
    from fnmoe.compile import compiled

    local = [x.to_local() if isinstance(x, DTensor) else x for x in (g, p, m, v)]
    # flat and detached: not views of the leaves, whose shapes and strides would each take a graph of their own
    u, m2, v2 = compiled(_adamw_leaf, dynamic=True)(*(x.reshape(-1).detach() for x in local), *scalars_and_decay)
    out = [y.view(x.shape) for y, x in zip((u, m2, v2), local[1:])]
    if isinstance(p, DTensor):
        out = [DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
               for y, x in zip(out, (p, m, v))]
    return tuple(out)


def adamw(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.01, mask: PerLeaf | None = None, fused: Fused = "off") -> GradientTransformation:
    """torch.optim.AdamW as one transform: decoupled decay p*(1 - lr*wd), bias correction,
    eps added after sqrt(v)/sqrt(bc2). `mask` (bools, or params -> bools) picks the decayed
    leaves; None decays all. Leaves under `buffers` are frozen, as every fnmoe optimizer labels them
    (a router bias has its own rule; a loss that reads a frozen buffer gives it a gradient).

    Exactness: the moments and the step term (lr/bc1)*m/denom are computed in torch's order
    and are bitwise equal, so leaves without decay match torch.optim.AdamW bitwise. With
    decay, torch rounds twice in place (p*(1-lr*wd), then + step) where p + update rounds
    once, so decayed leaves agree to about 1 ulp per step, not bitwise.

    fused: "on" runs each leaf's arithmetic as one compiled kernel (_fused_leaf), "auto" on a GPU
    only (there the eager ops' ~10 passes over the fp32 leaf and its moments bound the update by
    memory bandwidth), "off" never; the fused values agree with the eager ones to about an ulp.
    """
    if fused not in ("auto", "on", "off"):
        raise ValueError(f"adamw: fused must be 'auto', 'on' or 'off', got {fused!r}")
    hyper("adamw: learning rate", lr)
    hyper("adamw: weight_decay", weight_decay)
    _check_adam("adamw", b1, b2, eps)
    def update(grads: Tree, state: AdamWState, params: Tree = None) -> tuple[Tree, AdamWState]:
        if params is None:
            raise ValueError("adamw needs params")
        check_grads(grads, params, "adamw update")
        paths, g_leaves, rebuild = tree_flatten_with_paths(grads)
        decay = per_leaf_values(mask, params, grads) if mask is not None else [True] * len(paths)
        count = state.count + 1
        lr_now = current_lr(lr, state.count, state.lr)
        neg_step_size = -(lr_now / (1 - state.b1 ** count))
        bc2 = 1 - state.b2 ** count
        neg_decay = -(lr_now * state.weight_decay)
        out, mus, nus = [], [], []
        for path, g, p, m, v, d in zip(paths, g_leaves, leaves_of(params, grads), leaves_of(state.mu, grads),
                                       leaves_of(state.nu, grads), decay, strict=True):
            if leaf_kind(path) == "buffer":
                out.append(torch.zeros_like(g))
                mus.append(m)
                nus.append(v)
                continue
            leaf = _fused_leaf if _fusing(fused, g) else _adamw_leaf
            u, m, v = leaf(g, p, m, v, state.b1, state.b2, state.eps, bc2, neg_step_size, neg_decay, d)
            out.append(u)
            mus.append(m)
            nus.append(v)
        return rebuild(out), AdamWState(count, lr_now, state.b1, state.b2, state.eps, state.weight_decay,
                                        rebuild(mus), rebuild(nus))  # not _replace: see scale_by_adam

    def init(params: Tree) -> AdamWState:
        count, b1_, b2_, eps_, mu, nu = _adam_init(params, b1, b2, eps)
        device = device_of(params)
        return AdamWState(count, initial_lr(lr, device), b1_, b2_, eps_, hyper_tensor(weight_decay, device), mu, nu)
    return GradientTransformation(init, update)
