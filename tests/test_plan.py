"""The planner and the large presets: shapes and counts, byte formulas against MemTracker, the CLI."""
import dataclasses
import gc
import json
import time
import weakref
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fnmoe import optim

from fnmoe.models import transformer as model
from fnmoe.models.attention import rms_norm, rope
from fnmoe.cli import main
from fnmoe.config import load_config
from fnmoe.kernels import attention as cpu_attention
from fnmoe.kernels import gemm as cpu_gemm
from fnmoe.memory.policies import with_policy
from fnmoe.models.moe import expert_gemm, swiglu
from fnmoe.plan.flops import param_counts
from fnmoe.models.params import init_params
from fnmoe.plan.activations import (attention_bytes, mlp_bytes, moe_bytes, norm_bytes, selective_bytes,
                                    swiglu_bytes)
from fnmoe.plan.summary import plan
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict

ROOT = Path(__file__).resolve().parent.parent
LARGE = ["kimi_k2_1t", "deepseek_v3_671b", "deepseek_v3_16b", "qwen3_30b_a3b"]
# published totals (DeepSeek-V3 without its MTP layer; Qwen3's "30.5B")
TOTALS = {"kimi_k2_1t": 1.026e12, "deepseek_v3_671b": 671e9, "deepseek_v3_16b": 15.7e9, "qwen3_30b_a3b": 30.5e9}


@pytest.mark.parametrize("name", LARGE)
def test_large_presets_load_count_and_plan(name):
    run = load_config(ROOT / "configs" / f"{name}.toml")
    assert run.model.compute_dtype == "bfloat16" and run.micro_batch >= 1
    total, active = param_counts(run.model)
    assert abs(total / TOTALS[name] - 1) < 0.005
    p = plan(run)
    assert p["fits"]["device"] and p["fits"]["host"], (name, p["per_rank_bytes"])


def test_kimi_k2_counts_and_reference_layout():
    run = load_config(ROOT / "configs" / "kimi_k2_1t.toml")
    total, active = param_counts(run.model)
    assert abs(total / 1.026e12 - 1) < 0.005 and abs(active / 3.17e10 - 1) < 0.01
    # the layout `fnmoe plan --search` ranks first for 384 GH200 (tests/test_plan_search.py checks it stays so)
    assert (run.mesh.fsdp, run.mesh.ep, run.optim.name, run.plan.hardware) == (96, 4, "muon", "jupiter-gh200")
    # every block recomputed replaying its all-to-alls on NVLink, its input offloaded to Grace memory
    assert run.memory.recompute == "full" and run.memory.offload and not run.memory.keep_exchange


def test_plan_cli_json_for_1t_on_384_ranks_is_fast(capsys):
    start = time.perf_counter()
    assert main(["plan", "--config", str(ROOT / "configs" / "kimi_k2_1t.toml"), "--mesh.fsdp", "48",
                 "--mesh.ep", "8", "--mesh.reduce-dtype", "float32", "--json"]) == 0
    assert time.perf_counter() - start < 30
    p = json.loads(capsys.readouterr().out)
    for key in ("total_params", "active_params", "flops_per_token", "comm_bytes_per_step"):
        assert p[key] > 0
    assert set(p["per_rank_bytes"]) >= {"params", "grads", "optim", "gathered", "activations", "offload_host"}
    assert p["step_time"]["model"].startswith("stated rates")
    # Muon keeps one fp32 moment on matrices: ~12 B/param sharded over 384 ranks (ANCHORS: 32.1 GB),
    # with float32 gradients (the preset's bf16 reduce-scatters keep them bf16: half the grads row)
    r = p["per_rank_bytes"]
    assert abs((r["params"] + r["grads"] + r["optim"]) / 32.1e9 - 1) < 0.01


def test_plan_table_and_policies(capsys):
    cfg = str(ROOT / "configs" / "kimi_k2_1t.toml")
    assert main(["plan", "--config", cfg, "--memory.recompute", "none", "--memory.no-offload",
                 "--memory.keep-exchange", "--memory.block-chunks", "1"]) == 0
    assert "fits 96 GB: False" in capsys.readouterr().out
    assert main(["plan", "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "fits 96 GB: True" in out and "hardware jupiter-gh200" in out and "as built:" in out


def test_attention_bytes_double_with_sequence_length():
    for name in ("tiny", "tiny_mla", "kimi_k2_1t"):
        cfg = load_config(ROOT / "configs" / f"{name}.toml").model
        assert attention_bytes(cfg, 2 * 4096, 2) == 2 * attention_bytes(cfg, 4096, 2)


def _live(mt: MemTracker) -> int:
    return mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]


def _measure(run):
    """Live-byte deltas at phase boundaries of one fp32 eager step, measured by MemTracker."""
    params = init_params(run.model, 0)
    leaves = flatten_dict(params)
    tx = optim.from_config(run.optim, 10)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.model.vocab_size, (run.micro_batch, run.data.seq_len + 1), generator=g)
    mt = MemTracker()
    mt.track_external(*leaves.values())
    with mt:
        base = _live(mt)
        state = tx.init(params)
        after_init = _live(mt)
        trainable = {k: v.requires_grad_(True) for k, v in leaves.items() if not k.startswith("buffers.")}
        loss, _ = loss_fn(params, tokens[:, :-1], tokens[:, 1:], run.model, tokens[:, 1:].numel())
        after_forward = _live(mt)
        grads = torch.autograd.grad(loss, list(trainable.values()))
        del loss
        after_backward = _live(mt)
    del state, grads
    return {"params": base, "optim": after_init - base, "activations": after_forward - after_init,
            "grads": after_backward - after_forward + (after_forward - after_init)}


@pytest.mark.parametrize("name,seq_len,batch", [("tiny", 128, 16), ("tiny_qwen3", 512, 4)])
def test_plan_matches_measured_bytes(name, seq_len, batch):
    run = load_config(ROOT / "configs" / f"{name}.toml")
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, seq_len=seq_len),
                              train=dataclasses.replace(run.train, batch_size=batch))
    measured = _measure(run)
    planned = plan(run)["per_rank_bytes"]
    for key, value in measured.items():
        assert abs(planned[key] / value - 1) < 0.10, (key, planned[key], value)


# Per region: the planner's saved-bytes formulas (fnmoe.plan.activations) against the bytes autograd
# holds for backward once the region's forward returns, on the ops themselves (B·L = 120 tokens of 3
# rows). The planner models the GPU's kernels; where CPU runs another kernel or keeps something the
# formula leaves out, _cpu_extra names it, and the check is exact: measured == planned + extra.
#
# What CPU keeps that the GPU would not: MLA attention in fp32 runs CPU SDPA's math path (its flash
# kernel needs equal q/k/v head dims), which keeps the [B, H, L, L] fp32 probabilities, a contiguous v
# and no lse, where GPU bf16 runs the efficient kernel (q, k, v as a view of the kv projection, the
# output written [B, L, H, U], lse). In bf16 the check forces fnmoe's CPU attention kernel (GQA and MLA),
# which keeps what flash and efficient keep; fnmoe's grouped GEMM keeps int64 group ends where torch's
# grouped_mm takes int32 offsets. Everything else in extra is per position or per expert, on any device:
# RoPE's cos/sin cast to bf16 for q and k (per token with packed documents: not planned), the router
# weight's fp32 copy, the balance losses' counts. GQA attention in fp32 runs CPU flash, which keeps
# what CUDA flash keeps; norms, SwiGLU and the routing are the same ops on both.
_B, _L = 3, 40
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _regions(name: str) -> list[str]:
    cfg = load_config(ROOT / "configs" / f"{name}.toml").model
    ffn = {"moe" if cfg.is_moe_layer(i) else "mlp" for i in range(cfg.n_layers)}
    return ["norm", "swiglu", "attention", *sorted(ffn)] if "mlp" in ffn else ["norm", "attention", "moe"]


class _Held:
    """What the pack hook hands autograd: alive while the graph holds the saved tensor."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def _saved_bytes(fn, *args, skip=()):
    """(fn(*args), bytes of the distinct storages autograd still holds for backward after it returns):
    a view counts its whole storage once; skip's storages (params, RoPE tables) are left out, and so is
    what an op saved on a graph no output reaches (freed with it)."""
    held = []

    def pack(t):
        h = _Held(t)
        held.append((weakref.ref(h), t.untyped_storage()))
        return h
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        out = fn(*args)
    gc.collect()
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    live = {st.data_ptr(): st.nbytes() for ref, st in held if ref() is not None and st.data_ptr() not in skipped}
    return out, sum(live.values())


def _region_inputs(name: str, region: str, dtype: torch.dtype):
    """(cfg, the region's function, its args, the params and tables to skip), as model.block calls it
    on layer params in the compute dtype (gathered before the block, as one process's hidden_states)."""
    cfg = load_config(ROOT / "configs" / f"{name}.toml").model
    cfg = dataclasses.replace(cfg, compute_dtype=str(dtype).removeprefix("torch."))
    if dtype == torch.bfloat16:  # fnmoe's kernel: flash's saved tensors, for MLA too (CPU SDPA: math)
        cfg = dataclasses.replace(cfg, attention_impl="cpu")
    params = init_params(cfg, 0)
    for leaf in flatten_dict(params).values():
        leaf.requires_grad_(True)
    dense = region in ("mlp", "swiglu")
    i = next(i for i in range(cfg.n_layers) if region in ("norm", "attention") or cfg.is_moe_layer(i) != dense)
    p = model.layer_params(params, i, dtype)
    cos, sin = rope(cfg, torch.arange(_L))
    x = torch.randn(_B, _L, cfg.dim, dtype=dtype, requires_grad=True)
    skip = [*flatten_dict(p).values(), cos, sin]
    if region == "attention":
        attn = dict(p["attn"], norm_D=p["attn_norm"]["w_D"])
        args = (attn, x, cos, sin, cpu_attention.resolved(cfg, _B, _L, dtype, x.device))
        return cfg, model.attention_region, args, skip
    if region == "norm":
        return cfg, lambda x: rms_norm(x, p["attn_norm"]["w_D"], cfg.norm_eps), (x,), skip
    ffn = dict(p["moe" if region == "moe" else "mlp"], norm_D=p["mlp_norm"]["w_D"])
    if region == "moe":
        return cfg, model.moe_region, (ffn, x, cfg, expert_gemm(cfg, dtype)), skip
    if region == "mlp":
        return cfg, model.mlp_region, (ffn, x, cfg), skip
    return cfg, swiglu, (ffn, x), [*skip, x]  # the input is the norm's output: norm_bytes counts it


def _cpu_extra(cfg, region: str, dtype: torch.dtype, gemm: str = "") -> int:
    """Bytes the CPU run keeps beyond the planned (the GPU kernels') formula; see the note above."""
    T, s, H = _B * _L, dtype.itemsize, cfg.n_heads
    if region == "attention" and dtype == torch.bfloat16:
        return 4 * _L * cfg.rope_dim_ * s  # cos and sin in bf16, for q and for k
    if region == "attention" and cfg.attention == "mla":  # math path: probabilities and v, no kv view or lse
        U, X = cfg.v_head_dim, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return 4 * _B * H * _L * _L + T * H * U * 4 - T * X * 4 - 4 * T * H
    if region == "attention" and s == 4:  # CPU SDPA takes grouped kv in fp32; CUDA's efficient kernel every head's
        return -2 * T * (H - cfg.n_kv_heads) * cfg.head_dim_ * s
    if region == "moe":  # counts of the Switch (and sequence) balance loss; group ends; the router's fp32 copy
        m, E = cfg.moe, cfg.moe.n_experts
        return (4 * E + (4 * _B * E if m.seq_aux_loss_coeff else 0) + (8 * E if gemm == "grouped" else 0)
                + (4 * cfg.dim * E if s < 4 else 0))
    return 0


def _planned(cfg, region: str, s: int) -> int:
    T = _B * _L
    return {"norm": lambda: norm_bytes(T, cfg.dim, s), "swiglu": lambda: swiglu_bytes(T, cfg.ffn_hidden, s),
            "attention": lambda: attention_bytes(cfg, T, s), "mlp": lambda: mlp_bytes(cfg, T, s),
            "moe": lambda: moe_bytes(cfg, T, s)}[region]()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,region", [(n, r) for n in ("tiny", "tiny_qwen3", "tiny_mla") for r in _regions(n)])
def test_region_formulas_match_saved_bytes(name, region, dtype, monkeypatch):
    """Each formula to the byte, policy none: norm (its output counted, as the matmul reading it keeps
    it), SwiGLU, attention (GQA, GQA with q/k norms, MLA), dense MLP, MoE (softmax with z-loss; sigmoid
    with groups, bias and a shared expert). The planner counts a region's input in its first norm (in
    fp32 that norm keeps the input itself): the measure counts it too."""
    # the kernels the planner's formulas price (a GPU's, and a CPU's with native bf16): on a CPU without
    # native bf16, fnmoe's fp32 GEMMs keep their operands' fp32 copies (fnmoe.kernels.bf16)
    monkeypatch.setenv("FNMOE_BF16_GEMMS", "native")
    dtype = _DTYPES[dtype]
    if dtype == torch.bfloat16 and region in ("attention", "moe") and not cpu_gemm.available():
        pytest.skip("bf16 attention and MoE take fnmoe's CPU kernels (GPU kernels' saved tensors); not built")
    cfg, fn, args, skip = _region_inputs(name, region, dtype)
    out, measured = _saved_bytes(fn, *args, skip=skip)
    if region == "norm":
        measured += out.numel() * out.element_size()
    planned = _planned(cfg, region, dtype.itemsize)
    extra = _cpu_extra(cfg, region, dtype, args[-1] if region == "moe" else "")
    assert measured == planned + extra, (name, region, measured, planned, extra, measured - planned - extra)


@pytest.mark.parametrize("name,region", [(n, r) for n in ("tiny", "tiny_qwen3", "tiny_mla")
                                         for r in _regions(n) if r in ("attention", "mlp", "moe")])
def test_selective_formulas_match_kept_bytes(name, region):
    """selective_bytes in fp32 against MemTracker (the selective checkpoint keeps its ops' outputs
    where no saved-tensor hook sees them): live bytes after `x + region(x)`, the output dropped, the
    input counted as the planner does. CPU's grouped GEMM is fnmoe's op, which the policy does not
    keep: the MoE runs the loop path, whose per-expert mm outputs are what grouped_mm's are on GPU.
    MLA's math path keeps its scores and no lse (the fused kernels the reverse)."""
    cfg, fn, args, skip = _region_inputs(name, region, torch.float32)
    x = args[1]
    if region == "moe":
        args = (*args[:-1], "loop")
    mt = MemTracker()
    mt.track_external(*skip, x)
    with mt:
        base = _live(mt)
        out = with_policy(fn, "selective")(*args)
        y = x + (out[0] if region == "moe" else out)
        del out
        gc.collect()
        kept = _live(mt) - base - y.numel() * y.element_size() + x.numel() * x.element_size()
    T, H = _B * _L, cfg.n_heads
    extra = 4 * _B * H * _L * _L - 4 * T * H if region == "attention" and cfg.attention == "mla" else 0
    planned = selective_bytes(cfg, region, T, 4, T * cfg.moe.top_k)
    assert kept == planned + extra, (name, region, kept, planned, extra, kept - planned - extra)


def test_the_printed_total_says_it_is_the_larger_peak_not_the_sum(capsys):
    """`fnmoe plan`'s total row names its two candidates with their sizes: the step's peak (the rows
    above but update_transient) and the update's (params, grads, optim, update_transient)."""
    r = plan(load_config(ROOT / "configs" / "tiny.toml"))["per_rank_bytes"]
    step = sum(r[k] for k in ("params", "grads", "optim", "gathered", "activations", "recompute_transient",
                              "logits", "ep_buffers"))
    update = r["params"] + r["grads"] + r["optim"] + r["update_transient"]
    assert r["total_device"] == max(step, update) < step + r["update_transient"]
    assert main(["plan", "--config", str(ROOT / "configs" / "tiny.toml")]) == 0
    total = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("total "))
    assert (f"(not the sum of the rows: the larger of the step's peak, {step / 1e9:.2f} GB = the rows above but "
            f"update_transient, and the update's, {update / 1e9:.2f} GB = ") in total
