"""The planner behind `fnmoe plan`: per-rank memory, FLOPs, communication and a step-time model for
a RunConfig, from abstract shapes (params.leaf_inits, nothing allocated) and per-op byte formulas.

Legend: B batch (a rank's micro-batch), L sequence, T tokens (B·L), D model, F dense hidden,
E experts, K top-k, R routed rows a rank's experts receive (T·K·imbalance), V vocab, H heads,
G kv heads, A head dim, N = H·A, M = G·A; MLA: I = J + P query/key head dims, U value head dim,
C kv-lora rank, Q q-lora rank, W = C + P, X = H·(J + U); s bytes per compute-dtype element.

Activation formulas count what autograd saves for the kernels the target runs, op by op as
fnmoe's regions call them: RMSNorm keeps an fp32 input, the normalised and the weighted output;
flash attention keeps q, k, v, its output and the log-sum-exp (O(L·A) a head, never L²); a SwiGLU
keeps both projections, the activation and the product. tests/test_plan.py checks them against
bytes measured by MemTracker on small presets.
"""
from __future__ import annotations

import math
from functools import lru_cache

from fnmoe.plan import network as plan_net
from fnmoe.config import ModelConfig, RunConfig
from fnmoe.params import leaf_inits
from fnmoe.tree import flatten_dict

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
MASTER_BYTES = GRAD_BYTES = 4  # fp32 master params and fp32 reduce-scattered gradients
GB = 1e9


# ---------------------------------------------------------------- activations a region saves

def norm_bytes(T: int, n: int, s: int) -> int:
    """RMSNorm over n features: the fp32 input, the normalised and the weighted output, rsqrt."""
    return T * n * (4 + 2 * s) + 4 * T


def attention_bytes(cfg: ModelConfig, T: int, s: int) -> int:
    """Saved bytes of one attention region (its input norm included)."""
    H, D = cfg.n_heads, cfg.dim
    lse = 4 * T * H
    if cfg.attention == "mla":
        I, U, C, P, Q = cfg.qk_head_dim_, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank
        X = H * (cfg.qk_nope_head_dim + U)
        q = norm_bytes(T, Q, s) if Q else 0
        # q and k concatenated (SDPA inputs), v as a view of the kv projection, out and its reshape
        core = T * s * (2 * H * I + X + 2 * H * U)
        latent = norm_bytes(T, C, s) + (T * P * 4 if s == 4 else 0)  # fp32: the norm keeps the whole kv_a output
        return norm_bytes(T, D, s) + q + latent + core + lse
    N, M = H * cfg.head_dim_, cfg.n_kv_heads * cfg.head_dim_
    # q/k norms keep their fp32 input and normalised output; the weighted one goes into RoPE, which keeps nothing
    qk = T * (N + M) * (4 + s) + 4 * T * (H + cfg.n_kv_heads) if cfg.qk_norm else 0
    return norm_bytes(T, D, s) + qk + T * s * (3 * N + 2 * M) + lse


def swiglu_bytes(T: int, F: int, s: int) -> int:
    """gate and up projections, the activation, the product."""
    return 4 * T * F * s


def mlp_bytes(cfg: ModelConfig, T: int, s: int) -> int:
    return norm_bytes(T, cfg.dim, s) + swiglu_bytes(T, cfg.ffn_hidden, s)


def moe_bytes(cfg: ModelConfig, T: int, s: int, imbalance: float = 1.0, ep: int = 1) -> int:
    """Saved bytes of one MoE region on a rank: its tokens' routing, and the rows its experts receive
    (T·K on average over EP ranks, times the imbalance on the busiest)."""
    m, D = cfg.moe, cfg.dim
    K, E = m.top_k, m.n_experts
    R = int(T * K * (imbalance if ep > 1 else 1.0))
    router = (T * D * 4 if s != 4 else 0) + 2 * T * E * 4 + T * K * (8 + 4 + 4 + s)
    rows = R * 16 + 2 * R * D * s + swiglu_bytes(R, m.expert_hidden, s)
    shared = swiglu_bytes(T, m.n_shared_experts * m.expert_hidden, s)
    return norm_bytes(T, D, s) + router + rows + shared


def region_bytes(cfg: ModelConfig, i: int, T: int, s: int, imbalance: float = 1.0, ep: int = 1) -> dict:
    """{region: saved bytes with policy none} of layer i."""
    ffn = ("moe", moe_bytes(cfg, T, s, imbalance, ep)) if cfg.is_moe_layer(i) else ("mlp", mlp_bytes(cfg, T, s))
    return dict([("attention", attention_bytes(cfg, T, s)), ffn])


def selective_bytes(cfg: ModelConfig, region: str, T: int, s: int, R: int) -> int:
    """Saved bytes under selective recompute: the region input, matmul and attention outputs and the
    routing; norms and pointwise ops are recomputed."""
    D, x = cfg.dim, T * cfg.dim * s
    if region == "attention":
        return x + attention_bytes(cfg, T, s) - norm_bytes(T, D, s)
    if region == "mlp":
        return x + 2 * T * cfg.ffn_hidden * s
    m = cfg.moe
    return (x + T * m.top_k * (8 + 4) + R * (2 * m.expert_hidden + D) * s
            + 2 * T * m.n_shared_experts * m.expert_hidden * s)


def exchange_bytes(run: RunConfig, T: int) -> int:
    """A MoE layer's two all-to-all outputs on the busiest EP rank: the R rows its experts receive
    and the T·K rows that come back (none without expert parallelism)."""
    if run.mesh.ep == 1:
        return 0
    K = run.model.moe.top_k
    return int(T * K * (1 + run.plan.imbalance)) * run.model.dim * DTYPE_BYTES[run.model.compute_dtype]


def block_activations(run: RunConfig, i: int, T: int) -> dict:
    """Layer i's saved bytes under run.memory: {device, host, recomputed, transient} where transient
    is what recomputing it in backward holds at once."""
    cfg, mem = run.model, run.memory
    s = DTYPE_BYTES[cfg.compute_dtype]
    regions = region_bytes(cfg, i, T, s, run.plan.imbalance, run.mesh.ep)
    full = sum(regions.values())
    last = i == cfg.n_layers - 1
    if mem.recompute == "full":
        # the block input, and the exchange's outputs (memory.EXCHANGE_OPS: recompute never repeats an
        # all-to-all), which the recomputed block holds again beside its own saved tensors
        exchanged = exchange_bytes(run, T) if cfg.is_moe_layer(i) else 0
        kept = T * cfg.dim * s + exchanged
        host = kept if mem.offload and not last else 0
        # offloaded, what it keeps comes back for its recompute, beside the previous block's (prefetched)
        # and, as backward reaches each weight, that leaf's compute-dtype gradient before its reduce-scatter
        return {"device": kept - host, "host": host, "recomputed": full,
                "transient": full + exchanged + (2 * kept if host else 0) + largest_leaf(run, layers=True) * s}
    R = int(T * cfg.moe.top_k * (run.plan.imbalance if run.mesh.ep > 1 else 1.0))
    out = {"device": 0, "host": 0, "recomputed": 0, "transient": 0}
    for region, none_bytes in regions.items():
        policy = getattr(mem, region)
        if mem.offload or policy == "offload":
            out["host" if not last else "device"] += none_bytes
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


# ---------------------------------------------------------------- params, grads, optimizer state

@lru_cache(maxsize=16)
def leaf_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(dotted path, shape) of every leaf; cached, since flattening a 1T tree takes milliseconds and
    `fnmoe plan --search` plans hundreds of layouts of one model."""
    return tuple((path, tuple(init.shape)) for path, init in flatten_dict(leaf_inits(cfg)).items())


def _leaf_kind(path: str) -> str:
    if path.startswith("buffers."):
        return "buffer"
    return "expert" if path.endswith(("_EDF", "_EFD")) else "dense"


def _on_muon(path: str, shape: tuple[int, ...]) -> bool:
    """fnmoe.optim.muon's default labels: matrices that are not the embedding or the output head."""
    return len(shape) >= 2 and not path.startswith(("embed.", "head.", "buffers."))


def state_bytes(run: RunConfig) -> dict:
    """Per-rank bytes of fp32 master params, fp32 grads (twice with gradient accumulation: the sum
    and a micro-batch's) and optimizer state (every leaf sharded over all fsdp·ep ranks)."""
    world = run.mesh.world
    sb = DTYPE_BYTES[run.plan.state_dtype]
    params = grads = optim = 0
    for path, shape in leaf_shapes(run.model):
        n = math.ceil(math.prod(shape) / world)
        params += n * MASTER_BYTES
        if _leaf_kind(path) == "buffer":
            continue
        grads += n * GRAD_BYTES
        moments = 1 if run.optim.name == "muon" and _on_muon(path, shape) else 2
        optim += n * moments * sb
    # with micro-batches, each later backward's gradients live beside their running sum
    return {"params": params, "grads": grads * (2 if run.train.grad_accum > 1 else 1), "optim": optim}


def block_numels(cfg: ModelConfig, ep: int) -> list[int]:
    """Elements a rank holds of each gathered block (embedding, layers, head): dense leaves whole,
    expert stacks E/ep experts."""
    blocks = [0] * (cfg.n_layers + 2)  # embedding, layers, final norm and head
    for path, shape in leaf_shapes(cfg):
        head, _, rest = path.partition(".")
        if head == "buffers":
            continue
        i = 0 if head == "embed" else int(rest.partition(".")[0]) + 1 if head == "layers" else cfg.n_layers + 1
        blocks[i] += math.prod(shape) // (ep if path.endswith(("_EDF", "_EFD")) else 1)
    return blocks


def gathered_bytes(run: RunConfig) -> int:
    """Transient full weights in the compute dtype: a layer and the next one, prefetched (all layers
    without resharding, or on one rank where the compute-dtype copies are saved for backward), or
    the embedding or head alone. One fp32 rank gathers nothing."""
    s, blocks = DTYPE_BYTES[run.model.compute_dtype], block_numels(run.model, run.mesh.ep)
    if run.mesh.world == 1:
        return 0 if s == 4 else sum(blocks) * s
    if not run.mesh.reshard_after_forward:
        return (sum(blocks) + max(blocks)) * s
    return max(2 * max(blocks[1:-1]), blocks[0], blocks[-1]) * s


# ---------------------------------------------------------------- the plan

def tokens_per_rank(run: RunConfig) -> int:
    """T: tokens of one micro-batch on one rank."""
    return run.micro_batch * run.data.seq_len


def activation_plan(run: RunConfig) -> dict:
    """Saved activation bytes per rank (device and host), per block and in total, plus the head."""
    cfg, T = run.model, tokens_per_rank(run)
    s = DTYPE_BYTES[cfg.compute_dtype]
    blocks = [block_activations(run, i, T) for i in range(cfg.n_layers)]
    # final norm, the head's input, and the fp32 log-softmax cross-entropy keeps when not chunked
    head = norm_bytes(T, cfg.dim, s) + (T * cfg.vocab_size * 4 if run.train.ce_chunks == 1 else 0)
    device = sum(b["device"] for b in blocks) + head
    # block i's backward (the embedding's after block 0's) runs while block i+1's reduce-scatters
    # read their inputs, the layer's fp32 gradients (fnmoe.parallel.gather); none on one rank
    sends = [n * GRAD_BYTES * (run.mesh.world > 1) for n in block_numels(cfg, run.mesh.ep)[1:-1]] + [0]
    transient = max(max(b["transient"] + sends[i + 1] for i, b in enumerate(blocks)),
                    unsharded_grad_bytes(run) + sends[0])
    return {"blocks": blocks, "device": device, "host": sum(b["host"] for b in blocks), "transient": transient,
            "head": head}


def unsharded_grad_bytes(run: RunConfig) -> int:
    """The largest gathered leaf's gradient before its reduce-scatter, compute dtype and fp32."""
    return largest_leaf(run) * (DTYPE_BYTES[run.model.compute_dtype] + GRAD_BYTES)


def largest_leaf(run: RunConfig, layers: bool = False) -> int:
    """Elements of the largest leaf a rank gathers (expert stacks: its E/ep experts; of the layers'
    only with layers); 0 on one rank."""
    kinds = [(path, shape, _leaf_kind(path)) for path, shape in leaf_shapes(run.model)]
    return 0 if run.mesh.world == 1 else max(math.prod(shape) // (run.mesh.ep if kind == "expert" else 1)
                                             for path, shape, kind in kinds
                                             if kind != "buffer" and (path.startswith("layers.") or not layers))


def logits_bytes(run: RunConfig) -> int:
    """One CE chunk's fp32 log-softmax and, in backward, the two fp32 gradients before it (the
    compute-dtype logits and their fp32 copy are gone by then)."""
    T = tokens_per_rank(run)
    return math.ceil(T / run.train.ce_chunks) * run.model.vocab_size * (4 + 4 + 4)


def ep_buffer_bytes(run: RunConfig) -> int:
    """Backward's all-to-all buffer of one MoE layer on the busiest EP rank: the gradients of the R
    rows its experts received (forward's exchange outputs count as activations: saved, or freed at
    once). Rehearsed at full scale, one such buffer is alive at a time."""
    if run.mesh.ep == 1 or not run.model.moe.n_experts:
        return 0
    T, s = tokens_per_rank(run), DTYPE_BYTES[run.model.compute_dtype]
    return int(T * run.model.moe.top_k * max(run.plan.imbalance, 1.0)) * run.model.dim * s


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
        kind = _leaf_kind(path)
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


def region_flops(run: RunConfig) -> dict:
    """Forward FLOPs per token of every region kind summed over layers: {attention (its GEMMs),
    attention_core (q·k and p·v), moe, mlp}; recompute repeats a region's forward in backward."""
    cfg = run.model
    out = {"attention": 0.0, "attention_core": 0.0, "moe": 0.0, "mlp": 0.0}
    for path, shape in leaf_shapes(cfg):
        parts = path.split(".")
        if parts[0] != "layers" or len(shape) < 2:
            continue
        n = math.prod(shape) * (cfg.moe.top_k / cfg.moe.n_experts if path.endswith(("_EDF", "_EFD")) else 1)
        out["attention" if parts[2] == "attn" else parts[2]] += 2.0 * n
    out["attention_core"] = 1.0 * cfg.n_layers * run.data.seq_len * cfg.n_heads * (cfg.qk_head_dim_ + cfg.v_head_dim_)
    return out


def recompute_flops(run: RunConfig) -> tuple[float, float]:
    """(GEMM, attention-core) FLOPs per token recomputed in backward: every region under full
    recompute, the regions whose policy is 'full' otherwise; selective recompute redoes norms and
    pointwise ops only, which the model counts as free."""
    f, mem = region_flops(run), run.memory
    if mem.recompute == "full":
        return f["attention"] + f["moe"] + f["mlp"], f["attention_core"]
    gemm = sum(f[r] for r in ("attention", "moe", "mlp") if getattr(mem, r) == "full")
    return gemm, f["attention_core"] if mem.attention == "full" else 0.0


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


def step_time(run: RunConfig, fpt: float, comm: dict, host_bytes: int) -> dict:
    """A model, not a measurement: compute at the stated sustained rates (GEMMs, and attention's
    core at its own rate), collectives over the two-level network of plan_net (nvlink_gbps inside a
    node of gpus_per_node, network_gbps across nodes; an all-to-all uses both at once), offload
    copies out and back at the host-link rate, balanced routing. 'overlapped' assumes communication
    and copies hide behind compute, 'serial' that nothing overlaps; 'bound' names the largest term."""
    pl = run.plan
    tokens = tokens_per_rank(run) * run.train.grad_accum
    core = region_flops(run)["attention_core"] * 3  # forward and backward, as in fpt
    re_gemm, re_core = recompute_flops(run)
    gemm_s = tokens * (fpt - core + re_gemm) / (pl.matmul_tflops * 1e12)
    compute = gemm_s + tokens * (core + re_core) / (pl.attention_tflops * 1e12)
    nv, net = pl.nvlink_gbps * GB, pl.network_gbps * GB
    fsdp_intra_s, fsdp_inter_s = comm["fsdp_intra_node"] / nv, comm["fsdp_inter_node"] / net
    ep_intra, ep_inter = ep_link_bytes(run, comm)
    ep_intra_s, ep_inter_s = ep_intra / nv, ep_inter / net
    comm_s = fsdp_intra_s + fsdp_inter_s + max(ep_intra_s, ep_inter_s)
    offload_s = 2 * host_bytes * run.train.grad_accum / (pl.host_link_gbps * GB)
    overlapped, serial = max(compute, comm_s, offload_s), compute + comm_s + offload_s
    terms = {"compute": compute, "fsdp inside node": fsdp_intra_s, "fsdp across nodes": fsdp_inter_s,
             "ep inside node": ep_intra_s, "ep across nodes": ep_inter_s, "host link": offload_s}
    if comm_s >= max(compute, offload_s):
        bound = max(("fsdp inside node", "fsdp across nodes", "ep inside node", "ep across nodes"), key=terms.get)
    else:
        bound = "compute" if compute >= offload_s else "host link"
    return {"model": "stated rates; not measured", "compute_s": compute, "comm_s": comm_s, "offload_s": offload_s,
            "terms_s": terms, "bound": bound, "ep_dispatch": pl.dispatch,
            "step_s_overlapped": overlapped, "step_s_serial": serial,
            "tokens_per_s_per_gpu_overlapped": tokens / overlapped, "tokens_per_s_per_gpu_serial": tokens / serial}


def plan(run: RunConfig) -> dict:
    """Everything `fnmoe plan` reports, as one JSON-ready dict (bytes are per rank)."""
    total, active, fpt = _counts(run.model, run.data.seq_len)
    states, acts = state_bytes(run), activation_plan(run)
    per_rank = dict(states, gathered=gathered_bytes(run), activations=acts["device"],
                    recompute_transient=acts["transient"], logits=logits_bytes(run),
                    ep_buffers=ep_buffer_bytes(run), offload_host=acts["host"])
    step = sum(v for k, v in per_rank.items() if k != "offload_host")
    # the update makes the new optimizer state, the updates and the new params while the old ones,
    # kept until the step is known finite (a non-finite step leaves them bitwise as they were), live
    # Muon also holds the Nesterov blend (fp32) and the bf16 Newton-Schulz iterates of every matrix of
    # the rank at once: 1.5 times the params' bytes more (rehearsed on the 1T and 671B presets)
    per_rank["update_transient"] = states["optim"] + int((3.5 if run.optim.name == "muon" else 2) * states["params"])
    per_rank["total_device"] = max(step, sum(states.values()) + per_rank["update_transient"])
    comm = comm_bytes(run)
    pl = run.plan
    return {"config": run.name, "mesh": {"fsdp": run.mesh.fsdp, "ep": run.mesh.ep, "world": run.mesh.world},
            "tokens_per_rank_microbatch": tokens_per_rank(run), "memory": _policy(run),
            "total_params": total, "active_params": active, "flops_per_token": fpt,
            "per_rank_bytes": per_rank, "comm_bytes_per_step": comm["total"], "comm_bytes_detail": comm,
            "fits": {"device": per_rank["total_device"] <= pl.hbm_gb * GB,
                     "host": per_rank["offload_host"] <= pl.host_gb * GB, "hbm_gb": pl.hbm_gb, "host_gb": pl.host_gb},
            "per_host_offload_bytes": per_rank["offload_host"] * pl.gpus_per_node,
            "step_time": step_time(run, fpt, comm, acts["host"])}


@lru_cache(maxsize=16)
def _counts(cfg: ModelConfig, seq_len: int) -> tuple[int, int, float]:
    """(total params, active params, FLOPs per token), cached for the search's many layouts."""
    from fnmoe.run.metrics import flops_per_token, param_counts

    return (*param_counts(cfg), flops_per_token(cfg, seq_len))


def _policy(run: RunConfig) -> str:
    m = run.memory
    if m.recompute == "full":
        return "full recompute" + (" + offload" if m.offload else "")
    regions = ", ".join(f"{r}={getattr(m, r)}" for r in ("attention", "moe", "mlp"))
    return regions + (" + offload" if m.offload else "")


def format_plan(p: dict) -> str:
    """The human-readable table of `fnmoe plan`."""
    gb = lambda b: f"{b / GB:9.2f} GB"  # noqa: E731
    r, t, c = p["per_rank_bytes"], p["step_time"], p["comm_bytes_detail"]
    terms = ", ".join(f"{k} {v:.2f} s" for k, v in t["terms_s"].items() if v and k not in ("compute", "host link"))
    lines = [f"plan for {p['config']} on fsdp {p['mesh']['fsdp']} x ep {p['mesh']['ep']} ({p['mesh']['world']} ranks), "
             f"{p['tokens_per_rank_microbatch']} tokens a rank a micro-batch; memory: {p['memory']}",
             f"  params {p['total_params']:.4g} total, {p['active_params']:.4g} active; "
             f"{p['flops_per_token'] / 1e9:.1f} GFLOP/token", "", "  per rank (device)"]
    for key in ("params", "grads", "optim", "gathered", "activations", "recompute_transient", "logits", "ep_buffers",
                "update_transient"):
        lines.append(f"    {key:<20}{gb(r[key])}")
    lines += [f"    {'total':<20}{gb(r['total_device'])}   fits {p['fits']['hbm_gb']:.0f} GB: {p['fits']['device']}",
              f"  host, offloaded       {gb(r['offload_host'])} a GPU, {gb(p['per_host_offload_bytes'])} a node; "
              f"fits {p['fits']['host_gb']:.0f} GB a GPU: {p['fits']['host']}",
              f"  communication         {gb(p['comm_bytes_per_step'])} sent a rank a step "
              f"(fsdp {c['fsdp'] / GB:.1f}: {c['fsdp_intra_node'] / GB:.1f} inside a node, "
              f"{c['fsdp_inter_node'] / GB:.1f} across; ep {c['ep'] / GB:.1f}: {c['ep_intra_node'] / GB:.1f} inside, "
              f"{c['ep_inter_node'] / GB:.1f} across)",
              f"  step time (a model, stated rates): compute {t['compute_s']:.2f} s, comm {t['comm_s']:.2f} s "
              f"({terms}), offload {t['offload_s']:.2f} s -> {t['tokens_per_s_per_gpu_overlapped']:,.0f} tok/s/GPU "
              f"overlapped ({t['bound']} bound), {t['tokens_per_s_per_gpu_serial']:,.0f} serial"]
    return "\n".join(lines)
