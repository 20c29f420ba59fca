"""`fnmoe prepare`: text / JSONL files -> memory-mapped token shards with an index and a fingerprint.

Legend: T tokens.

Layout of a prepared directory (read by fnmoe.data when `--data.corpus DIR`):

    index.json   {"format": "fnmoe-tokens", "version": 1, "tokenizer": ..., "vocab_size", "eos_id",
                  "dtype": "uint16" | "uint32", "splits": {"train"|"val": {"file", "tokens", "docs",
                  "sha256"}}, "fingerprint"}
    train.bin    the training documents' tokens, EOS after each (raw little-endian dtype)
    val.bin      the held-out documents (the last val_fraction of all documents, in input order)
    train.loss_mask.bin, val.loss_mask.bin   SFT sets only (--prompt-field): uint8 per token, 0 on
                 prompt tokens (never labels), 1 elsewhere; in the index as splits.<s>.loss_mask
    tokenizer.json   a copy of the tokenizers tokenizer (not for 'byte'), for what decodes the tokens

Documents are tokenised in parallel in parts of PART_DOCS documents; each finished part is
renamed into `parts/` with its token count, so an interrupted run resumes at the first missing
part (only a run of the same documents and tokenizer: `parts/key.txt` holds their digest). The
final files are written to temporary names and renamed, so a crash never leaves a half-written
`train.bin` behind an index that claims it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from fnmoe.data import (PREPARED_FORMAT, PREPARED_TOKENIZER, PREPARED_VERSION, encode_documents, load_tokenizer,
                        read_documents)

PART_DOCS = 64


def read_inputs(inputs: list[str], text_field: str, prompt_field: str = "") -> list:
    docs: list = []
    for name in inputs:
        docs += read_documents(name, text_field, prompt_field)
    if not docs:
        raise ValueError(f"no documents in {inputs}")
    return docs


def _encode_part(args: tuple[str, str, list]) -> np.ndarray:
    """[T] token ids, or [2, T] ids and loss mask for SFT pairs."""
    spec, dtype, docs = args
    _, encode, _, eos = load_tokenizer(spec)
    ids, mask = encode_documents(encode, docs, eos)
    return np.asarray(ids if mask is None else [ids, mask], dtype=dtype)


def _progress(done: int, total: int) -> None:
    n = 30 * done // total
    sys.stderr.write(f"\rprepare [{'#' * n}{'.' * (30 - n)}] {done}/{total} parts")
    sys.stderr.flush()


def parts_key(docs: list, name: str, dtype: str) -> str:
    """What the parts of a run depend on: the documents (text, or prompt and text), the tokenizer
    and the part size. An interrupted run resumes only from parts of the same key."""
    h = hashlib.sha256(json.dumps([name, dtype, PART_DOCS]).encode())
    for doc in docs:
        h.update(json.dumps(doc).encode() + b"\0")
    return h.hexdigest()


def _tokenise_parts(docs: list, spec: str, name: str, dtype: str, parts_dir: Path, workers: int) -> list[Path]:
    """The part files of docs, tokenised where an earlier run of the same key left none."""
    key, key_file = parts_key(docs, name, dtype), parts_dir / "key.txt"
    if parts_dir.is_dir() and (not key_file.is_file() or key_file.read_text() != key):
        print(f"prepare: {parts_dir} holds parts of other inputs or another tokenizer; starting over", file=sys.stderr)
        for p in parts_dir.glob("*"):
            p.unlink()
    parts_dir.mkdir(parents=True, exist_ok=True)
    key_file.write_text(key)
    chunks = [docs[i:i + PART_DOCS] for i in range(0, len(docs), PART_DOCS)]
    todo = [k for k in range(len(chunks)) if not (parts_dir / f"{k:06d}.npy").exists()]
    done = len(chunks) - len(todo)
    _progress(done, len(chunks))
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        for k, ids_T in zip(todo, pool.map(_encode_part, [(spec, dtype, chunks[k]) for k in todo])):
            tmp = parts_dir / f"{k:06d}.tmp.npy"
            np.save(tmp, ids_T)
            os.replace(tmp, parts_dir / f"{k:06d}.npy")
            done += 1
            _progress(done, len(chunks))
    sys.stderr.write("\n")
    return [parts_dir / f"{k:06d}.npy" for k in range(len(chunks))]


def _concat(parts: list[Path], out: Path, dtype: str, row: int = 0) -> dict:
    """Stream row `row` of parts (1: the SFT loss mask) into out (via a temp name); its index entry."""
    tmp, h, n = out.with_suffix(".tmp"), hashlib.sha256(), 0
    with open(tmp, "wb") as f:
        for part in parts:
            b = np.atleast_2d(np.load(part))[row].astype(np.dtype(dtype).newbyteorder("<")).tobytes()
            f.write(b)
            h.update(b)
            n += len(b) // np.dtype(dtype).itemsize
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return {"file": out.name, "tokens": n, "sha256": h.hexdigest()}


def prepare(inputs: list[str], tokenizer: str, out_dir: str | Path, text_field: str = "text",
            val_fraction: float = 0.05, workers: int = 2, prompt_field: str = "") -> dict:
    """Tokenise inputs into out_dir (resuming an interrupted run there); returns the index.
    prompt_field: JSONL SFT pairs, whose prompt tokens are written with loss mask 0."""
    out = Path(out_dir)
    name, _, vocab, eos = load_tokenizer(tokenizer)
    if not 0 < val_fraction < 1:  # nan too
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    docs = read_inputs(inputs, text_field, prompt_field)
    n_val = max(1, round(len(docs) * val_fraction))
    if n_val >= len(docs):
        raise ValueError(f"{len(docs)} documents cannot hold out val_fraction={val_fraction} and still train")
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    parts_dir = out / "parts"
    parts = _tokenise_parts(docs, tokenizer, name, dtype, parts_dir, workers)
    # parts hold PART_DOCS documents each; split exactly at the first held-out document
    split = len(docs) - n_val
    boundary, cut = divmod(split, PART_DOCS)
    if cut:  # the boundary part holds both splits: split it by document
        head = _encode_part((tokenizer, dtype, docs[boundary * PART_DOCS:split]))
        whole = np.load(parts[boundary])
        np.save(parts_dir / "split_train.npy", whole[..., :head.shape[-1]])
        np.save(parts_dir / "split_val.npy", whole[..., head.shape[-1]:])
        train_parts = parts[:boundary] + [parts_dir / "split_train.npy"]
        val_parts = [parts_dir / "split_val.npy"] + parts[boundary + 1:]
    else:
        train_parts, val_parts = parts[:boundary], parts[boundary:]
    splits = {"train": _concat(train_parts, out / "train.bin", dtype) | {"docs": split},
              "val": _concat(val_parts, out / "val.bin", dtype) | {"docs": n_val}}
    if prompt_field:
        for s, s_parts in (("train", train_parts), ("val", val_parts)):
            splits[s]["loss_mask"] = _concat(s_parts, out / f"{s}.loss_mask.bin", "uint8", row=1)
    hashes = [e["sha256"] for e in splits.values()] + \
        [e["loss_mask"]["sha256"] for e in splits.values() if "loss_mask" in e]
    fingerprint = hashlib.sha256((name + "".join(hashes)).encode())
    index = {"format": PREPARED_FORMAT, "version": PREPARED_VERSION, "tokenizer": name,
             "tokenizer_spec": tokenizer, "vocab_size": vocab, "eos_id": eos, "dtype": dtype, "splits": splits,
             "fingerprint": fingerprint.hexdigest()[:16]}
    if tokenizer != "byte":  # a copy beside the tokens: what reads them (fnmoe generate) needs no other path
        shutil.copyfile(tokenizer, out / (PREPARED_TOKENIZER + ".tmp"))
        os.replace(out / (PREPARED_TOKENIZER + ".tmp"), out / PREPARED_TOKENIZER)
        index["tokenizer_file"] = PREPARED_TOKENIZER
    tmp = out / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / "index.json")
    for p in parts_dir.glob("*"):
        p.unlink()
    parts_dir.rmdir()
    return index
