"""Step 2 of tools/gpu_check.sh, k2layer: one MoE layer of the Kimi-K2 preset at its per-GPU shapes.

configs/kimi_k2_1t.toml: its E/ep = 96 experts, dim 7168, expert hidden 2048, top-8, the tokens of one chunk of
its micro-batch (memory.block_chunks, else model.moe.token_chunks: 3,584 tokens in 16
chunks of 14 x 4096), bf16, grouped GEMMs, forward + recompute + backward, timed with
CUDA events after warmup; once through expert_mlp alone (what the planner prices) and
once through moe_block (router, permute, combine too), with the experts chosen
round-robin (balanced: every expert the same rows) and at plan.imbalance (1.25: the
busiest rank's rows, spread evenly over its experts). Each row: achieved TFLOP/s
(executed FLOPs: forward, recompute, input and weight gradients, 2·R·I·O a matrix
each, as fnmoe/plan/gemm_time.py counts) beside the planner's time for the same
layer and chunk (gemm_time.moe_layer_expert_s at the preset's hardware profile).
At ~400 TFLOP/s: 10.1 TFLOP an iteration balanced, 12.6 at 1.25, 26 iterations of
each: ~1.5 s of GPU; memory ~22 GB (8.5 GB of weights, as much gradient, ~5 GB for
a chunk), far under an H200's 139 GB, so the whole chunk runs. Then the whole K2 block
(MLA attention, router, shared expert, the GPU's experts, balanced) on one block chunk,
eager and compiled, forward without autograd then recompute + backward as
memory.block_chunks runs it, beside the planner's compute for it (k2_block_planner_ms). Between
them, the fp8 expert GEMMs against bf16 at the same shapes (gpu_checks/fp8.py).

Legend: T tokens, D model dim, F expert hidden, E experts, K top-k, R routed rows,
X experts a GPU holds (E/ep).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

# first: it stubs safetensors where missing, before fnmoe loads
from gpu_checks.common import NOTES, ROOT, Recorder, device_params, leaves, status, time_left
from gpu_checks import fp8

import torch
from torch.utils.checkpoint import checkpoint

from fnmoe.config import MoEConfig, RunConfig, load_config
from fnmoe.models.moe import expert_gemm, expert_mlp, moe_block
from fnmoe.config.hardware import hardware
from fnmoe.plan.activations import tokens_per_rank
from fnmoe.plan.flops import region_flops
from fnmoe.models.transformer import block, rope
from fnmoe.plan.gemm_time import expert_chunks, moe_layer_expert_s, routed_flops_per_token, rows_per_expert
from fnmoe.tree import tree_map


K2_PRESET = ROOT / "configs" / "kimi_k2_1t.toml"


def k2_run(dry: bool) -> RunConfig:
    """The K2 preset; the dry run's at tiny widths (dim 64, expert hidden 32, 64 experts: 16 a GPU at
    its ep 4, top-8) and 64-token sequences, its micro-batch and chunks kept."""
    run = load_config(K2_PRESET, validate_config=False)
    if not dry:
        return run
    moe = dataclasses.replace(run.model.moe, n_experts=64, expert_hidden=32)
    return dataclasses.replace(run, model=dataclasses.replace(run.model, dim=64, n_layers=2, moe=moe),
                               data=dataclasses.replace(run.data, seq_len=64))


def round_robin_router(logits_TE: torch.Tensor, m: MoEConfig, bias_E: torch.Tensor | None = None):
    """A fnmoe.models.routing.Router pinned to balance: token t's k-th expert is (t·K + k) mod E, so every
    expert gets the same rows (one more for the first T·K mod E), whatever the logits; the weights
    are the sigmoid router's normalised scores of the chosen experts (gradients reach the router)."""
    T, E = logits_TE.shape
    idx_TK = round_robin_TK(T, m.top_k, E, logits_TE.device)
    scores_TE = torch.sigmoid(logits_TE)
    w_TK = scores_TE.gather(1, idx_TK)
    w_TK = w_TK / w_TK.sum(-1, keepdim=True) * m.routed_scaling_factor
    return w_TK, idx_TK, scores_TE / scores_TE.sum(-1, keepdim=True)


def round_robin_TK(T: int, K: int, E: int, device) -> torch.Tensor:
    return (torch.arange(T * K, device=device) % E).view(T, K)


def timed_ms(fn, device: str, warmup: int, iters: int) -> float:
    """Median ms of fn() after warmup: CUDA events around each call on the GPU, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class K2Layer:
    """One routed MoE layer of the run on one GPU at its per-GPU shapes: the X = E/ep experts a GPU
    holds, the tokens of one chunk of its micro-batch (a memory.block_chunks block chunk, else a
    model.moe.token_chunks chunk), bf16. Shared experts are left out: the planner prices them with
    the dense GEMMs, not in the expert term this is measured against. One GPU has no all-to-all: at
    an imbalance the busiest rank's extra rows come in as extra tokens of the chunk."""

    def __init__(self, run: RunConfig, device: str):
        m = run.model.moe
        self.run, self.device = run, device
        self.X, self.D, self.F, self.K = m.n_experts // run.mesh.ep, run.model.dim, m.expert_hidden, m.top_k
        self.T = tokens_per_rank(run) // expert_chunks(run)
        # the GPU's own experts as the whole layer: its rows arrive sorted by them (no all-to-all here)
        self.cfg = dataclasses.replace(run.model, moe=dataclasses.replace(m, n_experts=self.X))
        self.gemm = expert_gemm(self.cfg, torch.bfloat16, device)
        self.n_moe = sum(run.model.is_moe_layer(i) for i in range(run.model.n_layers))
        self.p: dict = {}

    def chunk(self) -> str:
        run, mb, L = self.run, self.run.micro_batch, self.run.data.seq_len
        if run.memory.block_chunks > 1:
            return (f"{mb // run.memory.block_chunks} of the micro-batch's {mb} x {L} "
                    f"(memory.block_chunks={run.memory.block_chunks})")
        return f"1/{run.model.moe.token_chunks} of the micro-batch's {mb} x {L} (model.moe.token_chunks)"

    def weight_bytes(self) -> int:
        return 2 * 3 * self.X * self.D * self.F

    def chunk_bytes(self, rows: int) -> int:
        """Roughly one chunk's transient: rows in and out and their gradients, the permuted copies
        (4·D a row), the recompute's gate, up and SwiGLU outputs with their gradients (8·F), bf16."""
        return 2 * rows * (8 * self.D + 8 * self.F)

    def init_weights(self) -> None:
        g = torch.Generator(device=self.device).manual_seed(0)
        X, D, F = self.X, self.D, self.F

        def draw(*shape: int) -> torch.Tensor:
            w = torch.randn(shape, device=self.device, dtype=torch.bfloat16, generator=g)
            return w.mul_(shape[-2] ** -0.5).requires_grad_(True)
        self.p = {"w_router_DE": draw(D, X), "w_gate_EDF": draw(X, D, F), "w_up_EDF": draw(X, D, F),
                  "w_down_EFD": draw(X, F, D)}

    def executed_flops(self, tokens: int) -> float:
        """Forward, recompute, input and weight gradients: four passes of 2·R·I·O a matrix
        (gemm_time's count), from the planner's routed FLOPs a token (flops.py's expert term is 3 of them)."""
        return 4 * routed_flops_per_token(self.run) / self.n_moe * tokens

    def planner_s(self, imbalance: float) -> float:
        run = dataclasses.replace(self.run, plan=dataclasses.replace(self.run.plan, imbalance=imbalance))
        return sum(moe_layer_expert_s(run, recomputed=True).values())

    def planner_rows(self, imbalance: float) -> float:
        run = dataclasses.replace(self.run, plan=dataclasses.replace(self.run.plan, imbalance=imbalance))
        return rows_per_expert(run) * self.X

    def inputs(self, tokens: int, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=self.device).manual_seed(tokens)
        x = torch.randn(*shape, device=self.device, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        return x, torch.randn(*shape, device=self.device, dtype=torch.bfloat16, generator=g).mul_(1e-2)

    def expert_pass(self, x_RD, gy_RD, counts_E) -> None:
        """expert_mlp over the rows under full recompute (torch checkpoint, as fnmoe's policies):
        forward saving nothing, then in backward the forward again and its gradients; the weight
        gradients add into .grad as a step's later chunks do."""
        x_RD.grad = None
        w = self.p
        y_RD = checkpoint(expert_mlp, x_RD, w["w_gate_EDF"], w["w_up_EDF"], w["w_down_EFD"], counts_E, self.gemm,
                          use_reentrant=False)
        y_RD.backward(gy_RD)

    def layer_pass(self, x_BLD, gy_BLD) -> None:
        """moe_block (router, permute, experts, combine) with the round-robin router, recomputed likewise."""
        x_BLD.grad = None
        y_BLD = checkpoint(lambda x: moe_block(self.p, x, self.cfg, self.gemm, router=round_robin_router)[0], x_BLD,
                           use_reentrant=False)
        y_BLD.backward(gy_BLD)

    def finite(self, x: torch.Tensor, entry: str) -> bool:
        """The pass's gradients (its input's and the weights' it reads) exist and are finite."""
        names = [k for k in self.p if entry == "moe_block" or k != "w_router_DE"]
        return all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in [x, *map(self.p.get, names)])


def step_k2layer(rec: Recorder, device: str, dry: bool) -> None:
    run = k2_run(dry)
    lay = K2Layer(run, device)
    imb = run.plan.imbalance
    variants = [("balanced", 1.0)] + ([(f"imbalance {imb:g}", imb)] if imb != 1.0 else [])
    tokens = {label: round(lay.T * i) for label, i in variants}
    flops = {label: lay.executed_flops(t) for label, t in tokens.items()}
    _k2_shape_rows(rec, lay, variants, tokens, flops, dry)
    need = 2 * lay.weight_bytes() + lay.chunk_bytes(max(tokens.values()) * lay.K)
    total = _k2_fits(rec, lay, need)
    if total is None:
        return
    lay.init_weights()
    hw = hardware(run.plan)
    NOTES.append(f"K2 layer rows: planner = gemm_time.moe_layer_expert_s at the preset's profile ({run.plan.hardware}: "
                 f"matmul {hw.matmul_tflops:.0f} TFLOP/s, HBM {hw.hbm_tbps:.2g} TB/s); balanced = round-robin experts, "
                 f"imbalance = the busiest rank's rows (plan.imbalance), each expert the same share")
    warmup, iters = (1, 2) if dry else (3, 10)
    for label, i in variants:
        counts_E = torch.bincount(round_robin_TK(tokens[label], lay.K, lay.X, "cpu").flatten(), minlength=lay.X)
        plan_ms = lay.planner_s(i) * 1e3
        for entry in ("expert_mlp", "moe_block"):
            check = f"K2 {entry}, {label} ({int(counts_E.min())}-{int(counts_E.max())} rows an expert)"
            if time_left() < 15:
                rec.row(check, f"not measured: {time_left():.0f} s left of the step's time", "skip")
                continue
            rec.guarded(check, _k2_measure, rec, lay, check, entry, tokens[label], counts_E, flops[label], plan_ms,
                        warmup, iters)
    if time_left() > 20:
        counts_E = torch.bincount(round_robin_TK(tokens["balanced"], lay.K, lay.X, "cpu").flatten(), minlength=lay.X)
        rec.guarded("K2 fp8 expert GEMMs", fp8.check_fp8_gemm, rec, lay, tokens["balanced"], counts_E, warmup, iters)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    lay.p = {}  # the whole block draws its own
    # eager, then compiled as the preset runs it (a cold compile: ~50 s on 2 CPU cores, so not in the dry run)
    for compiled in (False, True) if device.startswith("cuda") and run.model.compile else (False,):
        if time_left() > 30:
            rec.guarded("K2 whole block", check_k2_block, rec, lay, warmup, iters, compiled)
    if peak is not None:
        rec.row("K2 layer peak memory", f"{peak / 1e9:.3g} GB allocated (estimated {need / 1e9:.3g})",
                status(peak < total))


def k2_block_planner_ms(run: RunConfig) -> dict:
    """The planner's compute for one MoE block on one block chunk, forward + recompute + backward (one
    pass forward, one recompute, two backward: step_time._compute_s's count), by term, in ms: the
    attention and the MoE's router and shared-expert GEMMs at the matmul rate, attention's core at its
    own rate, the routed experts at the roofline (gemm_time)."""
    hw, f, cfg = hardware(run.plan), region_flops(run), run.model
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    tokens = tokens_per_rank(run) // expert_chunks(run)
    routed = routed_flops_per_token(run) / n_moe
    gemm = 4 * tokens * (f["attention"] / cfg.n_layers + f["moe"] / n_moe - routed) / (hw.matmul_tflops * 1e9)
    core = 4 * tokens * f["attention_core"] / cfg.n_layers / (hw.attention_tflops * 1e9)
    return {"gemm": gemm, "core": core, "experts": sum(moe_layer_expert_s(run, recomputed=True).values()) * 1e3}


def check_k2_block(rec: Recorder, lay: "K2Layer", warmup: int, iters: int, compiled: bool) -> None:
    """A whole K2 MoE block (MLA attention, router, shared expert, the GPU's experts, balanced) on one
    block chunk, eager or compiled (as the preset runs it): forward without autograd, then the recompute
    and its backward, as memory.block_chunks runs a chunk; beside the planner's compute for it."""
    run, dev = dataclasses.replace(lay.run, plan=dataclasses.replace(lay.run.plan, imbalance=1.0)), lay.device
    cfg = dataclasses.replace(lay.cfg, n_layers=1, compile=compiled,
                              moe=dataclasses.replace(lay.cfg.moe, first_k_dense=0))
    layer = device_params(cfg, dev)["layers"]["0"]
    p = tree_map(lambda t: t.to(torch.bfloat16).requires_grad_(True), layer)
    B, L = run.micro_batch // max(run.memory.block_chunks, 1), run.data.seq_len
    x, gy = lay.inputs(B * L, (B, L, cfg.dim))
    cos, sin = rope(cfg, torch.arange(L, device=dev))

    def chunk() -> None:
        with torch.no_grad():
            block(p, x, cos, sin, cfg, router=round_robin_router)
        y, _ = block(p, x, cos, sin, cfg, router=round_robin_router)
        y.backward(gy)
        for t in (x, *leaves(p)):
            t.grad = None
    ms = timed_ms(chunk, dev, warmup, iters)
    plan = k2_block_planner_ms(run)
    total = sum(plan.values())
    terms = ", ".join(f"{k} {v:.3g}" for k, v in plan.items())
    rec.row(f"K2 whole block, {B} x {L} (compile={cfg.compile}, balanced)",
            f"{ms:.3g} ms; planner {total:.3g} ms ({terms}); measured/planner {ms / total:.3g}", "ok")


def _k2_shape_rows(rec: Recorder, lay: "K2Layer", variants: list, tokens: dict, flops: dict, dry: bool) -> None:
    """The layer's shapes and work; FAIL when its rows or FLOPs are not the planner's for the same chunk."""
    run = lay.run
    same = all(abs(tokens[lab] * lay.K - lay.planner_rows(i)) <= lay.K
               and abs(flops[lab] / (4 * 2.0 * tokens[lab] * lay.K * 3 * lay.D * lay.F) - 1) < 1e-9
               for lab, i in variants)
    rec.row("K2 layer shapes", f"{K2_PRESET.name}{' (tiny widths)' if dry else ''}: {lay.X} of "
            f"{run.model.moe.n_experts} experts (ep {run.mesh.ep}), dim {lay.D}, expert hidden {lay.F}, top-{lay.K}",
            "info")
    rec.row("K2 layer chunk", f"{lay.T} tokens: {lay.chunk()}", "info")
    rec.row("K2 layer work (rows, FLOPs = the planner's)", f"{lay.gemm} GEMMs, bf16, fwd + recompute + bwd; "
            + "; ".join(f"{lab} {tokens[lab] * lay.K} rows {flops[lab] / 1e12:.3g} TFLOP" for lab, _ in variants),
            status(same))


def _k2_fits(rec: Recorder, lay: "K2Layer", need: int) -> int | None:
    """The device's bytes when the layer's weights, their gradients and one chunk fit in 90% of its free
    memory (always on CPU: 0), else None with a row saying so."""
    mem = (f"weights {lay.weight_bytes() / 1e9:.3g} GB + their grads + one chunk ~"
           f"{(need - 2 * lay.weight_bytes()) / 1e9:.3g} = {need / 1e9:.3g} GB")
    if not lay.device.startswith("cuda"):
        rec.row("K2 layer memory", mem, "ok")
        return 0
    free, total = torch.cuda.mem_get_info()
    torch.cuda.reset_peak_memory_stats()
    if need > 0.9 * free:
        rec.row("K2 layer memory", f"{mem}: over 90% of the {free / 1e9:.0f} GB free; not run", "skip")
        return None
    rec.row("K2 layer memory", f"{mem} of {free / 1e9:.0f} GB free ({total / 1e9:.0f} GB)", "ok")
    return total


def _k2_measure(rec: Recorder, lay: K2Layer, check: str, entry: str, tokens: int, counts_E: torch.Tensor,
                flops: float, plan_ms: float, warmup: int, iters: int) -> None:
    if entry == "expert_mlp":
        x, gy = lay.inputs(tokens, (tokens * lay.K, lay.D))
        counts = counts_E.to(lay.device)
        ms = timed_ms(lambda: lay.expert_pass(x, gy, counts), lay.device, warmup, iters)
    else:
        x, gy = lay.inputs(tokens, (1, tokens, lay.D))
        ms = timed_ms(lambda: lay.layer_pass(x, gy), lay.device, warmup, iters)
    extra = "" if entry == "expert_mlp" else " (+router/permute/combine)"
    rec.row(check, f"{ms:.3g} ms, {flops / ms / 1e9:.3g} TFLOP/s; planner {plan_ms:.3g} ms, "
            f"{flops / plan_ms / 1e9:.3g} TFLOP/s; measured/planner {ms / plan_ms:.3g}{extra}",
            status(lay.finite(x, entry)))
    for w in lay.p.values():  # the next measurement starts from no gradient (its x, gy go when this returns)
        w.grad = None
