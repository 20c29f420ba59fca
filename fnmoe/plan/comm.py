"""Bytes a rank sends a step: FSDP's gathers and reduce-scatters and the EP exchange, split by
link (inside a node, across nodes) with the two-level network of fnmoe.plan.network.

Legend: B batch (a rank's micro-batch), L sequence, T tokens (B·L), D model, F dense hidden,
E experts, K top-k, R routed rows a rank's experts receive (T·K·imbalance), V vocab, H heads,
G kv heads, A head dim, N = H·A, M = G·A; MLA: I = J + P query/key head dims, U value head dim,
C kv-lora rank, Q q-lora rank, W = C + P, X = H·(J + U); s bytes per compute-dtype element.
"""
from __future__ import annotations

import math
from functools import lru_cache

from fnmoe.config import ModelConfig, RunConfig
from fnmoe.plan import network as plan_net
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.dtypes import DTYPE_BYTES
from fnmoe.plan.state import expert_pack_bytes, leaf_shapes, reduce_bytes
from fnmoe.tree import leaf_kind


def comm_bytes(run: RunConfig) -> dict:
    """Bytes one rank sends per optimizer step (a ring collective of n bytes over g ranks sends
    n·(g-1)/g a rank), as fnmoe's step runs them, per micro-batch:

      fsdp  compute-dtype all-gathers of every sharded leaf (dense over all ranks, expert stacks
            over fsdp alone: the ep rank's E/ep experts; with mesh.expert_gather_dtype float8_e4m3fn
            each rank's fp8 pack of its shard, state.expert_pack_bytes) and reduce-scatters of their
            gradients in
            mesh.reduce_dtype, one per gather that autograd differentiates. A block's leaves are
            gathered again in backward when resharding or under full recompute; the embedding,
            final norm and head are gathered outside the blocks, once (twice for a tied embedding,
            which the head gathers again); QK-clip gathers each block's attention and its norm once
            more in the forward, without gradient (its max-logit pass, before the block).
      ep    the dispatch and combine all-to-alls of rows of D (the (ep-1)/ep that leave the rank),
            forward and backward: 4 passes a MoE layer, on the busiest rank T·K rows in the
            dispatch and its backward's reverse, imbalance times that in the combine and the
            dispatch's backward; 6 under full recompute with --memory.no-keep-exchange, whose
            recompute replays the forward's two.

    `parts` splits the same bytes by (phase, kind, where): phase forward, backward or update;
    kind all_gather, reduce_scatter or all_to_all; where "blocks" (the layers' leaves, their
    collectives issued once a layer) or "outer" (embedding, final norm, head); each with its bytes
    inside a node and across nodes. Buffers are replicated and never communicated; the count
    exchange and the scalar all-reduces (loss, label count, expert counts, gradient norm) are a
    few bytes and left out. Checked against bytes counted on the collectives of eager steps on a
    2x2 gloo mesh (tests/test_mesh_memory.py)."""
    keys = ("fsdp", "ep", "total", "fsdp_intra_node", "fsdp_inter_node", "ep_intra_node", "ep_inter_node")
    if run.mesh.world == 1:
        return {**dict.fromkeys(keys, 0), "parts": {}}
    parts = {**_fsdp_parts(run), **_ep_parts(run)}

    def summed(ep: bool, link: tuple[str, ...]) -> int:
        return int(sum(v[k] for (_, kind, _), v in parts.items() if (kind == "all_to_all") == ep for k in link))

    fsdp, ep = summed(False, ("intra", "inter")), summed(True, ("intra", "inter"))
    fsdp_intra, ep_intra = min(summed(False, ("intra",)), fsdp), min(summed(True, ("intra",)), ep)
    return {**dict(zip(keys, (fsdp, ep, fsdp + ep, fsdp_intra, fsdp - fsdp_intra, ep_intra, ep - ep_intra))),
            "parts": {"/".join(k): v for k, v in parts.items()}}


def _fsdp_parts(run: RunConfig) -> dict:
    cfg, mesh, accum = run.model, run.mesh, run.train.grad_accum
    s = DTYPE_BYTES[cfg.compute_dtype]
    sent = _sent(cfg, mesh.fsdp, mesh.ep)
    # the share of a ring's bytes that a GPU's NIC carries across nodes (plan_net), NVLink the rest
    across = {"dense": plan_net.dense_ring_nic_share(run), "expert": plan_net.expert_ring_nic_share(run)}
    regathered = mesh.reshard_after_forward or run.memory.recompute == "full"
    grad = reduce_bytes(run)
    out: dict = {}

    def add(key, elems_by_kind: dict, nbytes: float | dict, times: float = 1.0) -> None:
        """elems_by_kind's elements at nbytes each (or nbytes[kind]) sent `times`, split by link,
        added to key's."""
        if times:
            link = out.setdefault(key, {"intra": 0.0, "inter": 0.0})
            for kind, e in elems_by_kind.items():
                b = nbytes[kind] if isinstance(nbytes, dict) else nbytes
                link["inter"] += accum * e * b * times * across[kind]
                link["intra"] += accum * e * b * times * (1 - across[kind])

    # what a gather of the blocks' or outer leaves sends: fp8 expert stacks counted in bytes
    fp8 = mesh.expert_gather_dtype == "float8_e4m3fn"
    packs = (mesh.fsdp - 1) * expert_pack_bytes(cfg, mesh.fsdp, mesh.ep) if fp8 else 0
    gathered = {where: {"dense": sent[(where, "dense")],
                        "expert": packs if fp8 and where == "blocks" else sent[(where, "expert")]}
                for where in ("blocks", "outer")}
    per_elem = {"dense": s, "expert": 1 if fp8 else s}
    for where in ("blocks", "outer"):
        elems = {kind: sent[(where, kind)] for kind in ("dense", "expert")}
        add(("forward", "all_gather", where), gathered[where], per_elem)
        add(("backward", "reduce_scatter", where), elems, grad)
    add(("backward", "all_gather", "blocks"), gathered["blocks"], per_elem, 1 if regathered else 0)
    # QK-clip's max-logit pass runs in the forward, a block's before the block (hidden_states)
    add(("forward", "all_gather", "blocks"), {"dense": _max_logit_sent(cfg, mesh.fsdp, mesh.ep)}, s,
        1 if run.optim.qk_clip else 0)
    return out


@lru_cache(maxsize=256)
def _sent(cfg: ModelConfig, fsdp: int, ep: int) -> dict:
    """Elements a rank sends in one gather of every leaf, by (where, kind): blocks or outer, dense or
    expert."""
    sent = dict.fromkeys([("blocks", "dense"), ("blocks", "expert"), ("outer", "dense"), ("outer", "expert")], 0.0)
    for path, shape in leaf_shapes(cfg):
        n, kind = math.prod(shape), leaf_kind(path)
        if kind == "buffer":
            continue
        k = n / ep * (fsdp - 1) / fsdp if kind == "expert" else n * (fsdp * ep - 1) / (fsdp * ep)
        where = "blocks" if path.startswith("layers.") else "outer"
        sent[(where, kind)] += k * (2 if where == "outer" and cfg.tie_embeddings and path.startswith("embed.") else 1)
    return sent


@lru_cache(maxsize=256)
def _max_logit_sent(cfg: ModelConfig, fsdp: int, ep: int) -> float:
    """Elements a rank sends in QK-clip's max-logit gathers: each layer's attention and its norm
    (fnmoe.models.transformer._block_max_logits_H gathers only the leaves it reads), dense leaves over every rank."""
    n = sum(math.prod(shape) for path, shape in leaf_shapes(cfg) if path.split(".")[0] == "layers"
            and path.split(".")[2] in ("attn", "attn_norm"))
    return n * (fsdp * ep - 1) / (fsdp * ep)


def _ep_parts(run: RunConfig) -> dict:
    cfg, mesh = run.model, run.mesh
    if mesh.ep == 1 or not cfg.moe.n_experts:
        return {}
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    # two passes' worth (a dispatch and a combine, T tokens' rows and imbalance times that)
    pair = (run.train.grad_accum * n_moe * (1 + run.plan.imbalance) * tokens_per_rank(run) * cfg.dim
            * DTYPE_BYTES[cfg.compute_dtype])
    link = dict(zip(("intra", "inter"), (pair * rows for rows in _rows_a_token(run))))
    replay = run.memory.recompute == "full" and not getattr(run.memory, "keep_exchange", True)
    return {("forward", "all_to_all", "blocks"): dict(link),
            ("backward", "all_to_all", "blocks"): {k: v * (2 if replay else 1) for k, v in link.items()}}


def _rows_a_token(run: RunConfig) -> tuple[float, float]:
    """(to own-node peers, to other nodes): rows a token sends in one exchange pass under
    plan.dispatch: 'rows' is fnmoe's exchange (each of its K rows that leaves the rank), 'node_dedup'
    a dispatch that crosses to each node once per token and fans out there (plan_net.ep_dedup_rows),
    which fnmoe does not have yet: a what-if, priced with the same passes (6 under replay)."""
    if run.plan.dispatch == "node_dedup":
        return plan_net.ep_dedup_rows(run)
    inside, across = plan_net.ep_row_fractions(run)
    return run.model.moe.top_k * inside, run.model.moe.top_k * across
