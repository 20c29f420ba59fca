"""The model as pure functions: forward over a plain params tree.

Legend: B batch, L sequence, D model, F ffn hidden, E experts, V vocab, N = H·A query features,
M = G·A key/value features (H heads, G kv heads, A head dim); MLA letters (Q, C, W, X, Y) as in
attention.py.

The params tree and its init live in fnmoe.models.params. How blocks run (memory policies) and how params
reach compute (cast, or FSDP's gathers) are the caller's choices, passed in (fnmoe.models.seams).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fnmoe import _torch

from fnmoe.models import block_chunks, moe_chunks, transforms
from fnmoe import compile as fcompile
from fnmoe.kernels import attention as cpu_attention
from fnmoe.kernels.bf16 import fp32_gemms
from fnmoe.models.attention import attention, doc_mask, max_logits_H, rms_norm, rope, upcast
from fnmoe.config import ModelConfig
from fnmoe.dtypes import DTYPE
from fnmoe.models.moe import EXPERT_STACKS, expert_gemm, moe_block, swiglu
from fnmoe.models.moe_steps import moe_steps
from fnmoe.models.params import check_config, check_params
from fnmoe.models import routing
from fnmoe.models.routing import Router
from fnmoe.models.seams import CAST, PLAIN, BlockRunner, LayerFeed, ParamsSource
from fnmoe.tree import Tree, flatten_dict


def in_compute_dtype(p: dict, dtype: torch.dtype, keep: tuple[str, ...] = ("router_bias_E",)) -> dict:
    """A region's params in the compute dtype. Compiled regions of one process take the stored
    (fp32) params and cast them here, where inductor fuses the casts into a few kernels and the
    gradients' casts back into the backward graph (one eager op per leaf each way otherwise, a
    noticeable share of a small CPU step); sharded gathers and blocks under offload (memory.Runner.offloads) arrive
    cast. Leaves named in keep stay as stored: the router bias (it only ranks fp32 router scores)
    and, for fnmoe.kernels.gemm, the expert stacks (it casts slices inside its threads)."""
    return {k: v if k in keep or not isinstance(v, (dict, torch.Tensor))
            else in_compute_dtype(v, dtype, keep) if isinstance(v, dict)
            else v.to(dtype) if v.is_floating_point() else v
            for k, v in p.items()}


def attention_region(p, x_BLD, cos_LP, sin_LP, cfg, mask=None):
    p = in_compute_dtype(p, x_BLD.dtype)
    with fp32_gemms(x_BLD):  # each region takes it itself: a region recomputed in backward runs outside its block
        return attention(p, rms_norm(x_BLD, p["norm_D"], cfg.norm_eps), cos_LP, sin_LP, cfg, mask)


def mlp_region(p, x_BLD, cfg):
    p = in_compute_dtype(p, x_BLD.dtype)
    with fp32_gemms(x_BLD):
        return swiglu(p, rms_norm(x_BLD, p["norm_D"], cfg.norm_eps))


def moe_region(p, x_BLD, cfg, gemm, recompute=None, router=None, layer=None):
    """recompute: how backward recomputes the token chunks (BlockRunner.chunk_recompute); router and
    layer (the block's index, for a router that takes it): moe_block's."""
    chunked = None  # the dense path (every expert on every token) takes no chunks
    if cfg.moe.token_chunks > 1 and gemm != "dense":
        chunked = functools.partial(moe_chunks.chunked, recompute=recompute)
    with fp32_gemms(x_BLD):
        return moe_block(*_moe_inputs(p, x_BLD, cfg, gemm), cfg, gemm, chunked, router, layer)


def _moe_inputs(p, x_BLD, cfg, gemm):
    """(the MoE region's params as its GEMM path takes them, its normed input). The router's own
    leaves stay fp32, as the router bias: they act on fp32 router logits."""
    cpu_grouped = gemm == "grouped" and x_BLD.device.type == "cpu"
    p = in_compute_dtype(p, x_BLD.dtype, ("router_bias_E", "router", *(EXPERT_STACKS if cpu_grouped else ())))
    return p, rms_norm(x_BLD, p["norm_D"], cfg.norm_eps)


def block(p: dict, x_BLD: torch.Tensor, cos_LP, sin_LP, cfg: ModelConfig, mask=None,
          runner: BlockRunner = PLAIN, i: int = 0, router: Router | None = None):
    """Block i on compute-dtype params: (x_BLD, the MoE stats of moe_block or None). mask
    (attention.doc_mask's) keeps the documents of packed rows apart; None is plain causal. Each
    region runs through runner.region (its memory policy); router routes the MoE (moe_block's)."""
    run = functools.partial(runner.region, i)
    x_BLD = _attended(p, x_BLD, cos_LP, sin_LP, cfg, mask, runner, i)
    if "moe" in p:
        gemm = expert_gemm(cfg, x_BLD.dtype, x_BLD.device)
        recompute = runner.chunk_recompute(i) if cfg.moe.token_chunks > 1 and gemm != "dense" else None
        if cfg.compile and gemm == "loop":
            fcompile.say_once("compile: the MoE region runs eager (its loop over experts reads counts on "
                              "the host; bfloat16 with 16-byte-aligned dims traces); attention and MLP are compiled")
        elif cfg.compile and recompute:
            fcompile.say_once("compile: the MoE region runs eager (model.moe.token_chunks > 1 under recompute: "
                              "backward recomputes its chunks one by one, which dynamo cannot trace); attention and "
                              "MLP are compiled")
        y_BLD, stats = run("moe", moe_region, cfg.compile and gemm != "loop" and not recompute,
                           dict(p["moe"], norm_D=p["mlp_norm"]["w_D"]), x_BLD, cfg, gemm, recompute, router,
                           _layer(router, i))
        return x_BLD + y_BLD, stats
    return x_BLD + run("mlp", mlp_region, cfg.compile, dict(p["mlp"], norm_D=p["mlp_norm"]["w_D"]), x_BLD, cfg), None


def block_steps(p: dict, x_BLD: torch.Tensor, cos_LP, sin_LP, cfg: ModelConfig, mask=None,
                runner: BlockRunner = PLAIN, i: int = 0, router: Router | None = None, cut: bool = False):
    """block i, a MoE block under expert parallelism, as steps (fnmoe.models.moe_steps.moe_steps: a generator
    that yields while its exchanges travel, returning block's (x_BLD, stats)). For fnmoe.models.block_chunks'
    forward and recompute, where the MoE region's memory policy has nothing to keep of its own. cut:
    the MoE region's graph starts at a leaf of its own and is cut at its exchanges, so that backward
    takes the block in pieces; returns (x_BLD, stats, (the attention's output, that leaf, the
    moe_steps.Split))."""
    x_BLD = _attended(p, x_BLD, cos_LP, sin_LP, cfg, mask, runner, i)
    attended = x_BLD
    if cut:
        x_BLD = x_BLD.detach().requires_grad_(x_BLD.requires_grad)
    gemm = expert_gemm(cfg, x_BLD.dtype, x_BLD.device)
    q, h_BLD = _moe_inputs(dict(p["moe"], norm_D=p["mlp_norm"]["w_D"]), x_BLD, cfg, gemm)
    y_BLD, stats, *split = yield from moe_steps(q, h_BLD, cfg, gemm, router, cfg.compile and gemm != "loop",
                                                _layer(router, i), split=cut)
    return (x_BLD + y_BLD, stats, (attended, x_BLD, *split)) if cut else (x_BLD + y_BLD, stats)


def _layer(router: Router | None, i: int) -> int | None:
    """i for a router that takes layer=, else None: a compiled MoE region given an index it does not
    read would compile again at the second layer (the index turning symbolic)."""
    return i if router is not None and "layer" in routing.router_inputs(router) else None


def _attended(p: dict, x_BLD: torch.Tensor, cos_LP, sin_LP, cfg: ModelConfig, mask, runner: BlockRunner, i: int):
    """x_BLD plus block i's attention (its region run by runner)."""
    attn = dict(p["attn"], norm_D=p["attn_norm"]["w_D"])
    attn_cfg = cpu_attention.resolved(cfg, *x_BLD.shape[:2], x_BLD.dtype, x_BLD.device, mask)
    return x_BLD + runner.region(i, "attention", attention_region, cfg.compile, attn, x_BLD, cos_LP, sin_LP,
                                 attn_cfg, mask)


def check_tokens(tokens_BL: torch.Tensor, vocab_size: int, what: str = "tokens") -> None:
    """Raise unless tokens_BL is a non-empty 2-D integer tensor [batch, seq] of ids in the
    vocabulary, naming the first id outside it. The ids are read only on CPU, where it is free: on
    an accelerator it would sync every step, and the data loader validates ids already. Under
    torch.func's vmap it checks the whole batch (positions count in it)."""
    if not isinstance(tokens_BL, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor of token ids [batch, seq], got {type(tokens_BL).__name__}")
    if tokens_BL.dim() != 2 or tokens_BL.numel() == 0:
        raise ValueError(f"{what} must be a non-empty 2-D tensor [batch, seq], got shape {tuple(tokens_BL.shape)}")
    if tokens_BL.dtype.is_floating_point or tokens_BL.dtype.is_complex or tokens_BL.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor of token ids, got {tokens_BL.dtype}")
    # a traced graph (linearize's, dynamo's) and fake tensors (fnmoe.plan.rehearse's) have no ids to read
    if tokens_BL.device.type != "cpu" or torch.compiler.is_compiling() or _torch.tracing() or _torch.is_fake(tokens_BL):
        return
    tokens_BL = token_ids(_torch.unwrapped(tokens_BL))  # torch compares no uint16/32/64
    bad = (tokens_BL < 0) | (tokens_BL >= vocab_size)
    if bad.any():
        pos = bad.nonzero()[0].tolist()
        raise ValueError(f"token id {tokens_BL[tuple(pos)].item()} at position {pos} is outside "
                         f"0..model.vocab_size-1={vocab_size - 1}")


def token_ids(tokens_BL: torch.Tensor) -> torch.Tensor:
    """Token ids of any integer dtype as the embedding and the loss take them: int32 and int64 as they
    are, the rest (uint8, int16, uint16, ..., as token files store them) as int64."""
    return tokens_BL if tokens_BL.dtype in (torch.int32, torch.int64) else tokens_BL.long()


def check_inputs(params: Tree, tokens_BL: torch.Tensor, cfg: ModelConfig) -> None:
    """The public entry points' checks (forward, loss_fn): no host sync beyond check_tokens' on CPU."""
    check_config(cfg)
    check_params(params, cfg)
    check_tokens(tokens_BL, cfg.vocab_size)


def _router_bias(params: Tree, i: int) -> torch.Tensor | None:
    buffers = params.get("buffers", {}).get("layers", {})
    return buffers[str(i)]["moe"]["router_bias_E"] if str(i) in buffers else None


def _router_state(params: Tree, i: int, leaves: dict | None = None) -> dict:
    """What layer i's router takes beside the layer's params: its bias buffer, and its own leaves
    (leaves[str(i)], from _router_leaves) for a router that takes params=."""
    state = {"router_bias_E": _router_bias(params, i), "router": leaves and leaves.get(str(i))}
    return {k: v for k, v in state.items() if v is not None}


def _with_router_state(p: dict, state: dict) -> dict:
    if not state:  # the router bias and the router's leaves stay fp32: they act on fp32 router scores
        return p
    return dict(p, moe=dict(p["moe"], **state))


def _router_leaves(params: Tree, cfg: ModelConfig, router: Router | None, source: ParamsSource) -> dict | None:
    """{str(i): MoE layer i's extra.router.<i> subtree in fp32} for a router that takes params= (else
    None), taken from the source once a forward (under FSDP one gather; its backward reduce-scatters)."""
    if "params" not in routing.router_inputs(router or routing.ROUTERS[cfg.moe.score_func]):
        return None
    tree = params.get("extra", {}).get("router", {})
    missing = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i) and str(i) not in tree]
    if missing:
        raise ValueError(f"router {routing.router_name(router)} takes params=, its MoE layer's own leaves, from "
                         f"the params tree's extra.router.<layer>: extra.router.{missing[0]} is missing")
    if isinstance(params["embed"]["w_VD"], DTensor):  # on a mesh
        plain = [k for k, t in flatten_dict(tree).items() if not isinstance(t, DTensor)]
        if plain:  # a 0-D leaf stays whole on each rank, so nothing would sum its gradient over ranks
            raise ValueError(f"extra.router.{plain[0]}: on a mesh a router's leaf must be a sharded DTensor (at least "
                             f"one dim: shape [1] for a scalar), so that FSDP sums its gradient over ranks")
    return source(tree, torch.float32)


def layer_params(params: Tree, i: int, dtype: torch.dtype, source: ParamsSource = CAST) -> dict:
    """Layer i's params in the compute dtype, with its router bias (kept fp32) merged in."""
    return _with_router_state(source(params["layers"][str(i)], dtype), _router_state(params, i))


def fed_block(p: dict, x_BLD: torch.Tensor, state: dict, cos_LP, sin_LP, cfg: ModelConfig, mask,
              runner: BlockRunner, i: int, feed: LayerFeed, router: Router | None = None):
    """block on layer i's params as its runner holds them (feed.outside's), its router's state (the
    bias, its own leaves: _router_state) merged in: the feed gives the compute params here, inside the
    runner, so a runner that recomputes in backward takes them again there (under FSDP: gathers them
    again; fnmoe.parallel.fsdp). A runner that chunks the block (BlockRunner.block_chunks) runs it
    over chunks of its sequences on params taken once."""
    with fp32_gemms(x_BLD, not cfg.compile):  # here, inside the runner: a recompute in backward takes it again
        return _fed_block(p, x_BLD, state, cos_LP, sin_LP, cfg, mask, runner, i, feed, router)


def _fed_block(p: dict, x_BLD: torch.Tensor, state: dict, cos_LP, sin_LP, cfg: ModelConfig, mask,
               runner: BlockRunner, i: int, feed: LayerFeed, router: Router | None):
    w = _with_router_state(feed.inside(p, i), state)
    chunking = runner.block_chunks(i)
    if chunking is None:
        return block(w, x_BLD, cos_LP, sin_LP, cfg, mask, runner, i, router)

    def compute(w: dict, x_BLD: torch.Tensor, rows: slice, fn: Callable = block, **kw):
        return fn(w, x_BLD, _rows_of(cos_LP, rows), _rows_of(sin_LP, rows), cfg, _rows_of(mask, rows), runner, i,
                  router, **kw)
    # a MoE block's exchange travels while the other chunk in flight computes
    exchanges = "moe" in w and "ep" in w["moe"] and expert_gemm(cfg, x_BLD.dtype, x_BLD.device) != "dense"
    steps = functools.partial(compute, fn=block_steps) if exchanges else None
    return block_chunks.run(compute, w, x_BLD, chunking, cfg.moe.top_k, steps)


def _rows_of(t, rows: slice):
    """Sequences `rows` of a per-sequence table or mask: RoPE tables of packed rows [B, L, P] and
    masks (a tensor or flex attention's BlockMask) lead with the batch; one table for every row
    [L, P], and no mask, stay as they are."""
    return t[rows] if t is not None and getattr(t, "ndim", 4) > 2 else t


@torch.no_grad()
def _block_max_logits_H(layer: dict, x_BLD: torch.Tensor, cos_LP, sin_LP, cfg: ModelConfig,
                        positions_BL: torch.Tensor | None, source: ParamsSource) -> torch.Tensor:
    """max_logits_H of the attention of a layer (its stored params) on the block input x_BLD (normed
    here, as the block does). The source gives only the leaves it reads: under FSDP the layer's
    expert stacks would be gathered once more for nothing (the block gathers its own)."""
    p = source({"attn": layer["attn"], "attn_norm": layer["attn_norm"]}, DTYPE[cfg.compute_dtype])
    return max_logits_H(p["attn"], rms_norm(x_BLD, p["attn_norm"]["w_D"], cfg.norm_eps), cos_LP, sin_LP, cfg,
                        positions_BL=positions_BL)


def _rope_and_mask(tokens_BL: torch.Tensor, cfg: ModelConfig, positions_BL: torch.Tensor | None):
    """(cos_LP, sin_LP, attention mask or None) of hidden_states' positions."""
    L = tokens_BL.shape[1]
    if L > cfg.max_seq_len:
        raise ValueError(f"sequence length {L} exceeds model.max_seq_len={cfg.max_seq_len}")
    if positions_BL is None:
        return *rope(cfg, torch.arange(L, device=tokens_BL.device)), None
    if positions_BL.shape != tokens_BL.shape:
        raise ValueError(f"positions {tuple(positions_BL.shape)} must have the shape of the tokens "
                         f"{tuple(tokens_BL.shape)}")
    cos_LP, sin_LP = rope(cfg, positions_BL)
    return cos_LP, sin_LP, doc_mask(positions_BL, block_sparse=tokens_BL.is_cuda and cfg.compile
                                    and cfg.attention_impl != "math")


def _aux(stats: list[dict], max_logits: list[torch.Tensor] | None, router_logits: list[torch.Tensor] | None) -> dict:
    """hidden_states' aux from the MoE blocks' stats (and max_logits, router_logits when recorded)."""
    aux = {"expert_counts_NE": None, "balance_loss": None}
    if stats:
        aux = {"expert_counts_NE": torch.stack([s["counts_E"] for s in stats]),
               "probs_sum_NE": torch.stack([s["probs_sum_E"] for s in stats]),
               "dropped_N": torch.stack([s["dropped"] for s in stats])}
        for key in ("balance_loss", "seq_balance_loss", "z_loss"):
            if key in stats[0]:
                aux[key] = torch.stack([s[key] for s in stats]).mean()
    if max_logits is not None:
        aux["max_logits_NH"] = torch.stack(max_logits)
    if router_logits:
        aux["router_logits_NTE"] = torch.stack(router_logits)
    return aux


def hidden_states(params: Tree, tokens_BL: torch.Tensor, cfg: ModelConfig,
                  runner: BlockRunner | None = None, record_max_logits: bool = False,
                  positions_BL: torch.Tensor | None = None, source: ParamsSource = CAST, *,
                  router: Router | None = None, record_router_logits: bool = False, final_norm: bool = True):
    """Final-norm hidden states [B, L, D] in the compute dtype (final_norm False: the last block's
    output, which fnmoe.training.step's loss norms inside each cross-entropy chunk), and aux:
    expert_counts_NE (tokens per expert per MoE layer) and balance_loss (the mean over MoE layers,
    0-D; both None without MoE), plus seq_balance_loss and z_loss (the same means) only when their
    coefficients are set, with record_max_logits max_logits_NH (per layer and head, fp32; MuonClip's
    input), and with record_router_logits router_logits_NTE (per MoE layer, fp32, with their gradients,
    so that a loss of yours may take them: N·T·E·4 bytes and their graph held until aux goes, so off
    by default in training).

    runner (fnmoe.models.seams.BlockRunner; memory.Runner under a memory policy) runs each block and each
    of its regions: recompute in backward, offload, resharding. source (fnmoe.models.seams.ParamsSource)
    gives the params in the compute dtype: CAST in one process, fnmoe.parallel.fsdp.GATHER for
    sharded params. Under torch.func's transforms it runs the paths fnmoe.models.transforms picks.
    positions_BL marks packed documents (positions restart at 0 where one starts): RoPE uses them
    and attention stays within each document; None is one sequence per row. router
    (fnmoe.models.routing.Router) routes every MoE layer; None: the built-in of model.moe.score_func.
    """
    cfg = transforms.model_config(cfg)
    transforms.check_transformable(params["embed"]["w_VD"])
    dtype = DTYPE[cfg.compute_dtype]
    cos_LP, sin_LP, mask = _rope_and_mask(tokens_BL, cfg, positions_BL)
    leaves = _router_leaves(params, cfg, router, source)  # checked before any other gather is in flight
    # F.embedding's CPU backward is deterministic; indexing's (a threaded index_put) is not
    x_BLD = F.embedding(token_ids(tokens_BL), source(params["embed"], dtype)["w_VD"])
    runner = runner or PLAIN
    layers = [params["layers"][str(i)] for i in range(cfg.n_layers)]
    feed = source.layers(layers, dtype, cast_inside=cfg.compile and not runner.offloads)
    stats, max_logits, router_logits = [], [], []
    for i in range(cfg.n_layers):
        p, state = feed.outside(i), _router_state(params, i, leaves)
        if record_max_logits:  # outside the runner, so recompute in backward does not repeat it
            max_logits.append(_block_max_logits_H(layers[i], x_BLD, cos_LP, sin_LP, cfg, positions_BL, source))
        x_BLD, layer_stats = runner(i, fed_block, p, x_BLD, state, cos_LP, sin_LP, cfg, mask, runner, i, feed,
                                    router)
        if layer_stats is not None:
            logits_TE = layer_stats.pop("router_logits_TE")  # let go at once unless recorded
            if record_router_logits:
                router_logits.append(logits_TE)
            stats.append(layer_stats)
    if final_norm:
        x_BLD = rms_norm(x_BLD, final_norm_weight(params, cfg, source), cfg.norm_eps)
    return x_BLD, _aux(stats, max_logits if record_max_logits else None, router_logits)


def final_norm_weight(params: Tree, cfg: ModelConfig, source: ParamsSource = CAST) -> torch.Tensor:
    """[D] weight of the final norm, in the compute dtype."""
    return source(params["final_norm"], DTYPE[cfg.compute_dtype])["w_D"]


def head_weight(params: Tree, cfg: ModelConfig, source: ParamsSource = CAST) -> torch.Tensor:
    """[D, V] output projection (the embedding's transpose when tied), in the compute dtype."""
    dtype = DTYPE[cfg.compute_dtype]
    return source(params["embed"], dtype)["w_VD"].T if cfg.tie_embeddings else source(params["head"], dtype)["w_DV"]


def forward(params: Tree, tokens_BL: torch.Tensor, cfg: ModelConfig, positions_BL: torch.Tensor | None = None,
            source: ParamsSource = CAST, *, runner: BlockRunner | None = None, router: Router | None = None,
            record_router_logits: bool = False):
    """(logits_BLV fp32, aux): aux["expert_counts_NE"] holds tokens per expert per MoE layer, with
    record_router_logits aux["router_logits_NTE"] the router logits (see hidden_states); positions_BL
    marks packed documents; source: how params reach compute (CAST; fnmoe.parallel.fsdp.params_source(params)
    for sharded ones); runner: how blocks run (fnmoe.models.seams.BlockRunner, default PLAIN); router: how MoE
    layers route (fnmoe.models.routing.Router, default by model.moe.score_func). Its inputs are checked first:
    cfg as the CLI validates it, params against cfg's leaves and shapes, tokens (check_tokens)."""
    check_inputs(params, tokens_BL, cfg)
    h_BLD, aux = hidden_states(params, tokens_BL, cfg, runner, positions_BL=positions_BL, source=source,
                               router=router, record_router_logits=record_router_logits)
    with fp32_gemms(h_BLD):
        return upcast(h_BLD @ head_weight(params, cfg, source).to(h_BLD.dtype)), aux
