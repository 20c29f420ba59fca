"""The `fnmoe` command's subcommands (`main` dispatches): tyro-typed flags over RunConfig.

`--config FILE` names a TOML preset whose values become the defaults; every other flag is a
dotted override of the config tree (`--train.steps 50`, `--model.compute-dtype bfloat16`).
Without --config the built-in default is the tiny CPU preset (configs/tiny.toml holds the same
values, checked by a test).

A subcommand's stdout is its result (a report, --json, the generated text, the line naming what
it wrote), for a pipe or a JSON reader to take whole; its log (a first run's C++ kernel build,
notes, warnings) goes to stderr. train alone (LOG_ON_STDOUT) logs on stdout: its header and
progress lines are its output.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Callable, Iterator

import tyro

from fnmoe.cli.checks import out_dir
from fnmoe.cli.models import cmd_convert, cmd_generate, load_source, read_newest, write_stdout
from fnmoe.cli.prepare import cmd_prepare
from fnmoe.cli.tokenizer import cmd_tokenizer
from fnmoe.config import RunConfig, load_config, validate, with_token_steps

TOP_HELP = """usage: fnmoe SUBCOMMAND [--config FILE] [OVERRIDES]

subcommands:
  train     train a model (default: the tiny MoE on the bundled corpus, CPU, a few minutes)
  prepare   tokenise text / JSONL / Parquet / datasets corpora into memory-mapped shards (--data.corpus DIR)
  generate  sample text from a run, checkpoint or converted model (KV cache; greedy, temperature, top-p)
  eval      held-out loss and bits per byte of a run or checkpoint, per data source (--from RUN|CKPT)
  tokenizer train --input FILE... --vocab-size N --out tokenizer.json: a byte-level BPE for prepare --tokenizer
  plot      PNG charts of a run: loss, tokens/s, MFU, expert load per layer
  plan      per-rank memory, FLOPs, communication and a modelled step time of a config (nothing allocated)
  rehearse  one rank of the config's full mesh runs a real step on fake tensors, checked against the plan
  inspect   what torch.compile makes of each region: graphs, breaks, recompiles, kernels, host syncs
  checkpoint verify DIR   check what a resume checks: files (sizes, sha256, shapes), config, params finite
  convert   --from-hf SRC --out DST: a Hugging Face checkpoint to the native tree format;
            --to-hf SRC --out DST: a run directory (its newest checkpoint), a checkpoint or a native
            tree to a Hugging Face checkpoint

Run `fnmoe SUBCOMMAND --help` for the flags of one subcommand.
"""


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    config: str = ""
    """TOML preset whose values are the defaults of every flag below: a file (configs/tiny.toml) or the
    name of a preset shipped with fnmoe (tiny)"""
    run: Annotated[RunConfig, tyro.conf.arg(name="", prefix_name=False)] = dataclasses.field(
        default_factory=lambda: RunConfig(name="tiny"))


def _config_defaults(argv: list[str], base: RunConfig | None) -> RunConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default="")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return RunConfig(name="tiny") if base is None else base
    return load_config(known.config, validate_config=False)


def _flag_types() -> tyro.constructors.ConstructorRegistry:
    """How tyro reads the one config field that is not a plain value: data.mix as NAME=DIR:WEIGHT ...
    (kept here so the config classes, and `import fnmoe`, need no tyro)."""
    from fnmoe.config import MixSource

    registry = tyro.constructors.ConstructorRegistry()

    @registry.primitive_rule
    def _mix(info: tyro.constructors.PrimitiveTypeInfo):
        if info.type != tuple[MixSource, ...]:
            return None
        return tyro.constructors.PrimitiveConstructorSpec(
            nargs="*", metavar="NAME=DIR:WEIGHT", instance_from_str=lambda args: tuple(map(MixSource.parse, args)),
            is_instance=lambda x: isinstance(x, tuple) and all(isinstance(s, MixSource) for s in x),
            str_from_instance=lambda x: [s.flag() for s in x])
    return registry


def parse_run(argv: list[str], prog: str, base: RunConfig | None = None) -> RunConfig:
    """The RunConfig of a preset (--config FILE, else base, else the tiny default) plus flag
    overrides, validated."""
    base = _config_defaults(argv, base)
    args = tyro.cli(TrainArgs, args=argv, prog=prog, default=TrainArgs(config="", run=base), registry=_flag_types())
    return validate(_steps_or_tokens(args.run, argv))


def _steps_or_tokens(run: RunConfig, argv: list[str]) -> RunConfig:
    """The run's length: a token budget (--train.tokens, or a preset's) sets train.steps for the
    batch the flags leave, unless --train.steps is given: alone it replaces a preset's budget, with
    --train.tokens the two must agree (validate says so when they do not)."""
    given = lambda flag: any(a == flag or a.startswith(flag + "=") for a in argv)  # noqa: E731
    if not given("--train.steps"):
        return with_token_steps(run)
    if not given("--train.tokens"):
        return dataclasses.replace(run, train=dataclasses.replace(run.train, tokens=0))
    return run


def _parse_run_and(argv: list[str], prog: str, flag: str, spec: dict, usage: str):
    """(the namespace of one extra flag, the RunConfig of the rest): for subcommands that take a
    config plus one flag of their own."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(flag, **spec)
    known, rest = pre.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(usage + "\n")
    return known, parse_run(rest, prog)


def cmd_train(argv: list[str]) -> int:
    from fnmoe.cli.resumed import saved_run

    saved = saved_run(argv)  # --resume continues the run: its saved config is the flags' base
    if saved is not None:
        logging.getLogger("fnmoe").info("--resume: the base config is %s's config.toml (the run's preset and "
                                        "flags); the flags given here change it", saved[0])
    # every flag and config value checked before the loop is imported
    run = parse_run(argv, "fnmoe train", base=None if saved is None else saved[1])
    from fnmoe.training.loop import train

    summary = train(run)
    if not summary["interrupted"]:
        return 0
    from fnmoe.run.stop import under_torchrun

    # a stop a signal asked for and the run completed is no failure: torchrun must not restart it
    return 0 if under_torchrun() and not summary.get("aborted") else 130


def cmd_inspect(argv: list[str]) -> int:
    """Per-region compile report; exits 1 when a region breaks, so CI can use it."""
    from fnmoe.compile import setup_cache
    from fnmoe.plan.inspect_compile import format_reports, inspect_model

    known, run = _parse_run_and(argv, "fnmoe inspect", "--dump", dict(default=""),
                                "fnmoe inspect [--config FILE] [overrides] [--dump DIR]: graphs, breaks, "
                                "recompiles, FX nodes, kernels and host syncs per compiled region")
    out_dir(known.dump, "--dump")
    setup_cache(run.compile_cache)
    reports, note = inspect_model(run.model, Path(known.dump) if known.dump else None,
                                  say=lambda line: print(line, file=sys.stderr, flush=True))
    if note:
        print(note)
    print(format_reports(reports))
    if known.dump:
        print(f"FX graphs and inductor output written under {known.dump}")
    return 0 if all(r.ok for r in reports) else 1


def cmd_checkpoint(argv: list[str]) -> int:

    from fnmoe.checkpoint import SECTIONS, check_finite, verify

    parser = argparse.ArgumentParser(prog="fnmoe checkpoint", description="check training checkpoints")
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser("verify", help="check what a resume checks: every file's size, sha256 and tensor shapes "
                                          "against index.json, its config.toml and that model's params, and that "
                                          "the params are finite; exit 2 naming the first problem")
    p.add_argument("dir", help="a checkpoint directory, <run-dir>/checkpoints/step_<N>")
    args = parser.parse_args(argv)
    index = verify(Path(args.dir))
    check_finite(Path(args.dir), index)
    n = sum(len(index[section]) for section in SECTIONS)
    print(f"ok: {args.dir} (step {index['step']}): {len(index['files'])} files and {n} tensors match index.json, "
          "their model and finite params")
    return 0


def cmd_eval(argv: list[str]) -> int:
    """Held-out loss and bits per byte of a checkpoint per source (fnmoe.training.evaluate), on the data
    its run trained on or on --data.corpus / --data.mix."""
    import torch

    from fnmoe.config import MeshConfig
    from fnmoe.training.evaluate import evaluate, format_eval
    from fnmoe.models.params import shape_mismatches

    usage = ("fnmoe eval --from RUN|CKPT|DIR [--json] [--data.corpus DIR | --data.mix NAME=DIR:WEIGHT ...] "
             "[--train.eval-batches N] [overrides]: held-out loss, perplexity and bits per byte of a run's newest "
             "complete checkpoint, a checkpoint, a native tree or a Hugging Face directory, per data source; the "
             "data, batch and sequence length default to the checkpoint's run (else the bundled corpus)")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--from", dest="src", default="")
    pre.add_argument("--json", action="store_true")
    known, rest = pre.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(usage + "\n")
        parse_run(rest, "fnmoe eval")  # tyro prints the flags and exits
    if not known.src:
        raise ValueError(f"--from is required: {usage}")
    # the flags are read after the checkpoint, whose config they override: its read is then as short
    # as can be, so that a live run's --checkpoint.keep-last seldom removes it meanwhile
    src, (saved, cfg, params, step) = read_newest(Path(known.src), _eval_source)
    run = parse_run(rest, "fnmoe eval", base=saved)
    if saved is None:  # a tree or HF directory: its model, on the flags' data
        run = dataclasses.replace(run, model=cfg, data=dataclasses.replace(
            run.data, seq_len=min(run.data.seq_len, cfg.max_seq_len)))
    diff = shape_mismatches(params, run.model)
    if diff:
        raise ValueError(f"the model flags change the shape of {src}'s model: {'; '.join(diff)}")
    run = validate(dataclasses.replace(run, mesh=MeshConfig(), resume="none"))  # one process reads it whole
    result = evaluate(params, run, "cuda" if torch.cuda.is_available() else "cpu")
    result = {"from": str(src), "step": step, **result}
    write_stdout((json.dumps(result, indent=1) if known.json else
                   format_eval(result, f"{src}" + (f" (step {step})" if step is not None else ""), run)) + "\n")
    return 0


def _eval_source(src: Path):
    """load_source(src) and the step of a checkpoint (None for a tree or HF directory)."""
    from fnmoe.checkpoint import read_index

    saved, cfg, params = load_source(src)
    return saved, cfg, params, None if saved is None else read_index(src)["step"]


def cmd_plot(argv: list[str]) -> int:
    from fnmoe.run.plot import plot_run

    parser = argparse.ArgumentParser(prog="fnmoe plot", description="PNG charts of a run's metrics.jsonl: "
                                     "loss, tokens/s, MFU and a per-layer expert-load heatmap")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--out", default="", help="output directory (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    out_dir(args.out or str(Path(args.run_dir) / "plots"), "--out")
    drawn = plot_run(args.run_dir, args.out or None)
    print(f"wrote {', '.join(drawn)} to {args.out or Path(args.run_dir) / 'plots'}")
    return 0


def cmd_plan(argv: list[str]) -> int:
    """Per-rank memory, FLOPs, communication and a step-time model for a config; allocates nothing.
    --search ranks every layout of the world size instead (fnmoe.plan.search)."""
    from fnmoe.plan.summary import format_plan, plan

    usage = ("fnmoe plan [--config FILE] [overrides, e.g. --mesh.fsdp 48 --mesh.ep 8 --memory.recompute full] "
             "[--json]: per-rank bytes, FLOPs per token, communication and a modelled step time\n"
             "fnmoe plan --search [--world N] [--top K] [--max-global-tokens T] [--config FILE] [overrides] "
             "[--json]: every mesh (fsdp x ep = N, default the config's), memory policy (recompute keeping or "
             "replaying the EP exchange, offload, selective), tokens a GPU a step (global batch up to T, default "
             "67M), micro-batch, reduce-scatter dtype and chunks that fits the --plan.hardware profile, ranked "
             "by the modelled step as fnmoe runs it, with what bounds each")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--json", action="store_true")
    pre.add_argument("--search", action="store_true")
    pre.add_argument("--world", type=int, default=None)
    pre.add_argument("--top", type=int, default=10)
    pre.add_argument("--max-global-tokens", type=int, default=None)
    known, rest = pre.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(usage + "\n")
    run = parse_run(rest, "fnmoe plan")
    if not known.search:
        if known.world is not None or known.max_global_tokens is not None:
            raise ValueError("--world and --max-global-tokens go with --search (for one layout set --mesh.fsdp, "
                             "--mesh.ep and --train.batch-size)")
        result = plan(run)
        print(json.dumps(result, indent=1) if known.json else format_plan(result))
        return 0
    from fnmoe.plan.search import MAX_GLOBAL_TOKENS, format_search, search

    if known.top < 1:
        raise ValueError(f"--top must be >= 1, got {known.top}")
    cap = MAX_GLOBAL_TOKENS if known.max_global_tokens is None else known.max_global_tokens
    if cap < 1:
        raise ValueError(f"--max-global-tokens must be >= 1, got {cap}")
    ranking = search(run, known.world, known.top, cap)
    print(json.dumps(ranking, indent=1) if known.json else format_search(ranking))
    return 0


def cmd_rehearse(argv: list[str]) -> int:
    """One rank of the config's full mesh runs one training step on fake tensors (fnmoe.plan.rehearse);
    exit 1 when what it holds or sends differs from the plan."""
    from fnmoe.plan.rehearse import compare, format_report, rehearse

    usage = ("fnmoe rehearse [--config FILE] [overrides] [--rank R|worst] [--json]: this process plays rank R "
             "of the config's mesh (fsdp x ep ranks) over a fake process group with fake tensors, runs one real "
             "training step and sets what it holds and sends against `fnmoe plan`; exit 1 when a category differs")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--json", action="store_true")
    pre.add_argument("--rank", default="worst")
    known, rest = pre.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(usage + "\n")
    run = parse_run(rest, "fnmoe rehearse")
    rank = known.rank
    if rank != "worst":
        try:
            rank = int(rank)
        except ValueError:
            raise ValueError(f"--rank takes a rank number or 'worst', got {known.rank!r}") from None
    # this process has run nothing else; each phase said on stderr as it begins (stdout: the report)
    report = rehearse(run, rank, fresh_process=False, say=lambda line: print(line, file=sys.stderr, flush=True))
    cmp = compare(report)
    print(json.dumps({**report, "compare": cmp}, indent=1) if known.json else format_report(report, cmp))
    return 0 if cmp["ok"] else 1


COMMANDS: dict[str, Callable[[list[str]], int]] = {"train": cmd_train, "prepare": cmd_prepare, "inspect": cmd_inspect,
                                                   "plan": cmd_plan, "rehearse": cmd_rehearse,
                                                   "checkpoint": cmd_checkpoint,
                                                   "convert": cmd_convert, "plot": cmd_plot, "generate": cmd_generate,
                                                   "eval": cmd_eval, "tokenizer": cmd_tokenizer}
# the subcommands whose log lines are their output; every other one's stdout is its result alone
LOG_ON_STDOUT = frozenset({"train"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(TOP_HELP)
        return 0
    sub, rest = argv[0], argv[1:]
    if sub not in COMMANDS:
        print(f"fnmoe: unknown subcommand {sub!r}\n\n{TOP_HELP}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        stream=sys.stdout if sub in LOG_ON_STDOUT else sys.stderr, force=True)
    code = _run(sub, rest)
    from fnmoe.parallel import dist as fdist  # here, not at the top: help and bad flags load no torch

    if fdist.launched():
        fdist.exit_worker(code)
    return code


def _run(sub: str, rest: list[str]) -> int:
    try:
        if sub == "train":  # it stops on signals itself, saving a checkpoint (fnmoe.run.stop)
            return cmd_train(rest)
        with _stopped_by_signals():
            return COMMANDS[sub](rest)
    except KeyboardInterrupt as e:  # Ctrl-C, or a Stopped: what the command was writing is removed on the way
        if sub == "train":
            raise
        _say(f"fnmoe {sub}: interrupted ({e.args[0] if isinstance(e, Stopped) else 'SIGINT'})")
        return 130
    except (ValueError, OSError) as e:
        notes = "".join(f"\n  {note}" for note in getattr(e, "__notes__", ()))  # e.g. the rank that raised
        _say(f"fnmoe {sub}: error: {_said(e)}{notes}")
        return 2
    except RuntimeError as e:
        from fnmoe.training.loop import OutOfMemory
        if not isinstance(e, OutOfMemory):
            raise
        _say(f"fnmoe {sub}: {e}")
        return 1


def _say(text: str) -> None:
    """text and its newline on stderr in one write, flushed: print writes the newline apart, and
    the error lines of ranks sharing a terminal or a log file ran together between the two."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class Stopped(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler) or SIGHUP (a closed terminal) during a subcommand
    other than train: it stops as Ctrl-C stops it, so a half-written output directory is removed
    (fnmoe.tree_io.new_dir) rather than left behind by the signal's default end."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Stopped in the body (main thread only); the handlers before are
    restored after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)
    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _said(e: Exception) -> str:
    """An error as one line: an OSError of a file (one fnmoe reads or writes: a read-only or full
    disk, a directory that is a file) as the path and the OS's reason."""
    if isinstance(e, OSError) and e.filename is not None:
        paths = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
        return f"{paths}: {e.strerror}"
    return str(e)
