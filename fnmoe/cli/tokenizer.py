"""`fnmoe tokenizer train`'s command line: a byte-level BPE tokenizer.json trained on corpus files
(fnmoe.data.tokenizer_train), for `fnmoe prepare --tokenizer`."""
from __future__ import annotations

import argparse


def cmd_tokenizer(argv: list[str]) -> int:
    from fnmoe.data.tokenizer_train import MIN_VOCAB, train_tokenizer

    parser = argparse.ArgumentParser(prog="fnmoe tokenizer", description="tokenizers for fnmoe prepare --tokenizer")
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser("train", help="train a byte-level BPE (GPT-2's scheme) on corpus files and write its "
                                         "tokenizer.json (needs pip install 'fnmoe[tokenizers]')")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="what fnmoe prepare --input takes: text, .jsonl[.gz], .parquet files, quoted globs, "
                   "directories of .parquet files or datasets save_to_disk directories")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help=f"ids in all (>= {MIN_VOCAB}: the 256 bytes, <|endoftext|> as id 0, then merges); "
                   "train with --model.vocab-size of at least N")
    p.add_argument("--out", required=True, metavar="FILE", help="the tokenizer.json to write")
    p.add_argument("--text-field", default="text", help="the JSONL field or Parquet / datasets column of the text")
    p.add_argument("--prompt-field", default="", help="SFT sets: a field of prompts, trained on too")
    p.add_argument("--min-frequency", type=int, default=2, help="the fewest occurrences of a pair it merges")
    args = parser.parse_args(argv)
    info = train_tokenizer(args.input, args.vocab_size, args.out, args.text_field, args.prompt_field,
                           args.min_frequency)
    print(f"wrote {args.out}: vocab {info['vocab_size']} (256 bytes, <|endoftext|> = id {info['eos_id']}, "
          f"{info['merges']} merges); next: fnmoe prepare --input ... --tokenizer {args.out} --out DIR")
    return 0
