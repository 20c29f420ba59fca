"""The frozen dataclasses of the config tree (docs/design.md §3) and the Literal aliases of their
choices; the model's own (ModelConfig, MoEConfig, Dtype) are model.py's.

The dataclass defaults are the tiny CPU preset (configs/tiny.toml states the same values).
Derived values are properties, never stored. The CLI (tyro) reads each field's annotation and
the docstring right after it as a flag and its help, and check.py reads each annotation as the
one statement of that field's type, each Literal as the one list of its choices and each `Range`
(ranges.py; in an `Annotated` type) as the one statement of its bounds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from fnmoe.config.model import ModelConfig
from fnmoe.config.ranges import Count, NonNegativeFloat, PositiveFloat, PositiveInt, Range

RegionPolicy = Literal["none", "full", "selective", "offload"]
REGIONS = ("attention", "moe", "mlp")  # the regions a block compiles and MemoryConfig sets a policy for


@dataclass(frozen=True)
class MeshConfig:
    fsdp: PositiveInt = 1
    """ranks the params, gradients and optimizer state are sharded over (FSDP / ZeRO-3); mesh.fsdp x
    mesh.ep must be the job's ranks (torchrun --nproc-per-node ...)"""
    ep: PositiveInt = 1
    """expert-parallel ranks: each holds n_experts / ep experts and tokens are exchanged all-to-all;
    must divide model.moe.n_experts"""
    reshard_after_forward: bool = True
    """re-gather a block's params in backward instead of keeping them (ZeRO-3)"""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the gradients are reduce-scattered in (half the bytes in bfloat16); the sharded gradient
    and the master params stay float32"""
    expert_gather_dtype: Literal["compute", "float8_e4m3fn"] = "compute"
    """dtype the expert stacks are all-gathered in over fsdp: 'compute' (model.compute_dtype), or
    float8_e4m3fn: each rank quantises its expert shard once a step (a power-of-two float32 scale a
    128x128 block) and sends 1 byte an element plus the scales; blocks compute on it dequantised to
    the compute dtype, the gradient reaches the float32 master shard as from a compute-dtype gather
    (dense leaves, reduce-scatters, master params and evaluation's gathers are unchanged). Needs
    mesh.fsdp > 1 and experts"""
    expert_gemm_dtype: Literal["compute", "float8_e4m3fn"] = "compute"
    """dtype the routed experts' GEMMs run in: 'compute', or float8_e4m3fn: forward, input and weight
    gradient in e4m3 with fp32 accumulation and compute-dtype outputs, DeepSeek-V3's tiling
    (activations in 1x128 tiles, weights in 128x128 blocks, power-of-two scales; with fp8 expert
    gathers the gathered stack's blocks are taken as they come, with no second rounding). On a GPU
    through torch's scaled_grouped_mm, on CPU an emulation (dequantise, fp32 GEMM)
    (fnmoe.kernels.fp8_gemm). Not with model.moe.impl='dense'"""

    @property
    def world(self) -> int:
        return self.fsdp * self.ep


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """optimizer: AdamW, or Muon (Newton-Schulz orthogonalised momentum) on the hidden matrices and AdamW
    on the rest (embedding, output head, norms)"""
    lr: PositiveFloat = 3e-3
    """peak learning rate (Muon: the Muon lr; AdamW leaves use adamw_lr)"""
    min_lr_ratio: Annotated[float, Range(0, 1)] = 0.1
    """final lr as a fraction of the peak"""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """the lr over the run: a linear warmup, then cosine decay to min_lr_ratio x lr, or warmup-stable-decay
    (the decay in the last decay_fraction of the steps); or constant (no warmup)"""
    warmup_steps: Count = 50
    """linear warmup steps; one not shorter than the run is clamped to a tenth of it, with a warning"""
    warmup_fraction: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    """> 0: the warmup is this fraction of train.steps (rounded), in place of warmup_steps"""
    decay_fraction: Annotated[float, Range(0, 1, lo_open=True)] = 0.2
    """wsd: fraction of the steps spent in the final decay"""
    weight_decay: NonNegativeFloat = 0.1
    """decoupled weight decay (AdamW's, times lr) of the matrices; norms and biases get none"""
    beta1: Annotated[float, Range(0, 1, hi_open=True)] = 0.9
    """AdamW: decay of the first moment (the gradient's running mean)"""
    beta2: Annotated[float, Range(0, 1, hi_open=True)] = 0.95
    """AdamW: decay of the second moment (the squared gradient's running mean)"""
    eps: NonNegativeFloat = 1e-8
    """AdamW: added to the second moment's square root in the update's denominator"""
    clip_norm: NonNegativeFloat = 1.0
    """global gradient-norm clip; 0 disables"""
    momentum: Annotated[float, Range(0, 1, hi_open=True)] = 0.95
    """Muon only: momentum of the matrices' update"""
    nesterov: bool = True
    """Muon only: Nesterov momentum (orthogonalise gradient + momentum x buffer)"""
    ns_steps: Annotated[int, Range(1)] = 5
    """Muon only: Newton-Schulz iterations that orthogonalise an update"""
    adjust_lr: Literal["original", "match_rms_adamw", "spectral"] = "match_rms_adamw"
    """Muon only: how a matrix's lr scales with its shape: original (Keller Jordan's sqrt(max(1, out/in))),
    match_rms_adamw (0.2 sqrt(max(in, out)), Moonlight: AdamW's lr and weight decay carry over) or spectral"""
    adamw_lr: NonNegativeFloat = 0.0
    """Muon only: lr of the AdamW leaves; 0 means the same as lr"""
    momentum_dtype: Literal["float32", "bfloat16"] = "float32"
    """Muon only: dtype of the momentum buffers (bfloat16 halves Muon's state)"""
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Muon only: dtype of the Newton-Schulz iteration (bfloat16 as torch.optim.Muon; float32 costs
    more and makes runs on different meshes follow each other closely)"""
    fused: Literal["auto", "on", "off"] = "auto"
    """AdamW (and Muon's AdamW leaves) as one compiled kernel a leaf: 'auto' on a GPU, where the eager
    ops' passes over the fp32 params and moments bound the update by memory bandwidth; 'on' also on
    CPU; 'off' the eager ops, bitwise torch.optim.AdamW's (fused: within an ulp of them)"""
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
    block_chunks: PositiveInt = 1
    """with recompute='full': run each block's forward, recompute and backward over this many chunks of
    its sequences (attention, MLP, router and experts alike), the block's gathered weights held once
    for all of them, so the recompute's transient is one chunk's (fnmoe/models/block_chunks.py); must divide a
    rank's micro-batch"""
    attention: RegionPolicy = "none"
    """attention regions: keep, recompute, recompute cheap ops only, or offload their saved tensors"""
    moe: RegionPolicy = "none"
    """MoE regions (router top-k outputs are saved under every policy, so routing never changes)"""
    mlp: RegionPolicy = "none"
    """dense MLP regions"""
    offload_dtype: Literal["compute", "float8_e4m3fn"] = "compute"
    """with recompute='full' and offload: the block inputs offload keeps on the host in the compute dtype,
    or in e4m3 with a float32 scale a 1x128 tile (1.03 bytes an element: a GPU's host bytes about halve,
    so more sequences fit); the recompute then starts from the dequantised input (the forward used the exact one)"""
    offload_min_bytes: Count = 1024
    """saved tensors smaller than this stay on the device (not worth a copy)"""
    max_inflight_bytes: PositiveInt = 1 << 30
    """bound on staging bytes being copied at once (CUDA side stream; on CPU copies are synchronous)"""
    report: bool = False
    """print kept / offloaded / recomputed saved bytes per block after the first step"""


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints go to <run-dir>/checkpoints/step_<N> (fnmoe/checkpoint/); resume with --resume auto."""

    every: Count = 500
    """save every N steps besides the final save and the one on Ctrl-C or SIGTERM (500, as TorchTitan and
    HF Trainer: a SIGKILL or the OOM killer loses at most that many steps); 0: only those two"""
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
    """tokenizer of a text or JSONL corpus: bytes (256 ids + EOS); a prepared directory carries its own
    (fnmoe prepare --tokenizer)"""
    seq_len: PositiveInt = 128
    """tokens a training sequence (packed rows of documents); at most model.max_seq_len"""
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
    """optimizer steps of the run (the lr schedule spans them); see train.tokens"""
    tokens: Count = 0
    """> 0: train on this many tokens: train.steps becomes ceil(tokens / (batch_size x data.seq_len)) (given
    both, they must agree; on the command line the one given wins over a preset's)"""
    seed: int = 0
    """seed of the init and of the data order (the same seed and batch size: the same samples at a step)"""
    batch_size: PositiveInt = 16
    """global batch in sequences per optimizer step (all ranks, all micro-batches)"""
    grad_accum: PositiveInt = 1
    """micro-batches a step accumulates gradients over (the global batch is split into them); must
    divide batch_size / (mesh.fsdp x mesh.ep)"""
    ce_chunks: PositiveInt = 1
    """cross-entropy computed in this many token chunks, logits recomputed in backward"""
    run_dir: str = ""
    """default ./runs/<config stem>"""
    log_every: PositiveInt = 20
    """a progress line every N steps (its loss and tokens/s are the mean over those N steps); metrics.jsonl
    gets every step"""
    eval_every: Count = 200
    """validation every N steps (0: only at the end)"""
    eval_batches: PositiveInt = 8
    """held-out batches each validation averages (of batch_size sequences)"""
    peak_tflops: NonNegativeFloat = 0.0
    """accelerator peak for MFU (989 for H100/H200 bf16); 0 reports n/a"""
    threads: Annotated[int, Range(0, 1024)] = 0
    """torch intra-op threads (0: torch's default; at most 1024: torch crashes on a million)"""
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
    """the W&B project of --train.wandb"""
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
    donate: bool = True
    """the step owns the train state and updates params and optimizer state in place, leaf by leaf (JAX's
    donate_argnums): bitwise the pure update's values without a second copy of them beside the old (the
    planner's update_transient: one leaf's workspace instead of the optimizer state and 2-3.5x the params).
    A step skipped for a non-finite loss or gradient leaves the state bitwise as it was either way; a
    finite gradient whose update is not finite (a huge lr) leaves the leaves before the first non-finite
    one stepped where --train.no-donate leaves all as they were"""


@dataclass(frozen=True)
class DistConfig:
    timeout_s: Annotated[float, Range(0, 31_536_000, lo_open=True)] = 600.0
    """seconds a collective waits for its peers before the run fails naming them; at most a year
    (31,536,000 s: gloo refuses timeouts past ~9e9 s, and Python's timedelta overflows)"""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto is nccl on CUDA, gloo on CPU"""


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
    hardware: Literal["jupiter-gh200", "dgx-h100", "dgx-b200", "custom"] = "jupiter-gh200"
    """the machine planned for: a profile's figures (fnmoe/config/hardware.py; sources in
    docs/memory_plan.md), each overridden by the figure given below; custom: every figure given"""
    gpus_per_node: Annotated[int, Range(1)] | None = None
    """GPUs sharing fast links (profile: jupiter-gh200 4, dgx-h100 8)"""
    hbm_gb: NonNegativeFloat | None = None
    """device memory usable a GPU, GB = 1e9 B (profile: jupiter-gh200 96 of the 102.7 CUDA sees, dgx-h100 80 of
    85.5)"""
    host_gb: NonNegativeFloat | None = None
    """host memory usable for offload a GPU, GB (profile: jupiter-gh200 100 of a Grace's 120, dgx-h100 200)"""
    matmul_tflops: PositiveFloat | None = None
    """sustained bf16 GEMM rate a GPU, TFLOP/s (profile: 55% of 989)"""
    hbm_tbps: PositiveFloat | None = None
    """sustained device-memory bandwidth a GPU, TB/s (profile: 90% of jupiter-gh200's 4.0, dgx-h100's 3.35)"""
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
    nccl_ring_slowdown: NonNegativeFloat | None = None
    """fraction compute slows while an NCCL ring runs beside it (every profile: 0.05)"""
    nccl_a2a_slowdown: NonNegativeFloat | None = None
    """fraction compute slows while an NCCL all-to-all runs beside it (every profile: 0.05)"""
    host_sync_us: NonNegativeFloat | None = None
    """what one host sync (the count exchange before a dispatch) costs the GPU, us (every profile: 50)"""
    expert_matmul_tflops: PositiveFloat | None = None
    """sustained routed-expert grouped-GEMM rate a GPU, TFLOP/s (profile: matmul_tflops)"""
    fp8_matmul_tflops: PositiveFloat | None = None
    """sustained fp8 GEMM rate a GPU, TFLOP/s, for --mesh.expert-gemm-dtype float8_e4m3fn (profile: 55% of the fp8
    dense peak, 1,979 on H100/H200/GH200, 4,500 on B200)"""
    rates: Literal["stated", "measured"] = "stated"
    """the rates the step time uses: 'stated' the profile's; 'measured' the nearest row of the rate table
    (fnmoe/plan/rates.py: gpu_check measurements, published nccl-tests) for the profile's GPU and the
    run's shapes, the profile's where no row is (the plan names which terms were measured); a figure
    given here wins over both"""
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
    """none: a fresh run (refused where <run-dir>/checkpoints holds one); auto: continue from the newest
    checkpoint under <run-dir>/checkpoints that verifies (a fresh run when there is none); PATH: from that
    checkpoint directory. Resuming, `fnmoe train` takes the checkpoint's config.toml as the base of every
    flag (the run's preset and flags); flags given with it change it, each change named"""
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

