"""Held-out loss and bits per byte of a model, per data source (`fnmoe eval`).

The held-out batches are the training loop's own (`data.mixture.training_data`: the first
train.eval_batches batches of each source's validation split), so the loss of a run's final
checkpoint on its own config is the `val_loss` its last eval row holds. Bits per byte divide the
summed loss (nats, over the tokens that have a label) by ln 2 and by the UTF-8 bytes those tokens
stand for: one a byte for the byte tokenizer, none for its end-of-text token; for a tokenizer.json
each vocabulary entry's bytes (exact for byte-level BPE, GPT-2's and `fnmoe tokenizer train`'s;
the pieces' UTF-8 with SentencePiece's '▁' a space and `<0xHH>` one byte otherwise), none for
special tokens. A mixture's val_loss and bits per byte are its sources' weighted as the batches are.
Where bits per byte cannot be had (a tokenizer.json that is not one, or tokens that stand for no
bytes) they are None and `bits_per_byte_why` says why; the table prints that line under "n/a".

Legend: B batch, L sequence, V vocab, T the labelled tokens of a source's batches.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fnmoe.config import RunConfig
from fnmoe.data.loader import EOS_ID, IGNORE, PREPARED_TOKENIZER, read_prepared_index
from fnmoe.data.mixture import training_data
from fnmoe.hf.tokenizer import byte_to_unicode
from fnmoe.sampling.text import prepared_corpus
from fnmoe.training.step import eval_loss
from fnmoe.tree import Tree, tree_map

BYTE_PIECE = "<0x"
"""SentencePiece's byte-fallback pieces, <0x00>..<0xFF>: one byte each"""


def token_bytes(run: RunConfig) -> torch.Tensor:
    """int64 [V]: the UTF-8 bytes each token id of the run's data stands for (V = model.vocab_size)."""
    V = run.model.vocab_size
    corpus = prepared_corpus(run.data)
    if corpus is None or read_prepared_index(corpus)["tokenizer"] == "byte":
        bytes_V = torch.zeros(V, dtype=torch.long)
        bytes_V[:min(V, 256)] = 1
        bytes_V[EOS_ID:EOS_ID + 1] = 0
        return bytes_V
    index = read_prepared_index(corpus)
    return tokenizer_json_bytes(Path(corpus) / index.get("tokenizer_file", PREPARED_TOKENIZER), V)


def _has_byte_level(part: dict | None) -> bool:
    if not part:
        return False
    return part.get("type") == "ByteLevel" or any(_has_byte_level(p) for p in part.get("decoders") or [])


def tokenizer_json_bytes(path: Path, V: int) -> torch.Tensor:
    """int64 [V]: the bytes of each id of a tokenizers tokenizer.json (0 for special tokens and ids it
    lacks); a ValueError naming path and the problem where it holds no vocabulary to count."""
    try:
        tok = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:  # not UTF-8, or not JSON
        raise ValueError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None
    model = tok.get("model") if isinstance(tok, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not vocab or not isinstance(vocab, (dict, list)):
        raise ValueError(f"{path}: no model.vocab (a tokenizers tokenizer.json lists its pieces there)")
    pieces = vocab.items() if isinstance(vocab, dict) else ((p[0] if isinstance(p, list) and p else p, i)
                                                            for i, p in enumerate(vocab))
    pieces = [(p, i) for p, i in pieces if isinstance(p, str) and isinstance(i, int)]
    byte_level = _has_byte_level(tok.get("decoder"))
    of_char = {c: b for b, c in byte_to_unicode().items()}
    prefix = model.get("continuing_subword_prefix") or ""
    bytes_V = torch.zeros(V, dtype=torch.long)
    for piece, i in pieces:
        if not 0 <= i < V:
            continue
        if byte_level:
            n = sum(1 if c in of_char else len(c.encode()) for c in piece)
        elif piece.startswith(BYTE_PIECE) and piece.endswith(">") and len(piece) == 6:
            n = 1
        else:
            n = len(piece.removeprefix(prefix).replace("▁", " ").encode())
        bytes_V[i] = n
    for added in tok.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int) and isinstance(added.get("content"), str) \
                and 0 <= added["id"] < V:
            bytes_V[added["id"]] = 0 if added.get("special") else len(added["content"].encode())
    return bytes_V


def _to(tree: Tree, device: torch.device) -> Tree:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def evaluate(params: Tree, run: RunConfig, device: torch.device | str = "cpu") -> dict:
    """{"val_loss", "val_ppl", "bits_per_byte", "sources": {name: {"loss", "bits_per_byte", "tokens",
    "bytes", "weight", "batches"}}} of params on the run's held-out batches (one source named ""
    for data.corpus). One process; params whole."""
    _, val, weights = training_data(run)
    why = None
    try:
        bytes_V = token_bytes(run)
    except ValueError as e:  # the loss stands; only the bytes its tokens stand for are unknown
        bytes_V, why = None, f"the tokenizer's bytes per token are unknown: {e}"
    params = _to(params, torch.device(device))
    sources = {}
    for name, batches in val.items():
        loss = eval_loss(params, [_to(b, torch.device(device)) for b in batches], run)
        labels_T = torch.cat([b[1].flatten() for b in batches])
        labels_T = labels_T[labels_T != IGNORE]
        tokens, n_bytes = labels_T.numel(), 0 if bytes_V is None else int(bytes_V[labels_T].sum())
        if bytes_V is not None and not n_bytes:
            of = f" of {name}" if name else ""
            why = why or f"the {tokens} labelled tokens{of} stand for no bytes by the tokenizer"
        sources[name] = {"loss": loss, "bits_per_byte": loss * tokens / math.log(2) / n_bytes if n_bytes else None,
                         "tokens": tokens, "bytes": n_bytes, "weight": weights[name], "batches": len(batches)}
    val_loss = sum(s["weight"] * s["loss"] for s in sources.values())
    bpb = None if any(s["bits_per_byte"] is None for s in sources.values()) else \
        sum(s["weight"] * s["bits_per_byte"] for s in sources.values())
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 80.0)), "bits_per_byte": bpb, "sources": sources,
            **({"bits_per_byte_why": why} if bpb is None else {})}


def format_eval(result: dict, what: str, run: RunConfig) -> str:
    """The table `fnmoe eval` prints: a line per source, and the weighted whole of a mixture."""
    t, L = run.train, run.data.seq_len
    lines = [f"held-out loss of {what}: up to {t.eval_batches} batches of {t.batch_size // t.grad_accum} x {L} "
             "tokens a source", f"  {'source':<24}{'loss':>8}{'ppl':>10}{'bits/byte':>11}{'tokens':>11}{'bytes':>11}"]
    bpb = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    for name, s in result["sources"].items():
        label = name or (run.data.corpus if run.data.corpus != "bundled" else "bundled corpus")
        lines.append(f"  {label:<24}{s['loss']:>8.4f}{math.exp(min(s['loss'], 80.0)):>10.2f}"
                     f"{bpb(s['bits_per_byte']):>11}{s['tokens']:>11,}{s['bytes']:>11,}")
    if "" not in result["sources"]:
        lines.append(f"  {'weighted':<24}{result['val_loss']:>8.4f}{result['val_ppl']:>10.2f}"
                     f"{bpb(result['bits_per_byte']):>11}")
    if result.get("bits_per_byte_why"):
        lines.append(f"  bits/byte n/a: {result['bits_per_byte_why']}")
    return "\n".join(lines)
