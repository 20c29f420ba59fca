"""The sharpness of a trained model: the top eigenvalue of its loss's Hessian on held-out batches,
by power iteration with Hessian-vector products (fnmoe.func.hvp: jvp of grad, no Hessian in memory).

    python tools/sharpness.py --from runs/tiny                 # the run's newest checkpoint
    python tools/sharpness.py --from runs/tiny/checkpoints/step_00000800 --batches 2 --iters 50

It reads the checkpoint's config for the data and takes the first --batches x --batch-size
windows of the held-out split, the training loss `fnmoe.loss_fn` gives them (router terms included), in
fp32 (bf16 Hessian-vector products are too noisy for a stable estimate) and without compile.
The router bias is held fixed. Prints the top (largest) eigenvalue, the HVPs taken, the time,
and the held-out cross-entropy of those windows (the run's val_loss when they are its eval windows).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch


def checkpoint_source(src: Path) -> tuple:
    """(RunConfig, params) of a checkpoint, or of a run directory's newest one."""
    from fnmoe import checkpoint

    if (src / "checkpoints").is_dir():
        found = checkpoint.find_latest(src / "checkpoints")
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint under {src / 'checkpoints'}")
        src = found[0]
    if not (src / "index.json").is_file():
        raise FileNotFoundError(f"{src} is neither a run directory nor a checkpoint (no index.json)")
    return checkpoint.load_params(src)


def held_out(run, batches: int, batch_size: int) -> tuple[torch.Tensor, ...]:
    """The first batches x batch_size held-out windows as one batch (inputs, labels[, positions])."""
    from fnmoe.data.loader import load_data, val_batches

    data = load_data(run.data, run.model.vocab_size)
    parts = val_batches(data, run.data.seq_len, batch_size, batches, run.data.doc_mask)
    return tuple(torch.cat(p) for p in zip(*parts))


def progress(iters: int, every: int = 10, out=sys.stderr):
    """on_iter for top_hessian_eigenvalue: the first iteration and every `every`-th as a line on out,
    with the estimate, its residual and the time since the first HVP began."""
    start = time.perf_counter()

    def say(k: int, lam: float, residual: float) -> None:
        if k == 1 or k % every == 0:
            print(f"iteration {k} (at most {iters} a run): eigenvalue {lam:.6g}, residual {residual:.3g}, "
                  f"{time.perf_counter() - start:.1f} s", file=out, flush=True)
    return say


def sharpness(src: Path, batches: int = 1, batch_size: int = 8, iters: int = 100, tol: float = 1e-3,
              seed: int = 0, every: int = 0) -> dict:
    """every > 0: say every so many iterations on stderr (progress)."""
    from fnmoe import func, loss_fn

    run, params = checkpoint_source(src)
    cfg = dataclasses.replace(run.model, compute_dtype="float32", compile=False)
    inputs, labels, *positions = held_out(run, batches, batch_size)
    n = (labels != -100).sum()
    rest, full = func.trainable(params)

    def loss(tree):
        return loss_fn(full(tree), inputs, labels, cfg, n, positions_BL=positions[0] if positions else None)[0]
    start = time.perf_counter()
    lam, hvps = func.top_hessian_eigenvalue(loss, rest, iters, tol, seed, progress(iters, every) if every else None)
    ce = loss_fn(params, inputs, labels, cfg, n, positions_BL=positions[0] if positions else None)[1]["ce_loss"]
    return {"eigenvalue": lam, "hvps": hvps, "seconds": time.perf_counter() - start, "loss": ce.item(),
            "tokens": int(n)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="src", required=True, metavar="DIR", help="a run directory or a checkpoint")
    parser.add_argument("--batches", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=100, help="at most this many Hessian-vector products")
    parser.add_argument("--tol", type=float, default=1e-3, help="stop when the estimate moves by less (relative)")
    parser.add_argument("--seed", type=int, default=0, help="of the starting direction")
    parser.add_argument("--every", type=int, default=10,
                        help="print the estimate every N iterations on stderr (and the first); 0: never")
    args = parser.parse_args(argv)
    try:
        got = sharpness(Path(args.src), args.batches, args.batch_size, args.iters, args.tol, args.seed, args.every)
    except (FileNotFoundError, ValueError) as e:
        print(f"sharpness: {e}", file=sys.stderr)
        return 2
    print(f"top Hessian eigenvalue {got['eigenvalue']:.6g} (power iteration, {got['hvps']} HVPs, "
          f"{got['seconds']:.1f} s) at held-out loss {got['loss']:.4f} over {got['tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
