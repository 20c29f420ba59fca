"""The model as pure functions: init_params and forward over a plain params tree.

Legend: B batch, L sequence, D model, F ffn hidden, E experts, V vocab, N = H·A query features,
M = G·A key/value features (H heads, G kv heads, A head dim); MLA letters (Q, C, W, X, Y) as in
attention.py.

Tree (dotted paths): embed.w_VD; layers.<i>.{attn_norm.w_D, attn.{...}, mlp_norm.w_D,
mlp.{w_gate_DF, w_up_DF, w_down_FD} | moe.{router_DE, w_gate_EDF, w_up_EDF, w_down_EFD,
shared.{...}}}; final_norm.w_D; head.w_DV (absent when tied); buffers.layers.<i>.moe.router_bias_E
(non-trainable state, present with model.moe.router_bias).
attn is GQA {w_q_DN, w_k_DM, w_v_DM, w_o_ND, q_norm_A, k_norm_A} or MLA {w_q_DN | (w_q_a_DQ,
q_a_norm_Q, w_q_b_QN), w_kv_a_DW, kv_a_norm_C, w_kv_b_CX, w_o_YD}.

Init scheme "depth-scaled normal" (GPT-2 / Megatron): every matrix ~ N(0, init_std²), except the
projections that write into the residual stream (w_o, w_down) use init_std / sqrt(2·n_layers) so
the residual variance stays O(1) with depth; norms are ones. A leaf's values are a function of
(seed, path, chunk index) where chunks are fixed independently of any mesh (one expert of an
expert stack; blocks of CHUNK_ROWS rows otherwise), so any rank draws only the chunks its shard
overlaps and never materialises a whole large leaf.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fnmoe import compile as fcompile
from fnmoe import cpu_attention
from fnmoe import reshard
from fnmoe.attention import attention, doc_mask, max_logits_H, rms_norm, rope, upcast
from fnmoe.config import ModelConfig
from fnmoe.moe import EXPERT_STACKS, expert_gemm, moe_block, swiglu
from fnmoe.tree import Tree, flatten_dict, map_with_path, tree_map, unflatten_dict

CHUNK_ROWS = 256
DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class LeafInit:
    shape: tuple[int, ...]
    std: float  # 0 means the constant `value`
    value: float = 1.0  # 1 for norm weights, 0 for the router bias

    @property
    def chunk_rows(self) -> int:
        return 1 if len(self.shape) == 3 else CHUNK_ROWS


def leaf_inits(cfg: ModelConfig) -> Tree:
    """The abstract tree: every leaf's shape and init, no memory allocated."""
    D, V, F, A = cfg.dim, cfg.vocab_size, cfg.ffn_hidden, cfg.head_dim_
    N, M = cfg.n_heads * A, cfg.n_kv_heads * A
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    ones = lambda *s: LeafInit(s, 0.0)  # noqa: E731
    normal = lambda *s: LeafInit(s, std)  # noqa: E731

    def mlp(hidden: int) -> dict:
        return {"w_gate_DF": normal(D, hidden), "w_up_DF": normal(D, hidden),
                "w_down_FD": LeafInit((hidden, D), out_std)}

    layers, buffers = {}, {}
    for i in range(cfg.n_layers):
        attn = _mla_inits(cfg, normal, ones, out_std) if cfg.attention == "mla" else {
            "w_q_DN": normal(D, N), "w_k_DM": normal(D, M), "w_v_DM": normal(D, M),
            "w_o_ND": LeafInit((N, D), out_std)}
        if cfg.qk_norm:
            attn |= {"q_norm_A": ones(A), "k_norm_A": ones(A)}
        layer = {"attn_norm": {"w_D": ones(D)}, "attn": attn, "mlp_norm": {"w_D": ones(D)}}
        if cfg.is_moe_layer(i):
            m = cfg.moe
            E, FE = m.n_experts, m.expert_hidden
            moe = {"router_DE": normal(D, E), "w_gate_EDF": normal(E, D, FE), "w_up_EDF": normal(E, D, FE),
                   "w_down_EFD": LeafInit((E, FE, D), out_std)}
            if m.n_shared_experts:
                moe["shared"] = mlp(m.n_shared_experts * FE)
            layer["moe"] = moe
            if m.router_bias:
                buffers[str(i)] = {"moe": {"router_bias_E": LeafInit((E,), 0.0, 0.0)}}
        else:
            layer["mlp"] = mlp(F)
        layers[str(i)] = layer
    tree = {"embed": {"w_VD": normal(V, D)}, "layers": layers, "final_norm": {"w_D": ones(D)}}
    if not cfg.tie_embeddings:
        tree["head"] = {"w_DV": normal(D, V)}
    if buffers:
        tree["buffers"] = {"layers": buffers}
    return tree


def shape_mismatches(params: Tree, cfg: ModelConfig, limit: int = 4) -> list[str]:
    """The first few ways params differ from the leaves of cfg's model: missing, extra, other shapes."""
    want = {p: tuple(i.shape) for p, i in flatten_dict(leaf_inits(cfg)).items()}
    have = {p: tuple(t.shape) for p, t in flatten_dict(params).items()}
    out = [f"{p}: missing (expected {list(s)})" for p, s in want.items() if p not in have]
    out += [f"{p}: shape {list(have[p])}, expected {list(s)}" for p, s in want.items() if p in have and have[p] != s]
    return (out + [f"{p}: not a leaf of this model" for p in have if p not in want])[:limit]


def _mla_inits(cfg: ModelConfig, normal: Callable, ones: Callable, out_std: float) -> dict:
    D, H, C, P = cfg.dim, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    N, X, Y = H * cfg.qk_head_dim_, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), H * cfg.v_head_dim
    Q = cfg.q_lora_rank
    q = {"w_q_a_DQ": normal(D, Q), "q_a_norm_Q": ones(Q), "w_q_b_QN": normal(Q, N)} if Q else {"w_q_DN": normal(D, N)}
    return q | {"w_kv_a_DW": normal(D, C + P), "kv_a_norm_C": ones(C), "w_kv_b_CX": normal(C, X),
                "w_o_YD": LeafInit((Y, D), out_std)}


def _chunk_generator(seed: int, path: str, chunk: int) -> torch.Generator:
    digest = hashlib.sha256(f"fnmoe/{seed}/{path}/{chunk}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def draw_leaf(init: LeafInit, seed: int, path: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
    """init's values at index (one slice per leading dim; missing dims are whole), fp32 on CPU.

    Only the chunks that overlap index[0] are drawn; the result is exactly that slice of the
    full leaf whatever the slicing.
    """
    index = tuple(index) + (slice(None),) * (len(init.shape) - len(index))
    rows = range(*index[0].indices(init.shape[0]))
    if index[0].indices(init.shape[0])[2] != 1:
        raise ValueError(f"draw_leaf({path}): only unit-step row slices are supported")
    out_shape = [len(range(*s.indices(n))) for s, n in zip(index, init.shape)]
    if init.std == 0.0:
        return torch.full(out_shape, init.value)
    out = torch.empty(out_shape)
    cr = init.chunk_rows
    if not rows:
        return out
    for c in range(rows.start // cr, (rows.stop - 1) // cr + 1):
        lo, hi = c * cr, min((c + 1) * cr, init.shape[0])
        block = torch.randn((hi - lo, *init.shape[1:]), generator=_chunk_generator(seed, path, c))
        a, b = max(lo, rows.start), min(hi, rows.stop)
        out[a - rows.start:b - rows.start] = block[(slice(a - lo, b - lo), *index[1:])]
        del block
    return out.mul_(init.std)


def init_params(cfg: ModelConfig, seed: int = 0, *, device: str | torch.device = "cpu",
                mesh=None) -> Tree:
    """fp32 master params for cfg, the same values for a seed on any mesh; device="meta" is abstract."""
    if mesh is not None:  # this rank's shards (DTensor leaves), drawn chunk by chunk
        from fnmoe.sharding import init_params as init_sharded  # sharding builds on this module
        return init_sharded(cfg, seed, mesh)
    inits = leaf_inits(cfg)
    if str(device) == "meta":
        return tree_map(lambda i: torch.empty(i.shape, device="meta"), inits)
    return map_with_path(lambda path, i: draw_leaf(i, seed, path).to(device), inits)


# ---------------------------------------------------------------- forward

def in_compute_dtype(p: dict, dtype: torch.dtype, keep: tuple[str, ...] = ("router_bias_E",)) -> dict:
    """A region's params in the compute dtype. Compiled regions of one process take the stored
    (fp32) params and cast them here, where inductor fuses the casts into a few kernels and the
    gradients' casts back into the backward graph (one eager op per leaf each way otherwise, ~10%
    of a small CPU step); sharded gathers and blocks under offload (memory.Runner.offloads) arrive
    cast. Leaves named in keep stay as stored: the router bias (it only ranks fp32 router scores)
    and, for fnmoe.cpu_gemm, the expert stacks (it casts slices inside its threads)."""
    return {k: v if k in keep or not isinstance(v, (dict, torch.Tensor))
            else in_compute_dtype(v, dtype, keep) if isinstance(v, dict) else v.to(dtype) if v.is_floating_point() else v
            for k, v in p.items()}


def _attention_region(p, x_BLD, cos_LA, sin_LA, cfg, mask=None):
    p = in_compute_dtype(p, x_BLD.dtype)
    return attention(p, rms_norm(x_BLD, p["norm_D"], cfg.norm_eps), cos_LA, sin_LA, cfg, mask)


def _mlp_region(p, x_BLD, cfg):
    p = in_compute_dtype(p, x_BLD.dtype)
    return swiglu(p, rms_norm(x_BLD, p["norm_D"], cfg.norm_eps))


def _moe_region(p, x_BLD, cfg, gemm):
    cpu_grouped = gemm == "grouped" and x_BLD.device.type == "cpu"
    p = in_compute_dtype(p, x_BLD.dtype, ("router_bias_E", *(EXPERT_STACKS if cpu_grouped else ())))
    return moe_block(p, rms_norm(x_BLD, p["norm_D"], cfg.norm_eps), cfg, gemm)


def _plain_region(name: str, fn: Callable, compile: bool, *args):
    return (fcompile.compiled(fn) if compile else fn)(*args)


def block(p: dict, x_BLD: torch.Tensor, cos_LA, sin_LA, cfg: ModelConfig, mask=None, region_fn=None):
    """One transformer block on compute-dtype params: (x_BLD, the MoE stats of moe_block or None).
    mask (attention.doc_mask's) keeps the documents of packed rows apart; None is plain causal.
    region_fn(name, fn, compile, *args) runs each region (memory policies per region)."""
    run = region_fn or _plain_region
    attn = dict(p["attn"], norm_D=p["attn_norm"]["w_D"])
    attn_cfg = cpu_attention.resolved(cfg, *x_BLD.shape[:2], x_BLD.dtype, x_BLD.device, mask)
    x_BLD = x_BLD + run("attention", _attention_region, cfg.compile, attn, x_BLD, cos_LA, sin_LA, attn_cfg, mask)
    if "moe" in p:
        gemm = expert_gemm(cfg, x_BLD.dtype, x_BLD.device)
        if cfg.compile and gemm == "loop":
            fcompile.say_once("compile: the MoE region runs eager (its loop over experts reads counts on "
                              "the host; bfloat16 with 16-byte-aligned dims traces); attention and MLP are compiled")
        y_BLD, stats = run("moe", _moe_region, cfg.compile and gemm != "loop",
                           dict(p["moe"], norm_D=p["mlp_norm"]["w_D"]), x_BLD, cfg, gemm)
        return x_BLD + y_BLD, stats
    return x_BLD + run("mlp", _mlp_region, cfg.compile, dict(p["mlp"], norm_D=p["mlp_norm"]["w_D"]), x_BLD, cfg), None


def check_tokens(tokens_BL: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError naming the first id outside the vocabulary. Only on CPU, where it is free:
    on an accelerator it would sync every step, and the data loader validates ids already."""
    if tokens_BL.device.type != "cpu":
        return
    bad = (tokens_BL < 0) | (tokens_BL >= vocab_size)
    if bad.any():
        pos = bad.nonzero()[0].tolist()
        raise ValueError(f"token id {tokens_BL[tuple(pos)].item()} at position {pos} is outside "
                         f"0..model.vocab_size-1={vocab_size - 1}")


def cast(tree: Tree, dtype: torch.dtype) -> Tree:
    """The gather of one process: every leaf in the compute dtype."""
    return tree_map(lambda t: t.to(dtype), tree)


def gather_fn(params: Tree) -> Callable:
    """How params reach compute: `cast` for plain leaves; sharded (DTensor) leaves are gathered
    one block at a time by fnmoe.sharding.gather."""
    if isinstance(params["embed"]["w_VD"], DTensor):
        from fnmoe.sharding import gather  # sharding builds on this module, so imported when used
        return gather
    return cast


def _router_bias(params: Tree, i: int) -> torch.Tensor | None:
    buffers = params.get("buffers", {}).get("layers", {})
    return buffers[str(i)]["moe"]["router_bias_E"] if str(i) in buffers else None


def _with_bias(p: dict, bias_E: torch.Tensor | None) -> dict:
    if bias_E is not None:  # the router bias stays fp32: it only ranks fp32 router scores
        p["moe"] = dict(p["moe"], router_bias_E=bias_E)
    return p


def layer_params(params: Tree, i: int, dtype: torch.dtype) -> dict:
    """Layer i's params in the compute dtype, with its router bias (kept fp32) merged in."""
    return _with_bias(gather_fn(params)(params["layers"][str(i)], dtype), _router_bias(params, i))


def stored_block(stored: dict, bias_E, x_BLD: torch.Tensor, cos_LA, sin_LA, cfg: ModelConfig, gather: Callable,
                 mask=None, region_fn=None):
    """block on a layer's stored (sharded) params, gathered here: a block_fn that recomputes in
    backward gathers them again there, and resharding (fnmoe.reshard) regathers what backward needs."""
    dtype = DTYPE[cfg.compute_dtype]
    p = gather(stored, dtype)
    reshard.track(p, stored, lambda path, leaf: flatten_dict(gather(unflatten_dict({path: leaf}), dtype))[path])
    return block(_with_bias(p, bias_E), x_BLD, cos_LA, sin_LA, cfg, mask, region_fn)


class _Prefetching:
    """stored_block's gather with one block of lookahead: `issue` starts gathering a layer's params
    before the previous block computes (collectives are asynchronous, so they overlap it) and that
    layer's block takes the result once; any later call (backward's) gathers anew."""

    def __init__(self, gather: Callable, dtype: torch.dtype):
        self.gather, self.dtype, self.ready = gather, dtype, {}

    def issue(self, stored: dict) -> None:
        self.ready[id(stored)] = self.gather(stored, self.dtype)

    def __call__(self, stored: dict, dtype: torch.dtype):
        got = self.ready.pop(id(stored), None)
        return got if got is not None and dtype == self.dtype else self.gather(stored, dtype)


@torch.no_grad()
def _block_max_logits_H(p: dict, x_BLD: torch.Tensor, cos_LA, sin_LA, cfg: ModelConfig,
                        positions_BL: torch.Tensor | None) -> torch.Tensor:
    """max_logits_H of block p's attention on the block input x_BLD (normed here, as the block does)."""
    return max_logits_H(p["attn"], rms_norm(x_BLD, p["attn_norm"]["w_D"], cfg.norm_eps), cos_LA, sin_LA, cfg,
                        positions_BL=positions_BL)


def hidden_states(params: Tree, tokens_BL: torch.Tensor, cfg: ModelConfig,
                  block_fn: Callable | None = None, record_max_logits: bool = False,
                  positions_BL: torch.Tensor | None = None):
    """Final-norm hidden states [B, L, D] in the compute dtype, and aux: expert_counts_LE (tokens
    per expert per MoE layer) and balance_loss (the mean over MoE layers, 0-D; both None without
    MoE), plus seq_balance_loss and z_loss (the same means) only when their coefficients are set,
    and with record_max_logits max_logits_LH (per layer and head, fp32; MuonClip's input).

    block_fn(fn, *args) runs a block (memory policies wrap it, e.g. recompute in backward); a
    block_fn with a `region` method (memory.Runner) also runs each region under its own policy.
    positions_BL marks packed documents (positions restart at 0 where one starts): RoPE uses them
    and attention stays within each document; None is one sequence per row.
    """
    dtype = DTYPE[cfg.compute_dtype]
    L = tokens_BL.shape[1]
    if L > cfg.max_seq_len:
        raise ValueError(f"sequence length {L} exceeds model.max_seq_len={cfg.max_seq_len}")
    if positions_BL is None:
        cos_LA, sin_LA, mask = *rope(cfg, torch.arange(L, device=tokens_BL.device)), None
    else:
        if positions_BL.shape != tokens_BL.shape:
            raise ValueError(f"positions {tuple(positions_BL.shape)} must have the shape of the tokens "
                             f"{tuple(tokens_BL.shape)}")
        cos_LA, sin_LA = rope(cfg, positions_BL)
        mask = doc_mask(positions_BL, block_sparse=tokens_BL.is_cuda and cfg.compile)
    gather = gather_fn(params)
    # F.embedding's CPU backward is deterministic; indexing's (a threaded index_put) is not
    x_BLD = F.embedding(tokens_BL, gather(params["embed"], dtype)["w_VD"])
    stats, max_logits = [], []
    run = block_fn or (lambda fn, *a: fn(*a))
    region_fn = getattr(block_fn, "region", None)
    block_gather = gather
    cast_inside = cfg.compile and not getattr(block_fn, "offloads", False)
    if gather is not cast and getattr(block_fn, "prefetch", True):
        block_gather = _Prefetching(gather, dtype)
        block_gather.issue(params["layers"]["0"])
    for i in range(cfg.n_layers):
        stored, bias_E = params["layers"][str(i)], _router_bias(params, i)
        if isinstance(block_gather, _Prefetching) and i + 1 < cfg.n_layers:
            block_gather.issue(params["layers"][str(i + 1)])  # block i+1's gather runs while block i computes
        if gather is cast:  # one process: compiled regions cast their params inside (in_compute_dtype)
            p = _with_bias(dict(stored) if cast_inside else cast(stored, dtype), bias_E)
            block_args = (block, p, x_BLD, cos_LA, sin_LA, cfg, mask, region_fn)
        else:  # sharded: gathered inside the block, so that a recompute in backward gathers again
            block_args = (stored_block, stored, bias_E, x_BLD, cos_LA, sin_LA, cfg, block_gather, mask, region_fn)
        if record_max_logits:  # outside block_fn, so recompute in backward does not repeat it
            with torch.no_grad():
                p = _with_bias(gather(stored, dtype), bias_E)
            max_logits.append(_block_max_logits_H(p, x_BLD, cos_LA, sin_LA, cfg, positions_BL))
        x_BLD, layer_stats = run(*block_args)
        if layer_stats is not None:
            stats.append(layer_stats)
    x_BLD = rms_norm(x_BLD, gather(params["final_norm"], dtype)["w_D"], cfg.norm_eps)
    aux = {"expert_counts_LE": None, "balance_loss": None}
    if stats:
        aux = {"expert_counts_LE": torch.stack([s["counts_E"] for s in stats]),
               "probs_sum_LE": torch.stack([s["probs_sum_E"] for s in stats]),
               "dropped_L": torch.stack([s["dropped"] for s in stats])}
        for key in ("balance_loss", "seq_balance_loss", "z_loss"):
            if key in stats[0]:
                aux[key] = torch.stack([s[key] for s in stats]).mean()
    if record_max_logits:
        aux["max_logits_LH"] = torch.stack(max_logits)
    return x_BLD, aux


def head_weight(params: Tree, cfg: ModelConfig) -> torch.Tensor:
    """[D, V] output projection (the embedding's transpose when tied), in the compute dtype."""
    dtype, gather = DTYPE[cfg.compute_dtype], gather_fn(params)
    return gather(params["embed"], dtype)["w_VD"].T if cfg.tie_embeddings else gather(params["head"], dtype)["w_DV"]


def forward(params: Tree, tokens_BL: torch.Tensor, cfg: ModelConfig, positions_BL: torch.Tensor | None = None):
    """(logits_BLV fp32, aux): aux["expert_counts_LE"] holds tokens per expert per MoE layer;
    positions_BL marks packed documents (see hidden_states)."""
    check_tokens(tokens_BL, cfg.vocab_size)
    h_BLD, aux = hidden_states(params, tokens_BL, cfg, positions_BL=positions_BL)
    return upcast(h_BLD @ head_weight(params, cfg).to(h_BLD.dtype)), aux
