"""Attention: RoPE (half-split or interleaved, optionally YaRN-scaled), GQA (optional per-head
q/k RMSNorm) and MLA (DeepSeek's multi-head latent attention), all through SDPA or, for short bf16
rows on CPU, fnmoe.kernels.attention's kernel; packed rows of several documents attend only within a
document (see doc_mask).

Legend: B batch, L sequence (K key positions), D model, H heads, G kv heads, A head dim, N = H·A, M = G·A,
R = H/G query heads per kv head, S query positions of one chunk.
MLA: J no-RoPE and P RoPE dims of a query/key head, I = J + P, U value head dim, C kv-lora rank,
Q q-lora rank; N = H·I query features, W = C + P (latent plus the shared RoPE key),
X = H·(J + U) keys and values from the latent, Y = H·U attention output features.
Weights are [in, out] (y = x @ w).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fnmoe import _torch
from fnmoe.kernels import attention as cpu_attention
from fnmoe.config import ModelConfig

# DeepSeek's reference and transformers build the q/kv latent RMSNorms with their default eps,
# whatever rms_norm_eps says.
MLA_LATENT_EPS = 1e-6


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 at least (fp64 stays fp64 for gradient checks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back before the weight (the Hugging Face / Llama convention)."""
    x32 = upcast(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * w.to(x.dtype)


def rope_tables(positions_L: torch.Tensor, head_dim: int, theta: float,
                inv_freq_P: torch.Tensor | None = None, attention_factor: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, A] in fp32 for half-split RoPE (rotate_half pairs i with i + A/2); positions
    [B, L] (packed rows, restarting per document) give [B, L, A].

    inv_freq_P (A/2 frequencies) overrides theta's; attention_factor scales both tables (YaRN)."""
    if inv_freq_P is None:
        inv_freq_P = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang_LP = positions_L.double()[..., None] * inv_freq_P.double().to(positions_L.device)
    ang_LA = torch.cat([ang_LP, ang_LP], dim=-1)
    cos, sin = ang_LA.cos(), ang_LA.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.float(), sin.float()


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(A/2 frequencies fp64, cos/sin factor) of YaRN, the rule of transformers' yarn RoPE."""
    dim, base, factor = cfg.rope_dim_, cfg.rope_theta, cfg.yarn_factor
    orig = cfg.yarn_original_max_seq_len

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp_P = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    pos_freqs_P = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolate_P = 1 - ramp_P  # 1 keeps a dim's original frequency, 0 interpolates it by factor
    inv_freq_P = (1 / (factor * pos_freqs_P)) * (1 - extrapolate_P) + (1 / pos_freqs_P) * extrapolate_P
    if cfg.yarn_attention_factor:
        return inv_freq_P, cfg.yarn_attention_factor
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        return inv_freq_P, yarn_mscale(factor, cfg.yarn_mscale) / yarn_mscale(factor, cfg.yarn_mscale_all_dim)
    return inv_freq_P, yarn_mscale(factor)


def rope(cfg: ModelConfig, positions_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, P] for cfg's RoPE (its rotated head dims, YaRN when configured)."""
    if cfg.rope_scaling == "yarn":
        return rope_tables(positions_L, cfg.rope_dim_, cfg.rope_theta, *yarn_inv_freq(cfg))
    return rope_tables(positions_L, cfg.rope_dim_, cfg.rope_theta)


def apply_rope(x_BLHA: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate x by the tables ([L, A], or [B, L, A] for per-row positions). Interleaved pairs
    (x0, x1), (x2, x3), ... are first gathered into halves [x0, x2, ...; x1, x3, ...]: queries
    and keys get the same permutation, so their dot products are those of the interleaved
    rotation (transformers' DeepSeek-V3 does the same)."""
    if interleaved:
        x_BLHA = torch.cat([x_BLHA[..., 0::2], x_BLHA[..., 1::2]], dim=-1)
    half = x_BLHA.shape[-1] // 2
    rot = torch.cat([-x_BLHA[..., half:], x_BLHA[..., :half]], dim=-1)
    cos, sin = cos_LP.unsqueeze(-2).to(x_BLHA.dtype), sin_LP.unsqueeze(-2).to(x_BLHA.dtype)
    return x_BLHA * cos + rot * sin


def doc_ids(positions_BL: torch.Tensor) -> torch.Tensor:
    """[B, L] int: the document of each token of a packed row, where a position 0 starts one."""
    return (positions_BL == 0).cumsum(dim=1)


def doc_mask(positions_BL: torch.Tensor, block_sparse: bool = False):
    """What attention needs to keep packed documents apart: a token sees the earlier tokens of its
    own document only. block_sparse gives a flex_attention BlockMask (O((L/128)^2) per row; the
    kernel skips whole blocks across documents), used on CUDA in compiled regions; otherwise a
    bool [B, 1, L, K] mask for SDPA, since flex_attention has no CPU backward."""
    doc_BL = doc_ids(positions_BL)
    B, L = doc_BL.shape
    if block_sparse:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_doc_causal(b, h, q, k):
            return (doc_BL[b, q] == doc_BL[b, k]) & (q >= k)
        # compiled on CUDA: built eagerly it evaluates the mask dense, [B, 1, L, L], every micro-batch
        # (on CPU, where only tests build it, compiling costs more than it saves)
        return create_block_mask(same_doc_causal, B, None, L, L, device=doc_BL.device, _compile=doc_BL.is_cuda)
    causal_LK = torch.ones(L, L, dtype=torch.bool, device=doc_BL.device).tril()
    return ((doc_BL[:, :, None] == doc_BL[:, None, :]) & causal_LK)[:, None]


def sdpa(q_BHLA, k_BGKA, v_BGKU, mask=None, scale: float | None = None) -> torch.Tensor:
    """Causal attention [B, H, L, U]; mask (doc_mask's) also keeps documents of packed rows apart."""
    gqa = q_BHLA.shape[1] != k_BGKA.shape[1]
    if gqa and q_BHLA.is_cuda and q_BHLA.dtype == torch.float32:
        # no fused CUDA kernel takes fp32 with enable_gqa: SDPA's math path would save the [L, L]
        # scores, which the plan (and so the offload pool) does not hold; the efficient kernel takes
        # kv repeated to every head (what fnmoe.plan.activations.attention_bytes counts in fp32)
        R = q_BHLA.shape[1] // k_BGKA.shape[1]
        k_BGKA, v_BGKU, gqa = k_BGKA.repeat_interleave(R, 1), v_BGKU.repeat_interleave(R, 1), False
    # dynamo traces with fake tensors of its own and cannot call is_fake: only eager code meets rehearsal's
    if mask is None and q_BHLA.device.type == "cpu" and not torch.compiler.is_compiling() and _torch.is_fake(q_BHLA):
        return _fused_stand_in(q_BHLA, k_BGKA, v_BGKU, scale)
    if mask is None:
        return F.scaled_dot_product_attention(q_BHLA, k_BGKA, v_BGKU, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q_BHLA, k_BGKA, v_BGKU, attn_mask=mask, scale=scale, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q_BHLA, k_BGKA, v_BGKU, block_mask=mask, scale=scale, enable_gqa=gqa)


def _fused_stand_in(q_BHLA, k_BGKA, v_BGKU, scale: float | None) -> torch.Tensor:
    """For fake tensors on CPU (fnmoe.plan.rehearse plays a GPU rank): what SDPA runs there, a fused kernel
    saving O(L) a head (CPU SDPA takes its math path for MLA's unequal head dims, which saves the
    [L, L] scores). The memory-efficient kernel's op: fake tensors run it from shapes alone."""
    R = q_BHLA.shape[1] // k_BGKA.shape[1]
    k_BHKA, v_BHKU = (k_BGKA.repeat_interleave(R, 1), v_BGKU.repeat_interleave(R, 1)) if R > 1 else (k_BGKA, v_BGKU)
    return _torch.efficient_attention(q_BHLA, k_BHKA, v_BHKU, None, True, 0.0, True, scale=scale)[0]


def math_attention(q_BHLA, k_BGKA, v_BGKU, mask=None, scale: float | None = None) -> torch.Tensor:
    """sdpa as plain ops (scores and softmax in fp32 at least): what torch.func's vmap and forward AD
    take, since they have rules for every op here. Head h reads kv head h // R, as enable_gqa."""
    B, H, L, _ = q_BHLA.shape
    G, K = k_BGKA.shape[1], k_BGKA.shape[2]
    s_BGRLK = torch.einsum("bgrla,bgka->bgrlk", upcast(q_BHLA).unflatten(1, (G, H // G)), upcast(k_BGKA))
    s_BGRLK = s_BGRLK * (q_BHLA.shape[-1] ** -0.5 if scale is None else scale)
    keep = torch.ones(L, K, dtype=torch.bool, device=q_BHLA.device).tril() if mask is None else mask
    if keep.dim() == 4:  # doc_mask's [B, 1, L, K]
        keep = keep[:, :, None]
    p_BGRLK = torch.softmax(s_BGRLK.masked_fill(~keep, float("-inf")), dim=-1).to(v_BGKU.dtype)
    return torch.einsum("bgrlk,bgku->bgrlu", p_BGRLK, v_BGKU).flatten(1, 2)


def causal_attention(q_BLHA, k_BLGA, v_BLGU, cfg: ModelConfig, mask=None, scale: float | None = None
                     ) -> torch.Tensor:
    """Causal attention [B, L, H, U] through cfg.attention_impl: fnmoe's CPU kernel
    (fnmoe.kernels.attention), SDPA (see sdpa) or math_attention. model.block resolves "auto" before a
    compiled region."""
    impl = cfg.attention_impl
    if impl == "auto":
        impl = cpu_attention.choice(cfg, *q_BLHA.shape[:2], q_BLHA.dtype, q_BLHA.device, mask)
    if impl == "cpu":
        return cpu_attention.attention(q_BLHA, k_BLGA, v_BLGU, q_BLHA.shape[-1] ** -0.5 if scale is None else scale)
    if impl == "math":
        q_BHLA, k_BGKA, v_BGKU = q_BLHA.transpose(1, 2), k_BLGA.transpose(1, 2), v_BLGU.transpose(1, 2)
        return math_attention(q_BHLA, k_BGKA, v_BGKU, mask, scale).transpose(1, 2)
    return sdpa(q_BLHA.transpose(1, 2), k_BLGA.transpose(1, 2), v_BLGU.transpose(1, 2), mask, scale).transpose(1, 2)


def gqa_qk(p: dict, x_BLD: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor,
           cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA's queries [B, L, H, A] and keys [B, L, G, A] as attention sees them (normed, rotated)."""
    B, L, _ = x_BLD.shape
    H, G, A = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim_
    q_BLHA = (x_BLD @ p["w_q_DN"]).view(B, L, H, A)
    k_BLGA = (x_BLD @ p["w_k_DM"]).view(B, L, G, A)
    if cfg.qk_norm:
        q_BLHA = rms_norm(q_BLHA, p["q_norm_A"], cfg.norm_eps)
        k_BLGA = rms_norm(k_BLGA, p["k_norm_A"], cfg.norm_eps)
    return (apply_rope(q_BLHA, cos_LP, sin_LP, cfg.rope_interleave),
            apply_rope(k_BLGA, cos_LP, sin_LP, cfg.rope_interleave))


def gqa(p: dict, x_BLD: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor,
        cfg: ModelConfig, mask=None) -> torch.Tensor:
    """Causal grouped-query attention; p holds w_q_DN, w_k_DM, w_v_DM, w_o_ND (+ q_norm_A, k_norm_A)."""
    B, L, _ = x_BLD.shape
    H, G, A = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim_
    q_BLHA, k_BLGA = gqa_qk(p, x_BLD, cos_LP, sin_LP, cfg)
    v_BLGA = (x_BLD @ p["w_v_DM"]).view(B, L, G, A)
    return causal_attention(q_BLHA, k_BLGA, v_BLGA, cfg, mask).reshape(B, L, H * A) @ p["w_o_ND"]


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(I), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V3's rule)."""
    scale = cfg.qk_head_dim_ ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


def mla_qkv(p: dict, x_BLD: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor,
            cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's queries and keys [B, L, H, I] (k_rope shared by all heads) and values [B, L, H, U]."""
    B, L, _ = x_BLD.shape
    H, J, P, U, C = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if "w_q_DN" in p:
        q_BLN = x_BLD @ p["w_q_DN"]
    else:
        q_BLN = rms_norm(x_BLD @ p["w_q_a_DQ"], p["q_a_norm_Q"], MLA_LATENT_EPS) @ p["w_q_b_QN"]
    q_nope_BLHJ, q_rope_BLHP = q_BLN.view(B, L, H, J + P).split([J, P], dim=-1)
    c_BLC, k_rope_BLP = (x_BLD @ p["w_kv_a_DW"]).split([C, P], dim=-1)
    kv_BLHX = (rms_norm(c_BLC, p["kv_a_norm_C"], MLA_LATENT_EPS) @ p["w_kv_b_CX"]).view(B, L, H, J + U)
    k_nope_BLHJ, v_BLHU = kv_BLHX.split([J, U], dim=-1)
    q_rope_BLHP = apply_rope(q_rope_BLHP, cos_LP, sin_LP, cfg.rope_interleave)
    k_rope_BL1P = apply_rope(k_rope_BLP[:, :, None, :], cos_LP, sin_LP, cfg.rope_interleave)
    q_BLHI = torch.cat([q_nope_BLHJ, q_rope_BLHP], dim=-1)
    k_BLHI = torch.cat([k_nope_BLHJ, k_rope_BL1P.expand(B, L, H, P)], dim=-1)
    return q_BLHI, k_BLHI, v_BLHU


def mla(p: dict, x_BLD: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor,
        cfg: ModelConfig, mask=None) -> torch.Tensor:
    """Causal multi-head latent attention; p holds w_q_DN or (w_q_a_DQ, q_a_norm_Q, w_q_b_QN),
    w_kv_a_DW, kv_a_norm_C, w_kv_b_CX, w_o_YD."""
    B, L, _ = x_BLD.shape
    q_BLHI, k_BLHI, v_BLHU = mla_qkv(p, x_BLD, cos_LP, sin_LP, cfg)
    o_BLHU = causal_attention(q_BLHI, k_BLHI, v_BLHU, cfg, mask, mla_softmax_scale(cfg))
    return o_BLHU.reshape(B, L, -1) @ p["w_o_YD"]


def attention(p: dict, x_BLD: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor,
              cfg: ModelConfig, mask=None) -> torch.Tensor:
    """cfg's attention kind (GQA or MLA) on already-normalised inputs."""
    return (mla if cfg.attention == "mla" else gqa)(p, x_BLD, cos_LP, sin_LP, cfg, mask)


MAX_LOGIT_CHUNK = 1024
"""query rows per chunk of max_logits_H: scores exist as [B, H, 1024, L] at most"""


@torch.no_grad()
def max_logits_H(p: dict, x_BLD: torch.Tensor, cos_LP: torch.Tensor, sin_LP: torch.Tensor,
                 cfg: ModelConfig, chunk: int = MAX_LOGIT_CHUNK, positions_BL: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Per query head, the largest causal pre-softmax logit q·k·scale over the batch, fp32 [H]
    (within documents when positions_BL marks packed ones).

    MuonClip's input. SDPA does not expose its logits, so this is a separate QK pass, without
    gradients, over chunks of queries. I is the q/k head dim (A for GQA); MLA has G = H, R = 1.
    """
    if cfg.attention == "mla":
        q_BLHI, k_BLGI, _ = mla_qkv(p, x_BLD, cos_LP, sin_LP, cfg)
        q_BLGRI, scale = q_BLHI.unflatten(2, (cfg.n_heads, 1)), mla_softmax_scale(cfg)
    else:
        q_BLHI, k_BLGI = gqa_qk(p, x_BLD, cos_LP, sin_LP, cfg)
        q_BLGRI, scale = q_BLHI.unflatten(2, (cfg.n_kv_heads, -1)), cfg.head_dim_ ** -0.5
    B, L = x_BLD.shape[:2]
    pos_L = torch.arange(L, device=x_BLD.device)
    doc_BL = doc_ids(positions_BL) if positions_BL is not None else torch.zeros(B, L, device=x_BLD.device)
    best_GR = torch.full(q_BLGRI.shape[2:4], -math.inf, device=x_BLD.device)
    for start in range(0, L, chunk):
        s_BGRSL = torch.einsum("bsgri,blgi->bgrsl", q_BLGRI[:, start:start + chunk], k_BLGI)
        hidden_BSL = (pos_L[None, None, :] > pos_L[start:start + chunk, None]) | \
            (doc_BL[:, start:start + chunk, None] != doc_BL[:, None, :])
        masked_BGRSL = s_BGRSL.masked_fill(hidden_BSL[:, None, None], -math.inf)
        best_GR = torch.maximum(best_GR, masked_BGRSL.amax(dim=(0, 3, 4)).float())
    # max(s)·scale == max(s·scale) for scale > 0; head h = g·R + r, as SDPA's enable_gqa maps them
    return best_GR.flatten() * scale
