"""The steps of tools/gpu_check.sh, one per process: `python tools/gpu_check.py --step NAME --results DIR`.

Steps (in the priority order gpu_check.sh runs them):
  correctness   CUDA against the CPU reference: grouped and padded vs loop expert GEMMs (forward and
                gradients) and the compiled MoE block; 3 fp32 eager training steps of the tiny
                preset on the device vs on CPU; every memory policy fnmoe.config.MemoryConfig offers
                (recompute, offload, per-region) against none, or a skip row with the reason this
                build refuses it (e.g. offload on CUDA not built yet); the levers: fp8 expert-gather
                blocks quantised bitwise as on CPU, whole-block token chunks against none, the
                fused AdamW against its eager ops, the donated update bitwise the pure one (3 Muon steps)
  k2layer       one MoE layer of the Kimi-K2 preset (configs/kimi_k2_1t.toml) at its per-GPU shapes:
                its E/ep = 96 experts, dim 7168, expert hidden 2048, top-8, the tokens of one chunk of
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
                memory.block_chunks runs it, beside the planner's compute for it (k2_block_planner_ms)
  moe           tools/bench_moe.py on the device (against TorchTitan when it imports, else fnmoe alone),
                then tools/bench_adamw.py (fnmoe's AdamW eager and fused against torch.optim.AdamW
                foreach and fused, on a DeepSeek-V3-16B model's leaves cut to 2 layers)
  model         a DeepSeek-V3-16B-shaped model cut to 4 layers (MLA), bf16, compiled, AdamW, 2 x 4096
                tokens, donated update (as `fnmoe train`), per memory policy: tokens/s, MFU (989 TFLOP/s
                peak), peak memory, and with no policy the eager AdamW (optim.fused=off) beside; policies
                that would not finish in the step's time are skipped with a row saying so. Offload's
                proofs: each offload policy's CUDA peak below its policy without offload by the bytes
                it offloaded less two blocks, and one step's profiler trace with the offload copies
                on a side stream while the compute stream runs (copy_overlap)
  determinism   tokens/s of the same model with and without torch.use_deterministic_algorithms,
                and a deterministic replay check
  summary       the table of every step's rows, also written to $OUT/gpu_check.txt when $OUT is set
                (tools/gpu_check_summary.py; gpu_check.sh runs it directly)

Each step appends rows (section, check, result, status) to DIR/<step>.json as it goes, so a
step that times out still reports what it finished. --dry-run runs the same code on CPU at tiny
sizes (CI runs it, with tyro blocked as on the GPU image): steps 1 and 3 compile the MoE block as
the GPU run does (once: step 1 compiles it under bench_moe's inductor settings, so step 3 loads it
from the inductor cache); steps 4 and 5 run their model eager there (a cold compile of it per
memory policy took ~45 s each on 2 CPU cores). The summary is tools/gpu_check_summary.py (no torch).

Needs only torch and fnmoe (no tyro, no torchtitan, no network): Python functions of fnmoe
are called directly, never the `fnmoe` CLI. If safetensors is missing, it is stubbed (no step
reads or writes checkpoints).

Legend: T tokens, D model dim, F expert hidden, E experts, K top-k, R routed rows,
X experts a GPU holds (E/ep).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
import types
import typing
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path[:0] = [str(ROOT), str(TOOLS)]

from gpu_check_summary import SECTIONS, STEPS, summary  # noqa: E402 (torch-free)
PEAK_TFLOPS = 989.0  # H100/H200/GH200 bf16 dense (docs/design.md §7)
NOTES: list[str] = []
DEADLINE = float("inf")  # time.monotonic() by which this step must end (--timeout)
RESULTS_DIR: list[Path] = [Path(".")]  # --results (the step's traces go there)


def _stub_safetensors() -> None:
    """fnmoe imports safetensors at module level (checkpoints, HF); no step here uses it."""
    try:
        import safetensors  # noqa: F401
        import safetensors.torch  # noqa: F401 (fnmoe imports it)
    except ImportError:
        st, stt = types.ModuleType("safetensors"), types.ModuleType("safetensors.torch")

        class SafetensorError(Exception):
            pass

        def missing(*args, **kwargs):
            raise ImportError("safetensors is not installed (stubbed by tools/gpu_check.py)")

        st.SafetensorError, st.safe_open, st.torch = SafetensorError, missing, stt
        stt.save_file = stt.load_file = missing
        sys.modules["safetensors"], sys.modules["safetensors.torch"] = st, stt
        NOTES.append("safetensors not installed: stubbed (no step reads or writes checkpoints)")


_stub_safetensors()

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from fnmoe import compile as fcompile  # noqa: E402
from fnmoe import optim  # noqa: E402
from fnmoe.models import seams  # noqa: E402
from fnmoe.config import MemoryConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig, TrainConfig, load_config  # noqa: E402
from fnmoe.plan.flops import flops_per_token, mfu  # noqa: E402
from fnmoe.models.params import init_params, leaf_inits  # noqa: E402
from fnmoe.models.moe import expert_gemm, expert_mlp, moe_block  # noqa: E402
from fnmoe.memory.policies import train_runner  # noqa: E402
from fnmoe.config.hardware import hardware  # noqa: E402
from fnmoe.plan.activations import pool_bytes, tokens_per_rank  # noqa: E402
from fnmoe.plan.step_time import region_flops  # noqa: E402
from fnmoe.models.transformer import block, rope  # noqa: E402
from fnmoe.plan.gemm_time import expert_chunks, moe_layer_expert_s, routed_flops_per_token, rows_per_expert  # noqa: E402
from fnmoe.training.step import init_state, make_train_step  # noqa: E402
from fnmoe.tree import flatten_dict, map_with_path, tree_map  # noqa: E402


def build_step(run: RunConfig, tx, donate: bool = False):
    """(run's train step, its runner): the host pool sized where the step is built, as fnmoe.training.loop does;
    donate: the update in place (fnmoe.training.loop's default, run.train.donate), else the pure one."""
    runner = train_runner(run, pool_bytes(run))
    return make_train_step(run, tx, runner, donate=donate), runner


class Recorder:
    """Rows of one step, rewritten to DIR/<step>.json after every row."""

    def __init__(self, results: Path, step: str):
        self.path = results / f"{step}.json"
        self.section = SECTIONS[step]
        self.rows: list[list[str]] = []
        self.env = f"torch {torch.__version__}, python {sys.version.split()[0]}"
        if torch.cuda.is_available():
            self.env += f", {torch.cuda.get_device_name(0)}"
        self.flush()

    def row(self, check: str, result: str, status: str = "ok") -> None:
        print(f"  [{self.section}] {check}: {result}  -> {status}", flush=True)
        self.rows.append([check, result, status])
        self.flush()

    def guarded(self, check: str, fn, *args, **kwargs):
        """Run one sub-check; an exception becomes a FAIL row and the step goes on."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            traceback.print_exc()
            self.row(check, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", "FAIL")
        finally:
            print(f"  ({check}: {time.perf_counter() - t0:.1f} s)", flush=True)
        return None

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"section": self.section, "rows": self.rows, "notes": NOTES, "env": self.env}))
        tmp.replace(self.path)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def status(ok: bool) -> str:
    return "ok" if ok else "FAIL"


# ---------------------------------------------------------------- 1 correctness

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


def _memory_kwargs() -> dict:
    return {f.name: f.default for f in dataclasses.fields(MemoryConfig) if f.default is not dataclasses.MISSING}


def memory_policies() -> list[tuple[str, dict]]:
    """(label, MemoryConfig overrides) of the policies MemoryConfig offers, 'none' first: each value of
    `recompute`, a bool `offload` switch (alone and with full recompute), and each per-region value
    applied to every region field (attention / moe / mlp) at once."""
    hints = typing.get_type_hints(MemoryConfig)
    fields = {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(MemoryConfig)}
    out = [("none", {})]
    for v in fields.get("recompute", ()):
        if v != "none":
            out.append((f"recompute={v}", {"recompute": v}))
    for name in fields:
        if "offload" in name and hints[name] is bool:
            out.append((f"{name}=True", {name: True}))
            if "full" in fields.get("recompute", ()):
                out.append((f"recompute=full+{name}", {"recompute": "full", name: True}))
    regions = [n for n, args in fields.items() if n != "recompute" and "none" in args]
    values = [v for v in dict.fromkeys(v for n in regions for v in fields[n]) if v != "none"]
    for v in values:
        out.append((f"{'/'.join(regions)}={v}", {n: v for n in regions if v in fields[n]}))
    return out


def recompute_policies() -> list[str]:
    """The values MemoryConfig.recompute accepts (a Literal), 'none' first."""
    hints = typing.get_type_hints(MemoryConfig)
    vals = list(typing.get_args(hints.get("recompute", str))) or ["none"]
    return sorted(vals, key=lambda v: v != "none")


def offload_variant() -> tuple[dict, str] | None:
    """MemoryConfig kwargs that turn offload on, if MemoryConfig offers it: a bool field named *offload*,
    or a Literal field with an 'offload' value."""
    for label, kw in memory_policies():
        if "offload" in label:
            return kw, label
    return None


class NotOffered(Exception):
    """A memory policy this build refuses (invalid combination, planned but not run, not built on this device)."""


def with_policy(run: RunConfig, overrides: dict) -> RunConfig:
    """run with MemoryConfig overrides, validated (fnmoe.config.validate); NotOffered when refused."""
    from fnmoe.config import validate

    run = dataclasses.replace(run, memory=MemoryConfig(**{**_memory_kwargs(), **overrides}))
    try:
        return validate(run)
    except ValueError as e:
        raise NotOffered(str(e).replace("invalid config:", "").strip().splitlines()[0]) from None


def refused(e: Exception) -> str | None:
    """The reason when e says a policy is not offered (not a bug): validation, 'not run yet', not built."""
    if isinstance(e, NotOffered):
        return str(e)
    if isinstance(e, (NotImplementedError, ValueError)):
        return f"{type(e).__name__}: {str(e).splitlines()[0][:140]}"
    return None


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
    from fnmoe.parallel import fp8

    g = torch.Generator().manual_seed(2)
    shape = (3, 200, 300) if dry else (8, 2048, 1400)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 0, shape, generator=g).float())
    (q_c, s_c), (q_d, s_d) = fp8.quantise(x), fp8.quantise(x.to(device))
    y = fp8.dequantise(q_d, s_d, torch.bfloat16).cpu()
    same = torch.equal(q_c.view(torch.uint8), q_d.cpu().view(torch.uint8)) and torch.equal(s_c, s_d.cpu())
    within = bool(((x - y.float()).abs() <= torch.maximum(x.abs() * 2**-4, fp8._spread(s_c, x.shape) * 2**-10)
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
    run = dataclasses.replace(run, optim=dataclasses.replace(run.optim, name="muon"),
                              train=dataclasses.replace(run.train, grad_accum=1))
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


# ---------------------------------------------------------------- 2 K2 MoE layer

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
        for t in (x, *_leaves(p)):
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


# ---------------------------------------------------------------- 3 MoE benchmark

GPU_SHAPES = ["4096,512,256,32,4", "16384,2048,1408,64,6"]  # the CPU anchor; a DeepSeek-V3-16B layer
DRY_SHAPES = ["256,64,32,8,2"]


def step_moe(rec: Recorder, device: str, dry: bool) -> None:
    import bench_moe as bm

    try:
        import torchtitan  # noqa: F401
        have_tt = True
    except Exception:
        have_tt = False
    if not have_tt:
        rec.row("torchtitan", "does not import here: fnmoe timed alone", "skip")
    argv = ["--device", device]
    argv += ["--iters", "2", "--warmup", "1", "--profile-iters", "1"] if dry else ["--iters", "20", "--warmup", "3",
                                                                                  "--profile-iters", "3"]
    for spec in DRY_SHAPES if dry else GPU_SHAPES:
        res = rec.guarded(f"moe bench {spec}", bm.main,
                          argv + ["--shapes", spec] + ([] if have_tt else ["--no-torchtitan"]))
        if not res:
            continue
        r = res[0]
        for name, v in r["impls"].items():
            split = (" ".join(f"{k.split('+')[0]} {100 * x / v['ms']:.0f}%" for k, x in v["split"].items())
                     if v["split"] else "")
            rec.row(f"{r['shape']} {name}", f"{v['ms']:.2f} ms, {v['gflops']:.0f} GFLOP/s; {split}")
        for name, ratio in r.get("ratio", {}).items():
            # a timing, not a correctness check: "slower" is reported, never a failure
            rec.row(f"{r['shape']} {name}/torchtitan", f"{ratio:.2f} (<1: fnmoe faster)",
                    "ok" if ratio <= 1.0 else "slower")
        for name, problems in r["parity"].items():
            if problems:
                rec.row(f"{r['shape']} parity vs {name}", "; ".join(problems)[:200], "FAIL")
    rec.guarded("adamw bench", _adamw_rows, rec, device, dry)


def _adamw_rows(rec: Recorder, device: str, dry: bool) -> None:
    """tools/bench_adamw.py: fnmoe's AdamW (eager ops, fused) against torch.optim.AdamW (foreach, fused)
    on a DeepSeek-V3-16B model's leaves cut to 2 layers (1.1 B params; tiny widths in the dry run)."""
    import bench_adamw as ba

    cfg, layers, experts = ("tiny.toml", 2, 8) if dry else ("deepseek_v3_16b.toml", 2, 64)
    # the dry run leaves out fnmoe's fused variant: step 1 compiles and checks it, and CPU compiles are slow
    r = ba.run(str(ROOT / "configs" / cfg), layers, experts, 2 if dry else 10, device, fused=not dry)
    rec.row("adamw bench", r["what"], "info")
    for name, ms, gbps, x, first, err in r["rows"]:
        rec.row(name, f"{ms:.3g} ms, {gbps:.0f} GB/s, {x:.2f}x torch foreach, first call {first:.1f} s; "
                f"vs torch single-tensor {err:.1e}", status(err < 1e-5))


# ---------------------------------------------------------------- 4 model, 5 determinism

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


def device_params(cfg: ModelConfig, device: str, seed: int = 0):
    """fnmoe's init distribution drawn on the device (fast; not init_params' exact values)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(path, init):
        if init.std == 0.0:
            return torch.full(init.shape, init.value, device=device)
        return torch.randn(init.shape, device=device, generator=g).mul_(init.std)
    return map_with_path(draw, leaf_inits(cfg))


class ModelBench:
    def __init__(self, dry: bool, device: str):
        self.dry, self.device = dry, device
        self.cfg, self.note = model_16b_cut(dry)
        self.B, self.L = (2, 64) if dry else (2, 4096)
        self.warmup, self.iters = (1, 1) if dry else (2, 3)
        self.params = device_params(self.cfg, device)
        self.n_params = sum(t.numel() for t in _leaves(self.params))
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

def _leaves(tree) -> list:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]


def fmt_perf(r: dict) -> str:
    m = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    mem = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB (forward+backward {r['passes_peak_gib']:.1f})"
    return f"{r['ms']:.0f} ms/step, {r['tps']:,.0f} tok/s, MFU {m}, peak mem {mem}"


def time_left() -> float:
    return DEADLINE - time.monotonic()


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


def step_determinism(rec: Recorder, device: str, dry: bool) -> None:
    mb = ModelBench(dry, device)
    rec.row(*mb.describe(), "info")
    base = rec.guarded("default kernels", mb.measure)
    if base:
        rec.row("default kernels", fmt_perf(base))
    torch.use_deterministic_algorithms(True)
    det = rec.guarded("deterministic", mb.measure)
    if det:
        rec.row("use_deterministic_algorithms(True)", fmt_perf(det))
    if base and det:
        rec.row("cost of deterministic mode", f"tokens/s ratio det/default {det['tps'] / base['tps']:.2f}")
        run = mb.run_cfg({})
        tx = optim.from_config(run.optim, run.train.steps)
        step_fn, _ = build_step(run, tx)
        _, m1 = step_fn(mb.state, mb.batch)
        _, m2 = step_fn(mb.state, mb.batch)
        same = m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
        rec.row("deterministic replay of one step", f"loss {m1['loss']!r} vs {m2['loss']!r}, grad norm equal "
                f"{m1['grad_norm'] == m2['grad_norm']}", status(same))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step", required=True, choices=STEPS + ["summary"])
    ap.add_argument("--results", required=True, help="directory of the per-step JSON files")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--timeout", type=float, default=0, help="this step's time limit in s (later sub-steps are "
                    "skipped rather than cut off)")
    args = ap.parse_args(argv)
    global DEADLINE
    if args.timeout:
        DEADLINE = time.monotonic() + args.timeout - 5
    results = Path(args.results)
    RESULTS_DIR[0] = results
    results.mkdir(parents=True, exist_ok=True)
    if args.step == "summary":
        return summary(results, args.dry_run)
    if args.dry_run:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        rec = Recorder(results, args.step)
        rec.row("device", "no CUDA device (use --dry-run on CPU)", "FAIL")
        return 1
    fcompile.setup_cache()  # TORCHINDUCTOR_CACHE_DIR when set, else the checkout's compile_cache/
    rec = Recorder(results, args.step)
    t0 = time.perf_counter()
    print(f"== gpu_check step {args.step} on {device}: {rec.env}", flush=True)
    steps = {"correctness": step_correctness, "k2layer": step_k2layer, "moe": step_moe, "model": step_model,
             "determinism": step_determinism}
    steps[args.step](rec, device, args.dry_run)
    print(f"== step {args.step} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
