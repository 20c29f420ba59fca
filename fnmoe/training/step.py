"""Training: loss_fn and the step (make_train_step); the loop is fnmoe.training.loop.

Legend: B batch, L sequence, D model, T tokens (B·L), V vocab, N MoE layers, E experts, H heads.

The loss of a step is the sum of token losses over every micro-batch (and, with a mesh, every
rank) divided by the global count of non-ignored labels; each micro-batch's gradient is taken
of its share of that sum, so k micro-batches give exactly the update of one k-times batch
(`microbatched` sums them). The step is built from its caller's runner (fnmoe.models.seams.BlockRunner:
fnmoe.memory.policies.train_runner, its host pool sized where the step is built) and takes its params
source from the params it is given (fnmoe.parallel.fsdp.params_source).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fnmoe import _torch
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import gather as fgather
from fnmoe.kernels import fp8_gemm
from fnmoe import optim
from fnmoe.models.attention import rms_norm, upcast
from fnmoe.config import ModelConfig, RunConfig
from fnmoe.data.loader import IGNORE
from fnmoe.dtypes import DTYPE
from fnmoe.kernels.bf16 import fp32_gemms
from fnmoe.models.transformer import check_inputs, check_tokens, final_norm_weight, head_weight, hidden_states
from fnmoe.models.moe import balance_loss_part, update_router_bias
from fnmoe.parallel.fsdp import params_source
from fnmoe.parallel.sharding import all_sum
from fnmoe.models.routing import Router
from fnmoe.models.seams import CAST, BlockRunner, ParamsSource, mark
from fnmoe.optim import in_place
from fnmoe.training.state import DonatedError, TrainState, check_live
from fnmoe.training.state import donate as donate_state
from fnmoe.tree import Tree, tree_flatten, tree_map, tree_unflatten, value_and_grad


def _ce_sum(x_TD: torch.Tensor, norm_D: torch.Tensor, w_DV: torch.Tensor, labels_T: torch.Tensor,
            eps: float) -> torch.Tensor:
    with fp32_gemms(x_TD):  # here: a chunk's recompute in backward takes it again
        logits_TV = upcast(rms_norm(x_TD, norm_D, eps) @ w_DV)
    return F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE, reduction="sum")


def ce_loss_sum(x_BLD: torch.Tensor, norm_D: torch.Tensor, w_DV: torch.Tensor, labels_BL: torch.Tensor,
                eps: float, chunks: int = 1):
    """Sum of fp32 cross-entropy over non-ignored labels of the head on the final norm (weight norm_D)
    of x_BLD, the last block's output (hidden_states(..., final_norm=False)). With chunks > 1 each
    chunk's norm and logits are recomputed in backward from its rows of x_BLD, which is all that is
    kept: one chunk's normed states and logits exist at a time, not the norm's fp32 saves at full T.
    The rows' values and gradients are the unchunked ones; norm_D's gradient is summed chunk by chunk."""
    x_TD, labels_T = x_BLD.reshape(-1, x_BLD.shape[-1]), labels_BL.reshape(-1).long()  # cross_entropy: int64
    w_DV = w_DV.to(x_TD.dtype)
    if chunks == 1:
        return _ce_sum(x_TD, norm_D, w_DV, labels_T, eps)
    parts = [checkpoint(_ce_sum, x, norm_D, w_DV, y, eps, use_reentrant=False)
             for x, y in zip(x_TD.chunk(chunks), labels_T.chunk(chunks))]
    return torch.stack(parts).sum()


def _check_labels(labels_BL: torch.Tensor, inputs_BL: torch.Tensor) -> None:
    if not isinstance(labels_BL, torch.Tensor) or labels_BL.shape != inputs_BL.shape:
        got = tuple(labels_BL.shape) if isinstance(labels_BL, torch.Tensor) else type(labels_BL).__name__
        raise ValueError(f"labels must be a tensor of the inputs' shape {tuple(inputs_BL.shape)}, got {got}")
    if labels_BL.dtype.is_floating_point or labels_BL.dtype.is_complex or labels_BL.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (token ids, {IGNORE} to ignore), got {labels_BL.dtype}")


def _check_n_global(n_global) -> None:
    """n_global divides the loss: 0 makes it inf or NaN, a negative count turns descent into ascent.
    A tensor is read only where that is free (check_tokens' rule: CPU, no trace, no fake tensor)."""
    if isinstance(n_global, torch.Tensor):
        if n_global.device.type != "cpu" or _torch.tracing() or _torch.is_fake(n_global):
            return
        n = _torch.unwrapped(n_global)
        bad = not bool(((n > 0) & torch.isfinite(n.double())).all())
        shown = n.tolist()
    else:
        bad = not (isinstance(n_global, (int, float)) and n_global > 0 and math.isfinite(n_global))
        shown = n_global
    if bad:
        raise ValueError(f"n_global must be > 0: the step's count of labels that are not {IGNORE} over every rank "
                         f"and micro-batch, which divides the loss; got {shown}")


def loss_fn(params: Tree, inputs_BL: torch.Tensor, labels_BL: torch.Tensor, cfg: ModelConfig,
            n_global: torch.Tensor | int | None = None, ce_chunks: int = 1, runner: BlockRunner | None = None,
            record_max_logits: bool = False, positions_BL: torch.Tensor | None = None,
            source: ParamsSource = CAST, *, router: Router | None = None, record_router_logits: bool = False):
    """(this micro-batch's share of the step loss, aux); n_global counts the step's non-ignored labels.

    The loss is the summed cross-entropy of the labels that are not IGNORE (-100) divided by
    n_global, plus the router losses. n_global None counts this batch's own (at least 1): the mean
    cross-entropy of one batch in one process. A step split into micro-batches or over data-parallel
    ranks passes the count over all of them (as make_train_step does): each part's own count would
    weight it as if it were the whole step.

    The router losses (load balance, sequence-wise balance, z-loss) are weighted by this
    micro-batch's share of the labels, so the step's total weights each once; aux["ce_loss"] is
    the cross-entropy part alone; with record_max_logits, aux["max_logits_NH"] feeds MuonClip;
    positions_BL marks packed documents, runner, source and router are the model's seams
    (model.hidden_states; sharded params: source=fnmoe.parallel.fsdp.params_source(params)); with
    record_router_logits aux["router_logits_NTE"] holds the router logits.
    """
    check_inputs(params, inputs_BL, cfg)
    _check_labels(labels_BL, inputs_BL)
    n_global = (labels_BL != IGNORE).sum().clamp(min=1) if n_global is None else n_global
    _check_n_global(n_global)
    x_BLD, aux = hidden_states(params, inputs_BL, cfg, runner, record_max_logits, positions_BL, source,
                               router=router, record_router_logits=record_router_logits, final_norm=False)
    norm_D = final_norm_weight(params, cfg, source)
    ce = ce_loss_sum(x_BLD, norm_D, head_weight(params, cfg, source), labels_BL, cfg.norm_eps, ce_chunks) / n_global
    aux["ce_loss"] = ce.detach()
    m = cfg.moe
    terms = [(m.aux_loss_coeff, aux["balance_loss"]), (m.seq_aux_loss_coeff, aux.get("seq_balance_loss")),
             (m.z_loss_coeff, aux.get("z_loss"))]
    terms = [(coeff, value) for coeff, value in terms if coeff and value is not None]
    if not terms:
        return ce, aux
    n_local = (labels_BL != IGNORE).sum()
    loss = ce
    for coeff, value in terms:
        share = n_local / n_global
        if value is aux["balance_loss"] and dist.is_initialized():
            # with data parallelism each rank adds its part of the whole micro-batch's Switch loss; its
            # tokens are counted (the expert counts leave out the slots a router left empty)
            counts_NE = all_sum(aux["expert_counts_NE"], "expert counts for the balance loss")
            n_labels, n_tokens = all_sum(torch.stack([n_local, n_local.new_tensor(labels_BL.numel())]),
                                         "the micro-batch's label and token counts")
            value = balance_loss_part(aux["probs_sum_NE"], counts_NE, n_tokens, m.top_k)
            share = n_labels / n_global
        loss = loss + coeff * share * value
    return loss, aux


def _all_max(t: torch.Tensor) -> torch.Tensor:
    """t's elementwise max over every rank (t itself without a process group)."""
    if not dist.is_initialized():
        return t
    t = t.clone()
    fdist.entering("all-reduce (max) of attention logits for QK-clip over every rank")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def microbatched(grad_fn: Callable, fold: Callable, init: Callable) -> Callable:
    """grad_fn(params, micro_batch, *args) -> (out, grads) of one micro-batch, over a list of them
    (levanter's `microbatched`): (the outs folded in order, fold(acc, out) from init(); the grads
    summed leaf by leaf). Each micro-batch's gradients are let go once their sum exists: two
    gradient trees at the peak, not three (not summed in place: autograd may hand one gradient
    tensor to two inputs)."""

    def over(params: Tree, micro_batches: list, *args):
        acc, sums, spec = init(), None, None
        for micro_batch in micro_batches:
            out, g = grad_fn(params, micro_batch, *args)
            acc = fold(acc, out)
            parts, spec = tree_flatten(g)
            del g, out
            if sums is None:
                sums = parts
            else:
                for k in range(len(parts)):
                    sums[k], parts[k] = sums[k] + parts[k], None
            del parts
        return acc, tree_unflatten(sums, spec)
    return over


def _micro_grad(run: RunConfig, runner: BlockRunner, loss: Callable) -> Callable:
    """micro_grad(params, micro_batch, n_global, source) -> (aux, grads) of one micro-batch's loss share."""
    grad_fn = value_and_grad(loss, has_aux=True)
    reduce_dtype = DTYPE[run.mesh.reduce_dtype]
    expert_dtype = None if run.mesh.expert_gather_dtype == "compute" else getattr(torch, run.mesh.expert_gather_dtype)
    gemm_dtype = None if run.mesh.expert_gemm_dtype == "compute" else getattr(torch, run.mesh.expert_gemm_dtype)

    def micro_grad(params: Tree, micro_batch: tuple, n_global: int, source: ParamsSource):
        inputs_BL, labels_BL, *positions = micro_batch
        runner.begin()
        mark("forward")
        # backward too: a recompute there issues gathers again
        with fgather.reducing(reduce_dtype), fgather.expert_dtype(expert_dtype), fp8_gemm.expert_gemm_dtype(gemm_dtype):
            (_, aux), g = grad_fn(params, inputs_BL, labels_BL, run.model, n_global, run.train.ce_chunks, runner,
                                  run.optim.qk_clip, positions[0] if positions else None, source)
        mark("grads", g)
        return aux, g
    return micro_grad


def _folding(run: RunConfig) -> tuple[Callable, Callable]:
    """(fold, init) of a step's micro-batch auxes (microbatched's): the loss summed, the expert
    counts summed, the rows dropped over capacity summed, QK-clip's max attention logits maxed."""
    capacity, qk_clip = run.model.moe.capacity_factor, run.optim.qk_clip

    def init() -> dict:
        return {"loss": torch.zeros(()), "counts": None, "dropped": torch.zeros((), dtype=torch.int64),
                "max_logits_NH": None}

    def fold(acc: dict, aux: dict) -> dict:
        c, m = aux["expert_counts_NE"], acc["max_logits_NH"]
        if qk_clip:
            m = aux["max_logits_NH"] if m is None else torch.maximum(m, aux["max_logits_NH"])
        return {"loss": acc["loss"] + aux["ce_loss"], "counts": c if acc["counts"] is None else acc["counts"] + c,
                "dropped": acc["dropped"] + aux["dropped_N"].sum() if capacity else acc["dropped"],
                "max_logits_NH": m}
    return fold, init


def _reduced(acc: dict, qk_clip: bool) -> dict:
    """The step's sums over every rank: the loss, QK-clip's max logits (every rank clips the same
    heads by the same gamma, or replicas would drift apart), the expert counts (the router bias
    sees every rank's tokens)."""
    loss = all_sum(acc["loss"], "the loss")
    max_logits_NH = _all_max(acc["max_logits_NH"]) if qk_clip else None
    counts = None if acc["counts"] is None else all_sum(acc["counts"], "expert counts")
    return {"loss": loss, "max_logits_NH": max_logits_NH, "counts": counts, "dropped": acc["dropped"]}


def _apply(run: RunConfig, tx: optim.GradientTransformation, state: TrainState, grads: Tree, sums: dict,
           donate: bool = False):
    """(the new state, its flags): the optimizer's update, then the router bias's rule and QK-clip;
    a non-finite loss, gradient or new param leaves params and optimizer state bitwise as they were.
    donate: the update is written into state's own tensors (_apply_in_place)."""
    grad_norm = optim.global_norm(grads)
    finite = torch.isfinite(grad_norm) & torch.isfinite(sums["loss"])
    if donate:
        return _apply_in_place(run, tx, state, grads, sums, grad_norm, finite)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optim.apply_updates(state.params, updates)
    # the router bias follows its own rule, after the optimizer (which leaves buffers alone)
    params = update_router_bias(params, sums["counts"], run.model)
    if run.optim.qk_clip:
        params = optim.qk_clip(params, sums["max_logits_NH"], run.model, run.optim.qk_clip_tau)
    # finite gradients can still write non-finite params (a huge learning rate, a QK-clip of
    # non-finite logits): the new params' norm (one read of them, every rank) guards those too
    updated = torch.isfinite(optim.global_norm(params))
    ok = finite & updated
    # chosen on the device, so nothing waits for the flag before the metrics read it with the loss
    params = optim.select(ok, params, state.params, in_place=True)
    opt_state = optim.select(ok, opt_state, state.opt_state, in_place=True)
    return TrainState(params, opt_state, state.step + 1), {"grad_norm": grad_norm, "finite": finite,
                                                           "updated": updated}


def _apply_in_place(run: RunConfig, tx: optim.GradientTransformation, state: TrainState, grads: Tree, sums: dict,
                    grad_norm: torch.Tensor, finite: torch.Tensor):
    """_apply with state donated: the same values written into its own tensors, leaf by leaf
    (fnmoe.optim.in_place), so the update holds one leaf's workspace instead of a second state.

    What can be checked before a write is: the loss, the gradients' norm and QK-clip's max logits (a
    clip by gamma <= 1 of finite weights stays finite); a skip they decide leaves everything bitwise
    as it was. A new param leaf that is still not finite (a huge lr) is not written, nor any after it,
    nor the router bias and QK-clip: the step says "non-finite update", and the leaves before it keep
    their step (undoing them would need the old state's copy)."""
    ok = finite & torch.isfinite(sums["max_logits_NH"]).all() if run.optim.qk_clip else finite
    written = in_place.update_in_place(tx, grads, state.opt_state, state.params, ok, grad_norm)
    # the router bias and QK-clip are pure rules of the new params: their few changed leaves written back
    rules = update_router_bias(state.params, sums["counts"], run.model)
    if run.optim.qk_clip:
        rules = optim.qk_clip(rules, sums["max_logits_NH"], run.model, run.optim.qk_clip_tau)
    in_place.write_changed(written, rules, state.params)
    # every rank's verdict, as the pure step's norm of the new params gives (a rank checks its own leaves)
    updated = all_sum((~written).to(torch.int32), "the in-place update's non-finite leaves") == 0
    # new containers over the same tensors: the donated state's trees are told apart from the new ones
    return TrainState(tree_map(lambda x: x, state.params), tree_map(lambda x: x, state.opt_state), state.step + 1), \
        {"grad_norm": grad_norm, "finite": finite, "updated": updated}


def make_device_step(run: RunConfig, tx: optim.GradientTransformation, runner: BlockRunner,
                     loss: Callable = loss_fn, donate: bool = False) -> Callable:
    """device_step(state, micro_batches, n_global) -> (state, out): train_step without its host reads
    (the token check, the label count, the metrics), so that it also runs on fake tensors
    (fnmoe.plan.rehearse). runner runs the blocks (fnmoe.memory.policies.train_runner: the caller
    builds it, and sizes its host pool); loss and donate: make_train_step's. out holds device
    tensors: loss, grad_norm, finite, updated, counts, dropped."""
    grads_of = microbatched(_micro_grad(run, runner, loss), *_folding(run))
    last_donated: list = []  # the trees of the state donated last (their containers: no tensor is kept)

    def device_step(state: TrainState, micro_batches: list[tuple[torch.Tensor, ...]], n_global: int):
        if donate:
            _check_donatable(state, last_donated)
        # the params' source, once a step: FSDP's gathers for sharded params, else a cast
        sums, grads = grads_of(state.params, micro_batches, n_global, params_source(state.params))
        mark("update")
        sums = _reduced(sums, run.optim.qk_clip)
        if donate:
            donate_state(state)  # from here its tensors change
            last_donated[:] = [state.params, state.opt_state]
        new, flags = _apply(run, tx, state, grads, sums, donate)
        return new, {"loss": sums["loss"], **flags, "counts": sums["counts"], "dropped": sums["dropped"]}
    return device_step


def _check_donatable(state: TrainState, last_donated: list) -> None:
    """A donating step's input: not donated before (DonatedError), its leaves each their own memory."""
    check_live(state, "train_step")
    if any(tree is old for tree, old in zip((state.params, state.opt_state), last_donated)):
        raise DonatedError("train_step: this TrainState's params or opt_state were donated to the previous step, "
                           "which updated them in place; use the TrainState that step returned")
    in_place.check_no_aliases((state.params, state.opt_state), "the train state")


def make_train_step(run: RunConfig, tx: optim.GradientTransformation, runner: BlockRunner,
                    loss: Callable = loss_fn, donate: bool = False) -> Callable:
    """train_step(state, micro_batches) -> (state, metrics); micro_batches: [(inputs_BL, labels_BL)]
    or, for packed documents, [(inputs_BL, labels_BL, positions_BL)] (Loader.batch_at's). runner runs
    the blocks under run.memory: fnmoe.memory.policies.train_runner(run, pool_bytes), its host pool
    sized by fnmoe.plan.activations.pool_bytes(run) when the run offloads (fnmoe.models.seams.PLAIN runs them
    as they are). loss is differentiated on each micro-batch: loss_fn's signature and (loss, aux)
    result, aux holding what the step folds (loss_fn's ce_loss, expert_counts_NE, dropped_N with a
    capacity, max_logits_NH with QK-clip); wrap loss_fn to add a term or pass it a router
    (functools.partial(loss_fn, router=...)).

    donate (JAX's donate_argnums): the step owns the state it is given and updates its params and
    optimizer state in place, leaf by leaf (_apply_in_place): bitwise the values of the pure update,
    without a second copy of them. The given TrainState is then spent: giving it (or its params or
    opt_state trees) to the step again raises DonatedError; its tensors are the new state's."""
    device_step = make_device_step(run, tx, runner, loss, donate)

    def train_step(state: TrainState, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]):
        for inputs_BL, *_ in micro_batches:
            check_tokens(inputs_BL, run.model.vocab_size)
        # every rank's labels count: the loss is the same function of the global batch on any mesh
        n_global = int(all_sum(sum((mb[1] != IGNORE).sum() for mb in micro_batches), "the step's label count"))
        if n_global == 0:
            raise ValueError("every label of this step is ignored (-100): the loss is undefined")
        state, out = device_step(state, micro_batches, n_global)
        return state, _metrics(run, out, n_global)
    return train_step


def _metrics(run: RunConfig, out: dict, n_global: int) -> dict:
    """The step's metrics from device_step's out: one host read of the loss and the flags."""
    loss = out["loss"]
    loss_f, grad_norm_f, finite_f, updated_f = torch.stack(
        [loss, out["grad_norm"].to(loss), out["finite"].to(loss), out["updated"].to(loss)]).tolist()
    metrics = {"loss": loss_f, "grad_norm": grad_norm_f, "skipped": int(not (finite_f and updated_f)),
               "n_tokens": n_global, "expert_counts_NE": out["counts"]}
    if not finite_f or not updated_f:
        metrics["skipped_why"] = "non-finite loss or gradients" if not finite_f else "non-finite update"
    if run.model.moe.capacity_factor:  # routed (token, expert) rows over capacity, all ranks
        metrics["dropped_tokens"] = int(all_sum(out["dropped"], "the dropped-token count"))
    return metrics


def eval_loss(params: Tree, batches: list[tuple[torch.Tensor, ...]], run: RunConfig, *,
              router: Router | None = None) -> float:
    """Mean token cross-entropy over batches (as train_step's micro-batches), no gradients; router:
    the one the model was trained with (loss_fn's router=; None: the built-in of model.moe.score_func)."""
    total, count, source = 0.0, 0, params_source(params)
    with torch.no_grad():
        for inputs_BL, labels_BL, *positions in batches:
            x_BLD, _ = hidden_states(params, inputs_BL, run.model, positions_BL=positions[0] if positions else None,
                                     source=source, final_norm=False, router=router)
            norm_D = final_norm_weight(params, run.model, source)
            total += ce_loss_sum(x_BLD, norm_D, head_weight(params, run.model, source), labels_BL,
                                 run.model.norm_eps, run.train.ce_chunks).item()
            count += int((labels_BL != IGNORE).sum())
    return total / max(count, 1)


def init_state(params: Tree, tx: optim.GradientTransformation) -> TrainState:
    return TrainState(params, tx.init(params), 0)
