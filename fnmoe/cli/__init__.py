"""The `fnmoe` command (also `python -m fnmoe`): `main` runs a subcommand.

  commands.py   the dispatch, the flags (`parse_run`: a preset plus dotted overrides, validated) and
                the subcommands over a run config: train, eval, plan, rehearse, inspect, checkpoint, plot
  models.py     what --from names (`load_model`, `checkpoint_of`, `read_newest`); generate, convert
  prepare.py    prepare;  tokenizer.py: tokenizer train;  checks.py: the value checks they share

Importing it loads tyro and the config classes, not torch: each subcommand imports what it runs.
"""
from fnmoe.cli.commands import main, parse_run
from fnmoe.cli.models import load_model

__all__ = ["load_model", "main", "parse_run"]
