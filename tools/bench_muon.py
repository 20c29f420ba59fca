"""Time one Muon step of fnmoe (batched Newton-Schulz) against torch.optim.Muon, in one process.

The tensors are a preset's Muon leaves (every matrix and expert stack of fnmoe.models.params.leaf_inits,
default: configs/tiny.toml widened to 8 layers x 32 experts); embeddings, head and norms go to
AdamW in both and are left out. torch.optim.Muon only takes 2-D parameters, so it gets each
matrix, and each expert of a stack, as its own [out, in] parameter. Both take the same gradients;
a step includes the parameter update. fnmoe runs eager and compiled (the whole update plus
apply_updates as one fullgraph function; its compile time is reported on its own line).

    python tools/bench_muon.py [--config configs/tiny.toml --layers 8 --experts 32 --steps 5 --threads 1]

Legend: no shape-suffixed tensors; trees of leaves as in fnmoe.optim.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from fnmoe import optim
from fnmoe.compile import compile_fn
from fnmoe.config import load_config
from fnmoe.models.params import leaf_inits
from fnmoe.tree import flatten_dict, tree_map, unflatten_dict

ROOT = Path(__file__).resolve().parent.parent
KW = dict(weight_decay=0.1, momentum=0.95, nesterov=True)


def muon_leaves(config: str, layers: int, experts: int, seed: int = 0) -> dict:
    """Random fp32 tensors shaped like the preset's Muon-labelled leaves (as a tree)."""
    run = load_config(config)
    cfg = dataclasses.replace(run.model, n_layers=layers, moe=dataclasses.replace(run.model.moe, n_experts=experts))
    shapes = flatten_dict(tree_map(lambda i: torch.empty(i.shape, device="meta"), leaf_inits(cfg)))
    labels = flatten_dict(optim.default_labels(unflatten_dict(shapes)))
    g = torch.Generator().manual_seed(seed)
    muon = {k: x for k, x in shapes.items() if labels[k] == "muon"}
    return unflatten_dict({k: torch.randn(x.shape, generator=g) * 0.02 for k, x in muon.items()})


def timed(fn, steps: int) -> float:
    """Median wall time of fn() in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fnmoe_stepper(params: dict, grads: dict, compile: bool):
    """(step(), seconds of the first call): one muon update plus apply_updates on a held state."""
    tx = optim.muon(0.02, adjust_lr="match_rms_adamw", **KW)

    @torch.no_grad()
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state

    fn = compile_fn(update) if compile else update
    held = {"params": params, "opt": tx.init(params)}

    def step() -> None:
        held["params"], held["opt"] = fn(held["params"], held["opt"], grads)
    t0 = time.perf_counter()
    step()
    return step, time.perf_counter() - t0


def torch_stepper(params: dict, grads: dict):
    """torch.optim.Muon's step over every matrix and every expert as a separate [out, in] parameter."""
    mats = zip(optim.tree_flatten_with_paths(params)[1], optim.tree_flatten_with_paths(grads)[1])
    pairs = [(w, g) for W, G in mats for w, g in (zip(W, G) if W.ndim == 3 else [(W, G)])]
    tps = [torch.nn.Parameter(w.T.clone()) for w, _ in pairs]
    for t, (_, g) in zip(tps, pairs):
        t.grad = g.T.clone()
    return torch.optim.Muon(tps, lr=0.02, adjust_lr_fn="match_rms_adamw", **KW).step, len(tps)


def preset_args(description: str) -> argparse.ArgumentParser:
    """The optimizer benchmarks' arguments (this one's and bench_adamw's): a preset widened to
    --layers x --experts, --steps timed, --threads."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default); 1 is steadier on a shared machine")
    return ap


def main() -> None:
    ap = preset_args(__doc__.split("\n")[0])
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled fnmoe variant")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    params = muon_leaves(args.config, args.layers, args.experts)
    grads = tree_map(torch.randn_like, params)
    shapes = sorted({tuple(x.shape[-2:]) for x in optim.tree_flatten_with_paths(params)[1]})
    torch_step, n_mats = torch_stepper(params, grads)
    eager_step, _ = fnmoe_stepper(params, grads, compile=False)
    ms_torch, ms_eager = timed(torch_step, args.steps), timed(eager_step, args.steps)
    print(f"{Path(args.config).name} with {args.layers} layers x {args.experts} experts: {n_mats} matrices "
          f"({sum(x.numel() for x in optim.tree_flatten_with_paths(params)[1]) / 1e6:.1f} M params) of "
          f"{len(shapes)} shapes {shapes}, {torch.get_num_threads()} threads")
    print(f"torch.optim.Muon       {ms_torch:8.1f} ms/step  ({n_mats} Newton-Schulz calls)")
    print(f"fnmoe muon, eager      {ms_eager:8.1f} ms/step  ({len(shapes)} batched Newton-Schulz calls)"
          f"  speedup {ms_torch / ms_eager:5.2f}x")
    if not args.no_compile:
        compiled_step, compile_s = fnmoe_stepper(params, grads, compile=True)
        ms_compiled = timed(compiled_step, args.steps)
        print(f"fnmoe muon, compiled   {ms_compiled:8.1f} ms/step  speedup {ms_torch / ms_compiled:5.2f}x"
              f"  (first call, compile included: {compile_s:.1f} s)")


if __name__ == "__main__":
    main()
