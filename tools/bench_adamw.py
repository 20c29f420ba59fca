"""Time one AdamW step of fnmoe (eager ops, and fused: --optim.fused) against torch.optim.AdamW
(single-tensor, foreach and fused), in one process, on the same leaves and gradients.

The tensors are a preset's leaves (fnmoe.models.params.leaf_inits: default configs/tiny.toml widened to
8 layers x 32 experts), fp32, every one decayed, no clip. A step includes the parameter update: fnmoe's
tx.update then apply_updates (the pure update, the same arithmetic as the donated one), torch's
opt.step(). Before timing, one step of each is compared with torch.optim.AdamW's single-tensor
step: fnmoe's eager ops agree to an ulp a step (its decay rounds once where torch's rounds twice),
the fused kernel and torch's fused one to a few. The fused variants' first call (its compile) is
reported on its own line. Bytes: the fewest a step must move (read param, gradient, both moments;
write param and moments) over the time, as the achieved bandwidth.

    python tools/bench_adamw.py [--config configs/tiny.toml --layers 8 --experts 32 --steps 5 --device cpu]

Legend: no shape-suffixed tensors; trees of leaves as in fnmoe.optim.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from fnmoe import optim
from fnmoe.config import load_config
from fnmoe.models.params import leaf_inits
from fnmoe.tree import flatten_dict, tree_map, unflatten_dict

ROOT = Path(__file__).resolve().parent.parent
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def leaves(config: str, layers: int, experts: int, device: str, seed: int = 0) -> dict:
    """Random fp32 tensors shaped like the preset's trained leaves (buffers left out), as a tree."""
    run = load_config(config)
    cfg = dataclasses.replace(run.model, n_layers=layers, moe=dataclasses.replace(run.model.moe, n_experts=experts))
    shapes = {k: i.shape for k, i in flatten_dict(leaf_inits(cfg)).items() if not k.startswith("buffers")}
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: a GB of them is slow on a host
    return unflatten_dict({k: torch.randn(s, generator=g, device=device) * 0.02 for k, s in shapes.items()})


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, steps: int, device: str) -> float:
    """Median wall time of fn() in ms, after one warm-up call, the device synchronised around each."""
    fn()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fnmoe_stepper(params: dict, grads: dict, fused: str):
    """step(): fnmoe's AdamW update plus apply_updates on a held state; held: its params."""
    tx = optim.adamw(LR, *BETAS, EPS, WD, fused=fused)
    held = {"params": tree_map(torch.clone, params)}
    held["opt"] = tx.init(held["params"])

    @torch.no_grad()
    def step() -> None:
        updates, held["opt"] = tx.update(grads, held["opt"], held["params"])
        held["params"] = optim.apply_updates(held["params"], updates)
    return step, held


def torch_stepper(params: dict, grads: dict, **impl):
    """step(): torch.optim.AdamW (impl: foreach= / fused=) over every leaf; its parameters in tree order."""
    tps = [torch.nn.Parameter(p.clone()) for p in optim.tree_flatten_with_paths(params)[1]]
    for t, g in zip(tps, optim.tree_flatten_with_paths(grads)[1]):
        t.grad = g.clone()
    opt = torch.optim.AdamW(tps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **impl)
    return opt.step, tps


def max_rel(a: list, b: list) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


def run(config: str, layers: int, experts: int, steps: int, device: str, fused: bool = True) -> dict:
    """{"what": the leaves, "rows": [(variant, ms a step, GB/s, x torch foreach, first call s, max rel diff
    vs torch's single-tensor step)]}; fused=False leaves out fnmoe's fused variant (its compile)."""
    params = leaves(config, layers, experts, device)
    grads = tree_map(torch.randn_like, params)
    flat = optim.tree_flatten_with_paths(params)[1]
    n = sum(x.numel() for x in flat)
    # one step of each against torch's single-tensor AdamW: the arithmetic, before any timing
    ref_step, ref = torch_stepper(params, grads, foreach=False)
    ref_step()
    ref = [t.detach() for t in ref]
    variants = [("torch.optim.AdamW foreach", "torch", {"foreach": True}),
                ("torch.optim.AdamW fused", "torch", {"fused": True}),
                ("fnmoe adamw, eager ops", "fnmoe", "off"),
                ("fnmoe adamw, fused", "fnmoe", "on")][:None if fused else -1]
    rows = []
    for name, who, how in variants:
        step, held = torch_stepper(params, grads, **how) if who == "torch" else fnmoe_stepper(params, grads, how)
        t0 = time.perf_counter()
        step()
        sync(device)
        first = time.perf_counter() - t0
        got = [t.detach() for t in held] if who == "torch" else optim.tree_flatten_with_paths(held["params"])[1]
        err = max_rel(got, ref)
        del got
        ms = timed(step, steps, device)  # the state steps on from there: the same work each step
        rows.append((name, ms, 7 * 4 * n / ms / 1e6, 0.0, first, err))  # read p, g, m, v; write p, m, v
        del step, held
    rows = [(r[0], r[1], r[2], rows[0][1] / r[1], *r[4:]) for r in rows]
    what = (f"{Path(config).name} with {layers} layers x {experts} experts: {len(flat)} leaves, {n / 1e6:.1f} M "
            f"params, fp32, on {device} ({torch.get_num_threads()} threads)")
    return {"what": what, "rows": rows}


def main() -> None:
    from bench_muon import preset_args

    ap = preset_args(__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args.config, args.layers, args.experts, args.steps, args.device)
    print(r["what"])
    for name, ms, gbps, x, first, err in r["rows"]:
        print(f"{name:27s} {ms:8.2f} ms/step  {gbps:7.1f} GB/s  {x:5.2f}x foreach  first call {first:6.2f} s  "
              f"max rel diff vs single-tensor torch after 1 step {err:.1e}")


if __name__ == "__main__":
    main()
