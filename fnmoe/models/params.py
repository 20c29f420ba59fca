"""The parameter schema and init: every leaf's path, shape and init, drawn chunk by chunk.

Legend: D model, F ffn hidden, E experts, V vocab, N = H·A query features, M = G·A key/value
features (H heads, G kv heads, A head dim); MLA letters (Q, C, W, X, Y) as in attention.py.

Tree (dotted paths): embed.w_VD; layers.<i>.{attn_norm.w_D, attn.{...}, mlp_norm.w_D,
mlp.{w_gate_DF, w_up_DF, w_down_FD} | moe.{w_router_DE, w_gate_EDF, w_up_EDF, w_down_EFD,
shared.{...}}}; final_norm.w_D; head.w_DV (absent when tied); buffers.layers.<i>.moe.router_bias_E
(non-trainable state, present with model.moe.router_bias); extra.* and buffers.extra.* (EXTRA: the
user's own leaves, which the model leaves alone).
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

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from fnmoe.config import ModelConfig, validate_model
from fnmoe.tree import Tree, flatten_dict, map_with_path, tree_map

CHUNK_ROWS = 256
RENAMED = {"router_DE": "w_router_DE"}
"""leaf names of earlier releases -> today's: checkpoints and native trees that use them still load,
and a renamed leaf draws its init under its earlier name, so a seed gives the values it always gave"""
_DRAWN_AS = {new: old for old, new in RENAMED.items()}


def current_path(path: str) -> str:
    """path with an earlier release's leaf name (its last component, RENAMED) replaced by today's."""
    head, _, leaf = path.rpartition(".")
    return f"{head}.{RENAMED[leaf]}" if leaf in RENAMED and head else RENAMED.get(leaf, path)


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
            moe = {"w_router_DE": normal(D, E), "w_gate_EDF": normal(E, D, FE), "w_up_EDF": normal(E, D, FE),
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


@functools.cache
def _cached_config_errors(cfg: ModelConfig) -> tuple[str, ...]:
    return tuple(validate_model(cfg))


# dynamo cannot trace the validation (typing's introspection): a compiled caller such as
# torch.compile(fnmoe.forward) takes its verdict while it traces, as a constant of the config
@torch.compiler.assume_constant_result
def _config_errors(cfg: ModelConfig) -> tuple[str, ...]:
    try:
        return _cached_config_errors(cfg)
    except TypeError:  # unhashable (a list where the schema says tuple): validation names the field
        return tuple(validate_model(cfg))


def check_config(cfg: ModelConfig) -> None:
    """Raise unless cfg is a ModelConfig that validates as the CLI validates it (once per config)."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"the model config must be a fnmoe.ModelConfig, got {type(cfg).__name__}")
    errors = _config_errors(cfg)
    if errors:
        raise ValueError("invalid ModelConfig: " + "; ".join(errors))


@functools.cache
def _cached_leaf_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((p, tuple(i.shape)) for p, i in flatten_dict(leaf_inits(cfg)).items())


# a compiled caller takes them while it traces (dynamo honours the mark on a plain function, and a
# tuple as a constant; through the cache it would trace leaf_inits)
@torch.compiler.assume_constant_result
def _leaf_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return _cached_leaf_shapes(cfg)


def _shapes(tree: dict, prefix: str = "", out: dict | None = None) -> dict[str, tuple[int, ...]]:
    """{dotted path: shape} of a nested dict, walked directly (a pytree flatten with key paths
    costs ~25 ms at 1T scale; this, ~0.3 ms)."""
    out = {} if out is None else out
    for k, v in tree.items():
        if isinstance(v, dict):
            _shapes(v, f"{prefix}{k}.", out)
        else:
            out[f"{prefix}{k}"] = tuple(getattr(v, "shape", ()))
    return out


EXTRA = ("extra.", "buffers.extra.")
"""path prefixes of the user's own leaves beside the model's (adapters, extra heads, frozen tables):
forward and loss_fn accept them and leave them alone; a custom loss (make_train_step's loss=) reads
them. Under `extra` a leaf trains like any other (a gradient, the optimizer's default label by its
path); under `buffers.extra` it is frozen (no gradient, labelled 'frozen', never updated)."""


def check_params(params: Tree, cfg: ModelConfig) -> None:
    """Raise unless params has exactly cfg's leaves with their shapes (global shapes for sharded
    leaves), besides any under EXTRA, naming the missing, extra and mis-shaped ones: a tree of
    another model must not run, least of all a subset of its layers."""
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict tree of tensors (fnmoe.init_params'), got {type(params).__name__}")
    want = dict(_leaf_shapes(cfg))
    have = {p: s for p, s in _shapes(params).items() if not p.startswith(EXTRA)}
    if have == want:
        return
    n = len(want.keys() - have.keys()) + len(have.keys() - want.keys()) + sum(
        have[p] != s for p, s in want.items() if p in have)
    raise ValueError(f"params do not fit the model config ({n} leaves differ): "
                     + "; ".join(shape_mismatches(params, cfg, limit=8, extra=True)) + ("; ..." if n > 8 else ""))


def shape_mismatches(params: Tree, cfg: ModelConfig, limit: int = 4, extra: bool = False) -> list[str]:
    """The first few ways params differ from the leaves of cfg's model: missing, extra, other shapes;
    with extra, leaves under EXTRA are the user's and differ in no way."""
    want = {p: tuple(i.shape) for p, i in flatten_dict(leaf_inits(cfg)).items()}
    have = {p: tuple(t.shape) for p, t in flatten_dict(params).items() if not (extra and p.startswith(EXTRA))}
    out = [f"{p}: missing (expected {list(s)})" for p, s in want.items() if p not in have]
    out += [f"{p}: shape {list(have[p])}, expected {list(s)}" for p, s in want.items() if p in have and have[p] != s]
    hint = " (the user's own leaves go under extra.* or buffers.extra.*)" if extra else ""
    return (out + [f"{p}: not a leaf of this model{hint}" for p in have if p not in want])[:limit]


def _mla_inits(cfg: ModelConfig, normal: Callable, ones: Callable, out_std: float) -> dict:
    D, H, C, P = cfg.dim, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    N, X, Y = H * cfg.qk_head_dim_, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), H * cfg.v_head_dim
    Q = cfg.q_lora_rank
    q = {"w_q_a_DQ": normal(D, Q), "q_a_norm_Q": ones(Q), "w_q_b_QN": normal(Q, N)} if Q else {"w_q_DN": normal(D, N)}
    return q | {"w_kv_a_DW": normal(D, C + P), "kv_a_norm_C": ones(C), "w_kv_b_CX": normal(C, X),
                "w_o_YD": LeafInit((Y, D), out_std)}


def _chunk_generator(seed: int, path: str, chunk: int) -> torch.Generator:
    head, _, leaf = path.rpartition(".")
    path = f"{head}.{_DRAWN_AS[leaf]}" if leaf in _DRAWN_AS else path
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


def init_params(cfg: ModelConfig, seed: int = 0, *, device: str | torch.device = "cpu") -> Tree:
    """fp32 master params for cfg, whole, in one process; device="meta" is abstract. A mesh's shards
    of the same values: fnmoe.parallel.sharding.init_params (fnmoe.init_params, mesh=...)."""
    check_config(cfg)
    inits = leaf_inits(cfg)
    if str(device) == "meta":
        return tree_map(lambda i: torch.empty(i.shape, device="meta"), inits)
    return map_with_path(lambda path, i: draw_leaf(i, seed, path).to(device), inits)
