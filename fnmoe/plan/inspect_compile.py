"""Compile-graph inspection: what torch.compile makes of each region (`fnmoe inspect`).

Legend: B batch, L sequence, D model.

For every region (attention, dense MLP, MoE) of a config this reports the graph count, graph
breaks with reasons and source lines, recompiles when routing changes, FX node and generated
kernel counts, and host syncs (data-dependent scalar reads such as `.item()` / `.tolist()` /
`_local_scalar_dense`, each size read named with its hint for inductor, fnmoe.compile.size_hint).
Regions trace the config as given, in its compute dtype, as training compiles them on CPU; the MoE
region traces the expert GEMM path CPU uses (under impl='auto' fnmoe.kernels.gemm's grouped op, which
reads nothing on the host; the padded path reads its slab size once, named in the report), and is
left out where training runs it eager (the loop, which reads every count on the host), said in a
note. The last row, forward, is what `torch.compile(fnmoe.forward)` makes of the whole model:
dynamo's graphs and breaks, nothing compiled.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fnmoe import _torch
from fnmoe import compile as fcompile
from fnmoe.kernels import attention as cpu_attention
from fnmoe.config import ModelConfig
from fnmoe.models.attention import rope
from fnmoe.dtypes import DTYPE
from fnmoe.models.transformer import attention_region, forward, mlp_region, moe_region, layer_params
from fnmoe.models.params import init_params
from fnmoe.models.moe import expert_gemm

SYNC_TARGETS = {"item", "tolist", "_local_scalar_dense", "nonzero", "_local_scalar_dense.default"}


@dataclass
class RegionReport:
    name: str
    graphs: int = 0
    breaks: list[str] = field(default_factory=list)
    recompiles: list[str] = field(default_factory=list)
    fx_nodes: int = 0
    kernels: int | None = 0  # None: explained only, nothing compiled
    host_syncs: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.breaks and not self.error and self.graphs == 1


def region_cases(cfg: ModelConfig, B: int = 2, L: int = 64, seed: int = 0) -> list[tuple[str, Callable, list[tuple]]]:
    """(region name, function, two argument tuples whose routing differs) for each region kind."""
    dtype = DTYPE[cfg.compute_dtype]
    params = init_params(cfg, seed)
    cos, sin = rope(cfg, torch.arange(L))
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, L, cfg.dim, generator=gen).to(dtype) for _ in range(2)]
    cases, seen = [], set()
    for i in range(cfg.n_layers):
        p = layer_params(params, i, dtype)
        attn = dict(p["attn"], norm_D=p["attn_norm"]["w_D"])
        if "attention" not in seen:
            attn_cfg = cpu_attention.resolved(cfg, B, L, dtype, xs[0].device)
            cases.append(("attention", attention_region, [(attn, x, cos, sin, attn_cfg) for x in xs]))
        kind = "moe" if "moe" in p else "mlp"
        if kind not in seen:
            mp = dict(p[kind], norm_D=p["mlp_norm"]["w_D"])
            if kind == "moe":
                gemm = expert_gemm(cfg, dtype)
                if gemm != "loop":  # training runs the loop eager (model.block)
                    cases.append(("moe", moe_region, [(mp, x, cfg, gemm) for x in xs]))
            else:
                cases.append(("mlp", mlp_region, [(mp, x, cfg) for x in xs]))
        seen |= {"attention", kind}
    return cases


def _is_sync(node: torch.fx.Node) -> bool:
    target = getattr(node.target, "__name__", str(node.target))
    return node.op in ("call_method", "call_function") and target in SYNC_TARGETS


def _sync_line(node: torch.fx.Node) -> str:
    """The sync and, for each size it reads, the hint inductor sizes its kernels by (fnmoe.compile.size_hint)."""
    got = node.meta.get("example_value")
    got = got.shape if isinstance(got, torch.Tensor) else got  # nonzero: its row count
    sizes = [v for v in (got if isinstance(got, (list, tuple, torch.Size)) else [got]) if isinstance(v, torch.SymInt)]
    hints = [f"{v.node.expr} hinted {fcompile.hint_of(v)}" if fcompile.hint_of(v) is not None else
             f"{v.node.expr} not hinted (inductor takes it as 0 bytes and fuses no kernels over it)" for v in sizes]
    return f"{node.op} {node.target}" + (f": {', '.join(hints)}" if hints else "")


def forward_case(cfg: ModelConfig, B: int = 2, L: int = 64, seed: int = 0) -> tuple[Callable, tuple]:
    """(fnmoe.forward, its arguments on [B, L] tokens): what a user's torch.compile(fnmoe.forward) traces."""
    tokens_BL = torch.randint(0, cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(seed))
    return forward, (init_params(cfg, seed), tokens_BL, cfg)


def inspect_region(name: str, fn: Callable, args_list: list[tuple], dump: Path | None = None,
                   compile: bool = True) -> RegionReport:
    """fn's graphs, breaks and host syncs (dynamo's explain of the first arguments); compiled (unless
    compile=False) on each argument tuple, its kernels and recompiles."""
    rep = RegionReport(name, kernels=0 if compile else None)
    fcompile.set_compile_flags()  # explain sees the graphs fnmoe's compiles make
    _torch.dynamo_reset()
    explained = _torch.dynamo_explain(fn)(*args_list[0])
    rep.graphs = explained.graph_count
    for r in explained.break_reasons:
        where = r.user_stack[-1] if r.user_stack else None
        loc = f" at {where.filename}:{where.lineno} ({where.line})" if where else ""
        rep.breaks.append(f"{r.reason.splitlines()[0]}{loc}")
    for g in explained.graphs:
        rep.fx_nodes += len(g.graph.nodes)
        rep.host_syncs += [_sync_line(n) for n in g.graph.nodes if _is_sync(n)]
    if compile:
        _compile_into(rep, fn, args_list, dump)
    if dump:
        out = dump / name
        out.mkdir(parents=True, exist_ok=True)
        for k, g in enumerate(explained.graphs):
            (out / f"fx_graph_{k}.py").write_text(g.code)
    return rep


def _compile_into(rep: RegionReport, fn: Callable, args_list: list[tuple], dump: Path | None) -> None:
    """rep's kernels and recompiles (and inductor's output under dump) from fn compiled on each args tuple."""
    _torch.dynamo_reset()
    _torch.guard_failures.clear()
    compiled = fcompile.compile_fn(fn, fullgraph=False)
    try:
        _, codes = _torch.run_and_get_code(compiled, *args_list[0])
        for args in args_list[1:]:
            compiled(*args)
    except Exception as e:  # report, do not crash the inspection of other regions
        rep.error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        codes = []
    rep.kernels = sum(code.count("= async_compile.") for code in codes)  # one per generated kernel
    rep.recompiles = [str(reason) for reasons in _torch.guard_failures.values() for reason in reasons]
    if dump:
        (dump / rep.name).mkdir(parents=True, exist_ok=True)
        for k, code in enumerate(codes):
            (dump / rep.name / f"inductor_output_{k}.py").write_text(code)


def gemm_note(cfg: ModelConfig) -> str:
    """Which expert GEMM path the MoE region traces with here (CPU), and what its host sync is."""
    if cfg.moe.n_experts == 0:
        return ""
    gemm = expert_gemm(cfg, DTYPE[cfg.compute_dtype])
    why = {"padded": ": it reads the largest expert count on the host, once per MoE layer (its slab "
                     "size; free on CPU; impl='auto' picks grouped, which reads nothing)",
           "grouped": ": one ragged grouped GEMM (fnmoe.kernels.gemm here, torch's grouped_mm on CUDA), "
                      "no host reads",
           "loop": ": it reads every expert's count on the host, so training runs the MoE region eager "
                   "and it is not traced here"}.get(gemm, "")
    cuda = ("; on CUDA float32 takes the loop (the MoE region eager)"
            if cfg.compute_dtype == "float32" and cfg.moe.impl == "auto" else "")
    return f"note: MoE expert GEMMs {gemm!r} (model.moe.impl={cfg.moe.impl!r}, on CPU){why}{cuda}"


def attention_note(cfg: ModelConfig, B: int = 2, L: int = 64) -> str:
    """Which attention the attention region traces with here (CPU, [B, L] rows)."""
    impl = cpu_attention.choice(cfg, B, L, DTYPE[cfg.compute_dtype], torch.device("cpu"))
    what = {"cpu": "fnmoe's CPU kernel (fnmoe.kernels.attention)", "sdpa": "SDPA",
            "math": "softmax(q·k) as plain ops"}[impl]
    return f"note: attention {impl!r} (model.attention_impl={cfg.attention_impl!r}, [{B}, {L}] rows on CPU): {what}"


def inspect_model(cfg: ModelConfig, dump: Path | None = None,
                  say: Callable[[str], None] | None = None) -> tuple[list[RegionReport], str]:
    """(a report per region kind, then forward's, notes on the config's paths); say(line) hears each
    region as its compile begins, and the time it took."""
    note = "\n".join(n for n in (attention_note(cfg), gemm_note(cfg)) if n)
    cases, reports = region_cases(cfg), []
    for k, (name, fn, args) in enumerate(cases, 1):
        if say:
            say(f"inspect: region {k} of {len(cases)}, {name}: compiling for {len(args)} inputs...")
        t0 = time.perf_counter()
        reports.append(inspect_region(name, fn, args, dump))
        if say:
            say(f"inspect: {name} done in {time.perf_counter() - t0:.1f} s")
    if say:
        say("inspect: forward: explaining torch.compile(fnmoe.forward)...")
    t0 = time.perf_counter()
    fn, args = forward_case(cfg)
    reports.append(inspect_region("forward", fn, [args], dump, compile=False))
    if say:
        say(f"inspect: forward done in {time.perf_counter() - t0:.1f} s")
    return reports, note


def format_reports(reports: list[RegionReport]) -> str:
    lines = [f"{'region':<10} {'graphs':>6} {'breaks':>6} {'recompiles':>10} {'fx nodes':>8} "
             f"{'kernels':>7} {'host syncs':>10}  status"]
    for r in reports:
        status = "ok" if r.ok else ("ERROR " + r.error if r.error else "BREAKS")
        kernels = "-" if r.kernels is None else r.kernels
        lines.append(f"{r.name:<10} {r.graphs:>6} {len(r.breaks):>6} {len(r.recompiles):>10} {r.fx_nodes:>8} "
                     f"{kernels:>7} {len(r.host_syncs):>10}  {status}")
        lines += [f"  break: {b}" for b in r.breaks]
        lines += [f"  recompile: {x}" for x in r.recompiles]
        lines += [f"  host sync: {s}" for s in r.host_syncs]
    return "\n".join(lines)
