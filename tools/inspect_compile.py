"""Compile-graph inspection, the same as `fnmoe inspect`:

    python tools/inspect_compile.py --config configs/tiny.toml [--dump DIR]
"""
import sys

from fnmoe.cli import main

sys.exit(main(["inspect", *sys.argv[1:]]))
