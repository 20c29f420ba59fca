"""Step 4 of tools/gpu_check.sh, model: a DeepSeek-V3-16B-shaped model cut to 4 layers per memory policy.

A DeepSeek-V3-16B-shaped model cut to 4 layers (MLA), bf16, compiled, AdamW, 2 x 4096
tokens, donated update (as `fnmoe train`), per memory policy: tokens/s, MFU (989 TFLOP/s
peak), peak memory, and with no policy the eager AdamW (optim.fused=off) beside; policies
that would not finish in the step's time are skipped with a row saying so. Offload's
proofs: each offload policy's CUDA peak below its policy without offload by the bytes
it offloaded less two blocks, and one step's profiler trace with the offload copies
on a side stream while the compute stream runs (copy_overlap).

ModelBench (the model, its batch and one timed step) serves step 5 too (gpu_checks.determinism).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
import traceback
from pathlib import Path

# first: it stubs safetensors where missing, before fnmoe loads
from gpu_checks.common import (PEAK_TFLOPS, RESULTS_DIR, ROOT, Recorder, build_step, device_params, leaves,
                               memory_policies, refused, status, sync, time_left, with_policy)

import torch

from fnmoe import optim
from fnmoe.models import seams
from fnmoe.config import ModelConfig, MoEConfig, OptimConfig, RunConfig, TrainConfig, load_config
from fnmoe.plan.flops import flops_per_token, mfu
from fnmoe.training.step import init_state


def model_16b_cut(dry: bool) -> tuple[ModelConfig, str]:
    """DeepSeek-V3-16B widths (ANCHORS.md; configs/deepseek_v3_16b.toml when present) cut to 4 layers."""
    if dry:
        moe = MoEConfig(n_experts=8, top_k=2, expert_hidden=32, n_shared_experts=2, score_func="softmax",
                        norm_topk_prob=False, first_k_dense=1, aux_loss_coeff=0.001)
        cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, attention="mla", q_lora_rank=0,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn_hidden=128,
                          max_seq_len=256, moe=moe, compute_dtype="bfloat16", compile=False)
        # eager: a cold compile of this model takes ~45 s per policy on 2 CPU cores; the dry run takes
        # the compile path in step 1's compiled MoE block and step 3's benchmark of it instead
        return cfg, "dry run: a tiny MLA model, eager"
    preset = ROOT / "configs" / "deepseek_v3_16b.toml"
    if preset.is_file():
        base = load_config(preset, validate_config=False).model
        cfg = dataclasses.replace(base, n_layers=4, max_seq_len=max(base.max_seq_len, 4096),
                                  compute_dtype="bfloat16", compile=True)
        return cfg, "configs/deepseek_v3_16b.toml with n_layers=4"
    moe = MoEConfig(n_experts=64, top_k=6, expert_hidden=1408, n_shared_experts=2, score_func="softmax",
                    norm_topk_prob=False, first_k_dense=1, aux_loss_coeff=0.001)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if "kv_lora_rank" in fields:
        attn = dict(attention="mla", n_heads=16, n_kv_heads=16, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128)
        note = "ANCHORS.md 16B widths (MLA), 4 layers"
    else:
        attn = dict(n_heads=16, n_kv_heads=16, head_dim=128)
        note = "ANCHORS.md 16B widths, GQA (ModelConfig has no MLA fields), 4 layers"
    cfg = ModelConfig(vocab_size=102400, dim=2048, n_layers=4, ffn_hidden=10944, max_seq_len=4096, moe=moe,
                      compute_dtype="bfloat16", compile=True, **attn)
    return cfg, note


class ModelBench:
    def __init__(self, dry: bool, device: str):
        self.dry, self.device = dry, device
        self.cfg, self.note = model_16b_cut(dry)
        self.B, self.L = (2, 64) if dry else (2, 4096)
        self.warmup, self.iters = (1, 1) if dry else (2, 3)
        self.params = device_params(self.cfg, device)
        self.n_params = sum(t.numel() for t in leaves(self.params))
        gen = torch.Generator().manual_seed(1)
        toks = torch.randint(0, self.cfg.vocab_size, (self.B, self.L + 1), generator=gen).to(device)
        self.batch = [(toks[:, :-1], toks[:, 1:])]
        self.state = None

    def run_cfg(self, memory: dict, fused: str = "auto") -> RunConfig:
        """The run under MemoryConfig overrides `memory`, validated (NotOffered when refused)."""
        run = RunConfig(model=self.cfg, optim=OptimConfig(name="adamw", lr=1e-4, warmup_steps=0, fused=fused),
                        data=dataclasses.replace(RunConfig().data, seq_len=self.L),
                        train=TrainConfig(batch_size=self.B, steps=100, peak_tflops=PEAK_TFLOPS))
        return with_policy(run, memory)

    def measure(self, memory: dict | None = None, fused: str = "auto") -> dict:
        run = self.run_cfg(memory or {}, fused)
        tx = optim.from_config(run.optim, run.train.steps)
        if self.state is None:
            self.state, self.params = init_state(self.params, tx), None  # the state holds them: not twice
        step_fn, runner = build_step(run, tx, run.train.donate)  # as `fnmoe train` steps
        cuda = self.device.startswith("cuda")
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        passes = _PassPeak() if cuda else None
        if passes:
            seams.listen(passes)
        for i in range(self.warmup + self.iters):
            sync(self.device)
            t0 = time.perf_counter()
            self.state, m = step_fn(self.state, self.batch)  # .item() of the loss syncs
            sync(self.device)
            if i >= self.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(m["loss"])
            print(f"    step {i + 1}: {time.perf_counter() - t0:.3f} s, loss {m['loss']:.4f}", flush=True)
        dt = statistics.median(times)
        tps = self.B * self.L / dt
        fpt = flops_per_token(self.cfg, self.L)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        if passes:
            seams.unlisten(passes)
        offloaded = runner.pool.peak_used / 2**30 if runner.pool is not None else 0.0  # none offloaded: no pool
        return {"ms": dt * 1e3, "tps": tps, "mfu": mfu(fpt, tps, PEAK_TFLOPS), "peak_gib": peak, "losses": losses,
                "passes_peak_gib": passes.peak / 2**30 if passes else None, "offloaded_gib": offloaded,
                "step": step_fn}

    def trace(self, step_fn, path: Path) -> dict:
        """One more step under the profiler (CUDA activity), its chrome trace at path: copy_overlap's."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.startswith("cuda")
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            self.state, _ = step_fn(self.state, self.batch)
            sync(self.device)
        prof.export_chrome_trace(str(path))
        return copy_overlap(json.loads(path.read_text()))


    def describe(self) -> tuple[str, str]:
        c = self.cfg
        return (self.note, f"{c.n_layers} layers, dim {c.dim}, {c.moe.n_experts} experts top-{c.moe.top_k} "
                f"+{c.moe.n_shared_experts} shared, {c.attention}, {self.n_params / 1e9:.2f} B params; batch "
                f"{self.B} x {self.L}, bf16, compile={c.compile}")


class _PassPeak:
    """The CUDA peak of the forward and backward passes alone (fnmoe.models.seams' phase marks): what a memory
    policy changes. The update's peak (the optimizer's old and new state side by side) is above every
    policy's passes on the 16B cut (seen on an H200: 76.5 GiB for all of them), so the step's peak
    cannot show what offload frees."""

    def __init__(self):
        self.peak = 0

    def marked(self, phase: str, tree) -> None:
        if phase == "forward":
            torch.cuda.reset_peak_memory_stats()
        elif phase == "update":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())


def copy_overlap(trace: dict) -> dict:
    """From a chrome trace of CUDA activity: the compute stream (the most kernel time), the streams
    of the device<->host copies, their time, and the part of it that ran while a compute-stream
    kernel ran (offload's copies on a side stream overlap compute; on the compute stream they cannot)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    busy: dict = {}
    for e in events:
        if e.get("cat") == "kernel":
            busy[e["args"].get("stream")] = busy.get(e["args"].get("stream"), 0.0) + e["dur"]
    compute = max(busy, key=busy.get) if busy else None
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "kernel" and e["args"].get("stream") == compute)
    merged: list[list[float]] = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and ("DtoH" in e["name"] or "HtoD" in e["name"])]
    copy_us = sum(e["dur"] for e in copies)
    overlap_us = sum(max(0.0, min(e["ts"] + e["dur"], b) - max(e["ts"], a)) for e in copies for a, b in merged)
    return {"compute_stream": compute, "copy_streams": sorted({e["args"].get("stream") for e in copies}, key=str),
            "copy_ms": copy_us / 1e3, "overlap_ms": overlap_us / 1e3}

def fmt_perf(r: dict) -> str:
    m = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    mem = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB (forward+backward {r['passes_peak_gib']:.1f})"
    return f"{r['ms']:.0f} ms/step, {r['tps']:,.0f} tok/s, MFU {m}, peak mem {mem}"



def step_model(rec: Recorder, device: str, dry: bool) -> None:
    mb = ModelBench(dry, device)
    rec.row(*mb.describe(), "info")
    last = 20.0  # seconds the previous policy took (the first one compiles)
    results, traced = {}, False
    for label, kw in memory_policies():
        if time_left() < 1.5 * last:
            rec.row(f"memory {label}", f"not measured: {time_left():.0f} s left of the step's time", "skip")
            continue
        t0 = time.monotonic()
        try:
            r = mb.measure(kw)
        except Exception as e:
            why = refused(e)
            if why is None:
                traceback.print_exc()
                rec.row(f"memory {label}", f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                        "FAIL")
            else:
                rec.row(f"memory {label}", f"not offered here: {why}", "skip")
            continue
        finally:
            gc.collect()
        last = time.monotonic() - t0
        finite = all(x == x and abs(x) < 1e4 for x in r["losses"])
        rec.row(f"memory {label}", fmt_perf(r), status(finite))
        results[label] = r
        if r["offloaded_gib"] and not traced and time_left() > 2 * last:
            traced = True
            rec.guarded(f"offload copies overlap compute ({label})", _overlap_row, rec, mb, r, label)
        r.pop("step")  # its host pool (pinned on CUDA) goes with it
        if label == "none" and time_left() > 3 * last:
            rec.guarded("optim.fused=off", _eager_update_row, rec, mb, r)
    _peak_rows(rec, mb, results)


def _eager_update_row(rec: Recorder, mb: "ModelBench", fused: dict) -> None:
    """The same step with AdamW's eager ops (optim.fused=off) beside the default (fused on a GPU)."""
    r = mb.measure({}, fused="off")
    r.pop("step")
    rec.row("memory none, optim.fused=off", f"{fmt_perf(r)}; the default (fused on a GPU) "
            f"{r['ms'] / fused['ms']:.2f}x as fast", "ok")


def _overlap_row(rec: Recorder, mb: "ModelBench", r: dict, label: str) -> None:
    o = mb.trace(r["step"], RESULTS_DIR[0] / f"trace_{label.replace('=', '_').replace('+', '_')}.json")
    if not mb.device.startswith("cuda"):  # the same step, trace and reading, without CUDA streams
        rec.row(f"offload copies overlap compute ({label})", f"CUDA only (a CPU trace read: {o})", "skip")
        return
    side = [s for s in o["copy_streams"] if s != o["compute_stream"]]
    rec.row(f"offload copies overlap compute ({label})",
            f"copies {o['copy_ms']:.1f} ms on streams {o['copy_streams']} (compute on {o['compute_stream']}), "
            f"{o['overlap_ms']:.1f} ms of them while compute ran", status(bool(side) and o["overlap_ms"] > 0))


def _peak_rows(rec: Recorder, mb: "ModelBench", results: dict) -> None:
    """Each offload policy's CUDA peak of the passes (_PassPeak) against its policy without offload:
    lower by at least the bytes it offloaded less two blocks' (the last block stays; one block is
    reloaded ahead in backward)."""
    for label, r in results.items():
        base = results.get(label.replace("+offload=True", "") if "+offload=True" in label else "none")
        if not r["offloaded_gib"] or base is None or base is r:
            continue
        if r["peak_gib"] is None:
            rec.row(f"offload frees memory ({label})", "CUDA only (torch.cuda.max_memory_allocated)", "skip")
            continue
        block = r["offloaded_gib"] / max(mb.cfg.n_layers - 1, 1)
        drop = base["passes_peak_gib"] - r["passes_peak_gib"]
        rec.row(f"offload frees memory ({label})",
                f"forward+backward peak {base['passes_peak_gib']:.2f} -> {r['passes_peak_gib']:.2f} GiB: "
                f"{drop:.2f} GiB lower, "
                f"{r['offloaded_gib']:.2f} GiB offloaded (bound {r['offloaded_gib'] - 2 * block:.2f})",
                status(drop >= r["offloaded_gib"] - 2 * block))
