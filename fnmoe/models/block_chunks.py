"""Whole-block token chunks (memory.block_chunks = N): a block's forward, recompute and backward run
over N chunks of its sequences.

Legend: B batch (a rank's micro-batch), L sequence, D model, T tokens (B·L), E experts, N chunks.

Under full recompute a block keeps its input and recomputes the rest in backward. Whole, that
recompute holds every token's saved tensors at once, so its transient caps the tokens a GPU computes
a step, and with them how far the expert gathers are amortised. In chunks, `_Chunks` runs each chunk
of sequences through the whole block (attention, dense MLP, norms, router, experts: every op of a
block treats each sequence on its own, so a chunk's outputs are rows of the unchunked ones) without
autograd. It saves the block's input and its params as they reach compute: the gathered weights,
once for every chunk, which the runner's saved-tensor hooks regather in backward under resharding,
as they move the input to the host under offload. Its backward recomputes and differentiates one
chunk at a time, the last first, sums each weight's gradient over the chunks in the compute dtype
(as fnmoe.models.moe_chunks does), and returns the sums to the gathers' backward: one reduce-scatter a leaf.

Each chunk keeps what its recompute must not change, its routing and its expert-parallel exchange,
under the runner's modes (fnmoe.models.seams.Chunking), so backward routes each token as the forward did.

Under expert parallelism the forward runs two chunks at a time (`interleaved`): a chunk's steps
(fnmoe.models.transformer.block_steps) yield while its dispatch or its combine travels, and the other chunk computes
meanwhile. So chunk c's dispatch travels behind chunk c+1's attention, chunk c+1's behind chunk c's
experts, chunk c's combine behind chunk c+1's experts, and chunk c+1's behind chunk c's output and
chunk c+2's attention; only the last combine of a block waits with less to hide it (its chunk's
output and shared expert). Each chunk runs the ops of its unchunked block in their order, under its
own mode, so what it keeps and its values are the sequential forward's.

In backward, chunk c-1 is recomputed beside chunk c's backward, whose MoE part is split at its
exchanges (fnmoe.models.moe_steps.Split): chunk c's combine gradient travels while chunk c-1's
recomputed experts compute, and its dispatch gradient while chunk c's own expert weight gradients
(put off for it: fnmoe.kernels.wgrad) compute; chunk c-1's replayed exchanges travel behind chunk
c's backward. Of a MoE layer's 4N backward exchanges only 3 are waited for at issue: the last
chunk's recompute's two and the first chunk's combine gradient.

The block's MoE statistics are the unchunked ones: counts, probability sums and dropped rows summed
over the chunks, the router logits joined in token order, the sequence-wise balance and z losses
averaged (the chunks are equal), and the Switch balance loss built from the summed parts
(fnmoe.models.moe.balance_loss_part), since it is not linear in a chunk's.
"""
from __future__ import annotations

import collections
import contextlib
import functools
from typing import Callable, Generator

import torch

from fnmoe.models.moe import balance_loss_part
from fnmoe.models.moe_steps import backward_into
from fnmoe.models.seams import Chunking
from fnmoe.tree import Tree, tree_flatten, tree_unflatten

SUMMED = ("counts_E", "probs_sum_E", "dropped")
MEANS = ("seq_balance_loss", "z_loss")
JOINED = ("router_logits_TE",)
REBUILT = ("balance_loss",)

Compute = Callable[[dict, torch.Tensor, slice], tuple]
"""compute(w, x_BLD, rows) -> (y_BLD, stats or None): the block on sequences `rows` of the micro-batch"""
Steps = Callable[[dict, torch.Tensor, slice], Generator]
"""steps(w, x_BLD, rows): compute's forward as a generator that yields while an exchange of its own
travels and returns compute's result"""


def run(compute: Compute, w: dict, x_BLD: torch.Tensor, chunking: Chunking, top_k: int, steps: Steps | None = None):
    """(y_BLD, stats) of compute over chunking.n chunks of x_BLD's sequences, w its params in the
    compute dtype; stats merged as the unchunked block's (None for a block without MoE). steps: the
    forward's, two chunks at a time (`interleaved`); None: one chunk after the other."""
    B, N = x_BLD.shape[0], chunking.n
    if B % N:
        raise ValueError(f"memory.block_chunks={N} must divide the sequences of a rank's micro-batch, {B} here")
    leaves, spec = tree_flatten(w)
    tensors = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    # the run holds the tree's other leaves only: a gathered weight held here would outlive resharding
    others = [None if k in tensors else t for k, t in enumerate(leaves)]
    chunks = _Run(compute, steps, others, spec, tensors, [slice(c * B // N, (c + 1) * B // N) for c in range(N)],
                  [chunking.modes() for _ in range(N)])
    y_BLD, *merged = _Chunks.apply(chunks, x_BLD, *(leaves[k] for k in tensors))
    if not chunks.keys:
        return y_BLD, None
    stats = dict(zip(chunks.keys, merged))
    T = x_BLD.shape[0] * x_BLD.shape[1]
    stats["balance_loss"] = balance_loss_part(stats["probs_sum_E"][None], stats["counts_E"][None], T, top_k)
    return y_BLD, stats


def interleaved(steps: list[Callable[[], Generator]], modes: list) -> list:
    """What each chunk's steps return, two chunks in flight: the chunk whose turn it is runs until it
    yields (an exchange of its own travelling), then the other resumes; a chunk that ends lets the
    next begin at once, ahead of the one left. Each chunk runs under its mode."""
    out, active, nxt = [None] * len(steps), collections.deque(), 0
    while active or nxt < len(steps):
        if nxt < len(steps) and len(active) < 2:
            c, chunk, nxt = nxt, _Stepped(steps[nxt](), modes[nxt]), nxt + 1
        else:
            c, chunk = active.popleft()
        chunk.step()
        if chunk.done:
            out[c] = chunk.value
        else:
            active.append((c, chunk))
    return out


class _Run:
    """What a block's chunks share: the block, its params' tree, the chunks' rows and modes, and the
    keys of the statistics they merge (set by the forward)."""

    def __init__(self, compute: Compute, steps: Steps | None, leaves: list, spec, tensors: list[int],
                 slices: list[slice], modes: list):
        self.compute, self.steps, self.leaves, self.spec, self.tensors = compute, steps, leaves, spec, tensors
        self.slices, self.modes = slices, modes
        self.keys: list[str] = []

    def params(self, tensors) -> Tree:
        leaves = list(self.leaves)
        for k, t in zip(self.tensors, tensors):
            leaves[k] = t
        return tree_unflatten(leaves, self.spec)

    def merge(self, stats: list[dict | None]) -> list[torch.Tensor]:
        """The chunks' statistics as the whole block's (but the rebuilt ones), in self.keys' order."""
        if stats[0] is None:
            return []
        unknown = sorted(set(stats[0]) - set(SUMMED + MEANS + JOINED + REBUILT))
        if unknown:
            raise ValueError(f"block chunks cannot merge the MoE statistics {unknown}: "
                             "say how in fnmoe.models.block_chunks")
        self.keys = [k for k in stats[0] if k not in REBUILT]
        out = []
        for k in self.keys:
            parts = [s[k] for s in stats]
            out.append(torch.cat(parts) if k in JOINED else torch.stack(parts).sum(0) if k in SUMMED
                       else torch.stack(parts).mean(0))
        return out


class _Chunks(torch.autograd.Function):
    """A block over chunks of its sequences: forward without autograd, saving its input and params;
    backward recomputes and differentiates one chunk at a time."""

    @staticmethod
    def forward(ctx, run: _Run, x_BLD, *tensors):
        w = run.params(tensors)
        keeping = [m[0] for m in run.modes]
        if run.steps is None:
            results = []
            for rows, mode in zip(run.slices, keeping):
                with mode:
                    results.append(run.compute(w, x_BLD[rows], rows))
        else:
            results = interleaved([functools.partial(run.steps, w, x_BLD[rows], rows) for rows in run.slices], keeping)
        outs, stats = zip(*results)
        merged = run.merge(list(stats))
        ctx.run = run
        ctx.save_for_backward(x_BLD, *tensors)
        ctx.mark_non_differentiable(*(t for k, t in zip(run.keys, merged) if k not in ("probs_sum_E", *MEANS)))
        return (torch.cat(outs), *merged)

    @staticmethod
    def backward(ctx, g_BLD, *g_stats):
        run, needs = ctx.run, ctx.needs_input_grad
        x_BLD, *saved = ctx.saved_tensors
        ws = [t.detach().requires_grad_(need and t.is_floating_point()) for t, need in zip(saved, needs[2:])]
        w = run.params(ws)
        del saved
        grads = {k: g for k, g in zip(run.keys, g_stats) if k in ("probs_sum_E", *MEANS) and g is not None}
        N = len(run.slices)
        g_x = [None] * N
        done = _recompute(run, w, x_BLD, N - 1, needs[1]).result()
        for c in reversed(range(N)):
            ahead = _recompute(run, w, x_BLD, c - 1, needs[1]) if c else None
            back = _Stepped(_differentiate(run, c, done, g_BLD, grads, ws))
            done = None
            if ahead is not None and run.steps is not None:
                # chunk c-1's recompute beside chunk c's split backward (fnmoe.models.moe_steps.Split)
                back.step()   # c to its combine's gradient in flight,
                ahead.step()  # which c-1's attention and routing hide; c-1's dispatch in flight,
                back.step()   # which c's expert input and weight gradients hide, its dispatch's gradient
                #               travelling behind the latter;
                ahead.step()  # c-1's experts; its combine in flight, behind the rest of c's backward
            g_x[c] = back.result()
            done = ahead.result() if ahead is not None else None
        return (None, torch.cat(g_x) if needs[1] else None, *(t.grad for t in ws))


class _Stepped:
    """A generator run step by step (a step: to its next yield) under a mode, to its result."""

    def __init__(self, gen: Generator, mode=None, grad: bool | None = None):
        self.gen, self.mode, self.grad, self.done, self.value = gen, mode, grad, False, None

    def step(self) -> None:
        if self.done:
            return
        with (contextlib.nullcontext() if self.grad is None else torch.set_grad_enabled(self.grad)), \
                (self.mode or contextlib.nullcontext()):
            try:
                next(self.gen)
            except StopIteration as end:
                self.done, self.value = True, end.value

    def result(self):
        while not self.done:
            self.step()
        return self.value


def _recompute(run: _Run, w: dict, x_BLD: torch.Tensor, c: int, need_x: bool) -> _Stepped:
    """Chunk c recomputed with autograd, under its replaying mode: as steps cut before its MoE part
    where the block has steps, else whole. Its result: (x_c, y_BLD, stats, (attention output, the
    MoE part's input leaf) or None)."""
    rows = run.slices[c]
    x_c = x_BLD[rows].detach().requires_grad_(need_x)

    def steps():
        if run.steps is not None:
            return (x_c, *(yield from run.steps(w, x_c, rows, cut=True)))
        return (x_c, *run.compute(w, x_c, rows), None)
    return _Stepped(steps(), run.modes[c][1], grad=True)


def _differentiate(run: _Run, c: int, recomputed: tuple, g_BLD: torch.Tensor, grads: dict, ws: list):
    """Chunk c's backward from its recompute, into the leaves' .grad (each weight's gradient summed
    in place over the chunks): where it was cut, its MoE part as steps (moe_steps.Split.backward),
    then its attention part. Returns x_c's gradient."""
    x_c, y_BLD, stats, cut = recomputed
    run.modes[c] = None  # what it kept for the recompute is taken: let it go
    outs, gs = [y_BLD], [g_BLD[run.slices[c]]]
    for k, g in grads.items():  # a mean over equal chunks: each chunk's part is 1/N of it
        if stats[k].requires_grad:
            outs.append(stats[k])
            gs.append(g / len(run.slices) if k in MEANS else g)
    del y_BLD, stats
    if cut is not None:
        attended, leaf, split = cut
        del cut
        yield from split.backward(outs, gs, (leaf, *ws))
        outs, gs = [attended], [leaf.grad]
        del leaf, split
    if gs[0] is not None:
        backward_into(outs, gs, (x_c, *ws))
    return x_c.grad
