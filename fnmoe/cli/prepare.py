"""`fnmoe prepare`'s command line: corpus files to prepared token shards (fnmoe.data.prepare), or
--verify a prepared directory."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fnmoe.cli.checks import check_range, out_dir


def cmd_prepare(argv: list[str]) -> int:
    from fnmoe.config.schema import Range
    from fnmoe.data.prepare import prepare

    parser = argparse.ArgumentParser(prog="fnmoe prepare", description="tokenise text, JSONL, Parquet or "
                                     "`datasets` corpora into memory-mapped token shards for --data.corpus DIR, "
                                     "streaming (memory does not grow with the input)")
    parser.add_argument("--input", nargs="+", metavar="FILE",
                        help="text files (form-feed lines separate documents), .jsonl[.gz] files, .parquet files, "
                        "globs of them (quoted), directories of .parquet files, or directories written by "
                        "datasets' save_to_disk (Parquet and datasets: pip install fnmoe[parquet])")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer.json")
    parser.add_argument("--out", metavar="DIR", help="output directory (resumes if interrupted)")
    parser.add_argument("--verify", metavar="DIR", help="instead: check a prepared directory's files against the "
                        "sizes and sha256 checksums in its index.json; exit 2 naming the first bad file")
    parser.add_argument("--text-field", default="text", help="the JSONL field or Parquet / datasets column "
                        "holding a document's text")
    parser.add_argument("--prompt-field", default="", help="SFT: the field or column holding a prompt, whose "
                        "tokens get no loss (the completion is --text-field)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="held-out fraction of documents")
    parser.add_argument("--workers", type=int, default=2, help="tokeniser processes")
    args = parser.parse_args(argv)
    if args.verify:
        return _verify_prepared(args.verify)
    if not (args.input and args.out):
        parser.error("--input and --out are required (or --verify DIR)")
    check_range(args.workers, "--workers", Range(1))
    out_dir(args.out, "--out")
    try:
        index = prepare(args.input, args.tokenizer, args.out, args.text_field, args.val_fraction, args.workers,
                        args.prompt_field)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (fnmoe.data.prepare.Stopped)
        print(f"\nfnmoe prepare: {e.args[0] if e.args else 'SIGINT'}: stopped; finished parts stay in "
              f"{Path(args.out) / 'parts'}: the same command resumes from them", file=sys.stderr)
        return 130
    sp = index["splits"]
    print(f"wrote {args.out}: {sp['train']['tokens']:,} train tokens ({sp['train']['docs']} documents), "
          f"{sp['val']['tokens']:,} held-out tokens ({sp['val']['docs']}), {index['dtype']}, "
          f"vocab {index['vocab_size']}, fingerprint {index['fingerprint']}")
    return 0


def _verify_prepared(path: str) -> int:
    from fnmoe.data.loader import check_prepared_checksums

    index = check_prepared_checksums(path)
    names = [e["file"] for e in index["splits"].values()] + \
        [e["loss_mask"]["file"] for e in index["splits"].values() if "loss_mask" in e]
    print(f"ok: {path}: {', '.join(names)} match the sizes and sha256 checksums in index.json")
    return 0
