"""Training: loss_fn, train_step and the loop.

Legend: B batch, L sequence, D model, T tokens (B·L), V vocab.

The loss of a step is the sum of token losses over every micro-batch (and, with a mesh, every
rank) divided by the global count of non-ignored labels; each micro-batch's gradient is taken
of its share of that sum, so k micro-batches give exactly the update of one k-times batch.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fnmoe.parallel import dist as fdist
from fnmoe.parallel import gather as fgather
from fnmoe import optim
from fnmoe.plan import meters
from fnmoe.attention import upcast
from fnmoe.config import ModelConfig, RunConfig
from fnmoe.data.loader import IGNORE
from fnmoe.memory.policies import train_runner
from fnmoe.model import DTYPE, check_inputs, check_tokens, head_weight, hidden_states
from fnmoe.moe import balance_loss_part, update_router_bias
from fnmoe.memory.runner import BlockRunner
from fnmoe.parallel.sharding import all_sum
from fnmoe.train_state import TrainState
from fnmoe.tree import Tree, tree_flatten, tree_unflatten, value_and_grad


def _ce_sum(h_TD: torch.Tensor, w_DV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    logits_TV = upcast(h_TD @ w_DV)
    return F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE, reduction="sum")


def ce_loss_sum(h_BLD: torch.Tensor, w_DV: torch.Tensor, labels_BL: torch.Tensor, chunks: int = 1):
    """Sum of fp32 cross-entropy over non-ignored labels; with chunks > 1 only one chunk's logits
    exist at a time (each chunk's are recomputed in backward)."""
    h_TD, labels_T = h_BLD.reshape(-1, h_BLD.shape[-1]), labels_BL.reshape(-1)
    w_DV = w_DV.to(h_TD.dtype)
    if chunks == 1:
        return _ce_sum(h_TD, w_DV, labels_T)
    parts = [checkpoint(_ce_sum, h, w_DV, y, use_reentrant=False)
             for h, y in zip(h_TD.chunk(chunks), labels_T.chunk(chunks))]
    return torch.stack(parts).sum()


def _check_labels(labels_BL: torch.Tensor, inputs_BL: torch.Tensor) -> None:
    if not isinstance(labels_BL, torch.Tensor) or labels_BL.shape != inputs_BL.shape:
        got = tuple(labels_BL.shape) if isinstance(labels_BL, torch.Tensor) else type(labels_BL).__name__
        raise ValueError(f"labels must be a tensor of the inputs' shape {tuple(inputs_BL.shape)}, got {got}")
    if labels_BL.dtype.is_floating_point or labels_BL.dtype.is_complex or labels_BL.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (token ids, {IGNORE} to ignore), got {labels_BL.dtype}")


def loss_fn(params: Tree, inputs_BL: torch.Tensor, labels_BL: torch.Tensor, cfg: ModelConfig,
            n_global: torch.Tensor | int, ce_chunks: int = 1, runner: BlockRunner | None = None,
            record_max_logits: bool = False, positions_BL: torch.Tensor | None = None):
    """(this micro-batch's share of the step loss, aux); n_global counts the step's non-ignored labels.

    The router losses (load balance, sequence-wise balance, z-loss) are weighted by this
    micro-batch's share of the labels, so the step's total weights each once; aux["ce_loss"] is
    the cross-entropy part alone; with record_max_logits, aux["max_logits_NH"] feeds MuonClip;
    positions_BL marks packed documents (model.hidden_states).
    """
    check_inputs(params, inputs_BL, cfg)
    _check_labels(labels_BL, inputs_BL)
    h_BLD, aux = hidden_states(params, inputs_BL, cfg, runner, record_max_logits, positions_BL)
    ce = ce_loss_sum(h_BLD, head_weight(params, cfg), labels_BL, ce_chunks) / n_global
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
            # with data parallelism each rank adds its part of the whole micro-batch's Switch loss
            counts_NE = all_sum(aux["expert_counts_NE"], "expert counts for the balance loss")
            value = balance_loss_part(aux["probs_sum_NE"], counts_NE, counts_NE[0].sum() // m.top_k, m.top_k)
            share = all_sum(n_local, "the micro-batch's label count") / n_global
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


def make_device_step(run: RunConfig, tx: optim.GradientTransformation) -> Callable:
    """device_step(state, micro_batches, n_global) -> (state, out): train_step without its host reads
    (the token check, the label count, the metrics), so that it also runs on fake tensors
    (fnmoe.plan.rehearse). out holds device tensors: loss, grad_norm, finite, updated, counts, dropped."""
    cfg = run.model
    grad_fn = value_and_grad(loss_fn, has_aux=True)
    runner = train_runner(run)
    qk_clip = run.optim.qk_clip
    reduce_dtype = DTYPE[run.mesh.reduce_dtype]

    def device_step(state: TrainState, micro_batches: list[tuple[torch.Tensor, ...]], n_global: int):
        loss, sums, spec, counts, max_logits_NH = torch.zeros(()), None, None, None, None
        dropped = torch.zeros((), dtype=torch.int64)
        for inputs_BL, labels_BL, *positions in micro_batches:
            meters.mark("forward")
            with fgather.reducing(reduce_dtype):  # backward too: a recompute there issues gathers again
                (_, aux), g = grad_fn(state.params, inputs_BL, labels_BL, cfg, n_global, run.train.ce_chunks, runner,
                                      record_max_logits=qk_clip, positions_BL=positions[0] if positions else None)
            meters.mark("grads", g)
            loss = loss + aux["ce_loss"]
            # summed leaf by leaf, each old pair let go once its sum exists: two gradient trees at the
            # peak, not three (not in place: autograd may hand one gradient tensor to two inputs)
            parts, spec = tree_flatten(g)
            del g
            if sums is None:
                sums = parts
            else:
                for k in range(len(parts)):
                    sums[k], parts[k] = sums[k] + parts[k], None
            del parts
            c = aux["expert_counts_NE"]
            counts = c if counts is None else counts + c
            if cfg.moe.capacity_factor:
                dropped = dropped + aux["dropped_N"].sum()
            if qk_clip:
                m = aux["max_logits_NH"]
                max_logits_NH = m if max_logits_NH is None else torch.maximum(max_logits_NH, m)
        grads = tree_unflatten(sums, spec)
        del sums
        meters.mark("update")
        loss = all_sum(loss, "the loss")
        if qk_clip:  # every rank clips the same heads by the same gamma, or replicas would drift apart
            max_logits_NH = _all_max(max_logits_NH)
        # the router bias sees every rank's tokens
        counts = None if counts is None else all_sum(counts, "expert counts")
        grad_norm = optim.global_norm(grads)
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optim.apply_updates(state.params, updates)
        # the router bias follows its own rule, after the optimizer (which leaves buffers alone)
        params = update_router_bias(params, counts, cfg)
        if qk_clip:
            params = optim.qk_clip(params, max_logits_NH, cfg, run.optim.qk_clip_tau)
        # finite gradients can still write non-finite params (a huge learning rate, a QK-clip of
        # non-finite logits): the new params' norm (one read of them, every rank) guards those too
        updated = torch.isfinite(optim.global_norm(params))
        ok = finite & updated
        # a non-finite step leaves params and optimizer state bitwise as they were; chosen on the
        # device, so nothing waits for the flag before the metrics read it with the loss
        params = optim.select(ok, params, state.params, in_place=True)
        opt_state = optim.select(ok, opt_state, state.opt_state, in_place=True)
        out = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "updated": updated, "counts": counts,
               "dropped": dropped}
        return TrainState(params, opt_state, state.step + 1), out

    device_step.runner = runner  # (its host pool's bookkeeping is what fnmoe.plan.rehearse reports)
    return device_step


def make_train_step(run: RunConfig, tx: optim.GradientTransformation) -> Callable:
    """train_step(state, micro_batches) -> (state, metrics); micro_batches: [(inputs_BL, labels_BL)]
    or, for packed documents, [(inputs_BL, labels_BL, positions_BL)] (Loader.batch_at's)."""
    device_step = make_device_step(run, tx)

    def train_step(state: TrainState, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]):
        for inputs_BL, *_ in micro_batches:
            check_tokens(inputs_BL, run.model.vocab_size)
        # every rank's labels count: the loss is the same function of the global batch on any mesh
        n_global = int(all_sum(sum((mb[1] != IGNORE).sum() for mb in micro_batches), "the step's label count"))
        if n_global == 0:
            raise ValueError("every label of this step is ignored (-100): the loss is undefined")
        state, out = device_step(state, micro_batches, n_global)
        loss = out["loss"]
        loss_f, grad_norm_f, finite_f, updated_f = torch.stack(
            [loss, out["grad_norm"].to(loss), out["finite"].to(loss), out["updated"].to(loss)]).tolist()
        metrics = {"loss": loss_f, "grad_norm": grad_norm_f, "skipped": int(not (finite_f and updated_f)),
                   "n_tokens": n_global, "expert_counts_NE": out["counts"]}
        if not finite_f or not updated_f:
            metrics["skipped_why"] = "non-finite loss or gradients" if not finite_f else "non-finite update"
        if run.model.moe.capacity_factor:  # routed (token, expert) rows over capacity, all ranks
            metrics["dropped_tokens"] = int(all_sum(out["dropped"], "the dropped-token count"))
        return state, metrics

    train_step.runner = device_step.runner  # its memory runner (the host pool's bookkeeping: tools/gpu_check)
    return train_step


def eval_loss(params: Tree, batches: list[tuple[torch.Tensor, ...]], run: RunConfig) -> float:
    """Mean token cross-entropy over batches (as train_step's micro-batches), no gradients."""
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs_BL, labels_BL, *positions in batches:
            h_BLD, _ = hidden_states(params, inputs_BL, run.model, positions_BL=positions[0] if positions else None)
            total += ce_loss_sum(h_BLD, head_weight(params, run.model), labels_BL, run.train.ce_chunks).item()
            count += int((labels_BL != IGNORE).sum())
    return total / max(count, 1)


def init_state(params: Tree, tx: optim.GradientTransformation) -> TrainState:
    return TrainState(params, tx.init(params), 0)
