"""The model's shape: `ModelConfig` (with its `MoEConfig`), all that `forward`, `init_params` and
`fnmoe.hf` take of a run, and `Dtype`, the dtype names of the config.

As schema.py: defaults are the tiny CPU preset, derived values are properties, each annotation and
the docstring after it are a field's type, bounds (`Range`) and help.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from fnmoe.config.ranges import Count, NonNegativeFloat, PositiveFloat, PositiveInt, Range

Dtype = Literal["float32", "bfloat16", "float64"]

@dataclass(frozen=True)
class MoEConfig:
    n_experts: Count = 8
    """routed experts per MoE layer (0 makes every layer dense)"""
    top_k: PositiveInt = 2
    """experts a token is routed to (K); at most n_experts"""
    expert_hidden: PositiveInt = 256
    """hidden size F of one routed expert"""
    n_shared_experts: Count = 0
    """shared experts, fused into one SwiGLU of hidden n_shared_experts * expert_hidden"""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """router scores: softmax over experts (Qwen3, Mixtral) or per-expert sigmoid (DeepSeek-V3)"""
    norm_topk_prob: bool = True
    """renormalise the top-k weights to sum to one"""
    routed_scaling_factor: PositiveFloat = 1.0
    """multiplies the routed experts' weights (after renormalisation)"""
    n_group: PositiveInt = 1
    """expert groups for group-limited routing (DeepSeek-V3); 1 disables it"""
    topk_group: PositiveInt = 1
    """groups a token may route into; a group's score is the sum of its top-2 choice scores"""
    router_bias: bool = False
    """a per-expert score-correction bias (buffers.layers.<i>.moe.router_bias_E) added to the
    scores for top-k selection only; the expert weights come from the unbiased scores"""
    bias_update_coeff: NonNegativeFloat = 0.0
    """aux-loss-free balancing (DeepSeek-V3): after each optimizer step
    bias += coeff * sign(mean count - count) per expert; 0 keeps the bias fixed"""
    first_k_dense: Count = 1
    """the first k layers use the dense MLP instead of MoE"""
    dense_layers: tuple[int, ...] = ()
    """explicit extra dense layer indices"""
    moe_every: Annotated[int, Range(1)] = 1
    """only layers i with (i + 1) % moe_every == 0 are MoE (Qwen's decoder_sparse_step)"""
    aux_loss_coeff: NonNegativeFloat = 0.01
    """weight of the Switch-style load-balancing loss (per micro-batch, averaged over MoE layers)"""
    seq_aux_loss_coeff: NonNegativeFloat = 0.0
    """weight of DeepSeek-V3's sequence-wise balance loss (per sequence, averaged over sequences)"""
    z_loss_coeff: NonNegativeFloat = 0.0
    """weight of the router z-loss, mean over tokens of logsumexp(router logits)^2 (ST-MoE)"""
    impl: Literal["auto", "grouped", "padded", "loop", "dense"] = "auto"
    """expert GEMMs: grouped (CUDA: torch's grouped_mm, bf16, 16-byte aligned dims; CPU: fnmoe's C++
    grouped GEMM, any float dtype), padded (batched matmuls over per-expert slabs padded to the
    largest count; one host read of that count per layer) or a loop; auto: grouped where it runs,
    else padded in bf16 with aligned dims, else the loop. dense runs every expert on every token,
    weighted by the routing (E/K times the FLOPs; what torch.func's vmap and jvp take)"""
    capacity_factor: Annotated[float, Range(0, 1e6)] = 0.0
    """0: dropless. c > 0: an expert takes at most ceil(c*T*K/E) of the T*K rows a rank routes in a
    micro-batch (first come, in token order); the rest are dropped (zero expert output) and
    counted in metrics as dropped_tokens. At most 1e6 (from E/K on nothing is dropped; far larger
    overflows the row count)"""
    token_chunks: Annotated[int, Range(1)] = 1
    """run a MoE layer's tokens (a rank's micro-batch) in N chunks while its gathered weights are held
    once: EP buffers, GEMM transients and saved tensors scale with T/N; N must divide the tokens"""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: PositiveInt = 264
    """rows of the embedding and columns of the output head (the byte tokenizer: 256 bytes + EOS,
    padded to 264)"""
    dim: PositiveInt = 128
    """model width D: the residual stream, embedding and attention input size"""
    n_layers: PositiveInt = 4
    """transformer blocks (attention plus a dense MLP or a MoE layer each)"""
    n_heads: PositiveInt = 4
    """query heads of attention"""
    n_kv_heads: PositiveInt = 2
    """key/value heads of GQA (MLA ignores it: every head has its own keys and values)"""
    head_dim: Count = 0
    """GQA head dim; 0 means dim // n_heads"""
    qk_norm: bool = False
    """per-head RMSNorm on queries and keys (Qwen3)"""
    attention: Literal["gqa", "mla"] = "gqa"
    """grouped-query attention, or DeepSeek's multi-head latent attention"""
    attention_impl: Literal["auto", "sdpa", "cpu", "math"] = "auto"
    """sdpa: torch's scaled_dot_product_attention (flex attention for block-sparse document masks);
    cpu: fnmoe's C++ kernel (bf16 on CPU, causal rows without document masks); auto: cpu where it
    applies, rows are <= 1024 long and every thread gets a (batch, kv head), else sdpa; math:
    softmax(q·k) as plain ops, [B, H, L, L] scores in memory (what torch.func's vmap and jvp take)"""
    q_lora_rank: Count = 0
    """MLA: rank of the low-rank query projection; 0 projects queries directly"""
    kv_lora_rank: Count = 0
    """MLA: rank of the compressed key/value latent"""
    qk_nope_head_dim: Count = 0
    """MLA: per-head query/key dims without RoPE"""
    qk_rope_head_dim: Count = 0
    """MLA: per-head query/key dims with RoPE (the rotary key is shared by all heads)"""
    v_head_dim: Count = 0
    """MLA: per-head value dim"""
    ffn_hidden: PositiveInt = 512
    """hidden size of the dense SwiGLU MLP"""
    rope_theta: PositiveFloat = 10000.0
    """RoPE base: the rotation of dim pair i is position * theta^(-2i/head dim)"""
    rope_interleave: bool = False
    """RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of (x_i, x_i+A/2)"""
    rope_scaling: Literal["none", "yarn"] = "none"
    """RoPE context extension: none, or YaRN (the yarn_* fields)"""
    yarn_factor: PositiveFloat = 1.0
    """YaRN: context extension factor"""
    yarn_original_max_seq_len: PositiveInt = 4096
    """YaRN: the pre-extension context length"""
    yarn_beta_fast: float = 32.0
    """YaRN: dims that rotate more than this many times over the original context keep their frequency"""
    yarn_beta_slow: float = 1.0
    """YaRN: dims that rotate fewer than this many times are interpolated by yarn_factor (between the
    two: a linear ramp)"""
    yarn_mscale: NonNegativeFloat = 0.0
    """YaRN: with yarn_mscale_all_dim, sets the cos/sin factor mscale(mscale) / mscale(mscale_all_dim);
    0 (either) means mscale(1) = 0.1 ln(factor) + 1"""
    yarn_mscale_all_dim: NonNegativeFloat = 0.0
    """YaRN: MLA multiplies its softmax scale by mscale(mscale_all_dim)^2 (DeepSeek-V3); 0: no change"""
    yarn_attention_factor: NonNegativeFloat = 0.0
    """YaRN: explicit cos/sin factor; 0 derives it from the mscales"""
    yarn_truncate: bool = True
    """YaRN: round the correction range to whole dims"""
    norm_eps: NonNegativeFloat = 1e-6
    """epsilon of every RMSNorm"""
    tie_embeddings: bool = False
    """the output head reuses the embedding matrix (one parameter)"""
    max_seq_len: PositiveInt = 1024
    """longest sequence the RoPE tables cover (data.seq_len and generation must stay within it)"""
    init_std: NonNegativeFloat = 0.02
    """standard deviation of the normal init of the weight matrices (norms start at one)"""
    moe: MoEConfig = field(default_factory=MoEConfig)
    compute_dtype: Dtype = "float32"
    """dtype of the activations and GEMMs; the master params and optimizer state stay float32
    (bfloat16 on a GPU; float64 serves gradient checks)"""
    compile: bool = False
    """compile each region (attention, MoE, dense MLP) with torch.compile"""

    @property
    def head_dim_(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def qk_head_dim_(self) -> int:
        """per-head query/key dim (MLA: no-RoPE plus RoPE dims)"""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim_

    @property
    def v_head_dim_(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim_

    @property
    def rope_dim_(self) -> int:
        """dims of a query/key head that RoPE rotates"""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim_

    def is_moe_layer(self, i: int) -> bool:
        m = self.moe
        return (m.n_experts > 0 and i >= m.first_k_dense and i not in m.dense_layers
                and (i + 1) % m.moe_every == 0)
