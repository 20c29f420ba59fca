"""Time one Muon step of fnmoe (batched Newton-Schulz) against torch.optim.Muon, in one process.

The parameter set is model-like: per layer four attention matrices [D, D] and an expert
stack up [E, D, F] and down [E, F, D]. torch.optim.Muon only takes 2-D parameters, so it
gets each matrix, and each expert, as its own [out, in] parameter. Both run eagerly on the
same gradients; the step includes the parameter update. Prints ms per step and the ratio.

    python tools/bench_muon.py [--layers 8 --dim 512 --experts 16 --ffn 256 --steps 5]

Legend: D model dim, E experts, F expert hidden.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fnmoe import optim


def make_params(layers: int, D: int, E: int, F: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    return {"layers": {str(i): {"attn": {n: r(D, D) for n in ("w_q_DD", "w_k_DD", "w_v_DD", "w_o_DD")},
                                "moe": {"w_up_EDF": r(E, D, F), "w_down_EFD": r(E, F, D)}}
                       for i in range(layers)}}


def timed(fn, steps: int) -> float:
    """Median wall time of fn() in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    params = make_params(args.layers, args.dim, args.experts, args.ffn)
    grads = optim.tree_map(lambda p: torch.randn_like(p), params)
    kw = dict(weight_decay=0.1, momentum=0.95, nesterov=True)

    tx = optim.muon(0.02, adjust_lr="match_rms_adamw", **kw)
    state = {"params": params, "opt": tx.init(params)}

    @torch.no_grad()
    def fnmoe_step() -> None:
        updates, state["opt"] = tx.update(grads, state["opt"], state["params"])
        state["params"] = optim.apply_updates(state["params"], updates)

    # torch: every matrix and every expert a separate [out, in] parameter
    mats = zip(optim.tree_flatten_with_paths(params)[1], optim.tree_flatten_with_paths(grads)[1])
    pairs = [(w, g) for W, G in mats for w, g in (zip(W, G) if W.ndim == 3 else [(W, G)])]
    tps = [torch.nn.Parameter(w.T.clone()) for w, _ in pairs]
    for t, (_, g) in zip(tps, pairs):
        t.grad = g.T.clone()
    opt = torch.optim.Muon(tps, lr=0.02, adjust_lr_fn="match_rms_adamw", **kw)

    n_mats = len(tps)
    n_calls = len({tuple(w.shape) for w, _ in pairs})
    ms_torch = timed(opt.step, args.steps)
    ms_fnmoe = timed(fnmoe_step, args.steps)
    print(f"{n_mats} matrices ({args.layers} layers x 4 [{args.dim},{args.dim}] + 2 x [{args.experts} experts]"
          f" [{args.dim},{args.ffn}]/[{args.ffn},{args.dim}]), {torch.get_num_threads()} threads")
    print(f"torch.optim.Muon  {ms_torch:8.1f} ms/step  ({n_mats} Newton-Schulz calls)")
    print(f"fnmoe muon        {ms_fnmoe:8.1f} ms/step  ({n_calls} batched Newton-Schulz calls)")
    print(f"speedup           {ms_torch / ms_fnmoe:8.2f}x")


if __name__ == "__main__":
    main()
