"""Time a whole model's forward + backward: fnmoe against `transformers`, on one Qwen3-MoE checkpoint.

The script builds a small random `Qwen3MoeForCausalLM` from a config, saves it with
`save_pretrained` into a temporary directory, and loads that directory twice: with
`transformers` (`from_pretrained`, fp32, whatever experts implementation it picks by default)
and with `fnmoe.hf.load`. Before timing it checks that fnmoe's fp32 eager logits match the
transformers model's. Then, on the same token batch, it times forward + next-token
cross-entropy + backward (gradients of every parameter) of:

  transformers    as loaded (fp32, eager)
  fnmoe eager     bf16 compute (fp32 master params), no compile
  fnmoe compiled  bf16 compute, every region compiled (the MoE region as one graph)

and prints the median ms (the three alternate, so machine noise hits all alike), tokens/s,
achieved GFLOP/s (model: fnmoe.run.metrics.flops_per_token x tokens; experts: 18*T*K*D*F per MoE
layer), a split of each median into GEMM / routing+permute / elementwise / other (torch.profiler
self times, ops classified as tools/bench_moe.py does) and the ratio transformers / fnmoe.
--blocks also times each implementation over consecutive runs (one after another, not
alternating), the way a training loop runs it, and prints those medians beside.

    python tools/bench_model.py                       # 4 layers, dim 256, 16 experts top-4, 4 x 256 tokens
    python tools/bench_model.py --layers 2 --dim 64 --experts 4 --seq 32 --iters 2
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

# OpenMP threads that spin while waiting make a shared, oversubscribed CPU many times slower
# (a tiny training step: 25x measured); passive waiting costs little. Set before torch loads
# OpenMP; OMP_WAIT_POLICY=ACTIVE in the environment overrides it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if __package__ in (None, ""):  # run as a script from anywhere: the checkout's fnmoe first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fnmoe  # noqa: E402
from fnmoe.plan.flops import flops_per_token  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402  (its op classification and profiler split)


def hf_checkpoint(out_dir: str, args) -> None:
    """A tiny random Qwen3-MoE checkpoint (fp32 safetensors) in out_dir."""
    import transformers

    hd = args.head_dim
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=2 * args.dim, moe_intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.dim // hd,
        num_key_value_heads=max(1, args.dim // hd // 2),
        head_dim=hd, num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=max(1024, args.seq),
        tie_word_embeddings=False, output_router_logits=False, router_aux_loss_coef=0.0)
    torch.manual_seed(args.seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    model.save_pretrained(out_dir)


def next_token_ce(logits_BLV: torch.Tensor, tokens_BL: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BLV[:, :-1].reshape(-1, logits_BLV.shape[-1]).float(), tokens_BL[:, 1:].reshape(-1))


def leaves_of(tree) -> list[torch.Tensor]:
    out = []

    def walk(t):
        if isinstance(t, dict):
            for v in t.values():
                walk(v)
        else:
            out.append(t)
    walk(tree)
    return out


def time_interleaved(fns: dict, warmup: int, iters: int) -> dict[str, list[float]]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return times


def time_blocks(fns: dict, iters: int) -> dict[str, list[float]]:
    """Each fn run iters times in a row (after one untimed run), one fn after another."""
    times = {}
    for k, fn in fns.items():
        fn()
        times[k] = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return times


class _Run:  # what bench_moe.profile_split calls
    def __init__(self, fn):
        self.run = lambda x, g: fn()


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=256, help="expert hidden size (moe_intermediate_size)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled fnmoe run")
    ap.add_argument("--profile-iters", type=int, default=2, help="runs profiled for the time split (0: no split)")
    ap.add_argument("--blocks", action="store_true", help="also time each implementation over consecutive runs")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # inductor's CPU kernels show up in the profiler by name (for the split); restored on return
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": bool(args.profile_iters)}):
        return _run(args)


def _run(args) -> dict | None:
    try:
        import fnmoe.hf as fhf
    except ImportError as e:
        print(f"SKIP: fnmoe.hf is not available ({e}); this benchmark loads the checkpoint with fnmoe.hf.load")
        return None
    try:
        import transformers
    except ImportError as e:
        print(f"SKIP: transformers does not import ({e})")
        return None

    print(f"model forward+backward: fnmoe vs transformers {transformers.__version__} on one Qwen3-MoE checkpoint; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} "
          "(times are noisy on a shared machine)")
    with tempfile.TemporaryDirectory(prefix="fnmoe-bench-model-") as d:
        hf_checkpoint(d, args)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        mcfg, params = fhf.load(d)
    hf_model.train()
    experts_impl = getattr(hf_model.config, "_experts_implementation", None) or "default"
    n_params = sum(p.numel() for p in hf_model.parameters())
    print(f"checkpoint: {args.layers} layers, dim {args.dim}, {args.experts} experts top-{args.top_k}, expert hidden "
          f"{args.ffn}, vocab {args.vocab}; {n_params / 1e6:.1f} M params; batch {args.batch} x {args.seq} tokens; "
          f"transformers experts implementation: {experts_impl}")

    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)

    # the same checkpoint: fnmoe's fp32 eager logits against transformers'
    with torch.no_grad():
        ref = hf_model(input_ids=tokens).logits.float()
        ours, _ = fnmoe.forward(params, tokens, mcfg)
    err = (ours - ref).abs().max().item()
    print(f"check: fp32 logits max |fnmoe - transformers| = {err:.2e}" + ("" if err < 1e-3 else "  (MISMATCH)"))

    hf_params = [p for p in hf_model.parameters() if p.requires_grad]
    for leaf in leaves_of(params):
        leaf.requires_grad_(True)
    f_leaves = leaves_of(params)

    def hf_step():
        loss = next_token_ce(hf_model(input_ids=tokens).logits, tokens)
        torch.autograd.grad(loss, hf_params)

    def fnmoe_step(cfg):
        def step():
            logits, _ = fnmoe.forward(params, tokens, cfg)
            torch.autograd.grad(next_token_ce(logits, tokens), f_leaves)
        return step

    eager_cfg = dataclasses.replace(mcfg, compute_dtype="bfloat16", compile=False)
    fns = {"transformers fp32": hf_step, "fnmoe bf16 eager": fnmoe_step(eager_cfg)}
    if not args.no_compile:
        comp_cfg = dataclasses.replace(mcfg, compute_dtype="bfloat16", compile=True)
        fns["fnmoe bf16 compiled"] = fnmoe_step(comp_cfg)
        t0 = time.perf_counter()
        fns["fnmoe bf16 compiled"]()
        print(f"fnmoe compile (first step): {time.perf_counter() - t0:.1f} s")

    times = time_interleaved(fns, args.warmup, args.iters)
    n_tok = args.batch * args.seq
    model_gflop = flops_per_token(mcfg, args.seq) * n_tok / 1e9
    expert_gflop = 18.0 * n_tok * args.top_k * args.dim * args.ffn * args.layers / 1e9
    print(f"FLOPs per forward+backward: model {model_gflop:.2f} GFLOP, of which expert GEMMs {expert_gflop:.2f}")
    res = {"ms": {}, "ratio": {}, "split": {}, "gflops": {}}
    print(f"{'':22} {'median ms':>10} {'(min..max)':>14} {'tokens/s':>10} {'GFLOP/s':>8}   split of the median")
    for k, ts in times.items():
        ms = statistics.median(ts)
        res["ms"][k], res["gflops"][k] = ms, model_gflop / ms * 1e3
        split = {}
        if args.profile_iters:
            split = bench_moe.scale_split(bench_moe.profile_split(_Run(fns[k]), None, None, args.profile_iters,
                                                                  "cpu")[0], ms)
        res["split"][k] = split
        print(f"{k:22} {ms:10.1f} {f'({min(ts):.0f}..{max(ts):.0f})':>14} {n_tok / ms * 1e3:10.0f} "
              f"{res['gflops'][k]:8.1f}   {bench_moe.format_split(split) if split else ''}")
    base = res["ms"]["transformers fp32"]
    for k, ms in res["ms"].items():
        if k.startswith("fnmoe"):
            res["ratio"][k] = base / ms
            print(f"speedup {k} over transformers: {base / ms:.2f}x")
    if args.blocks:
        blocks = {k: statistics.median(ts) for k, ts in time_blocks(fns, args.iters).items()}
        res["blocks_ms"] = blocks
        print("consecutive runs (median ms): " + ", ".join(f"{k} {ms:.1f}" for k, ms in blocks.items()))
        for k, ms in blocks.items():
            if k.startswith("fnmoe"):
                print(f"speedup {k} over transformers, consecutive runs: {blocks['transformers fp32'] / ms:.2f}x")
    return res


if __name__ == "__main__":
    main()
