"""Sampling with a KV cache: greedy, temperature and top-p (`fnmoe generate`).

Legend: B batch, L new positions this call, S cached positions (keys), D model, V vocab,
H heads, G kv heads (MLA: G = H), A head dim of keys, U of values.

The cache holds each layer's rotated keys and values; MLA caches its per-head keys (the shared
RoPE key broadcast) and values, so decoding reuses the training attention's projections as they
are. A prompt is one call over all its positions; each new token is one call of L = 1.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from fnmoe.models.attention import gqa_qk, mla_qkv, mla_softmax_scale, rms_norm, rope
from fnmoe.config import ModelConfig
from fnmoe.dtypes import DTYPE
from fnmoe.models.transformer import mlp_region, moe_region, check_inputs, head_weight, layer_params, token_ids
from fnmoe.models.moe import expert_gemm
from fnmoe.tree import Tree, flatten_dict


def _qkv(p: dict, x_BLD: torch.Tensor, cos_LP, sin_LP, cfg: ModelConfig):
    """(q [B, L, H, A], k [B, L, G, A], v [B, L, G, U], softmax scale) of cfg's attention."""
    if cfg.attention == "mla":
        return *mla_qkv(p, x_BLD, cos_LP, sin_LP, cfg), mla_softmax_scale(cfg)
    q_BLHA, k_BLGA = gqa_qk(p, x_BLD, cos_LP, sin_LP, cfg)
    B, L, _ = x_BLD.shape
    return q_BLHA, k_BLGA, (x_BLD @ p["w_v_DM"]).view(B, L, cfg.n_kv_heads, cfg.head_dim_), None


def init_cache(cfg: ModelConfig, B: int, max_len: int, device="cpu") -> dict:
    """Empty per-layer key/value buffers for max_len positions, in the compute dtype."""
    dtype = DTYPE[cfg.compute_dtype]
    if cfg.attention == "mla":
        G, A, U = cfg.n_heads, cfg.qk_head_dim_, cfg.v_head_dim
    else:
        G, A, U = cfg.n_kv_heads, cfg.head_dim_, cfg.head_dim_
    return {"len": 0, "layers": [
        {"k_BSGA": torch.zeros(B, max_len, G, A, dtype=dtype, device=device),
         "v_BSGU": torch.zeros(B, max_len, G, U, dtype=dtype, device=device)} for _ in range(cfg.n_layers)]}


def _cached_attention(p: dict, x_BLD, cos_LP, sin_LP, layer: dict, start: int, cfg: ModelConfig):
    q_BLHA, k_BLGA, v_BLGU, scale = _qkv(p, x_BLD, cos_LP, sin_LP, cfg)
    L = x_BLD.shape[1]
    layer["k_BSGA"][:, start:start + L] = k_BLGA
    layer["v_BSGU"][:, start:start + L] = v_BLGU
    S = start + L
    k_BGSA, v_BGSU = layer["k_BSGA"][:, :S].transpose(1, 2), layer["v_BSGU"][:, :S].transpose(1, 2)
    # query at position start + i sees keys 0 .. start + i
    mask_LS = torch.arange(S, device=x_BLD.device)[None, :] <= start + torch.arange(L, device=x_BLD.device)[:, None]
    H, G = q_BLHA.shape[2], k_BGSA.shape[1]
    o_BHLU = torch.nn.functional.scaled_dot_product_attention(
        q_BLHA.transpose(1, 2), k_BGSA, v_BGSU, attn_mask=mask_LS, scale=scale, enable_gqa=H != G)
    w_o = p["w_o_YD"] if "w_o_YD" in p else p["w_o_ND"]
    return o_BHLU.transpose(1, 2).reshape(*x_BLD.shape[:2], -1) @ w_o


@torch.no_grad()
def step_logits(params: Tree, tokens_BL: torch.Tensor, cache: dict, cfg: ModelConfig) -> torch.Tensor:
    """fp32 logits [B, L, V] of tokens_BL placed after the cached positions; extends the cache."""
    dtype, start = DTYPE[cfg.compute_dtype], cache["len"]
    L = tokens_BL.shape[1]
    if start + L > cache["layers"][0]["k_BSGA"].shape[1]:
        raise ValueError(f"generation needs {start + L} positions; the cache holds "
                         f"{cache['layers'][0]['k_BSGA'].shape[1]}")
    cos_LP, sin_LP = rope(cfg, torch.arange(start, start + L, device=tokens_BL.device))
    unchunked = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, token_chunks=1))
    x_BLD = torch.nn.functional.embedding(token_ids(tokens_BL), params["embed"]["w_VD"].to(dtype))
    for i, layer in enumerate(cache["layers"]):
        p = layer_params(params, i, dtype)
        attn = dict(p["attn"], norm_D=p["attn_norm"]["w_D"])
        x_BLD = x_BLD + _cached_attention(attn, rms_norm(x_BLD, attn["norm_D"], cfg.norm_eps),
                                          cos_LP, sin_LP, layer, start, cfg)
        if "moe" in p:  # a decode step's few tokens take no token chunks (training's memory knob)
            y_BLD, _ = moe_region(dict(p["moe"], norm_D=p["mlp_norm"]["w_D"]), x_BLD, unchunked,
                                  expert_gemm(cfg, dtype, x_BLD.device))
        else:
            y_BLD = mlp_region(dict(p["mlp"], norm_D=p["mlp_norm"]["w_D"]), x_BLD, cfg)
        x_BLD = x_BLD + y_BLD
    cache["len"] = start + L
    h_BLD = rms_norm(x_BLD, params["final_norm"]["w_D"].to(dtype), cfg.norm_eps)
    return (h_BLD @ head_weight(params, cfg).to(dtype)).float()


def sample(logits_BV: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Next tokens [B]: argmax at temperature 0, else from the smallest set of tokens whose
    probability reaches top_p (nucleus sampling)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if not 0 < top_p:  # nan fails too
        raise ValueError(f"top_p must be > 0 (1: no nucleus cut), got {top_p}")
    if temperature == 0:
        return logits_BV.argmax(-1)
    # the top logit shifted to 0 first: a tiny temperature sends the others to -inf, never the top to inf
    probs_BV = torch.softmax((logits_BV - logits_BV.amax(-1, keepdim=True)).double() / temperature, dim=-1)
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    # keep a token while the mass before it is below top_p; the top token always stays
    keep_BV = (sorted_BV.cumsum(-1) - sorted_BV) < top_p
    keep_BV[:, 0] = True
    sorted_BV = sorted_BV * keep_BV
    choice_B1 = torch.multinomial(sorted_BV / sorted_BV.sum(-1, keepdim=True), 1, generator=gen)
    return order_BV.gather(-1, choice_B1).squeeze(-1)


def generate(params: Tree, prompt_BL: torch.Tensor, cfg: ModelConfig, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, stop_id: int | None = None) -> torch.Tensor:
    """prompt_BL followed by up to max_new_tokens sampled tokens [B, L + new] (stops early when
    every row has produced stop_id). params are checked first: cfg's leaves and shapes, finite values."""
    check_inputs(params, prompt_BL, cfg)
    broken = [path for path, t in flatten_dict(params).items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if broken:
        raise ValueError(f"the model's weights hold non-finite values (NaN or inf) in {len(broken)} leaves, e.g. "
                         f"{broken[:3]}: they cannot generate text (a diverged run, or a damaged file)")
    B, L = prompt_BL.shape
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if L + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt ({L}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"model.max_seq_len={cfg.max_seq_len}")
    prompt_BL = token_ids(prompt_BL)  # any integer dtype in, int32 or int64 ids out
    gen = torch.Generator(device=prompt_BL.device).manual_seed(seed)
    cache = init_cache(cfg, B, L + max_new_tokens, prompt_BL.device)
    logits_BLV = step_logits(params, prompt_BL, cache, cfg)
    out, done_B = [prompt_BL], torch.zeros(B, dtype=torch.bool, device=prompt_BL.device)
    for i in range(max_new_tokens):
        next_B = sample(logits_BLV[:, -1], temperature, top_p, gen)
        out.append(next_B[:, None])
        if stop_id is not None:
            done_B |= next_B == stop_id
        if i == max_new_tokens - 1 or done_B.all():
            break
        logits_BLV = step_logits(params, next_B[:, None], cache, cfg)
    return torch.cat(out, dim=1)
