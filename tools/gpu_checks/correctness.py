"""Step 1 of tools/gpu_check.sh, correctness: CUDA against the CPU reference.

Grouped and padded vs loop expert GEMMs (forward and
gradients) and the compiled MoE block; 3 fp32 eager training steps of the tiny
preset on the device vs on CPU; every memory policy fnmoe.config.MemoryConfig offers
(recompute, offload, per-region) against none, or a skip row with the reason this
build refuses it (e.g. offload on CUDA not built yet); the levers: fp8 expert-gather
blocks quantised bitwise as on CPU, whole-block token chunks against none, the
fused AdamW against its eager ops, the donated update bitwise the pure one (3 Muon steps).
"""
from __future__ import annotations

import dataclasses
import json
import traceback
from pathlib import Path

# first: it stubs safetensors where missing, before fnmoe loads
from gpu_checks.common import (DRY_SHAPES, GPU_SHAPES, ROOT, NotOffered, Recorder, build_step, memory_policies,
                               offload_variant, refused, rel_err, status, with_policy)

import torch

from fnmoe import optim
from fnmoe.config import MemoryConfig, RunConfig, load_config
from fnmoe.models.params import init_params
from fnmoe.models.moe import expert_mlp, moe_block
from fnmoe.memory.policies import train_runner
from fnmoe.plan.activations import pool_bytes
from fnmoe.training.step import init_state, make_train_step
from fnmoe.tree import flatten_dict, tree_map


def check_grouped_gemm(rec: Recorder, device: str, dry: bool) -> None:
    """expert_mlp grouped and padded (device, bf16) vs loop (device, bf16) vs loop (CPU, fp32):
    outputs and grads."""
    R, D, F, E = (256, 64, 32, 8) if dry else (8192, 1024, 512, 32)
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 2 * R // E, (E,), generator=g)
    counts[1] = 0  # an expert with no rows
    counts[-1] += R - counts.sum()
    if counts[-1] < 0:
        counts = torch.full((E,), R // E, dtype=torch.int64)
        counts[-1] += R - counts.sum()
    x = torch.randn(R, D, generator=g)
    ws = [torch.randn(E, D, F, generator=g) * D ** -0.5, torch.randn(E, D, F, generator=g) * D ** -0.5,
          torch.randn(E, F, D, generator=g) * F ** -0.5]
    gy = torch.randn(R, D, generator=g)

    def run(dev, dtype, gemm):
        leaves = [t.to(dev, dtype).requires_grad_(True) for t in [x, *ws]]
        y = expert_mlp(*leaves, counts.to(dev), gemm=gemm)
        grads = torch.autograd.grad(y, leaves, gy.to(dev, dtype))
        return y, grads

    y_ref, g_ref = run("cpu", torch.float32, "loop")
    y_loop, g_loop = run(device, torch.bfloat16, "loop")
    names = ["x", "w_gate", "w_up", "w_down"]
    for gemm in ("grouped", "padded"):
        y_new, g_new = run(device, torch.bfloat16, gemm)
        e_out, e_ref = rel_err(y_new, y_loop), rel_err(y_new, y_ref)
        e_grads = max(rel_err(a, b) for a, b in zip(g_new, g_loop))
        e_grads_ref = max(rel_err(a, b) for a, b in zip(g_new, g_ref))
        worst = names[max(range(4), key=lambda i: rel_err(g_new[i], g_ref[i]))]
        rec.row(f"{gemm} GEMM R={R} D={D} F={F} E={E} fwd", f"{gemm} vs loop {e_out:.1e}, vs fp32 CPU {e_ref:.1e}",
                status(e_out < 1e-2 and e_ref < 2e-2))
        rec.row(f"{gemm} GEMM grads", f"{gemm} vs loop max {e_grads:.1e}, vs fp32 CPU max {e_grads_ref:.1e} "
                f"({worst})", status(e_grads < 2e-2 and e_grads_ref < 3e-2))


def check_compiled_moe(rec: Recorder, device: str, dry: bool) -> None:
    """The compiled MoE block (auto's GEMM path) on the device vs the eager loop path on the device, bf16."""
    import bench_moe as bm

    s = bm.Shape.parse(DRY_SHAPES[0] if dry else GPU_SHAPES[0])
    w = bm.make_weights(s)
    cfg = bm.model_config(s)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, s.T, s.D, generator=gen).to(device, torch.bfloat16)
    gy = (torch.randn(1, s.T, s.D, generator=gen) * 1e-2).to(device, torch.bfloat16)
    comp = bm.fnmoe_impl(w, s, device)
    # compiled under the inductor setting bench_moe.main runs with (kernel names for its profile split on
    # CPU): step 3's benchmark of the same block and shape then loads this graph from the inductor cache
    with torch._inductor.config.patch(bm_inductor_patch(device)):
        out_c, grads_c = comp.run(x, gy)
    p = {k: v.to(device, torch.bfloat16).requires_grad_(True) for k, v in w.items()}
    xe = x.detach().requires_grad_(True)
    out_e, stats = moe_block(p, xe, cfg, gemm="loop")
    grads_e = torch.autograd.grad(out_e, [xe, *p.values()], gy)
    # compiled and eager fp32 router logits may differ in the last bit: allow a near-tie to flip a few rows
    moved = int((comp.counts().cpu() - stats["counts_E"].cpu()).abs().sum()) // 2
    e_out = rel_err(out_c, out_e)
    e_grad = max(rel_err(a, b) for a, b in zip(grads_c, grads_e))
    rec.row(f"compiled MoE block ({s}) vs eager loop", f"rows routed differently {moved}, out {e_out:.1e}, "
            f"grads max {e_grad:.1e}", status(moved <= max(1, s.T * s.K // 1000) and e_out < 2e-2 and e_grad < 4e-2))


def bm_inductor_patch(device: str) -> dict:
    """The inductor config bench_moe.main compiles under (tools/bench_moe.py, main)."""
    return {"cpp.enable_kernel_profile": device == "cpu"}


def tiny_run(dry: bool, memory: MemoryConfig | None = None) -> RunConfig:
    """The tiny preset, fp32 eager; the dry run takes a quarter of its batch and half its sequence."""
    run = load_config(ROOT / "configs" / "tiny.toml")
    model = dataclasses.replace(run.model, compute_dtype="float32", compile=False)
    # a run of the 3 steps every check takes: the direct steps and fnmoe's own loop (check_train_loop)
    # then follow one schedule (a run shorter than the preset's warmup clamps it)
    run = dataclasses.replace(run, model=model, memory=memory or run.memory,
                              train=dataclasses.replace(run.train, steps=3))
    if dry:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, batch_size=4),
                                  data=dataclasses.replace(run.data, seq_len=64))
    return run


_DATA: dict = {}


def _data(run: RunConfig):
    from fnmoe.data.loader import load_data

    key = (run.data, run.model.vocab_size)
    if key not in _DATA:
        _DATA[key] = load_data(run.data, run.model.vocab_size)
    return _DATA[key]


def train_losses(run: RunConfig, device: str, steps: int) -> list[tuple[float, float]]:
    """(loss, grad_norm) of `steps` training steps of run on device, from init_params and the preset's data."""
    from fnmoe.data.loader import Loader

    torch.manual_seed(run.train.seed)
    tx = optim.from_config(run.optim, run.train.steps)
    params = tree_map(lambda t: t.to(device), init_params(run.model, run.train.seed))
    state = init_state(params, tx)
    step_fn, _ = build_step(run, tx)
    t = run.train
    loader = Loader(_data(run), run.data.seq_len, t.batch_size, t.grad_accum, t.seed)
    out = []
    for s in range(steps):
        batch = [tuple(v.to(device) for v in loader.batch_at(s, 0, 1, m)) for m in range(t.grad_accum)]
        state, m = step_fn(state, batch)
        out.append((m["loss"], m["grad_norm"]))
    return out


def check_train_steps(rec: Recorder, device: str, dry: bool) -> list:
    steps = 3
    # the CPU reference on the padded expert path: it needs no C++ build (~17 s on a fresh machine)
    cpu_run = tiny_run(dry)
    cpu_run = dataclasses.replace(cpu_run, model=dataclasses.replace(
        cpu_run.model, moe=dataclasses.replace(cpu_run.model.moe, impl="padded")))
    ref = train_losses(cpu_run, "cpu", steps)
    got = train_losses(tiny_run(dry), device, steps)
    e = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, ref))
    eg = max(abs(a[1] - b[1]) / max(abs(b[1]), 1e-12) for a, b in zip(got, ref))
    t = tiny_run(dry).train
    rec.row(f"tiny preset ({t.batch_size} x {tiny_run(dry).data.seq_len}), {steps} fp32 eager steps, {device} vs cpu",
            f"losses {' '.join(f'{a[0]:.4f}' for a in got)}; max rel diff loss {e:.1e}, grad norm {eg:.1e}",
            status(e < 2e-3 and eg < 1e-2))
    return got


def check_memory_policies(rec: Recorder, device: str, dry: bool, base: list | None) -> None:
    """Every memory policy on the device, 3 fp32 eager steps of the tiny preset: the same losses as none."""
    steps = 3
    base = base or train_losses(tiny_run(dry), device, steps)
    for label, kw in memory_policies()[1:]:
        try:
            run = with_policy(tiny_run(dry), kw)
            got = train_losses(run, device, steps)
        except Exception as e:
            why = refused(e)
            if why is None:
                traceback.print_exc()
                rec.row(f"memory {label} vs none on {device}", f"{type(e).__name__}: {str(e)[:150]}", "FAIL")
            else:
                rec.row(f"memory {label}", f"not offered here: {why}", "skip")
            continue
        e = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, base))
        rec.row(f"memory {label} vs none on {device} ({steps} fp32 steps)", f"max rel loss diff {e:.1e}",
                status(e < 1e-5))
    if offload_variant() is None:
        names = ", ".join(f.name for f in dataclasses.fields(MemoryConfig))
        rec.row("offload policy", f"not offered by MemoryConfig (fields: {names})", "skip")


def check_train_loop(rec: Recorder, device: str, dry: bool, base: list | None) -> None:
    """`fnmoe train`'s own loop (fnmoe.training.loop.train): it must put params and batches on the GPU by itself."""
    import tempfile

    from fnmoe.training.loop import train

    run = tiny_run(dry)
    with tempfile.TemporaryDirectory() as tmp:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=3, eval_every=0, eval_batches=1,
                                                                 run_dir=tmp), resume="none")
        out = train(run)
        where = next(iter(flatten_dict(out["params"]).values())).device.type
        losses = [json.loads(line)["loss"] for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()
                  if '"loss"' in line]
    e = max(abs(a - b[0]) / abs(b[0]) for a, b in zip(losses, base)) if base else float("nan")
    rec.row("fnmoe train loop, 3 steps", f"params on {where}; losses {' '.join(f'{x:.4f}' for x in losses)}; "
            f"max rel diff vs the direct steps {e:.1e}", status(where == torch.device(device).type and e < 1e-5))


def final_params(run: RunConfig, device: str, steps: int, donate: bool) -> dict:
    """Params (flat, on CPU) after `steps` steps of run on device, pure or donated."""
    from fnmoe.data.loader import Loader

    tx = optim.from_config(run.optim, run.train.steps)
    state = init_state(tree_map(lambda t: t.to(device), init_params(run.model, run.train.seed)), tx)
    step_fn = make_train_step(run, tx, train_runner(run, pool_bytes(run)), donate=donate)
    loader = Loader(_data(run), run.data.seq_len, run.train.batch_size, 1, run.train.seed)
    for s in range(steps):
        state, _ = step_fn(state, [tuple(v.to(device) for v in loader.batch_at(s, 0, 1, 0))])
    return {k: v.detach().cpu() for k, v in flatten_dict(state.params).items()}


def check_levers(rec: Recorder, device: str, dry: bool, base: list | None) -> None:
    """The JUPITER levers on the device: fp8 expert-gather blocks bitwise as on CPU and within their
    bound, whole-block token chunks against the unchunked losses, the donated update bitwise the pure one."""
    from fnmoe.kernels import fp8_blocks
    from fnmoe.parallel import fp8

    g = torch.Generator().manual_seed(2)
    shape = (3, 200, 300) if dry else (8, 2048, 1400)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 0, shape, generator=g).float())
    (q_c, s_c), (q_d, s_d) = fp8.quantise(x), fp8.quantise(x.to(device))
    y = fp8.dequantise(q_d, s_d, torch.bfloat16).cpu()
    same = torch.equal(q_c.view(torch.uint8), q_d.cpu().view(torch.uint8)) and torch.equal(s_c, s_d.cpu())
    within = bool(((x - y.float()).abs() <= torch.maximum(x.abs() * 2**-4, fp8_blocks._spread(s_c, x.shape) * 2**-10)
                   + x.abs() * 2**-8).all())  # + bf16's rounding of the dequantised value
    rec.row(f"fp8 block quantise {tuple(shape)} on {device} vs cpu", f"bitwise equal {same}; bf16 round trip "
            f"within 2^-4 of each block amax {within}", status(same and within))
    steps = 3
    base = base or train_losses(tiny_run(dry), device, steps)
    try:
        run = with_policy(tiny_run(dry), {"recompute": "full", "block_chunks": 2})
        got = train_losses(run, device, steps)
        e = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, base))
        rec.row(f"block chunks 2 (full recompute) vs none on {device} ({steps} fp32 steps)",
                f"max rel loss diff {e:.1e}", status(e < 1e-5))
    except NotOffered as e:
        rec.row("block chunks", f"not offered here: {e}", "skip")
    run = tiny_run(dry)
    # the dry run orthogonalises in fp32: bf16 batched GEMMs on a CPU without AVX512-BF16 or AMX are
    # 10-30x slower (20 of the dry run's seconds); donated against pure is bitwise in either dtype
    muon = dataclasses.replace(run.optim, name="muon", ns_dtype="float32" if dry else run.optim.ns_dtype)
    run = dataclasses.replace(run, optim=muon, train=dataclasses.replace(run.train, grad_accum=1))
    pure, donated = final_params(run, device, steps, False), final_params(run, device, steps, True)
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    diff = [k for k in pure if not torch.equal(bits(pure[k]), bits(donated[k]))]
    adamw = {f: dataclasses.replace(run, optim=dataclasses.replace(run.optim, name="adamw", fused=f))
             for f in ("on", "off")}
    fused = {f: final_params(r, device, steps, True) for f, r in adamw.items()}
    e = max(rel_err(fused["on"][k], fused["off"][k]) for k in fused["off"] if fused["off"][k].is_floating_point())
    rec.row(f"fused AdamW vs eager ops on {device} ({steps} donated steps)", f"max rel diff of a param leaf {e:.1e}",
            status(e < 1e-6))
    rec.row(f"donated update vs pure on {device} ({steps} Muon steps)",
            f"{len(pure) - len(diff)} of {len(pure)} leaves bitwise equal{': ' + diff[0] if diff else ''}",
            status(not diff))


def step_correctness(rec: Recorder, device: str, dry: bool) -> None:
    rec.guarded("grouped GEMM", check_grouped_gemm, rec, device, dry)
    rec.guarded("compiled MoE block", check_compiled_moe, rec, device, dry)
    base = rec.guarded("tiny preset training steps", check_train_steps, rec, device, dry)
    rec.guarded("fnmoe train loop", check_train_loop, rec, device, dry, base)
    rec.guarded("memory policies", check_memory_policies, rec, device, dry, base)
    rec.guarded("levers", check_levers, rec, device, dry, base)
