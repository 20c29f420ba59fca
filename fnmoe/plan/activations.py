"""Activation bytes a rank saves for backward, region by region, under a memory policy.

Formulas count what autograd saves for the kernels the target runs, op by op as fnmoe's regions
call them: RMSNorm keeps an fp32 input, the normalised and the weighted output; flash attention
keeps q, k, v, its output and the log-sum-exp (O(L·A) a head, never L²); a SwiGLU keeps both
projections, the activation and the product. tests/test_plan.py checks them against bytes measured
by MemTracker on small presets.

Legend: B batch (a rank's micro-batch), L sequence, T tokens (B·L), D model, F dense hidden,
E experts, K top-k, R routed rows a rank's experts receive (T·K·imbalance), V vocab, H heads,
G kv heads, A head dim, N = H·A, M = G·A; MLA: I = J + P query/key head dims, U value head dim,
C kv-lora rank, Q q-lora rank, W = C + P, X = H·(J + U); s bytes per compute-dtype element.
"""
from __future__ import annotations

import math
from functools import lru_cache

from fnmoe.config import ModelConfig, PlanConfig, RunConfig, TrainConfig
from fnmoe.dtypes import DTYPE_BYTES
from fnmoe.memory.host_pool import pool_bytes_for
from fnmoe.memory.policies import offloads
from fnmoe.plan.state import block_numels, largest_leaf, leaf_shapes, reduce_bytes, unsharded_grad_bytes
from fnmoe.tree import leaf_kind


def norm_bytes(T: int, n: int, s: int) -> int:
    """RMSNorm over n features: the fp32 input (in fp32 the region's input itself, so a region counts
    its input here), rsqrt, the normalised output and the weighted one (saved by the matmul that reads it)."""
    return T * n * (4 + 2 * s) + 4 * T


def attention_bytes(cfg: ModelConfig, T: int, s: int) -> int:
    """Saved bytes of one attention region (its input norm included)."""
    H, D = cfg.n_heads, cfg.dim
    lse = 4 * T * H
    if cfg.attention == "mla":
        I, U, C, P, Q = cfg.qk_head_dim_, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank
        X = H * (cfg.qk_nope_head_dim + U)
        q = norm_bytes(T, Q, s) if Q else 0
        # q and k concatenated (SDPA inputs), v as a view of the kv projection (its storage: all of it),
        # the output (written [B, L, H, U] by the fused kernels: the reshape before w_o is a view of it)
        core = T * s * (2 * H * I + X + H * U)
        latent = norm_bytes(T, C, s) + (T * P * 4 if s == 4 else 0)  # fp32: the norm keeps the whole kv_a output
        return norm_bytes(T, D, s) + q + latent + core + lse
    N, M = H * cfg.head_dim_, cfg.n_kv_heads * cfg.head_dim_
    # q/k norms keep their fp32 input and normalised output; the weighted one goes into RoPE, which keeps nothing
    qk = T * (N + M) * (4 + s) + 4 * T * (H + cfg.n_kv_heads) if cfg.qk_norm else 0
    # q, k, v after RoPE and the output, which flash (and efficient, and fnmoe's CPU kernel) write
    # [B, L, H, A]: the reshape w_o reads is a view of it, not a second copy. In fp32 no CUDA fused
    # kernel takes grouped kv: fnmoe.models.attention.sdpa repeats it to every head for the efficient one
    kv = N if s == 4 else M
    return norm_bytes(T, D, s) + qk + T * s * (2 * N + 2 * kv) + lse


def swiglu_bytes(T: int, F: int, s: int) -> int:
    """gate and up projections, the activation, the product."""
    return 4 * T * F * s


def mlp_bytes(cfg: ModelConfig, T: int, s: int) -> int:
    return norm_bytes(T, cfg.dim, s) + swiglu_bytes(T, cfg.ffn_hidden, s)


def moe_bytes(cfg: ModelConfig, T: int, s: int, imbalance: float = 1.0, ep: int = 1) -> int:
    """Saved bytes of one MoE region on a rank: its tokens' routing, and the rows its experts receive
    (T·K on average over EP ranks, times the imbalance on the busiest)."""
    m, D = cfg.moe, cfg.dim
    R = int(T * m.top_k * (imbalance if ep > 1 else 1.0))
    rows = R * 16 + 2 * R * D * s + swiglu_bytes(R, m.expert_hidden, s)
    shared = swiglu_bytes(T, m.n_shared_experts * m.expert_hidden, s)
    return moe_unchunked_bytes(cfg, T, s) + rows + shared


def moe_unchunked_bytes(cfg: ModelConfig, T: int, s: int) -> int:
    """The part of moe_bytes that sees all T tokens at once when the region runs in token chunks
    (fnmoe.models.moe_chunks): its input norm and the routing (one router matmul over every token)."""
    m, D = cfg.moe, cfg.dim
    K, E = m.top_k, m.n_experts
    # below fp32 the router reads an fp32 copy of the normed tokens, and only a shared expert keeps the
    # weighted norm output that norm_bytes counts; in fp32 the router reads (and keeps) that output itself
    upcast = T * D * 4 - (0 if m.n_shared_experts else T * D * s) if s < 4 else 0
    # fp32 scores (softmax and sigmoid keep their output; the logits, and their logsumexp, only for the
    # z-loss), the top-k indices, the combine's weights in the compute dtype; renormalised, the gathered
    # scores and their sum; sigmoid scores' per-token sum for the balance losses
    router = (upcast + T * E * 4 + (T * E * 4 + 4 * T if m.z_loss_coeff else 0) + T * K * (8 + s)
              + (T * K * 4 + 4 * T if m.norm_topk_prob else 0) + (4 * T if m.score_func == "sigmoid" else 0))
    return norm_bytes(T, D, s) + router


def weight_grad_bytes(run: RunConfig, i: int) -> int:
    """Compute-dtype weight gradients of layer i alive at once in its backward: as backward reaches
    each weight, that one before its reduce-scatter (the largest); a MoE layer in token chunks
    (fnmoe.models.moe_chunks) differentiated chunk by chunk holds every chunked weight's gradient, summed
    over the chunks, beside one chunk's new one."""
    s, one = DTYPE_BYTES[run.model.compute_dtype], largest_leaf(run, layers=True)
    m, full = run.model.moe, run.memory.recompute == "full"
    if full and run.memory.block_chunks > 1:
        # every weight of the block (fnmoe.models.block_chunks): all of them summed over the chunks
        chunked = [math.prod(shape) // (run.mesh.ep if leaf_kind(path) == "expert" else 1)
                   for path, shape in leaf_shapes(run.model) if path.startswith(f"layers.{i}.")]
    elif run.model.is_moe_layer(i) and m.token_chunks > 1 and full:
        # the chunks' weights (moe_chunks._weights): the expert stacks (a rank's E/ep) and the shared experts'
        chunked = [math.prod(shape) // (run.mesh.ep if leaf_kind(path) == "expert" else 1)
                   for path, shape in leaf_shapes(run.model)
                   if path.startswith(f"layers.{i}.moe.") and (leaf_kind(path) == "expert" or ".moe.shared." in path)]
    else:
        return one * s
    return (sum(chunked) + max(max(chunked), one)) * s


def region_bytes(cfg: ModelConfig, i: int, T: int, s: int, imbalance: float = 1.0, ep: int = 1) -> dict:
    """{region: saved bytes with policy none} of layer i."""
    ffn = ("moe", moe_bytes(cfg, T, s, imbalance, ep)) if cfg.is_moe_layer(i) else ("mlp", mlp_bytes(cfg, T, s))
    return dict([("attention", attention_bytes(cfg, T, s)), ffn])


def selective_bytes(cfg: ModelConfig, region: str, T: int, s: int, R: int) -> int:
    """Saved bytes under selective recompute: the region input and the outputs of its matmuls, attention
    kernel and top-k (memory.SELECTIVE_SAVE_OPS; the last matmul's is the region output, which the
    checkpoint keeps too); norms, RoPE and pointwise ops are recomputed."""
    D, x, H = cfg.dim, T * cfg.dim * s, cfg.n_heads
    if region == "attention":  # the projections, the kernel's output and lse, w_o's output
        if cfg.attention == "mla":
            U, P = cfg.v_head_dim, cfg.qk_rope_head_dim
            proj = cfg.q_lora_rank + H * cfg.qk_head_dim_ + cfg.kv_lora_rank + P + H * (cfg.qk_nope_head_dim + U)
            out = H * U
        else:
            proj, out = (H + 2 * cfg.n_kv_heads) * cfg.head_dim_, H * cfg.head_dim_
        return x + T * s * (proj + out + D) + 4 * T * H
    if region == "mlp":
        return x + T * (2 * cfg.ffn_hidden + D) * s
    m = cfg.moe
    # the router's fp32 logits and top-k (values, indices; group-limited: the groups' top-2 and top-k too),
    # the experts' three GEMMs, the combine, the shared experts' three matmuls
    topk = topk_bytes(cfg, T)
    shared = T * (2 * m.n_shared_experts * m.expert_hidden + D) * s if m.n_shared_experts else 0
    return x + T * m.n_experts * 4 + topk + R * (2 * m.expert_hidden + D) * s + T * D * s + shared


def topk_bytes(cfg: ModelConfig, T: int) -> int:
    """The router's top-k outputs (fp32 values, int64 indices; group-limited routing: the groups'
    top-2 and top-k too): what every recompute keeps of the routing (memory.ROUTING_OPS)."""
    m = cfg.moe
    return T * 12 * (m.top_k + (2 * m.n_group + m.topk_group if m.n_group > 1 else 0))


def routing_bytes(run: RunConfig, T: int) -> int:
    """What a MoE layer's recompute keeps of its routing: the top-k outputs and, under expert
    parallelism, the count exchange's output (int64 [S, X] = E counts) of each chunk the layer
    exchanges counts for (a block chunk each; token chunks share one exchange)."""
    m = run.model.moe
    counts = m.n_experts * 8 * m.token_chunks * run.memory.block_chunks if run.mesh.ep > 1 else 0
    return topk_bytes(run.model, T) + counts


def exchange_bytes(run: RunConfig, T: int) -> int:
    """A MoE layer's two all-to-all outputs on the busiest EP rank: the R rows its experts receive
    and the T·K rows that come back (none without expert parallelism)."""
    if run.mesh.ep == 1:
        return 0
    K = run.model.moe.top_k
    return int(T * K * (1 + run.plan.imbalance)) * run.model.dim * DTYPE_BYTES[run.model.compute_dtype]


def block_activations(run: RunConfig, i: int, T: int) -> dict:
    """Layer i's saved bytes under run.memory: {device, host, host_routed, recomputed, transient}
    where host_routed is the part of host whose size follows the routing (the pool's margin covers
    it) and transient is what recomputing it in backward holds at once."""
    cfg, mem = run.model, run.memory
    s = DTYPE_BYTES[cfg.compute_dtype]
    regions = region_bytes(cfg, i, T, s, run.plan.imbalance, run.mesh.ep)
    full = sum(regions.values())
    last = i == cfg.n_layers - 1
    if mem.recompute == "full":
        # the block input, and the exchange's outputs (memory.EXCHANGE_OPS), which the recomputed block
        # holds again beside its own saved tensors; --memory.no-keep-exchange replays them instead,
        # and the replay makes them again in backward (a token chunk's at a time when chunked)
        exchange = exchange_bytes(run, T) if cfg.is_moe_layer(i) else 0
        exchanged = exchange if mem.keep_exchange else 0
        kept = T * cfg.dim * s + exchanged + (routing_bytes(run, T) if cfg.is_moe_layer(i) else 0)
        host = kept - T * cfg.dim * s + host_input_bytes(run, T) if mem.offload and not last else 0
        recomputing = _recomputing(run, i, T, regions) + (exchange // _chunks(run, i) if not exchanged else 0)
        # offloaded, what it keeps comes back for its recompute, beside the previous block's (prefetched)
        # and, as backward reaches each weight, that leaf's compute-dtype gradient before its reduce-scatter
        return {"device": 0 if host else kept, "host": host, "host_routed": exchanged if host else 0,
                "recomputed": full,
                "transient": recomputing + exchanged + (2 * kept if host else 0) + weight_grad_bytes(run, i)}
    R = int(T * cfg.moe.top_k * (run.plan.imbalance if run.mesh.ep > 1 else 1.0))
    out = {"device": 0, "host": 0, "host_routed": 0, "recomputed": 0, "transient": 0}
    for region, none_bytes in regions.items():
        policy = getattr(mem, region)
        if mem.offload or policy == "offload":
            out["host" if not last else "device"] += none_bytes
            out["host_routed"] += none_bytes if region == "moe" and not last else 0
        elif policy == "full":
            out["device"] += T * cfg.dim * s
            out["recomputed"] += none_bytes
            out["transient"] = max(out["transient"], none_bytes)
        elif policy == "selective":
            kept = selective_bytes(cfg, region, T, s, R)
            out["device"] += kept
            out["recomputed"] += none_bytes - kept
            out["transient"] = max(out["transient"], none_bytes - kept)
        else:
            out["device"] += none_bytes
    return out


def host_input_bytes(run: RunConfig, T: int) -> int:
    """A block input's bytes in the offload pool: the compute dtype, or under memory.offload_dtype
    e4m3 and a float32 scale a 1x128 tile of each token's row (fnmoe.memory.policies._Fp8Handle)."""
    D = run.model.dim
    if run.memory.offload_dtype == "compute":
        return T * D * DTYPE_BYTES[run.model.compute_dtype]
    return T * D + T * -(-D // 128) * 4


def _chunks(run: RunConfig, i: int) -> int:
    """The chunks block i's recompute runs in: the block's (memory.block_chunks), else its MoE
    region's (model.moe.token_chunks)."""
    if run.memory.block_chunks > 1:
        return run.memory.block_chunks
    return run.model.moe.token_chunks if run.model.is_moe_layer(i) else 1


def _recomputing(run: RunConfig, i: int, T: int, regions: dict) -> int:
    """What block i's recompute (full) holds at once. In block chunks (fnmoe.models.block_chunks) one chunk's
    regions, beside the input gradients of the chunks done before it (rehearsed on K2's shapes: the
    last chunk's peak is the block's) and, under expert parallelism, the next chunk's attention and
    routing. In MoE token chunks the MoE region is recomputed and
    differentiated a chunk at a time, but for its norm and routing, which see every token at once."""
    cfg, s = run.model, DTYPE_BYTES[run.model.compute_dtype]
    n = run.memory.block_chunks
    if n > 1:
        c = T // n
        chunk = sum(region_bytes(cfg, i, c, s, run.plan.imbalance, run.mesh.ep).values())
        # a MoE block under expert parallelism recomputes chunk c-1 beside chunk c's split backward
        # (fnmoe.models.moe_steps.Split), up to its dispatch while chunk c's experts are differentiated
        ahead = (attention_bytes(cfg, c, s) + moe_unchunked_bytes(cfg, c, s)
                 if run.mesh.ep > 1 and cfg.is_moe_layer(i) else 0)
        return chunk + ahead + (n - 1) * c * cfg.dim * s
    n, moe = _chunks(run, i), regions.get("moe", 0)
    whole = moe_unchunked_bytes(cfg, T, s) if n > 1 else moe
    return sum(regions.values()) - moe + whole + (moe - whole) // n


def tokens_per_rank(run: RunConfig) -> int:
    """T: tokens of one micro-batch on one rank."""
    return run.micro_batch * run.data.seq_len


def activation_plan(run: RunConfig) -> dict:
    """Saved activation bytes per rank (device and host), per block and in total, plus the head
    (cached by what it reads: `fnmoe plan --search` plans thousands of layouts; do not mutate)."""
    return _activation_plan(run.model, tokens_per_rank(run), run.memory, run.mesh, run.plan.imbalance,
                            run.train.ce_chunks)


@lru_cache(maxsize=4096)
def _activation_plan(cfg: ModelConfig, T: int, memory, mesh, imbalance: float, ce_chunks: int) -> dict:
    run = RunConfig(model=cfg, memory=memory, mesh=mesh, plan=PlanConfig(imbalance=imbalance),
                    train=TrainConfig(ce_chunks=ce_chunks))
    s = DTYPE_BYTES[cfg.compute_dtype]
    # a layer's bytes depend on its kind and whether it is the last (which offload keeps), not its index
    kinds: dict[tuple, dict] = {}
    blocks = []
    for i in range(cfg.n_layers):
        kind = (cfg.is_moe_layer(i), i == cfg.n_layers - 1)
        if kind not in kinds:
            kinds[kind] = block_activations(run, i, T)
        blocks.append(kinds[kind])
    head = head_bytes(cfg, T, s, ce_chunks)
    device = sum(b["device"] for b in blocks) + head
    # block i's backward (the embedding's after block 0's) runs while block i+1's reduce-scatters
    # read their inputs, the layer's fp32 gradients (fnmoe.parallel.gather); none on one rank
    sends = [n * reduce_bytes(run) * (run.mesh.world > 1) for n in block_numels(cfg, run.mesh.ep)[1:-1]] + [0]
    transient = max(max(b["transient"] + sends[i + 1] for i, b in enumerate(blocks)),
                    unsharded_grad_bytes(run) + sends[0])
    return {"blocks": blocks, "device": device, "host": sum(b["host"] for b in blocks),
            "host_routed": sum(b["host_routed"] for b in blocks), "transient": transient, "head": head}


def pool_bytes(run: RunConfig) -> int:
    """Host bytes a rank's offload pool pins (0 when nothing is offloaded): the planned offload_host,
    its part sized by the routing with the pool's margin (none when the exchange is replayed: the
    block inputs are all it holds), in whole segments (fnmoe.memory.host_pool.pool_bytes_for). The size the
    step's runner is built with (fnmoe.memory.policies.train_runner, where the step is built) and
    the one fnmoe.plan.host_limit holds against the host."""
    if not offloads(run.memory):
        return 0
    acts = activation_plan(run)
    return pool_bytes_for(acts["host"], acts["host_routed"])


def head_bytes(cfg: ModelConfig, T: int, s: int, ce_chunks: int) -> int:
    """What the final norm and the cross-entropy keep for backward (fnmoe.training.step.ce_loss_sum): whole,
    the final norm (its output the head's input) and the fp32 log-softmax; in chunks, the last
    block's output alone, from which backward recomputes each chunk's norm and logits."""
    if ce_chunks == 1:
        return norm_bytes(T, cfg.dim, s) + T * cfg.vocab_size * 4
    return T * cfg.dim * s


def logits_bytes(run: RunConfig) -> int:
    """One CE chunk's fp32 log-softmax and, in backward, the two fp32 gradients before it (the
    compute-dtype logits and their fp32 copy are gone by then). The chunk's recomputed final norm
    beside them (norm_bytes of its rows, D/V of this at most) is the backward's: a block's recompute
    transient, which comes later, is larger."""
    T = tokens_per_rank(run)
    return math.ceil(T / run.train.ce_chunks) * run.model.vocab_size * (4 + 4 + 4)


def ep_buffer_bytes(run: RunConfig) -> int:
    """Backward's all-to-all buffer of one MoE layer (a token chunk's) on the busiest EP rank: the
    gradients of the R rows its experts received (forward's exchange outputs count as activations: saved, or freed at
    once). Rehearsed at full scale, one such buffer is alive at a time."""
    if run.mesh.ep == 1 or not run.model.moe.n_experts:
        return 0
    T = tokens_per_rank(run) // (run.model.moe.token_chunks * run.memory.block_chunks)
    s = DTYPE_BYTES[run.model.compute_dtype]
    # a replayed exchange's outputs are alive beside the gradients' exchange (rehearsed: twice); in
    # whole-block chunks' split backward (fnmoe.models.moe_steps.Split) chunk c-1's replayed dispatch
    # and chunk c's combine gradient, both the busiest rank's received rows, beside the dispatch
    # gradient returned to this rank's own T·K rows (rehearsed on K2's shapes: 2,912 MiB against 3,136)
    replayed = run.memory.recompute == "full" and not run.memory.keep_exchange
    received = int(T * run.model.moe.top_k * max(run.plan.imbalance, 1.0))
    if replayed and run.memory.block_chunks > 1:
        return (2 * received + T * run.model.moe.top_k) * run.model.dim * s
    return received * run.model.dim * s * (2 if replayed else 1)

