"""The tokenizer files of a Hugging Face export: tokenizer.json, tokenizer_config.json and
generation_config.json, so `AutoTokenizer.from_pretrained(dir)` encodes text as the run did and
`generate` stops at its end-of-text token.

fnmoe's byte tokenizer (ids 0..255 are UTF-8 bytes, EOS_ID ends a document) is written as a
byte-level BPE without merges: the pre-tokenizer maps each byte to one character of GPT-2's
byte-to-unicode table, the vocabulary maps that character to the byte's value, and the end-of-text
token is an added special token. A tokenizer.json a prepared corpus kept (`fnmoe prepare
--tokenizer`) is copied as it is. Nothing here needs the `tokenizers` package.

Legend: no tensors here; files are handled by name and text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fnmoe.config.types import read_json
from fnmoe.data.loader import EOS_ID, PREPARED_TOKENIZER, read_prepared_index

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer as the files an export holds (name -> text) and its end-of-text id."""

    files: tuple[tuple[str, str], ...]
    eos_token_id: int

    def write(self, out_dir: Path) -> None:
        for name, text in self.files:
            (out_dir / name).write_text(text)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte (bytes that print stand for themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _config_files(eos_token: str, eos_id: int, max_len: int, split_special: bool) -> tuple[tuple[str, str], ...]:
    """tokenizer_config.json and generation_config.json. split_special: text that spells a special
    token is encoded as ordinary text (fnmoe's byte tokenizer), not as that token (tokenizers' own
    encode, which `fnmoe prepare --tokenizer` uses)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "pad_token": eos_token,
              "bos_token": None, "unk_token": None, "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
              "split_special_tokens": split_special}
    generation = {"eos_token_id": eos_id, "pad_token_id": eos_id, "bos_token_id": None}
    return (("tokenizer_config.json", json.dumps(config, indent=1) + "\n"),
            ("generation_config.json", json.dumps(generation, indent=1) + "\n"))


def byte_level(max_len: int) -> TokenizerFiles:
    """fnmoe's byte tokenizer (data.loader.ByteTokenizer) as tokenizer.json: text -> its UTF-8 bytes."""
    chars = byte_to_unicode()
    byte_level_ = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": EOS_ID, "content": EOS_TOKEN, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}],
           "normalizer": None, "pre_tokenizer": byte_level_, "post_processor": None, "decoder": byte_level_,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": {**{chars[b]: b for b in range(256)}, EOS_TOKEN: EOS_ID}, "merges": []}}
    return TokenizerFiles((("tokenizer.json", json.dumps(tok, ensure_ascii=False, indent=1) + "\n"),
                           *_config_files(EOS_TOKEN, EOS_ID, max_len, True)), EOS_ID)


def _token_of(tok: dict, token_id: int, where: Path) -> str:
    """The text of token token_id in a tokenizer.json: an added token, or one of the model's vocabulary."""
    added = tok.get("added_tokens")
    for entry in added if isinstance(added, list) else []:
        if isinstance(entry, dict) and entry.get("id") == token_id and isinstance(entry.get("content"), str):
            return entry["content"]
    model = tok.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        found = [t for t, i in vocab.items() if i == token_id]
        if found:
            return found[0]
    elif isinstance(vocab, list) and 0 <= token_id < len(vocab):  # Unigram: [piece, score] pairs
        piece = vocab[token_id]
        if isinstance(piece, list) and piece and isinstance(piece[0], str):
            return piece[0]
    raise ValueError(f"{where}: no token with id {token_id} (the corpus's end-of-text id)")


def from_file(path: str | Path, eos_id: int, max_len: int) -> TokenizerFiles:
    """A tokenizers tokenizer.json, copied, with eos_id its end-of-text id."""
    path = Path(path)
    eos_token = _token_of(read_json(path), eos_id, path)  # read_json names path: not UTF-8, not JSON, no object
    return TokenizerFiles((("tokenizer.json", path.read_text()), *_config_files(eos_token, eos_id, max_len, False)),
                          eos_id)


def of_corpus(corpus: Path | None, max_len: int) -> TokenizerFiles:
    """The tokenizer a run's data was tokenised with: a prepared corpus's (byte or its kept
    tokenizer.json), or (None: text read with the byte tokenizer) the byte tokenizer."""
    if corpus is None:
        return byte_level(max_len)
    index = read_prepared_index(corpus)
    if index["tokenizer"] == "byte":
        return byte_level(max_len)
    path = Path(corpus) / index.get("tokenizer_file", PREPARED_TOKENIZER)
    if not path.is_file():
        raise ValueError(f"{corpus} keeps no copy of its tokenizer ({index['tokenizer']}; prepared before copies "
                         "were kept): run fnmoe prepare again")
    return from_file(path, index["eos_id"], max_len)
