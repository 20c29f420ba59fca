"""The subcommands that read a model from what `--from` / `--to-hf` names (a run directory, a
checkpoint, a native tree or a Hugging Face directory): `generate` and `convert`, and the loaders
`fnmoe eval` shares with them."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Callable, TypeVar

from safetensors import SafetensorError

from fnmoe.cli.checks import check_range, out_dir
from fnmoe.config import RunConfig, to_toml
from fnmoe.config.types import read_json


def checkpoint_of(src: Path) -> Path:
    """src, or for a run directory its newest complete checkpoint, named on stderr (a corrupt newer
    one is passed over with a warning, once)."""
    from fnmoe import checkpoint

    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    if not (src / "checkpoints").is_dir():
        return src
    found = checkpoint.find_latest(src / "checkpoints")
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint under {src / 'checkpoints'}")
    print(f"fnmoe: using {found[0]} (step {found[1]['step']}), the newest complete checkpoint of {src}",
          file=sys.stderr)
    return found[0]


def _format_of(index: Path) -> str | None:
    """The "format" an index.json declares (None: not an object or none declared)."""
    d = read_json(index, obj=False)
    return d.get("format") if isinstance(d, dict) else None


def is_checkpoint(src: Path) -> bool:
    """Whether src is a training checkpoint (its index.json declares the checkpoint format)."""
    from fnmoe import checkpoint

    return (src / "index.json").is_file() and _format_of(src / "index.json") == checkpoint.FORMAT


def load_source(src: Path):
    """(the RunConfig a training checkpoint was saved with, else None; ModelConfig; params) of a
    checkpoint, a native tree directory or a Hugging Face checkpoint directory."""
    from fnmoe import checkpoint, hf
    from fnmoe.tree_io import load_tree

    if is_checkpoint(src):
        run, params = checkpoint.load_params(src)
        return run, run.model, params
    if (src / "config.json").is_file():
        return None, *hf.load(src)
    return None, *load_tree(src)


def load_model(src: Path):
    """(ModelConfig, params) of a run directory (its newest complete checkpoint), a checkpoint,
    a native tree directory or a Hugging Face checkpoint directory."""
    return load_source(checkpoint_of(Path(src)))[1:]


T = TypeVar("T")


def read_newest(src: Path, read: Callable[[Path], T], tries: int = 5) -> tuple[Path, T]:
    """(checkpoint_of(src), read(it)). For a run directory, a checkpoint removed while it is chosen or
    read (a live training run's --checkpoint.keep-last removes older ones as it saves) is said on
    stderr and the newest complete one chosen again, up to `tries` times. read does all the reading
    of the checkpoint, so that what it returns is of one checkpoint."""
    from fnmoe import checkpoint

    for attempt in range(1, tries + 1):
        listed, ckpt = checkpoint.list_checkpoints(src / "checkpoints"), None
        try:
            ckpt = checkpoint_of(src)
            return ckpt, read(ckpt)
        # a file deleted under a reader: the OS's, safetensors' or a CheckpointError (a ValueError)
        except (OSError, ValueError, RuntimeError, SafetensorError):
            if not _vanished(src, ckpt, listed):
                raise
        if attempt < tries:
            what = ckpt or f"a checkpoint under {src / 'checkpoints'}"
            print(f"fnmoe: {what} vanished while it was read (a training run's --checkpoint.keep-last removes "
                  "older checkpoints); choosing the newest complete one again", file=sys.stderr)
    raise ValueError(f"{src}: each of the {tries} checkpoints chosen in turn vanished while it was read (the training "
                     "run removes them faster than this reads one: raise its --checkpoint.keep-last, or read a copy)")


def _vanished(src: Path, ckpt: Path | None, listed: list) -> bool:
    """Whether reading src failed because a run removed a checkpoint meanwhile: the one chosen from
    src's checkpoints has lost a file, or, none chosen yet, the checkpoints listed changed."""
    from fnmoe import checkpoint

    if ckpt is None:
        return checkpoint.list_checkpoints(src / "checkpoints") != listed
    try:
        return ckpt != src and not all((ckpt / name).is_file() for name in checkpoint.read_index(ckpt)["files"])
    except (OSError, ValueError):  # index.json removed or half read: removed
        return True


def _generate_codec(ckpt: Path, saved: RunConfig | None):
    """(encode, decode, eos id) for generate: the tokenizer of the prepared corpus the checkpoint
    (saved with the run config `saved`) trained on, else bytes. Bytes with a warning when that
    tokenizer is missing: the corpus (or its copy of the tokenizer) is gone, so the ids may not be
    bytes and the text comes out garbled."""
    from fnmoe.data.loader import EOS_ID, ByteTokenizer, corpus_codec
    from fnmoe.data.sources import BUNDLED
    from fnmoe.sampling.text import prepared_corpus

    tok = ByteTokenizer()
    as_bytes = (tok.encode, tok.decode, EOS_ID)
    if saved is None:
        return as_bytes  # a tree or HF directory names no corpus
    data = saved.data
    corpus = prepared_corpus(data)
    if corpus is not None:
        try:
            return corpus_codec(corpus)
        except (OSError, ValueError) as e:
            why = str(e)
    else:
        named = data.mix[0].corpus if data.mix else data.corpus
        # a prepared corpus is a directory (text corpora are files, read with the byte tokenizer)
        if named == BUNDLED or Path(named).is_file() or (not Path(named).exists() and (
                Path(named).suffix or any(c in named for c in "*?["))):
            return as_bytes
        state = "holds no index.json" if Path(named).is_dir() else "is missing"
        why = f"{named}, the corpus {ckpt} trained on, {state}, and with it the tokenizer it was prepared with"
    logging.getLogger("fnmoe").warning("warning: %s; generating with bytes (ids 0-255), which garbles the text "
                                       "unless that tokenizer was 'byte'", why)
    return as_bytes


def cmd_generate(argv: list[str]) -> int:
    import torch

    from fnmoe.config.ranges import INT64, Range
    from fnmoe.sampling.generate import generate

    parser = argparse.ArgumentParser(prog="fnmoe generate", description="sample text from a trained model "
                                     "with a KV cache (bytes, or the tokenizer of the prepared corpus it trained on)")
    parser.add_argument("--from", dest="src", required=True, metavar="DIR",
                        help="a run directory (newest checkpoint), a checkpoint, a native tree or a HF directory")
    parser.add_argument("--prompt", default="", help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] "
                        "(with temperature > 0)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_range(args.max_new_tokens, "--max-new-tokens", Range(0))
    check_range(args.temperature, "--temperature", Range(0))
    check_range(args.top_p, "--top-p", Range(0, 1, lo_open=True))
    check_range(args.seed, "--seed", INT64)
    src, (saved, cfg, params) = read_newest(Path(args.src), load_source)
    encode, decode, eos = _generate_codec(src, saved)
    try:
        ids = encode(args.prompt) or [eos]  # an empty prompt starts a new document
    except UnicodeEncodeError as e:  # bytes the shell could not decode arrive as surrogates
        raise ValueError(f"--prompt is not valid text in UTF-8 ({e.reason} at characters {e.start}..{e.end})") from None
    out = generate(params, torch.tensor([ids]), cfg, args.max_new_tokens, args.temperature, args.top_p,
                   args.seed, stop_id=eos)
    write_stdout(args.prompt + decode(out[0, len(ids):].tolist()) + "\n")
    return 0


def write_stdout(text: str) -> None:
    """text on stdout, or one error with the OS reason (a full disk, a closed pipe)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no second failure at exit's flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise ValueError(f"cannot write the output to stdout: {e.strerror or e}") from None


def _export_tokenizer(src: Path, saved: RunConfig | None, max_len: int):
    """(the tokenizer files an export of src carries or None, what to say of them): a training
    checkpoint (saved with the run config `saved`) names its data, so its tokenizer (the prepared
    corpus's, else bytes); a bare tree, or a run whose prepared corpus is gone, names none."""
    from fnmoe import hf
    from fnmoe.data.sources import BUNDLED
    from fnmoe.sampling.text import prepared_corpus

    if saved is None:
        return None, f"no tokenizer: {src} is not a training checkpoint, which names one"
    data = saved.data
    corpus = prepared_corpus(data)
    named = data.mix[0].corpus if data.mix else data.corpus
    if corpus is None and named != BUNDLED and not Path(named).is_file() and not Path(named).suffix:  # a directory
        return None, f"no tokenizer: {named}, the corpus it trained on, is gone"
    try:
        return hf.of_corpus(corpus, max_len), "with its tokenizer"
    except (OSError, ValueError) as e:  # the prepared corpus lost its copy of the tokenizer
        return None, f"no tokenizer: {e}"


def cmd_convert(argv: list[str]) -> int:
    from fnmoe import hf
    from fnmoe.run.rundir import write_text
    from fnmoe.tree_io import save_tree

    parser = argparse.ArgumentParser(prog="fnmoe convert", description="convert between Hugging Face "
                                     "checkpoints and fnmoe's native tree format (safetensors + index.json)")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="SRC", help="a Hugging Face checkpoint directory (config.json + safetensors)")
    src.add_argument("--to-hf", metavar="SRC", help="a run directory (its newest complete checkpoint), a training "
                     "checkpoint (<run-dir>/checkpoints/step_N) or a native tree directory (index.json + "
                     "params.safetensors); a run's export carries its tokenizer")
    parser.add_argument("--out", metavar="DST", required=True, help="the output directory (new or empty)")
    args = parser.parse_args(argv)
    out_dir(args.out, "--out")
    if args.from_hf:
        cfg, params = hf.load(args.from_hf)
        save_tree(args.out, params, cfg)
        # a run config with this model, for `fnmoe train --config DST/config.toml --train.init-from-hf SRC`
        run = RunConfig(model=cfg, name=Path(args.from_hf).resolve().name)
        run = dataclasses.replace(run, data=dataclasses.replace(run.data,
                                                                seq_len=min(run.data.seq_len, cfg.max_seq_len)))
        write_text(Path(args.out) / "config.toml", to_toml(run))  # one line naming it if it fails, no temp file left
        print(f"wrote {args.out} (native tree)")
        return 0
    src, (saved, cfg, params) = read_newest(Path(args.to_hf), load_source)
    tokenizer, said = _export_tokenizer(src, saved, cfg.max_seq_len)
    hf.save(args.out, params, cfg, tokenizer=tokenizer)
    print(f"wrote {args.out} ({hf.hf_architecture(cfg)}, {said})")
    return 0
