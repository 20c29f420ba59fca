"""The two-level network under the planner's step-time model: which link each collective of a step
crosses, and how a rank's expert-parallel rows split between its own node and other nodes.

Legend: g GPUs a node (plan.gpus_per_node), S ep ranks, X experts an ep rank owns (E/S), E experts,
K top-k, Y experts a group (E/n_group), k groups a token may use (topk_group), Z experts of the
chosen groups (k·Y), n nodes an ep group spans.

Ranks are laid out as torch's DeviceMesh lays out the ("fsdp", "ep") mesh: rank = f·S + e, so an
ep group is S consecutive ranks (it spans ceil(S/g) nodes when g divides S), the flattened dense
group is every rank, and an expert stack's fsdp group is every S-th rank. Node j holds ranks
[j·g, (j+1)·g). A ring collective over a group inside one node runs at the NVLink rate; over a
group that spans nodes the network carries the bytes of the hops that cross nodes, spread over the
NICs of the group's GPUs on a node (NCCL's channels; `_nic_share`), NVLink the rest. An all-to-all
sends to its own node and to other nodes at once, over both links.
"""
from __future__ import annotations

import math
from functools import lru_cache

from fnmoe.config import RunConfig
from fnmoe.config.hardware import hardware


def nodes_of(ranks, g: int) -> set[int]:
    return {r // g for r in ranks}


def spans_nodes(ranks, g: int) -> bool:
    """Whether a collective over these ranks leaves one node."""
    return len(nodes_of(ranks, g)) > 1


def dense_ring_nic_share(run: RunConfig) -> float:
    """The share of a dense leaf's ring bytes a GPU's NIC carries: dense leaves are sharded over
    every rank (the flattened dp axis)."""
    return _nic_share((range(run.mesh.world),), hardware(run.plan).gpus_per_node)


def expert_ring_nic_share(run: RunConfig) -> float:
    """The same for an expert stack, sharded over fsdp: ranks e, e+S, e+2S, ...; the slowest ep
    index binds."""
    S, fsdp = run.mesh.ep, run.mesh.fsdp
    return _nic_share(tuple(range(e, e + S * fsdp, S) for e in range(S)), hardware(run.plan).gpus_per_node)


@lru_cache(maxsize=256)
def _nic_share(groups: tuple[range, ...], g: int) -> float:
    """0 for rings inside one node. A ring that leaves the node with m of its members on each node
    crosses the network once per m hops, and NCCL lays its channels so that each crossing leaves from
    another of those m GPUs' NICs: a NIC carries 1/m of a member's ring bytes (m = 1: every byte),
    the rest moving over NVLink. The node with the fewest members binds."""
    shares = [0.0]
    for ranks in groups:
        if spans_nodes(ranks, g):
            per_node: dict[int, int] = {}
            for r in ranks:
                per_node[r // g] = per_node.get(r // g, 0) + 1
            shares.append(1.0 / min(per_node.values()))
    return max(shares)


def _ep_nodes(S: int, g: int, first: int) -> list[list[int]]:
    """The ep indices of the group that starts at rank `first`, by node."""
    by_node: dict[int, list[int]] = {}
    for e in range(S):
        by_node.setdefault((first + e) // g, []).append(e)
    return list(by_node.values())


def _group_starts(run: RunConfig) -> range:
    """Rank offsets of ep groups whose node layouts differ (the pattern repeats every g/gcd(S, g))."""
    S, g = run.mesh.ep, hardware(run.plan).gpus_per_node
    return range(0, S * min(run.mesh.fsdp, g // math.gcd(S, g)), S)


def ep_row_fractions(run: RunConfig) -> tuple[float, float]:
    """(to own-node peers, to other nodes): the fractions of a rank's routed rows that leave it for
    each, with uniform routing (a row lands on each ep rank with probability 1/S; routing groups do
    not change that average) on the rank that sends most across nodes. They sum to (S-1)/S."""
    S, g = run.mesh.ep, hardware(run.plan).gpus_per_node
    if S == 1:
        return 0.0, 0.0
    fewest = min(len(node) for start in _group_starts(run) for node in _ep_nodes(S, g, start))
    return (fewest - 1) / S, (S - fewest) / S


@lru_cache(maxsize=256)
def _node_hit_probability(E: int, K: int, G: int, k: int, overlaps: tuple[int, ...]) -> float:
    """P(a token routes at least one copy to a node owning overlaps[q] experts of group q): the token
    picks k of the G groups uniformly, then K experts uniformly among their Z = k·Y experts.
    A DP over groups counts the k-subsets by how many of the node's experts they hold."""
    Z = k * (E // G)
    held = [o for o in overlaps if o]  # groups without the node's experts only multiply the count
    ways = [[0] * (sum(held) + 1) for _ in range(k + 1)]  # ways[c][h]: c such groups holding h experts
    ways[0][0] = 1
    for o in held:
        for c in range(min(k, len(held)) - 1, -1, -1):
            for h in range(len(ways[c]) - 1 - o, -1, -1):
                if ways[c][h]:
                    ways[c + 1][h + o] += ways[c][h]
    empty = G - len(held)
    miss = sum(n * math.comb(empty, k - c) * math.comb(Z - h, K)
               for c in range(k + 1) for h, n in enumerate(ways[c]) if n)
    miss /= math.comb(G, k) * math.comb(Z, K)
    return 1.0 - miss


def ep_dedup_rows(run: RunConfig) -> tuple[float, float]:
    """(inside the node, across nodes): rows a rank sends a token under a node-deduplicating dispatch
    (each token crosses to each destination node once and fans out there over NVLink, as DeepSeek-V3's
    DeepEP does; fnmoe's dispatch sends every routed row and does not do this yet). Across nodes it
    is the expected number of other nodes the token reaches: with group-limited routing and groups
    laid out on nodes, at most topk_group. Inside: every copy for an own-node peer, and each copy on
    another node forwarded once (an upper bound: the copy the receiving GPU keeps is counted too)."""
    m, S, g = run.model.moe, run.mesh.ep, hardware(run.plan).gpus_per_node
    if S == 1:
        return 0.0, 0.0
    E, K, G, k = m.n_experts, m.top_k, m.n_group, m.topk_group
    X, Y = E // S, E // G
    best = (0.0, -1.0)
    for start in _group_starts(run):
        nodes = _ep_nodes(S, g, start)
        copies, hit = [], []
        for node in nodes:
            owned = [0] * G  # experts of each group on this node
            for e in node:
                for x in range(e * X, (e + 1) * X):
                    owned[x // Y] += 1
            copies.append(K * len(node) * X / E)
            hit.append(_node_hit_probability(E, K, G, k, tuple(owned)))
        for i, own in enumerate(nodes):
            across = sum(hit) - hit[i]
            inside = sum(copies) - copies[i] + copies[i] * (len(own) - 1) / len(own)
            if across > best[1]:
                best = (inside, across)
    return best
