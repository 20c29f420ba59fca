"""Time fnmoe's MoE block against TorchTitan's MoE layer, in one process, routing pinned identically.

Both run compiled (fnmoe through `fnmoe.compile.compiled`, TorchTitan through `torch.compile`),
bf16, forward + backward (gradients of the input and of every weight, from one fixed output
gradient). The same router and expert weights are copied into both, and before any timing the
script checks that both give the same expert counts and the same outputs and gradients within
bf16 tolerance. Printed per implementation: the median ms of --iters timed runs (the two
implementations alternate, so machine noise hits both alike), achieved GFLOP/s of the experts
(fwd+bwd = 18*T*K*D*F FLOPs) and where the time goes (GEMM / routing+permute / elementwise /
other, from torch.profiler self times, ops classified by name), then the ratio.

    python tools/bench_moe.py                          # T=4096 D=512 F=256 E=32 K=4, plus one more shape
    python tools/bench_moe.py --shapes 4096,512,256,32,4 --iters 20 --device cuda
    python tools/bench_moe.py --variants               # also a candidate change of fnmoe (see --help)

Routing: softmax over experts in fp32, top-k, renormalised (TorchTitan route_norm=True,
score_func="softmax", no expert bias, load_balance_coeff=None). TorchTitan computes its router
logits under `torch.autocast(dtype=float32)`, which works on CUDA but is ignored on CPU (bf16
logits there); on CPU the script runs TorchTitan's gate in fp32, as it does on a GPU, so both
route on the same fp32 logits. The fnmoe side is `moe_block` (the MoE region without its
RMSNorm, which TorchTitan's layer does not have); it also computes its balance-loss statistics.

Layouts: fnmoe stores expert weights [E, in, out] (w_gate_EDF, w_up_EDF, w_down_EFD); TorchTitan
stores them [E, out, in] (w1_EFD = gate, w3_EFD = up, w2_EDF = down) and multiplies by transposed
views. The router is [D, E] in fnmoe and nn.Linear's [E, D] in TorchTitan.

Legend: T tokens, D model dim, F expert hidden, E experts, K top-k, R routed rows (T*K).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings
from typing import Callable

# OpenMP threads that spin while waiting make a shared, oversubscribed CPU many times slower
# (a tiny training step: 25x measured); passive waiting costs little. Set before torch loads
# OpenMP; OMP_WAIT_POLICY=ACTIVE in the environment overrides it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if __package__ in (None, ""):  # run as a script from anywhere: the checkout's fnmoe first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fnmoe import compile as fcompile  # noqa: E402
from fnmoe.config import ModelConfig, MoEConfig  # noqa: E402
from fnmoe.models.moe import expert_gemm, moe_block  # noqa: E402

DEFAULT_SHAPES = ["4096,512,256,32,4", "2048,256,512,16,4"]
CATEGORIES = ("gemm", "routing+permute", "elementwise", "other")
GEMM_WORDS = ("mm", "gemm", "matmul", "linear", "addmm", "bmm", "cutlass", "xmma", "nvjet", "mkldnn", "onednn",
              "cublas", "sgemm", "grouped",
              "attention")  # fused attention kernels (SDPA, flash): their GEMMs plus an online softmax
ROUTING_WORDS = ("topk", "sort", "gather", "scatter", "index", "cumsum", "softmax", "sigmoid", "bincount", "histc",
                 "nonzero", "masked", "take", "radix", "arange", "one_hot", "embedding", "unique")
WRAPPER_WORDS = ("compiledfunction", "compiled region", "callcompiledfxgraph", "call compiledfxgraph",
                 "autograd::engine", "profilerstep", "dynamo", "torch-compiled", "## ", "cudastreamsynchronize",
                 "cudadevicesynchronize", "cudalaunchkernel", "cudamemcpy", "cudamemset", "cudafree", "cudamalloc")


@dataclasses.dataclass(frozen=True)
class Shape:
    T: int
    D: int
    F: int
    E: int
    K: int

    @classmethod
    def parse(cls, s: str) -> "Shape":
        vals = [int(v) for v in s.replace("x", ",").split(",")]
        if len(vals) != 5:
            raise ValueError(f"shape {s!r}: want T,D,F,E,K")
        return cls(*vals)

    @property
    def flops(self) -> float:
        """Expert GEMM FLOPs of forward + backward: 3 matmuls of 2*R*D*F, times 3 (fwd + 2 bwd)."""
        return 18.0 * self.T * self.K * self.D * self.F

    def __str__(self) -> str:
        return f"T={self.T} D={self.D} F={self.F} E={self.E} K={self.K}"


def model_config(s: Shape, impl: str = "auto") -> ModelConfig:
    moe = MoEConfig(n_experts=s.E, top_k=s.K, expert_hidden=s.F, score_func="softmax", norm_topk_prob=True,
                    routed_scaling_factor=1.0, n_shared_experts=0, first_k_dense=0, impl=impl)
    return ModelConfig(dim=s.D, n_heads=max(1, s.D // 64), n_kv_heads=max(1, s.D // 64), moe=moe,
                       compute_dtype="bfloat16", compile=True)


def make_weights(s: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights in fnmoe's layout; the router is scaled so routing is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, std: torch.randn(*shape, generator=g) * std  # noqa: E731
    return {"w_router_DE": r(s.D, s.E, std=s.D ** -0.5), "w_gate_EDF": r(s.E, s.D, s.F, std=s.D ** -0.5),
            "w_up_EDF": r(s.E, s.D, s.F, std=s.D ** -0.5), "w_down_EFD": r(s.E, s.F, s.D, std=s.F ** -0.5)}


# ---------------------------------------------------------------- the two implementations

class Impl:
    """A forward+backward callable plus what the parity check reads."""

    def __init__(self, name: str, run: Callable[[torch.Tensor, torch.Tensor], tuple], counts: Callable):
        self.name, self.run, self.counts = name, run, counts


def fnmoe_impl(w: dict, s: Shape, device: str, transposed_storage: bool = False, block=moe_block,
               name: str = "", impl: str = "auto") -> Impl:
    """fnmoe's moe_block on bf16 leaves, compiled, with the expert GEMM path model.moe.impl=impl
    picks on device. transposed_storage keeps each expert weight as a contiguous [E, out, in]
    tensor and passes its transposed view (TorchTitan's layout)."""
    cfg = model_config(s, impl)

    def leaf(t: torch.Tensor, transpose: bool) -> torch.Tensor:
        t = t.to(device, torch.bfloat16)
        if transpose:
            return t.transpose(1, 2).contiguous().requires_grad_(True).transpose(1, 2)
        return t.contiguous().requires_grad_(True)

    p = {k: leaf(v, transposed_storage and k != "w_router_DE") for k, v in w.items()}
    gemm = expert_gemm(cfg, torch.bfloat16, device)
    fn = fcompile.compiled(block)
    leaves = [v for v in p.values()]
    last = {}

    def run(x_BLD: torch.Tensor, g_BLD: torch.Tensor):
        x = x_BLD.detach().requires_grad_(True)
        out, stats = fn(p, x, cfg, gemm)
        last["counts"] = stats["counts_E"]
        grads = torch.autograd.grad(out, [x, *leaves], g_BLD)
        return out, grads

    name = name or ("fnmoe" + (f" {gemm}" if impl != "auto" else "") + (" [E,out,in]^T" if transposed_storage else ""))
    return Impl(name, run, lambda: last["counts"])


def torchtitan_module(w: dict, s: Shape, device: str):
    """TorchTitan's MoE layer with w's weights, bf16, or (None, reason) when it does not import."""
    try:
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    except Exception as e:  # ImportError, or triton missing underneath
        return None, f"{type(e).__name__}: {e}"
    cfg = MoE.Config(
        num_experts=s.E, load_balance_coeff=None, shared_experts=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=s.D, hidden_dim=s.F, num_experts=s.E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=s.E, top_k=s.K)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=s.E, gate=Linear.Config(in_features=s.D, out_features=s.E, bias=False), top_k=s.K,
            score_func="softmax", route_norm=True, route_scale=1.0))
    # its router enters torch.autocast(dtype=float32), which CPU autocast ignores with a warning per call
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    m = cfg.build()
    ex = m.routed_experts.inner_experts
    with torch.no_grad():
        ex.w1_EFD.copy_(w["w_gate_EDF"].transpose(1, 2))
        ex.w3_EFD.copy_(w["w_up_EDF"].transpose(1, 2))
        ex.w2_EDF.copy_(w["w_down_EFD"].transpose(1, 2))
        m.router.gate.weight.copy_(w["w_router_DE"].T)
    m = m.to(device=device, dtype=torch.bfloat16)
    if device == "cpu":  # CPU autocast ignores dtype=float32: run the gate in fp32 as it runs on a GPU
        gate = m.router.gate
        gate.forward = lambda x: F.linear(x.float(), gate.weight.float())
    m.train()
    return m, ""


def torchtitan_impl(m, s: Shape) -> Impl:
    compiled = torch.compile(m)
    params = list(m.parameters())
    last = {}

    def run(x_BLD: torch.Tensor, g_BLD: torch.Tensor):
        x = x_BLD.detach().requires_grad_(True)
        out = compiled(x)
        grads = torch.autograd.grad(out, [x, *params], g_BLD)
        return out, grads

    def counts():
        with torch.no_grad():  # the same rule as MoE.forward, on the last input
            _, idx, _ = m.router(last["x"])
            return torch.bincount(idx.reshape(-1), minlength=s.E)

    def run_keep(x_BLD, g_BLD):
        last["x"] = x_BLD
        return run(x_BLD, g_BLD)

    return Impl("torchtitan", run_keep, counts)


# ---------------------------------------------------------------- parity, timing, profile

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def grads_by_name(impl: Impl, grads: tuple) -> dict[str, torch.Tensor]:
    """Gradients in fnmoe's names and layouts."""
    if impl.name.startswith("fnmoe"):
        return dict(zip(["x", "w_router_DE", "w_gate_EDF", "w_up_EDF", "w_down_EFD"], grads))
    x, w1, w2, w3, gate = grads  # MoE.parameters(): w1_EFD, w2_EDF, w3_EFD, router.gate.weight
    return {"x": x, "w_router_DE": gate.T, "w_gate_EDF": w1.transpose(1, 2), "w_up_EDF": w3.transpose(1, 2),
            "w_down_EFD": w2.transpose(1, 2)}


def check_parity(ref: Impl, other: Impl, x: torch.Tensor, g: torch.Tensor, tol: float = 2e-2) -> list[str]:
    """Problems (empty when the two agree): expert counts equal, outputs and grads within bf16 tolerance."""
    out_a, grads_a = ref.run(x, g)
    out_b, grads_b = other.run(x, g)
    ca, cb = ref.counts().cpu(), other.counts().cpu()
    problems = []
    if not torch.equal(ca.long(), cb.long()):
        problems.append(f"expert counts differ: {ref.name} {ca.tolist()} vs {other.name} {cb.tolist()}")
    e = rel_err(out_b, out_a)
    if e > tol:
        problems.append(f"outputs differ: relative error {e:.3g} > {tol}")
    ga, gb = grads_by_name(ref, grads_a), grads_by_name(other, grads_b)
    for k in ga:
        e = rel_err(gb[k], ga[k])
        if e > tol * 2:  # gradients pass through one more bf16 rounding per GEMM
            problems.append(f"grad of {k} differs: relative error {e:.3g} > {tol * 2}")
    return problems


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(impls: list[Impl], x, g, warmup: int, iters: int, device: str) -> dict[str, list[float]]:
    """ms per forward+backward of each impl; one run of each in turn per round."""
    for _ in range(warmup):
        for im in impls:
            im.run(x, g)
    sync(device)
    times: dict[str, list[float]] = {im.name: [] for im in impls}
    for _ in range(iters):
        for im in impls:
            sync(device)
            t0 = time.perf_counter()
            im.run(x, g)
            sync(device)
            times[im.name].append((time.perf_counter() - t0) * 1e3)
    return times


def classify(name: str) -> str:
    n = name.lower()
    if any(w in n for w in WRAPPER_WORDS):
        return "other"
    if any(w in n for w in ROUTING_WORDS):
        return "routing+permute"
    if any(w in n for w in GEMM_WORDS):
        return "gemm"
    return "elementwise"


def profile_split(im: Impl, x, g, iters: int, device: str) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(ms per run by category, the top ops by self time in ms per run) from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            im.run(x, g)
        sync(device)
    split = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[str, float] = {}
    for ev in prof.key_averages():
        if cuda:
            us = getattr(ev, "self_device_time_total", 0.0)
            if not us or ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            us = ev.self_cpu_time_total
        ms = us / 1e3 / iters
        split[classify(ev.key)] += ms
        per_op[ev.key] = per_op.get(ev.key, 0.0) + ms
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:8]
    return split, top


def scale_split(split: dict[str, float], ms: float) -> dict[str, float]:
    """The profiled split as fractions of its total, times the timed median: the profiler's own
    overhead and a busy machine inflate absolute profiled times, their proportions much less."""
    total = sum(split.values())
    return {k: ms * v / total for k, v in split.items()} if total else {}


def format_split(split: dict[str, float]) -> str:
    total = sum(split.values()) or 1.0
    return "  ".join(f"{k} {v:.1f} ms ({100 * v / total:.0f}%)" for k, v in split.items())


# ---------------------------------------------------------------- main

def bench_shape(s: Shape, args) -> dict:
    device = args.device
    torch._dynamo.reset()  # each shape compiles static shapes afresh (no automatic-dynamic recompiles)
    w = make_weights(s, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    B = 1
    x = torch.randn(B, s.T // B, s.D, generator=gen).to(device, torch.bfloat16)
    g = (torch.randn(B, s.T // B, s.D, generator=gen) * 1e-2).to(device, torch.bfloat16)

    impls = [fnmoe_impl(w, s, device)]
    if args.variants:
        impls.append(fnmoe_impl(w, s, device, transposed_storage=True))
        impls.append(fnmoe_impl(w, s, device, impl="padded"))  # auto picks grouped on CPU and CUDA
    tt_note = ""
    if not args.no_torchtitan:
        m, why = torchtitan_module(w, s, device)
        if m is None:
            tt_note = f"TorchTitan skipped (does not import: {why})"
        else:
            impls.append(torchtitan_impl(m, s))
    else:
        tt_note = "TorchTitan skipped (--no-torchtitan)"
    if tt_note:
        print(f"  {tt_note}")

    t0 = time.perf_counter()
    for im in impls:  # first call compiles
        t1 = time.perf_counter()
        im.run(x, g)
        sync(device)
        print(f"  {im.name:<20} first call (compile) {time.perf_counter() - t1:6.1f} s", flush=True)
    parity = {}
    for im in impls[1:]:
        problems = check_parity(impls[0], im, x, g)
        parity[im.name] = problems
        if problems:
            print(f"  PARITY FAILED {impls[0].name} vs {im.name}:\n    " + "\n    ".join(problems))
        else:
            print(f"  parity ok: {impls[0].name} vs {im.name} (same expert counts; outputs and grads within bf16 "
                  "tolerance)")
    if any(parity.values()) and not args.ignore_parity:
        raise RuntimeError("routing or outputs differ: timings would not compare like with like "
                         "(--ignore-parity to time anyway)")

    times = time_interleaved(impls, x, g, args.warmup, args.iters, device)
    res = {"shape": str(s), "impls": {}, "torchtitan_note": tt_note, "parity": parity}
    for im in impls:
        ms = statistics.median(times[im.name])
        split, top = {}, []
        if args.profile_iters:
            try:
                split, top = profile_split(im, x, g, args.profile_iters, device)
            except Exception as e:  # e.g. no CUPTI: the timing stands without its split
                print(f"  {im.name}: profiler failed ({type(e).__name__}: {e}); no time split")
        res["impls"][im.name] = {"ms": ms, "gflops": s.flops / ms / 1e6, "split": scale_split(split, ms),
                                 "profiled_ms": split, "top": top,
                                 "min_ms": min(times[im.name]), "max_ms": max(times[im.name])}
    res["seconds"] = time.perf_counter() - t0
    return res


def print_result(res: dict, s: Shape, verbose: bool) -> None:
    print(f"  {'impl':<20} {'median ms':>10} {'(min..max)':>16} {'GFLOP/s':>9}   "
          "split of the median (profiler self-time shares)")
    for name, r in res["impls"].items():
        rng = f"({r['min_ms']:.0f}..{r['max_ms']:.0f})"
        print(f"  {name:<20} {r['ms']:10.1f} {rng:>16} {r['gflops']:9.1f}   "
              f"{format_split(r['split']) if r['split'] else ''}")
        if verbose and r["top"]:
            print("      top ops (profiled ms/run): " + ", ".join(f"{k} {v:.1f}" for k, v in r["top"]))
    impls = res["impls"]
    if "torchtitan" in impls:
        for name in impls:
            if name.startswith("fnmoe"):
                ratio = impls[name]["ms"] / impls["torchtitan"]["ms"]
                print(f"  ratio {name} / torchtitan = {ratio:.2f}  "
                      f"({1 / ratio:.2f}x {'faster' if ratio < 1 else 'slower'} than torchtitan)")
                res.setdefault("ratio", {})[name] = ratio


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="T,D,F,E,K per shape (first one: the anchor)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=10, help="timed runs per implementation (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-iters", type=int, default=3, help="runs profiled for the time split (0: no split)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--variants", action="store_true",
                    help="also time candidate changes of fnmoe: expert weights stored [E, out, in] (passed "
                         "as transposed views), and the padded expert GEMM path (auto picks grouped)")
    ap.add_argument("--no-torchtitan", action="store_true", help="time fnmoe alone")
    ap.add_argument("--ignore-parity", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the top ops by self time")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # inductor's CPU kernels show up in the profiler by name (for the split); restored on return
    patch = {"cpp.enable_kernel_profile": args.device == "cpu"}
    with torch._inductor.config.patch(patch):
        return _run(args)


def _run(args) -> list[dict]:
    print(f"MoE block forward+backward, bf16, compiled; device {args.device}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; "
          f"median of {args.iters} after {args.warmup} warm-up runs (times are noisy on a shared machine)")
    results = []
    for spec in args.shapes:
        s = Shape.parse(spec)
        print(f"\n[{s}]  expert FLOPs fwd+bwd {s.flops / 1e9:.2f} GFLOP", flush=True)
        res = bench_shape(s, args)
        print_result(res, s, args.verbose)
        results.append(res)
    return results


if __name__ == "__main__":
    main()
