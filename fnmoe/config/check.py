"""Config validation: every problem of a config tree at once, each naming its field and value.

`validate_model` checks a ModelConfig alone (hf.load uses it); `validate` checks a whole
RunConfig and raises ValueError listing every problem.
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

from fnmoe.config.schema import MemoryConfig, ModelConfig, MoEConfig, RunConfig


def _check(errors: list[str], ok: bool, msg: str) -> None:
    if not ok:
        errors.append(msg)


def _choice_errors(obj: Any, where: str) -> list[str]:
    """Every Literal-typed field of obj (and of its nested dataclasses) whose value is not a choice
    of its Literal: the annotation is the one list of choices."""
    out, hints = [], typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            out += _choice_errors(value, f"{where}{f.name}.")
        elif typing.get_origin(hint) is Literal and value not in typing.get_args(hint):
            out.append(f"{where}{f.name} must be one of {typing.get_args(hint)}, got {value!r}")
    return out


def validate_model(m: ModelConfig) -> list[str]:
    e = _choice_errors(m, "model.")
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
        _check(e, getattr(m, name) > 0, f"model.{name} must be > 0, got {getattr(m, name)}")
    if m.attention == "mla":
        _validate_mla(e, m)
    else:
        _check(e, m.n_heads % max(m.n_kv_heads, 1) == 0,
               f"model.n_heads={m.n_heads} must be divisible by model.n_kv_heads={m.n_kv_heads}")
        _check(e, m.head_dim > 0 or m.dim % max(m.n_heads, 1) == 0,
               f"model.dim={m.dim} must be divisible by model.n_heads={m.n_heads} when model.head_dim=0")
        _check(e, m.head_dim_ % 2 == 0, f"head dim {m.head_dim_} must be even for RoPE")
    _validate_rope(e, m)
    _check(e, m.attention_impl != "cpu" or m.compute_dtype == "bfloat16",
           f"model.attention_impl='cpu' takes bfloat16 compute (model.compute_dtype={m.compute_dtype!r}); "
           "use 'auto' or 'sdpa'")
    _validate_moe(e, m)
    return e


def _validate_mla(e: list[str], m: ModelConfig) -> None:
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        _check(e, getattr(m, name) > 0, f"model.{name} must be > 0 for MLA, got {getattr(m, name)}")
    for name in ("q_lora_rank", "qk_nope_head_dim"):
        _check(e, getattr(m, name) >= 0, f"model.{name} must be >= 0, got {getattr(m, name)}")
    _check(e, m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even for RoPE")
    _check(e, not m.qk_norm, "model.qk_norm is a GQA option; MLA normalises its latents instead")


def _validate_rope(e: list[str], m: ModelConfig) -> None:
    _check(e, m.rope_theta > 0, f"model.rope_theta must be > 0, got {m.rope_theta}")
    if m.rope_scaling == "yarn":
        _check(e, m.yarn_factor > 0, f"model.yarn_factor must be > 0, got {m.yarn_factor}")
        _check(e, m.yarn_original_max_seq_len > 0,
               f"model.yarn_original_max_seq_len must be > 0, got {m.yarn_original_max_seq_len}")


def _validate_moe(e: list[str], m: ModelConfig) -> None:
    moe = m.moe
    _check(e, moe.n_experts >= 0, f"model.moe.n_experts must be >= 0, got {moe.n_experts}")
    if moe.n_experts > 0:
        _check(e, 1 <= moe.top_k <= moe.n_experts,
               f"model.moe.top_k={moe.top_k} must be in 1..model.moe.n_experts={moe.n_experts}")
        _check(e, moe.expert_hidden > 0, f"model.moe.expert_hidden must be > 0, got {moe.expert_hidden}")
        _validate_groups(e, moe)
    _check(e, moe.n_shared_experts >= 0, f"model.moe.n_shared_experts must be >= 0, got {moe.n_shared_experts}")
    _check(e, 0 <= moe.first_k_dense <= m.n_layers,
           f"model.moe.first_k_dense={moe.first_k_dense} must be in 0..model.n_layers={m.n_layers}")
    bad = [i for i in moe.dense_layers if not 0 <= i < m.n_layers]
    _check(e, not bad, f"model.moe.dense_layers has indices outside 0..{m.n_layers - 1}: {bad}")
    _check(e, moe.moe_every >= 1, f"model.moe.moe_every must be >= 1, got {moe.moe_every}")
    for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_coeff", "capacity_factor"):
        _check(e, getattr(moe, name) >= 0, f"model.moe.{name} must be >= 0, got {getattr(moe, name)}")
    _check(e, moe.bias_update_coeff == 0 or moe.router_bias,
           f"model.moe.bias_update_coeff={moe.bias_update_coeff} needs model.moe.router_bias=true")


def _validate_groups(e: list[str], moe: MoEConfig) -> None:
    G = moe.n_group
    if G < 1 or moe.n_experts % G:
        _check(e, False, f"model.moe.n_group={G} must be >= 1 and divide model.moe.n_experts={moe.n_experts}")
        return
    _check(e, 1 <= moe.topk_group <= G, f"model.moe.topk_group={moe.topk_group} must be in 1..model.moe.n_group={G}")
    per_group = moe.n_experts // G
    _check(e, G == 1 or per_group >= 2,
           f"model.moe.n_group={G} leaves {per_group} expert per group; group scores need >= 2")
    _check(e, moe.top_k <= moe.topk_group * per_group,
           f"model.moe.top_k={moe.top_k} exceeds the {moe.topk_group * per_group} experts of "
           f"model.moe.topk_group={moe.topk_group} groups")


def _validate_memory(e: list[str], mem: MemoryConfig) -> None:
    for name in ("attention", "moe", "mlp"):
        value = getattr(mem, name)
        _check(e, mem.recompute == "none" or value == "none",
               f"memory.{name}={value!r} needs memory.recompute='none' (full recompute already covers the region)")
        _check(e, not mem.offload or value != "offload",
               f"memory.{name}='offload' is already implied by memory.offload=true")
    _check(e, mem.offload_min_bytes >= 0, f"memory.offload_min_bytes must be >= 0, got {mem.offload_min_bytes}")
    _check(e, mem.max_inflight_bytes > 0, f"memory.max_inflight_bytes must be > 0, got {mem.max_inflight_bytes}")


def validate(cfg: RunConfig) -> RunConfig:
    """Return cfg unchanged, or raise ValueError listing every problem with field names and values."""
    e = validate_model(cfg.model)
    for f in dataclasses.fields(cfg):  # the model's choices are checked by validate_model
        if f.name != "model" and dataclasses.is_dataclass(getattr(cfg, f.name)):
            e += _choice_errors(getattr(cfg, f.name), f"{f.name}.")
    t, o, d = cfg.train, cfg.optim, cfg.data
    for name in ("steps", "batch_size", "grad_accum", "ce_chunks", "log_every", "eval_batches"):
        _check(e, getattr(t, name) > 0, f"train.{name} must be > 0, got {getattr(t, name)}")
    _check(e, cfg.mesh.fsdp > 0 and cfg.mesh.ep > 0,
           f"mesh.fsdp={cfg.mesh.fsdp} and mesh.ep={cfg.mesh.ep} must be > 0")
    E = cfg.model.moe.n_experts
    if cfg.mesh.ep > 1:  # expert parallelism gives every ep rank the same whole experts
        _check(e, E > 0 and E % cfg.mesh.ep == 0,
               f"model.moe.n_experts={E} must be a positive multiple of mesh.ep={cfg.mesh.ep}")
    if t.batch_size > 0 and t.grad_accum > 0 and cfg.dp_size > 0:
        _check(e, t.batch_size % (cfg.dp_size * t.grad_accum) == 0,
               f"train.batch_size={t.batch_size} must be divisible by data-parallel degree "
               f"(mesh.fsdp*mesh.ep={cfg.dp_size}) x train.grad_accum={t.grad_accum}")
    _check(e, d.seq_len > 0, f"data.seq_len must be > 0, got {d.seq_len}")
    _check(e, not (d.doc_mask and cfg.model.attention_impl == "cpu"),
           "model.attention_impl='cpu' is plain causal; data.doc_mask=true needs 'auto' or 'sdpa'")
    _check(e, d.seq_len <= cfg.model.max_seq_len,
           f"data.seq_len={d.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    _check(e, 0 < d.val_fraction < 1, f"data.val_fraction must be in (0, 1), got {d.val_fraction}")
    if d.tokenizer == "byte" and not (Path(d.corpus) / "index.json").is_file():  # a prepared corpus has its own
        _check(e, cfg.model.vocab_size >= 257,
               f"model.vocab_size={cfg.model.vocab_size} is too small for the byte tokenizer (needs >= 257)")
    _check(e, o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    _check(e, 0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _check(e, o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _check(e, 0 < o.decay_fraction <= 1, f"optim.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    _check(e, o.clip_norm >= 0, f"optim.clip_norm must be >= 0, got {o.clip_norm}")
    _check(e, o.ns_steps >= 1, f"optim.ns_steps must be >= 1 (Newton-Schulz iterations of Muon), got {o.ns_steps}")
    if o.qk_clip:
        _check(e, o.qk_clip_tau > 0, f"optim.qk_clip_tau must be > 0, got {o.qk_clip_tau}")
        # q/k RMSNorm undoes any rescaling of the query/key weights, so the clip could not act
        _check(e, not cfg.model.qk_norm, "optim.qk_clip needs model.qk_norm=false")
    _check(e, cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {cfg.checkpoint.keep_last}")
    _check(e, cfg.checkpoint.every >= 0, f"checkpoint.every must be >= 0, got {cfg.checkpoint.every}")
    _validate_memory(e, cfg.memory)
    _check(e, cfg.plan.imbalance >= 1, f"plan.imbalance must be >= 1 (max/mean expert load), got {cfg.plan.imbalance}")
    for name in ("hbm_gb", "host_gb"):
        _check(e, getattr(cfg.plan, name) >= 0, f"plan.{name} must be >= 0, got {getattr(cfg.plan, name)}")
    for name in ("matmul_tflops", "attention_tflops", "nvlink_gbps", "network_gbps", "host_link_gbps"):
        _check(e, getattr(cfg.plan, name) > 0, f"plan.{name} must be > 0 (a rate the step-time model divides by), "
                                               f"got {getattr(cfg.plan, name)}")
    _check(e, cfg.plan.gpus_per_node >= 1, f"plan.gpus_per_node must be >= 1, got {cfg.plan.gpus_per_node}")
    if cfg.profile.steps:
        a, _, b = cfg.profile.steps.partition(":")
        ok = a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)
        _check(e, ok, f"profile.steps must be A:B with 1 <= A <= B, got {cfg.profile.steps!r}")
        _check(e, not ok or int(b) <= t.steps, f"profile.steps={cfg.profile.steps} ends after train.steps={t.steps}")
    if e:
        raise ValueError("invalid config:\n  " + "\n  ".join(e))
    return cfg
