"""Routing: each token's experts and weights from the router logits. The router is a seam: a pure
function (`Router`) passed to fnmoe.forward / loss_fn as router=..., the built-ins chosen by
model.moe.score_func (ROUTERS: top-k of softmax scores; top-k of sigmoid scores with the bias and
group limit of DeepSeek-V3).

Legend: T tokens, D model, E experts, K top-k, G expert groups, S experts per group (E/G).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from fnmoe import caches
from fnmoe.models.attention import upcast
from fnmoe.config import ModelConfig, MoEConfig


Router = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""router(logits_TE, cfg.moe, bias_E) -> (weights_TK, idx_TK, probs_TE): the MoE block's routing
decision from the fp32 router logits [T, E]. weights_TK scale each token's K expert outputs (gradients
reach the router through them), idx_TK (int64 [T, K], K = cfg.moe.top_k) names the experts, probs_TE
(each token's distribution over experts) feeds the balance losses. bias_E is the router bias buffer
(model.moe.router_bias), else None. The built-ins, by model.moe.score_func: ROUTERS. A router is a pure
function of its inputs: recompute policies run it again in backward (keeping only torch.topk's outputs
from the forward), and a compiled MoE region traces it (a module-level function: a new function object
recompiles).

Beyond the three, a router receives what its signature names (INPUTS, passed by keyword; read once
per router): `layer`, the index of the MoE layer it routes (None where route is called outside a
model; under model.compile the region traces it as a symbolic int from the second layer on, so use
it in arithmetic: a Python `if` on it compiles once per layer), and `params`, that layer's own
trained leaves, the params tree's extra.router.<layer> subtree in fp32 (gradients reach them; the
optimizer trains them as any extra.* leaf; on a mesh each must have a dim, for FSDP to shard it).

A slot idx_TK[t, k] == EMPTY (-1) is left empty (its weight is ignored): no expert computes it, no
count or balance loss counts it, and it adds nothing to token t's output, so a router may give a
token fewer than K experts (expert choice: experts pick tokens). The built-ins never leave one
empty; a user's router's rows go the way rows over capacity go (moe.sorted_rows): gathered past the
empty ones, one more copy of the rows (and on a GPU one host sync) than the built-ins take."""

INPUTS = ("layer", "params")
"""the optional inputs a router receives when its signature names them"""

EMPTY = -1
"""idx_TK's value for an empty slot"""


def route(x_TD: torch.Tensor, w_router_DE: torch.Tensor, cfg: ModelConfig,
          bias_E: torch.Tensor | None = None, router: Router | None = None, *, layer: int | None = None,
          params: dict | None = None):
    """(weights_TK, idx_TK, probs_TE, logits_TE): the router logits in fp32, then router's decision
    (default: ROUTERS[model.moe.score_func]), given layer and params when it names them (Router). What
    a router returns is checked here, the error naming it: the count, the shapes and, for a user's
    router outside a compiled region, that its expert indices are in [0, E) or EMPTY (one host sync a
    layer; an index out of range failed deep in the MoE block)."""
    logits_TE = upcast(x_TD) @ upcast(w_router_DE)
    fn = router or ROUTERS[cfg.moe.score_func]
    wants = router_inputs(fn)
    if "params" in wants and params is None:
        raise ValueError(f"router {router_name(fn)} takes params=: give its MoE layer's own leaves in the params tree "
                         f"under extra.router.<layer>")
    given = {"layer": layer, "params": params}
    out = fn(logits_TE, cfg.moe, bias_E, **{k: given[k] for k in wants})
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        got = f"{len(out)} values" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}"
        raise ValueError(f"router {router_name(fn)} returned {got}; a router returns 3: (weights_TK, idx_TK, probs_TE)")
    w_TK, idx_TK, probs_TE = out
    T, K = x_TD.shape[0], cfg.moe.top_k
    shapes = (w_TK.shape, idx_TK.shape, idx_TK.dtype, probs_TE.shape) if all(
        isinstance(t, torch.Tensor) for t in out) else None
    if shapes != ((T, K), (T, K), torch.int64, logits_TE.shape):
        raise ValueError(f"router {router_name(fn)}: a router returns (weights_TK, idx_TK int64, probs_TE) of "
                         f"shapes [{T}, {K}], [{T}, {K}], {list(logits_TE.shape)}; got {_shapes(out)}")
    if may_leave_empty(router) and not torch.compiler.is_compiling() and idx_TK.numel():
        E = logits_TE.shape[1]
        bad_TK = (idx_TK < EMPTY) | (idx_TK >= E)
        if bad_TK.any():  # one read of one flag (the same on every rank of a simulated mesh), the index only then
            raise ValueError(f"router {router_name(fn)} returned expert index {int(idx_TK[bad_TK][0])} in idx_TK; "
                             f"the model has {E} experts, so indices must be in [0, {E - 1}], or {EMPTY} for an "
                             f"empty slot")
    return w_TK, idx_TK, probs_TE, logits_TE


def may_leave_empty(router: Router | None) -> bool:
    """Whether router's idx_TK may hold EMPTY slots: a user's router may, the built-ins never do."""
    return router is not None and router not in ROUTERS.values()


def spare_slots(w_TK: torch.Tensor, idx_TK: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_TK, idx_TK) with the EMPTY slots at index E, past the last expert, and weight 0 (whatever the
    router gave): the MoE block sorts them after every expert's rows and leaves them out there
    (moe.over_capacity), counts them in a spare bin it drops, and the dense path matches no expert."""
    empty_TK = idx_TK < 0
    return w_TK.masked_fill(empty_TK, 0), idx_TK.masked_fill(empty_TK, n_experts)


@caches.register
@functools.cache
def _cached_inputs(fn: Callable) -> tuple[str, ...]:
    try:
        named = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature takes the three alone
        return ()
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(k for k in INPUTS if k in named and named[k].kind in by_name)


# a compiled MoE region takes the answer while it traces, as a constant of the router (dynamo
# guards on the router's identity already)
@torch.compiler.assume_constant_result
def router_inputs(fn: Callable) -> tuple[str, ...]:
    """The INPUTS fn's signature names (as parameters passed by keyword), read once per router."""
    try:
        return _cached_inputs(fn)
    except TypeError:  # unhashable: read each time
        return _cached_inputs.__wrapped__(fn)


def router_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', None) or repr(fn)}"


def _shapes(out) -> str:
    return ", ".join(f"{list(t.shape)}{' ' + str(t.dtype) if i == 1 else ''}" if isinstance(t, torch.Tensor)
                     else f"a {type(t).__name__}" for i, t in enumerate(out))


def top_k_routing(scores_TE: torch.Tensor, m: MoEConfig, bias_E: torch.Tensor | None = None):
    """(weights_TK, idx_TK) of the top-k experts by scores: the score-correction bias and the group
    limit decide which experts are chosen; the weights are the chosen experts' unbiased scores,
    renormalised if norm_topk_prob, times routed_scaling_factor."""
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.detach().to(scores_TE.dtype)
    if m.n_group > 1:
        choice_TE = limit_groups(choice_TE, m.n_group, m.topk_group)
    idx_TK = torch.topk(choice_TE, m.top_k, dim=-1).indices
    w_TK = scores_TE.gather(1, idx_TK)
    if m.norm_topk_prob:  # + 1e-20 guards all-zero sigmoid scores; it cannot change a softmax sum
        w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
    return w_TK * m.routed_scaling_factor, idx_TK


def softmax_router(logits_TE: torch.Tensor, m: MoEConfig, bias_E: torch.Tensor | None = None):
    """Top-k of softmax scores (Qwen3, Mixtral); the scores are the balance losses' probabilities."""
    scores_TE = torch.softmax(logits_TE, dim=-1)
    return *top_k_routing(scores_TE, m, bias_E), scores_TE


def sigmoid_router(logits_TE: torch.Tensor, m: MoEConfig, bias_E: torch.Tensor | None = None):
    """Top-k of per-expert sigmoid scores (DeepSeek-V3: with the bias and groups); the balance losses
    take the scores normalised per token."""
    scores_TE = torch.sigmoid(logits_TE)
    return *top_k_routing(scores_TE, m, bias_E), scores_TE / scores_TE.sum(-1, keepdim=True)


ROUTERS: dict[str, Router] = {"softmax": softmax_router, "sigmoid": sigmoid_router}
"""the built-in routers by model.moe.score_func"""


def limit_groups(choice_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice_TE with every expert outside the token's best topk_group groups set to -inf; a
    group's score is the sum of its two best choice scores (DeepSeek-V3)."""
    T, E = choice_TE.shape
    choice_TGS = choice_TE.view(T, n_group, E // n_group)
    group_TG = choice_TGS.topk(2, dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
    keep_TG = keep_TG.scatter(1, group_TG.topk(topk_group, dim=-1).indices, True)
    return choice_TGS.masked_fill(~keep_TG[:, :, None], float("-inf")).view(T, E)
