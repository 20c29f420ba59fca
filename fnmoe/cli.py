"""The `fnmoe` command (also `python -m fnmoe`): tyro-typed subcommands over RunConfig.

`--config FILE` names a TOML preset whose values become the defaults; every other flag is a
dotted override of the config tree (`--train.steps 50`, `--model.compute-dtype bfloat16`).
Without --config the built-in default is the tiny CPU preset (configs/tiny.toml holds the same
values, checked by a test).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Callable

import tyro

from fnmoe.config import RunConfig, load_config, validate

TOP_HELP = """usage: fnmoe SUBCOMMAND [--config FILE] [OVERRIDES]

subcommands:
  train     train a model (default: the tiny MoE on the bundled corpus, CPU, a few minutes)
  prepare   tokenise text / JSONL files into memory-mapped shards (--data.corpus DIR)
  plot      PNG charts of a run: loss, tokens/s, MFU, expert load per layer
  inspect   what torch.compile makes of each region: graphs, breaks, recompiles, kernels, host syncs
  checkpoint verify DIR   check a checkpoint's files (sizes, sha256, tensor shapes) against its index.json
  convert   --from-hf SRC --out DST: a Hugging Face checkpoint to the native tree format;
            --to-hf SRC --out DST: a native tree to a Hugging Face checkpoint

Run `fnmoe SUBCOMMAND --help` for the flags of one subcommand.
"""


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    config: str = ""
    """TOML preset whose values are the defaults of every flag below (e.g. configs/tiny.toml)"""
    run: Annotated[RunConfig, tyro.conf.arg(name="", prefix_name=False)] = dataclasses.field(
        default_factory=lambda: RunConfig(name="tiny"))


def _config_defaults(argv: list[str]) -> RunConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return RunConfig(name="tiny")
    return load_config(known.config, validate_config=False)


def parse_run(argv: list[str], prog: str) -> RunConfig:
    """The RunConfig of a preset plus flag overrides, validated."""
    base = _config_defaults(argv)
    args = tyro.cli(TrainArgs, args=argv, prog=prog, default=TrainArgs(config="", run=base))
    return validate(args.run)


def cmd_train(argv: list[str]) -> int:
    from fnmoe.loop import train

    run = parse_run(argv, "fnmoe train")
    summary = train(run)
    return 130 if summary["interrupted"] else 0


def cmd_inspect(argv: list[str]) -> int:
    """Per-region compile report; exits 1 when a region breaks, so CI can use it."""
    from fnmoe.compile import setup_cache
    from fnmoe.inspect_compile import format_reports, inspect_model

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--dump", default="", help="write FX graphs and inductor output code per region here")
    known, rest = pre.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print("fnmoe inspect [--config FILE] [overrides] [--dump DIR]: graphs, breaks, recompiles, "
              "FX nodes, kernels and host syncs per compiled region\n")
    run = parse_run(rest, "fnmoe inspect")
    setup_cache(run.compile_cache)
    reports, note = inspect_model(run.model, Path(known.dump) if known.dump else None)
    if note:
        print(note)
    print(format_reports(reports))
    if known.dump:
        print(f"FX graphs and inductor output written under {known.dump}")
    return 0 if all(r.ok for r in reports) else 1


def cmd_checkpoint(argv: list[str]) -> int:

    from fnmoe.checkpoint import SECTIONS, verify

    parser = argparse.ArgumentParser(prog="fnmoe checkpoint", description="check training checkpoints")
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser("verify", help="check every file's size, sha256 and tensor shapes against index.json; "
                                          "exit 2 naming the first bad file")
    p.add_argument("dir", help="a checkpoint directory, <run-dir>/checkpoints/step_<N>")
    args = parser.parse_args(argv)
    index = verify(Path(args.dir))
    n = sum(len(index[section]) for section in SECTIONS)
    print(f"ok: {args.dir} (step {index['step']}): {len(index['files'])} files and {n} tensors match index.json")
    return 0


def _load_native(src: Path):
    """(ModelConfig, params) of a native tree directory or of a training checkpoint (verified)."""
    from fnmoe import checkpoint
    from fnmoe.tree_io import load_tree

    index = src / "index.json"
    if index.is_file() and json.loads(index.read_text()).get("format") == checkpoint.FORMAT:
        run, params = checkpoint.load_params(src)
        return run.model, params
    return load_tree(src)


def cmd_convert(argv: list[str]) -> int:
    from fnmoe import hf
    from fnmoe.tree_io import save_tree

    parser = argparse.ArgumentParser(prog="fnmoe convert", description="convert between Hugging Face "
                                     "checkpoints and fnmoe's native tree format (safetensors + index.json)")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="SRC", help="a Hugging Face checkpoint directory (config.json + safetensors)")
    src.add_argument("--to-hf", metavar="SRC", help="a native tree directory (index.json + params.safetensors) "
                     "or a training checkpoint (<run-dir>/checkpoints/step_N)")
    parser.add_argument("--out", metavar="DST", required=True, help="the output directory (new or empty)")
    args = parser.parse_args(argv)
    if args.from_hf:
        cfg, params = hf.load(args.from_hf)
        save_tree(args.out, params, cfg)
    else:
        cfg, params = _load_native(Path(args.to_hf))
        hf.save(args.out, params, cfg)
    print(f"wrote {args.out} ({'native tree' if args.from_hf else hf.hf_architecture(cfg)})")
    return 0


def cmd_prepare(argv: list[str]) -> int:
    from fnmoe.prepare import prepare

    parser = argparse.ArgumentParser(prog="fnmoe prepare", description="tokenise text / JSONL files into "
                                     "memory-mapped token shards for --data.corpus DIR")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="text files (form-feed lines separate documents) or .jsonl[.gz] files")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer.json")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (resumes if interrupted)")
    parser.add_argument("--text-field", default="text", help="the JSONL field holding a document's text")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="held-out fraction of documents")
    parser.add_argument("--workers", type=int, default=2, help="tokeniser processes")
    args = parser.parse_args(argv)
    index = prepare(args.input, args.tokenizer, args.out, args.text_field, args.val_fraction, args.workers)
    sp = index["splits"]
    print(f"wrote {args.out}: {sp['train']['tokens']:,} train tokens ({sp['train']['docs']} documents), "
          f"{sp['val']['tokens']:,} held-out tokens ({sp['val']['docs']}), {index['dtype']}, "
          f"vocab {index['vocab_size']}, fingerprint {index['fingerprint']}")
    return 0


def cmd_plot(argv: list[str]) -> int:
    from fnmoe.plot import plot_run

    parser = argparse.ArgumentParser(prog="fnmoe plot", description="PNG charts of a run's metrics.jsonl: "
                                     "loss, tokens/s, MFU and a per-layer expert-load heatmap")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--out", default="", help="output directory (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    drawn = plot_run(args.run_dir, args.out or None)
    print(f"wrote {', '.join(drawn)} to {args.out or Path(args.run_dir) / 'plots'}")
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"train": cmd_train, "prepare": cmd_prepare, "inspect": cmd_inspect,
                                                   "checkpoint": cmd_checkpoint, "convert": cmd_convert, "plot": cmd_plot}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    if not argv or argv[0] in ("-h", "--help"):
        print(TOP_HELP)
        return 0
    sub, rest = argv[0], argv[1:]
    if sub not in COMMANDS:
        print(f"fnmoe: unknown subcommand {sub!r}\n\n{TOP_HELP}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[sub](rest)
    except (ValueError, FileNotFoundError) as e:
        print(f"fnmoe {sub}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
