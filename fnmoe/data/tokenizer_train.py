"""Training a tokenizer on a corpus (`fnmoe tokenizer train`): a byte-level BPE (GPT-2's scheme:
every byte is in the alphabet, so any text encodes without an unknown token) whose
tokenizer.json `fnmoe prepare --tokenizer` takes.

The documents are read as `fnmoe prepare` reads them (fnmoe.data.sources: text, JSONL, Parquet,
`datasets` directories, globs), streaming; an SFT pair gives both its prompt and its completion.
The end-of-text token `<|endoftext|>` is the first id (0), which is how prepare finds it. Needs
the `tokenizers` package (pip install 'fnmoe[tokenizers]').

Legend: no tensors here.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from fnmoe.data.sources import expand_inputs, iter_documents

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB = 257
"""the 256 bytes and the end-of-text token"""


def _texts(inputs: list[str], text_field: str, prompt_field: str) -> Iterator[str]:
    for src in expand_inputs(inputs):
        for doc in iter_documents(src, text_field, prompt_field):
            yield from (doc if isinstance(doc, tuple) else (doc,))


def train_tokenizer(inputs: list[str], vocab_size: int, out: str | Path, text_field: str = "text",
                    prompt_field: str = "", min_frequency: int = 2) -> dict:
    """Train a byte-level BPE of vocab_size ids (at least MIN_VOCAB) on the inputs' documents and
    write it to out (a tokenizer.json, replaced atomically); returns {"vocab_size", "merges", "eos_id"}."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"--vocab-size must be >= {MIN_VOCAB} (256 bytes and {EOS_TOKEN}), got {vocab_size}")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError("fnmoe tokenizer train needs the `tokenizers` package: "
                         "pip install 'fnmoe[tokenizers]'") from None
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; it must name the tokenizer.json to write")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = _texts(inputs, text_field, prompt_field)
    first = next(texts, None)
    if first is None:
        raise ValueError(f"{' '.join(inputs)}: no documents to train a tokenizer on")
    tok.train_from_iterator((t for part in ([first], texts) for t in part), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return {"vocab_size": tok.get_vocab_size(), "merges": tok.get_vocab_size() - MIN_VOCAB,
            "eos_id": tok.token_to_id(EOS_TOKEN)}
