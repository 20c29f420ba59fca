"""Bytes a rank sends a step: FSDP's gathers and reduce-scatters and the EP exchange, split by
link (inside a node, across nodes) with the two-level network of fnmoe.plan.network.

Legend: B batch (a rank's micro-batch), L sequence, T tokens (B·L), D model, F dense hidden,
E experts, K top-k, R routed rows a rank's experts receive (T·K·imbalance), V vocab, H heads,
G kv heads, A head dim, N = H·A, M = G·A; MLA: I = J + P query/key head dims, U value head dim,
C kv-lora rank, Q q-lora rank, W = C + P, X = H·(J + U); s bytes per compute-dtype element.
"""
from __future__ import annotations

import math

from fnmoe.config import RunConfig
from fnmoe.plan import network as plan_net
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.plan.state import DTYPE_BYTES, GRAD_BYTES, leaf_kind, leaf_shapes


def comm_bytes(run: RunConfig) -> dict:
    """Bytes one rank sends per optimizer step (a ring collective of n bytes over g ranks sends
    n·(g-1)/g a rank), as fnmoe's step runs them, per micro-batch:

      fsdp  compute-dtype all-gathers of every sharded leaf (dense over all ranks, expert stacks
            over fsdp alone: the ep rank's E/ep experts) and fp32 reduce-scatters of their
            gradients, one per gather that autograd differentiates. A block's leaves are gathered
            again in backward when resharding or under full recompute; the embedding, final norm
            and head are gathered outside the blocks, once (twice for a tied embedding, which the
            head gathers again); QK-clip gathers each block once more, without gradient.
      ep    the dispatch and combine all-to-alls of rows of D (the (ep-1)/ep that leave the rank),
            forward and backward: 4 passes a MoE layer, on the busiest rank T·K rows in the
            dispatch and its backward's reverse, imbalance times that in the combine and the
            dispatch's backward; recompute never repeats them (memory.EXCHANGE_OPS are saved by
            every recompute policy).

    Buffers are replicated and never communicated; the count exchange and the scalar all-reduces
    (loss, label count, expert counts, gradient norm) are a few bytes and left out. Checked against
    bytes counted on the collectives of eager steps on a 2x2 gloo mesh (tests/test_mesh_memory.py)."""
    cfg, mesh, accum = run.model, run.mesh, run.train.grad_accum
    world, s = mesh.world, DTYPE_BYTES[cfg.compute_dtype]
    keys = ("fsdp", "ep", "total", "fsdp_intra_node", "fsdp_inter_node", "ep_intra_node", "ep_inter_node")
    if world == 1:
        return dict.fromkeys(keys, 0)
    # elements a rank sends in one gather of every block leaf / of the other leaves, dense and expert
    blocks, outer = {"dense": 0.0, "expert": 0.0}, {"dense": 0.0, "expert": 0.0}
    for path, shape in leaf_shapes(cfg):
        n = math.prod(shape)
        kind = leaf_kind(path)
        if kind == "buffer":
            continue
        sent = n / mesh.ep * (mesh.fsdp - 1) / mesh.fsdp if kind == "expert" else n * (world - 1) / world
        if path.startswith("layers."):
            blocks[kind] += sent
        else:
            outer[kind] += sent * (2 if cfg.tie_embeddings and path.startswith("embed.") else 1)
    regathered = mesh.reshard_after_forward or run.memory.recompute == "full"
    block_gathers = (2 if regathered else 1) + (1 if run.optim.qk_clip else 0)
    part = {k: accum * ((blocks[k] * block_gathers + outer[k]) * s + (blocks[k] + outer[k]) * GRAD_BYTES)
            for k in blocks}
    fsdp = int(part["dense"] + part["expert"])
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    imbalance = run.plan.imbalance if mesh.ep > 1 else 1.0
    ep = int(accum * n_moe * 2 * (1 + imbalance) * tokens_per_rank(run) * cfg.moe.top_k * cfg.dim * s
             * (mesh.ep - 1) / mesh.ep)
    # the split by link (plan_net): a ring over a group that leaves the node is all counted across
    intra = sum(part[k] for k, spans in (("dense", plan_net.dense_group_spans(run)),
                                          ("expert", plan_net.expert_group_spans(run))) if not spans)
    inside, _ = plan_net.ep_row_fractions(run)
    ep_intra = int(ep * inside * mesh.ep / (mesh.ep - 1)) if mesh.ep > 1 else 0
    return dict(zip(keys, (fsdp, ep, fsdp + ep, min(int(intra), fsdp), fsdp - min(int(intra), fsdp),
                           ep_intra, ep - ep_intra)))


def ep_link_bytes(run: RunConfig, comm: dict) -> tuple[float, float]:
    """(inside the node, across nodes) all-to-all bytes a rank sends a step under plan.dispatch:
    'rows' is fnmoe's exchange (comm_bytes' split), 'node_dedup' a dispatch that crosses to each
    node once per token (plan_net.ep_dedup_rows), which fnmoe does not have yet."""
    if run.plan.dispatch == "rows" or run.mesh.ep == 1:
        return comm["ep_intra_node"], comm["ep_inter_node"]
    cfg = run.model
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    row = run.train.grad_accum * n_moe * 4 * tokens_per_rank(run) * cfg.dim * DTYPE_BYTES[cfg.compute_dtype]
    inside, across = plan_net.ep_dedup_rows(run)
    return row * inside, row * across

