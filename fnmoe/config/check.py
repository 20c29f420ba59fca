"""Config validation: every problem of a config tree at once, each naming its field and value.

`validate_model` checks a ModelConfig alone (hf.load uses it); `validate` checks a whole
RunConfig and raises ValueError listing every problem. Each field's own check (type, choices,
range, finiteness) comes from its annotation (types.py); the checks here relate fields to each
other, and run once every field passes its own (they compare and divide by fields).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from fnmoe.config.hardware import OPTIONAL_RATES, hardware
from fnmoe.config.model import ModelConfig, MoEConfig
from fnmoe.config.schema import REGIONS, MemoryConfig, RunConfig
from fnmoe.config.types import field_errors


def _check(errors: list[str], ok: bool, msg: str) -> None:
    if not ok:
        errors.append(msg)


def validate_model(m: ModelConfig) -> list[str]:
    """Every problem of a model config (empty: it is valid)."""
    return field_errors(m, "model.") or _model_relations(m)


def _model_relations(m: ModelConfig) -> list[str]:
    e: list[str] = []
    if m.attention == "mla":
        _validate_mla(e, m)
    else:
        _check(e, m.n_heads % max(m.n_kv_heads, 1) == 0,
               f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.n_kv_heads}")
        _check(e, m.head_dim > 0 or m.dim % max(m.n_heads, 1) == 0,
               f"model.dim={m.dim} must be divisible by model.n_heads={m.n_heads} when model.head_dim=0")
        _check(e, m.head_dim_ % 2 == 0, f"head dim {m.head_dim_} must be even for RoPE")
    _check(e, m.attention_impl != "cpu" or m.compute_dtype == "bfloat16",
           f"model.attention_impl='cpu' takes bfloat16 compute (model.compute_dtype={m.compute_dtype!r}); "
           "use 'auto' or 'sdpa'")
    _validate_moe(e, m)
    return e


def _validate_mla(e: list[str], m: ModelConfig) -> None:
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        _check(e, getattr(m, name) > 0, f"model.{name} must be > 0 for MLA, got {getattr(m, name)}")
    _check(e, m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even for RoPE")
    _check(e, not m.qk_norm, "model.qk_norm is a GQA option; MLA normalises its latents instead")


def _validate_moe(e: list[str], m: ModelConfig) -> None:
    moe = m.moe
    if moe.n_experts > 0:
        _check(e, moe.top_k <= moe.n_experts,
               f"model.moe.top_k={moe.top_k} must be in 1..model.moe.n_experts={moe.n_experts}")
        _validate_groups(e, moe)
    _check(e, moe.first_k_dense <= m.n_layers,
           f"model.moe.first_k_dense={moe.first_k_dense} must be in 0..model.n_layers={m.n_layers}")
    bad = [i for i in moe.dense_layers if not 0 <= i < m.n_layers]
    _check(e, not bad, f"model.moe.dense_layers has indices outside 0..{m.n_layers - 1}: {bad}")
    _check(e, moe.bias_update_coeff == 0 or moe.router_bias,
           f"model.moe.bias_update_coeff={moe.bias_update_coeff} needs model.moe.router_bias=true")


def _validate_token_chunks(e: list[str], cfg: RunConfig) -> None:
    """model.moe.token_chunks divides the tokens of a rank's micro-batch (the batch's own check names
    a batch that does not split over ranks)."""
    N, t = cfg.model.moe.token_chunks, cfg.train
    if N == 1 or not cfg.model.moe.n_experts or t.batch_size % (cfg.dp_size * t.grad_accum):
        return
    T = cfg.micro_batch * cfg.data.seq_len
    _check(e, T % N == 0, f"model.moe.token_chunks={N} must divide the tokens of a rank's micro-batch: "
           f"data.seq_len={cfg.data.seq_len} x {cfg.micro_batch} sequences (train.batch_size={t.batch_size} / "
           f"({cfg.dp_size} ranks x train.grad_accum={t.grad_accum})) = {T}")


def _validate_block_chunks(e: list[str], cfg: RunConfig) -> None:
    """memory.block_chunks splits a rank's micro-batch by sequences, under full recompute, dropless."""
    N, t = cfg.memory.block_chunks, cfg.train
    if N == 1:
        return
    _check(e, cfg.memory.recompute == "full",
           f"memory.block_chunks={N} needs memory.recompute='full' (the chunks are recomputed one at a time)")
    _check(e, cfg.model.moe.token_chunks == 1,
           f"memory.block_chunks={N} takes model.moe.token_chunks=1 (it is {cfg.model.moe.token_chunks}): a block "
           "chunk's MoE region in token chunks would hold every token chunk's expert-weight gradient at once "
           "in backward; chunk the block more instead")
    _check(e, not cfg.model.moe.capacity_factor,
           f"memory.block_chunks={N} needs a dropless MoE (model.moe.capacity_factor=0): a capacity counts an "
           "expert's rows over the whole micro-batch")
    if t.batch_size % (cfg.dp_size * t.grad_accum):
        return
    _check(e, cfg.micro_batch % N == 0,
           f"memory.block_chunks={N} must divide a rank's micro-batch of {cfg.micro_batch} sequences "
           f"(train.batch_size={t.batch_size} / ({cfg.dp_size} ranks x train.grad_accum={t.grad_accum}))")


def _validate_groups(e: list[str], moe: MoEConfig) -> None:
    G = moe.n_group
    if moe.n_experts % G:
        e.append(f"model.moe.n_group={G} must divide model.moe.n_experts={moe.n_experts}")
        return
    _check(e, moe.topk_group <= G, f"model.moe.topk_group={moe.topk_group} must be in 1..model.moe.n_group={G}")
    per_group = moe.n_experts // G
    _check(e, G == 1 or per_group >= 2,
           f"model.moe.n_group={G} leaves {per_group} expert per group; group scores need >= 2")
    _check(e, moe.top_k <= moe.topk_group * per_group,
           f"model.moe.top_k={moe.top_k} exceeds the {moe.topk_group * per_group} experts of "
           f"model.moe.topk_group={moe.topk_group} groups")


def _validate_memory(e: list[str], mem: MemoryConfig) -> None:
    for name in REGIONS:
        value = getattr(mem, name)
        _check(e, mem.recompute == "none" or value == "none",
               f"memory.{name}={value!r} needs memory.recompute='none' (full recompute already covers the region)")
        _check(e, not mem.offload or value != "offload",
               f"memory.{name}='offload' is already implied by memory.offload=true")
    # region policies always keep the exchange (fnmoe.memory.policies): the flag would do nothing there
    _check(e, mem.keep_exchange or mem.recompute == "full",
           "memory.keep_exchange=false (--memory.no-keep-exchange) needs memory.recompute='full'")
    if mem.offload_dtype != "compute":
        import torch  # here: a config without the field is checked without torch
        field = f"memory.offload_dtype={mem.offload_dtype!r}"
        _check(e, getattr(torch, mem.offload_dtype, None) is not None,
               f"{field} needs torch.{mem.offload_dtype}, which this torch ({torch.__version__}) lacks")
        _check(e, mem.offload and mem.recompute == "full",
               f"{field} keeps the offloaded block inputs in fp8: it needs memory.offload=true and "
               f"memory.recompute='full' (here offload={mem.offload}, recompute={mem.recompute!r})")


def _validate_expert_gather(e: list[str], cfg: RunConfig) -> None:
    """An fp8 expert gather needs the dtype in this torch and expert stacks that fsdp gathers."""
    name, mesh, E = cfg.mesh.expert_gather_dtype, cfg.mesh, cfg.model.moe.n_experts
    if name == "compute":
        return
    import torch  # here: a config without the field is checked without torch
    _check(e, getattr(torch, name, None) is not None,
           f"mesh.expert_gather_dtype={name!r} needs torch.{name}, which this torch ({torch.__version__}) lacks")
    _check(e, mesh.fsdp > 1 and E > 0,
           f"mesh.expert_gather_dtype={name!r} quantises the expert stacks' all-gather over mesh.fsdp, but "
           f"mesh.fsdp={mesh.fsdp} with model.moe.n_experts={E} gathers no expert weights: set mesh.fsdp > 1, "
           "or leave it 'compute'")


def _validate_expert_gemm(e: list[str], cfg: RunConfig) -> None:
    """fp8 expert GEMMs need the dtype in this torch, routed experts through expert_mlp, and on a GPU
    fp8 tensor cores (compute capability 8.9+) and torch's scaled grouped GEMM."""
    name, moe = cfg.mesh.expert_gemm_dtype, cfg.model.moe
    if name == "compute":
        return
    import torch  # here: a config without the field is checked without torch
    field = f"mesh.expert_gemm_dtype={name!r}"
    if getattr(torch, name, None) is None:
        return _check(e, False, f"{field} needs torch.{name}, which this torch ({torch.__version__}) lacks")
    _check(e, moe.n_experts > 0 and moe.impl != "dense",
           f"{field} runs the routed experts' GEMMs in fp8, but model.moe.n_experts={moe.n_experts} with "
           f"model.moe.impl={moe.impl!r} runs none: needs experts and an impl other than 'dense'")
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        _check(e, cc >= (8, 9), f"{field} needs a GPU with fp8 GEMMs (compute capability 8.9+), but "
                                f"{torch.cuda.get_device_name()} is {cc[0]}.{cc[1]}")
        _check(e, hasattr(torch.nn.functional, "scaled_grouped_mm"),
               f"{field} on a GPU needs torch.nn.functional.scaled_grouped_mm, which this torch "
               f"({torch.__version__}) lacks")


MIX_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""a mixture source's name, as it appears in metric keys (val_loss/<name>)"""


def _validate_mix(e: list[str], cfg: RunConfig) -> None:
    d = cfg.data
    if not d.mix:
        return
    _check(e, d.corpus == "bundled", f"data.corpus={d.corpus!r} and data.mix both name the data; set one of them")
    _check(e, not d.prompt_field, "data.prompt_field applies to a JSONL corpus; a mixture's sources are prepared "
           "directories (prepare them with --prompt-field)")
    labels = [s.label for s in d.mix]
    for i, (s, label) in enumerate(zip(d.mix, labels)):
        _check(e, bool(MIX_NAME.fullmatch(label)),
               f"data.mix[{i}] name {label!r} must be letters, digits, '_', '.' or '-' (set name = ...)")
    total = sum(s.weight for s in d.mix)  # each is finite; their sum can overflow, every share then 0
    _check(e, math.isfinite(total), f"data.mix weights sum to {total} (an overflow): give them on a smaller scale, "
           "e.g. as fractions")
    twice = sorted({x for x in labels if labels.count(x) > 1})
    _check(e, not twice, f"data.mix names must differ; {', '.join(twice)} appear more than once (set name = ...)")


def validate(cfg: RunConfig) -> RunConfig:
    """Return cfg unchanged, or raise ValueError listing every problem with field names and values."""
    e = field_errors(cfg) or _model_relations(cfg.model) + _run_relations(cfg) + _hardware_errors(cfg)
    if e:
        raise ValueError("invalid config: " + e[0] if len(e) == 1 else "invalid config:\n  " + "\n  ".join(e))
    return cfg


def _hardware_errors(cfg: RunConfig) -> list[str]:
    """The plan section's figures, the profile's with the given ones over them, each in its range."""
    try:
        hw = hardware(cfg.plan)
    except ValueError as err:
        return [str(err)]
    # the rates a profile may leave to another (None: derived), each a positive finite figure when given
    derived = [f"plan.{name} must be finite, got {v}" if not math.isfinite(v) else f"plan.{name} must be > 0, got {v}"
               for name in OPTIONAL_RATES if (v := getattr(hw, name)) is not None and not (math.isfinite(v) and v > 0)]
    return field_errors(hw, "plan.") + derived


def _run_relations(cfg: RunConfig) -> list[str]:
    e: list[str] = []
    t, o, d = cfg.train, cfg.optim, cfg.data
    E = cfg.model.moe.n_experts
    if cfg.mesh.ep > 1:  # expert parallelism gives every ep rank the same whole experts
        _check(e, E > 0 and E % cfg.mesh.ep == 0,
               f"model.moe.n_experts={E} must be a positive multiple of mesh.ep={cfg.mesh.ep}")
    _check(e, not t.tokens or t.steps == cfg.token_steps,
           f"train.steps={t.steps} and train.tokens={t.tokens} disagree: {t.tokens} tokens at train.batch_size="
           f"{t.batch_size} x data.seq_len={d.seq_len} tokens a step are {cfg.token_steps} steps; set one of them")
    _check(e, t.batch_size % (cfg.dp_size * t.grad_accum) == 0,
           f"train.batch_size={t.batch_size} must be divisible by data-parallel degree "
           f"(mesh.fsdp*mesh.ep={cfg.dp_size}) x train.grad_accum={t.grad_accum}")
    _check(e, not (d.doc_mask and cfg.model.attention_impl == "cpu"),
           "model.attention_impl='cpu' is plain causal; data.doc_mask=true needs 'auto' or 'sdpa'")
    _check(e, d.seq_len <= cfg.model.max_seq_len,
           f"data.seq_len={d.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    _validate_mix(e, cfg)
    if d.tokenizer == "byte" and not d.mix and not (Path(d.corpus) / "index.json").is_file():  # prepared: its own
        _check(e, cfg.model.vocab_size >= 257,
               f"model.vocab_size={cfg.model.vocab_size} is too small for the byte tokenizer (needs >= 257)")
    # q/k RMSNorm undoes any rescaling of the query/key weights, so the clip could not act
    _check(e, not (o.qk_clip and cfg.model.qk_norm), "optim.qk_clip needs model.qk_norm=false")
    _validate_memory(e, cfg.memory)
    _validate_expert_gather(e, cfg)
    _validate_expert_gemm(e, cfg)
    _validate_token_chunks(e, cfg)
    _validate_block_chunks(e, cfg)
    if cfg.profile.steps:
        a, _, b = cfg.profile.steps.partition(":")
        ok = a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)
        _check(e, ok, f"profile.steps must be A:B with 1 <= A <= B, got {cfg.profile.steps!r}")
        _check(e, not ok or int(b) <= t.steps, f"profile.steps={cfg.profile.steps} ends after train.steps={t.steps}")
    return e
