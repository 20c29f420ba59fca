"""The `fnmoe` command (also `python -m fnmoe`): tyro-typed subcommands over RunConfig.

`--config FILE` names a TOML preset whose values become the defaults; every other flag is a
dotted override of the config tree (`--train.steps 50`, `--model.compute-dtype bfloat16`).
Without --config the built-in default is the tiny CPU preset (configs/tiny.toml holds the same
values, checked by a test).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Annotated, Callable

import tyro

from fnmoe.config import RunConfig, load_config, validate

TOP_HELP = """usage: fnmoe SUBCOMMAND [--config FILE] [OVERRIDES]

subcommands:
  train     train a model (default: the tiny MoE on the bundled corpus, CPU, a few minutes)

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


COMMANDS: dict[str, Callable[[list[str]], int]] = {"train": cmd_train}


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
