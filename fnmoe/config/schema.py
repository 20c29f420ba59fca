"""The frozen dataclasses of the config tree (docs/design.md §3) and the Literal aliases of their choices.

The dataclass defaults are the tiny CPU preset (configs/tiny.toml states the same values).
Derived values are properties, never stored. The CLI (tyro) reads each field's annotation and
the docstring right after it as a flag and its help, and check.py reads each annotation as the
one statement of that field's type, each Literal as the one list of its choices and each `Range`
(ranges.py; in an `Annotated` type) as the one statement of its bounds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from fnmoe.config.ranges import Count, NonNegativeFloat, PositiveFloat, PositiveInt, Range

Dtype = Literal["float32", "bfloat16", "float64"]
RegionPolicy = Literal["none", "full", "selective", "offload"]
REGIONS = ("attention", "moe", "mlp")  # the regions a block compiles and MemoryConfig sets a policy for


@dataclass(frozen=True)
class MoEConfig:
    n_experts: Count = 8
    """routed experts per MoE layer (0 makes every layer dense)"""
    top_k: PositiveInt = 2
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
    dim: PositiveInt = 128
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
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
    rope_interleave: bool = False
    """RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of (x_i, x_i+A/2)"""
    rope_scaling: Literal["none", "yarn"] = "none"
    yarn_factor: PositiveFloat = 1.0
    """YaRN: context extension factor"""
    yarn_original_max_seq_len: PositiveInt = 4096
    """YaRN: the pre-extension context length"""
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
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
    tie_embeddings: bool = False
    max_seq_len: PositiveInt = 1024
    init_std: NonNegativeFloat = 0.02
    moe: MoEConfig = field(default_factory=MoEConfig)
    compute_dtype: Dtype = "float32"
    """float64 serves gradient checks"""
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


@dataclass(frozen=True)
class MeshConfig:
    fsdp: PositiveInt = 1
    ep: PositiveInt = 1
    reshard_after_forward: bool = True
    """re-gather a block's params in backward instead of keeping them (ZeRO-3)"""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the gradients are reduce-scattered in (half the bytes in bfloat16); the sharded gradient
    and the master params stay float32"""

    @property
    def world(self) -> int:
        return self.fsdp * self.ep


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    lr: PositiveFloat = 3e-3
    """peak learning rate (Muon: the Muon lr; AdamW leaves use adamw_lr)"""
    min_lr_ratio: Annotated[float, Range(0, 1)] = 0.1
    """final lr as a fraction of the peak"""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: Count = 50
    """linear warmup steps; one not shorter than the run is clamped to a tenth of it, with a warning"""
    warmup_fraction: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    """> 0: the warmup is this fraction of train.steps (rounded), in place of warmup_steps"""
    decay_fraction: Annotated[float, Range(0, 1, lo_open=True)] = 0.2
    """wsd: fraction of the steps spent in the final decay"""
    weight_decay: NonNegativeFloat = 0.1
    beta1: Annotated[float, Range(0, 1, hi_open=True)] = 0.9
    beta2: Annotated[float, Range(0, 1, hi_open=True)] = 0.95
    eps: NonNegativeFloat = 1e-8
    clip_norm: NonNegativeFloat = 1.0
    """global gradient-norm clip; 0 disables"""
    momentum: Annotated[float, Range(0, 1, hi_open=True)] = 0.95
    nesterov: bool = True
    ns_steps: Annotated[int, Range(1)] = 5
    adjust_lr: Literal["original", "match_rms_adamw", "spectral"] = "match_rms_adamw"
    adamw_lr: NonNegativeFloat = 0.0
    """Muon only: lr of the AdamW leaves; 0 means the same as lr"""
    momentum_dtype: Literal["float32", "bfloat16"] = "float32"
    """Muon only: dtype of the momentum buffers (bfloat16 halves Muon's state)"""
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Muon only: dtype of the Newton-Schulz iteration (bfloat16 as torch.optim.Muon; float32 costs
    more and makes runs on different meshes follow each other closely)"""
    qk_clip: bool = False
    """MuonClip (Kimi K2), for any optimizer: after each step, rescale the query/key weights of
    heads whose max attention logit on the step's batch exceeded qk_clip_tau (costs a QK pass per layer)"""
    qk_clip_tau: PositiveFloat = 100.0
    """the max-logit threshold tau of qk_clip (Kimi K2 used 100)"""


@dataclass(frozen=True)
class MemoryConfig:
    """Activation memory (fnmoe/memory/policies.py, docs/design.md §6). `recompute` and `offload` act on whole
    blocks; attention / moe / mlp act on one region each, inside blocks that `recompute` leaves alone."""

    recompute: Literal["none", "full"] = "none"
    """activation checkpointing per block: 'full' keeps each block's input, its routing and its EP
    exchange's outputs (never recomputed: no communication in backward; see keep_exchange) (the shorthand for
    recomputing every region)"""
    offload: bool = False
    """move each block's saved tensors (with recompute='full': what it keeps) to host memory; the last
    block stays"""
    keep_exchange: bool = True
    """with recompute='full': keep the EP all-to-alls' outputs for backward (4 exchange passes a MoE
    layer); --memory.no-keep-exchange replays them in the recompute instead (6 passes, less memory).
    Region policies always keep them"""
    attention: RegionPolicy = "none"
    """attention regions: keep, recompute, recompute cheap ops only, or offload their saved tensors"""
    moe: RegionPolicy = "none"
    """MoE regions (router top-k outputs are saved under every policy, so routing never changes)"""
    mlp: RegionPolicy = "none"
    """dense MLP regions"""
    offload_min_bytes: Count = 1024
    """saved tensors smaller than this stay on the device (not worth a copy)"""
    max_inflight_bytes: PositiveInt = 1 << 30
    """bound on staging bytes being copied at once (CUDA side stream; on CPU copies are synchronous)"""
    report: bool = False
    """print kept / offloaded / recomputed saved bytes per block after the first step"""


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints go to <run-dir>/checkpoints/step_<N> (fnmoe/checkpoint/); resume with --resume auto."""

    every: Count = 0
    """save every N steps (0: only the final save, and one on Ctrl-C)"""
    keep_last: Annotated[int, Range(1)] = 3
    """keep the newest K complete checkpoints; older ones are deleted after each save"""
    async_save: bool = False
    """copy tensors to CPU and write on a background thread while training goes on (one write in flight)"""


@dataclass(frozen=True)
class MixSource:
    """One source of a data mixture (data.mix): a prepared directory and its share of every batch.
    On the command line NAME=DIR:WEIGHT (or DIR:WEIGHT, named after the directory)."""

    corpus: str
    """a directory written by `fnmoe prepare`"""
    weight: PositiveFloat = 1.0
    """its share of each global batch is weight / (the sum of the weights)"""
    name: str = ""
    """the name of its val_loss/<name> metrics (default: the directory's name)"""

    @property
    def label(self) -> str:
        return self.name or self.corpus.rstrip("/").rsplit("/", 1)[-1]

    @classmethod
    def parse(cls, text: str) -> MixSource:
        """NAME=DIR:WEIGHT or DIR:WEIGHT (the weight after the last ':'; a NAME holds no '/')."""
        head, colon, weight = text.rpartition(":")
        name, eq, corpus = head.partition("=")
        if not eq or "/" in name:
            name, corpus = "", head
        try:
            w = float(weight)
        except ValueError:
            w = None
        if not colon or not corpus or w is None:
            raise ValueError(f"--data.mix {text!r}: expected NAME=DIR:WEIGHT (e.g. web=data/web:0.7)")
        return cls(corpus, w, name)

    def flag(self) -> str:
        return f"{self.name + '=' if self.name else ''}{self.corpus}:{self.weight:g}"


@dataclass(frozen=True)
class DataConfig:
    corpus: str = "bundled"
    """'bundled' (the English corpus shipped with fnmoe), a .jsonl[.gz] / text file, or a directory
    written by `fnmoe prepare`"""
    mix: tuple[MixSource, ...] = ()
    """instead of data.corpus, a mixture of prepared directories NAME=DIR:WEIGHT ... (TOML: a list of
    {corpus = DIR, weight = w} tables, `name` optional): each global batch takes its rows from the
    sources in proportion to the weights; a source that runs out starts a new epoch of itself"""
    tokenizer: Literal["byte"] = "byte"
    seq_len: PositiveInt = 128
    val_fraction: Annotated[float, Range(0, 1, lo_open=True, hi_open=True)] = 0.05
    """the last fraction of documents is held out for validation"""
    doc_mask: bool = False
    """packing with document masks: attention and RoPE positions restart at each document inside a
    packed row, and no loss on a document's first token"""
    text_field: str = "text"
    """the field of a JSONL corpus holding a document's text (an SFT completion)"""
    prompt_field: str = ""
    """SFT: the field of a JSONL corpus holding a prompt, whose tokens are never labels"""


@dataclass(frozen=True)
class TrainConfig:
    steps: PositiveInt = 800
    tokens: Count = 0
    """> 0: train on this many tokens: train.steps becomes ceil(tokens / (batch_size x data.seq_len)) (given
    both, they must agree; on the command line the one given wins over a preset's)"""
    seed: int = 0
    batch_size: PositiveInt = 16
    """global batch in sequences per optimizer step (all ranks, all micro-batches)"""
    grad_accum: PositiveInt = 1
    ce_chunks: PositiveInt = 1
    """cross-entropy computed in this many token chunks, logits recomputed in backward"""
    run_dir: str = ""
    """default ./runs/<config stem>"""
    log_every: PositiveInt = 20
    eval_every: Count = 200
    """validation every N steps (0: only at the end)"""
    eval_batches: PositiveInt = 8
    peak_tflops: NonNegativeFloat = 0.0
    """accelerator peak for MFU (989 for H100/H200 bf16); 0 reports n/a"""
    threads: Count = 0
    """torch intra-op threads (0: torch's default)"""
    tensorboard: bool = False
    """also write TensorBoard scalars and expert-load histograms to <run-dir>/tensorboard (needs the
    tensorboard package)"""
    deterministic: bool = False
    """deterministic kernels only (torch.use_deterministic_algorithms; the cuBLAS workspace setting on
    CUDA): needed for bit-exact resume on GPUs, slower there; on CPU resume is bit-exact without it"""
    wandb: bool = False
    """also log the metrics rows, expert-load histograms and the resolved config to Weights & Biases
    (pip install 'fnmoe[wandb]'; WANDB_MODE=offline logs without a network); a resumed run continues
    the same W&B run (its id is kept in <run-dir>/wandb_id)"""
    wandb_project: str = "fnmoe"
    wandb_name: str = ""
    """the W&B run's display name (default: the run's name)"""
    init_from_hf: str = ""
    """start from the weights of this Hugging Face checkpoint directory (fnmoe.hf.load; on a mesh each
    rank reads only its slices) instead of the random init; its shapes must be the config's"""
    max_consecutive_skips: Count = 10
    """stop the run (exit 2) after this many skipped steps in a row (a non-finite loss, gradient or
    update; a skip leaves the weights as they were, so a cause in the weights or the optimizer repeats
    every step while one bad batch does not); 0: never. A run whose every step was skipped fails anyway"""
    sample_every: Count = 0
    """every N steps print a short greedy sample of the model (rank 0; on a mesh every rank gathers the
    params for it); 0: never"""
    sample_prompt: str = ""
    """the text a sample continues (empty: the start of a document)"""
    sample_tokens: PositiveInt = 64
    """tokens a sample adds"""


@dataclass(frozen=True)
class DistConfig:
    timeout_s: Annotated[float, Range(0, 31_536_000, lo_open=True)] = 600.0
    """seconds a collective waits for its peers before the run fails naming them; at most a year
    (31,536,000 s: gloo refuses timeouts past ~9e9 s, and Python's timedelta overflows)"""
    backend: Literal["auto", "gloo", "nccl"] = "auto"


@dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""
    """A:B writes a torch.profiler trace of steps A..B (1-based, inclusive)"""


@dataclass(frozen=True)
class PlanConfig:
    imbalance: Annotated[float, Range(1)] = 1.0
    """assumed max/mean expert load when planning memory"""
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """optimizer-state dtype the planner assumes (moments / momentum)"""
    hardware: Literal["jupiter-gh200", "dgx-h100", "custom"] = "jupiter-gh200"
    """the machine planned for: a profile's figures (fnmoe/config/hardware.py; sources in
    docs/memory_plan.md), each overridden by the figure given below; custom: every figure given"""
    gpus_per_node: Annotated[int, Range(1)] | None = None
    """GPUs sharing fast links (profile: jupiter-gh200 4, dgx-h100 8)"""
    hbm_gb: NonNegativeFloat | None = None
    """device memory usable a GPU, GB (profile: jupiter-gh200 92 of 96, dgx-h100 76 of 80)"""
    host_gb: NonNegativeFloat | None = None
    """host memory usable for offload a GPU, GB (profile: jupiter-gh200 100 of a Grace's 120, dgx-h100 200)"""
    matmul_tflops: PositiveFloat | None = None
    """sustained bf16 GEMM rate a GPU, TFLOP/s (profile: 55% of 989)"""
    attention_tflops: PositiveFloat | None = None
    """sustained flash-attention rate a GPU, TFLOP/s (profile: 40% of 989)"""
    nvlink_gbps: PositiveFloat | None = None
    """collectives inside a node, GB/s a GPU one direction, achieved (profile: jupiter-gh200 150, one
    NV6 peer link; dgx-h100 360 on NVSwitch)"""
    nvlink_a2a_gbps: PositiveFloat | None = None
    """an all-to-all inside a node, GB/s a GPU one direction, achieved, every peer at once (profile:
    jupiter-gh200 360, 80% of 3 NV6 peer links; dgx-h100 360 on NVSwitch)"""
    network_gbps: PositiveFloat | None = None
    """collectives across nodes, GB/s a GPU one direction, achieved (profile: jupiter-gh200 22 on
    NDR200, dgx-h100 40 on NDR400)"""
    network_nominal_gbps: PositiveFloat | None = None
    """cross-node line rate a GPU, GB/s (profile: jupiter-gh200 25, dgx-h100 50)"""
    d2h_gbps: PositiveFloat | None = None
    """device -> host copy rate a GPU with the node's GPUs all copying, GB/s: offload's copies out
    (profile: jupiter-gh200 150, dgx-h100 50)"""
    h2d_gbps: PositiveFloat | None = None
    """host -> device copy rate a GPU, GB/s: offload's reloads (profile: jupiter-gh200 400, dgx-h100 50)"""
    dispatch: Literal["rows", "node_dedup"] = "rows"
    """EP exchange the step-time model assumes: 'rows' is fnmoe's (every routed row sent); 'node_dedup'
    sends a token once per destination node and fans it out there over NVLink (DeepEP), not built yet"""


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    resume: str = "none"
    """auto | none | PATH"""
    compile_cache: str = ""
    """compile cache directory (default: the checkout's compile_cache/); TORCHINDUCTOR_CACHE_DIR wins"""
    name: str = "run"
    """preset name (the config file's stem); names the default run directory"""

    @property
    def dp_size(self) -> int:
        return self.mesh.world

    @property
    def micro_batch(self) -> int:
        """sequences per rank per micro-batch"""
        return self.train.batch_size // (self.dp_size * self.train.grad_accum)

    @property
    def token_steps(self) -> int:
        """the train.steps that train.tokens asks for: ceil(tokens / global batch tokens); 0 without tokens"""
        return -(-self.train.tokens // (self.train.batch_size * self.data.seq_len))

