"""Byte tokenizer, corpus loading, and a deterministic, resumable batch loader.

Shape suffixes: B batch (sequences), L sequence length, T tokens of a flat token stream,
N windows (all validation batches together).

A corpus is a list of documents. Tokenized, each document is followed by EOS and the documents
are concatenated into one stream; the last `val_fraction` of the documents form the validation
stream. Training samples are the windows of L+1 tokens that start at multiples of L, so
neighbouring windows share one boundary token and every token is predicted at most once per epoch.
`Loader.batch_at` is a pure function of (seed, step, rank, micro-batch), so resuming needs only
the step, and any data-parallel layout of the same global batch sees the same samples.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from fnmoe.config import DataConfig

EOS_ID = 256
BUNDLED = "bundled"


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; EOS_ID ends a document. Nothing to download."""

    vocab_size: int = 257
    name: str = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in map(int, ids) if 0 <= i < 256).decode("utf-8", errors="replace")


# ---------------------------------------------------------------- reading documents

def read_documents(corpus: str, text_field: str = "text") -> list[str]:
    """Documents of `corpus`: "bundled" (fnmoe/assets/corpus.jsonl.gz), a .jsonl or .jsonl.gz
    file with one {"text": ...} object per line, or any other file read as UTF-8 text (gunzipped
    if its name ends in .gz) in which a line holding only a form feed ('\\f') separates documents
    (no such line: the file is one document); newlines around a separator are not kept."""
    if corpus == BUNDLED:
        raw = resources.files("fnmoe").joinpath("assets/corpus.jsonl.gz").read_bytes()
        return _parse_jsonl(_decode(gzip.decompress(raw), corpus), corpus, "text")
    path = Path(corpus)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {corpus}")
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"corpus {corpus}: not a valid gzip file ({e})") from None
    text = _decode(raw, corpus)
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        docs = _parse_jsonl(text, corpus, text_field)
    else:
        docs = [d.strip("\n") for d in re.split(r"^\f$", text, flags=re.M) if d.strip()]
    if not docs:
        raise ValueError(f"corpus {corpus} has no documents")
    return docs


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {where}: not valid UTF-8 at byte {e.start}") from None


def _parse_jsonl(text: str, where: str, field: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"corpus {where}, line {lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise ValueError(f'corpus {where}, line {lineno}: expected an object with a string "{field}"')
        docs.append(obj[field])
    return docs


# ---------------------------------------------------------------- token streams

@dataclass(frozen=True, eq=False)   # tensors have no truth value; compare fingerprints
class TokenData:
    train_T: torch.Tensor
    """int32 token stream of the training documents, EOS after each"""
    val_T: torch.Tensor
    """the same for the held-out documents (the last val_fraction, at least one)"""
    fingerprint: str
    """short sha256 of the tokenizer name and both streams; identifies the data"""
    n_train_docs: int
    n_val_docs: int


def check_token_ids(tokens, vocab_size: int, where: str) -> None:
    """Raise ValueError naming the first id outside 0..vocab_size-1 and its (flat) position."""
    flat_T = torch.as_tensor(tokens).reshape(-1)
    bad_T = (flat_T < 0) | (flat_T >= vocab_size)
    if bad_T.any():
        pos = int(bad_T.nonzero()[0])
        tok = int(flat_T[pos])
        why = "is negative" if tok < 0 else f"is >= model.vocab_size={vocab_size}"
        raise ValueError(f"token id {tok} at position {pos} of {where} {why}")


def load_prepared(path: Path, vocab_size: int) -> TokenData:
    """A `fnmoe prepare` directory: memory-mapped streams, validated against the model's vocab."""
    from fnmoe.prepare import open_prepared

    index, arrays = open_prepared(path)
    if index["vocab_size"] > vocab_size:
        raise ValueError(f"corpus {path} was tokenised with a vocabulary of {index['vocab_size']} "
                         f"ids (> model.vocab_size={vocab_size})")
    train_T, val_T = (torch.from_numpy(arrays[s]) for s in ("train", "val"))
    return TokenData(train_T, val_T, index["fingerprint"], index["splits"]["train"]["docs"],
                     index["splits"]["val"]["docs"])


def load_data(dcfg: DataConfig, vocab_size: int) -> TokenData:
    if dcfg.corpus != BUNDLED and (Path(dcfg.corpus) / "index.json").is_file():
        return load_prepared(Path(dcfg.corpus), vocab_size)
    if dcfg.tokenizer != "byte":
        raise ValueError(f"data.tokenizer={dcfg.tokenizer!r} is not supported (only 'byte')")
    tok = ByteTokenizer()
    docs = read_documents(dcfg.corpus)
    n_val = max(1, round(len(docs) * dcfg.val_fraction))
    if n_val >= len(docs):
        raise ValueError(f"corpus {dcfg.corpus} has {len(docs)} documents, too few to hold out "
                         f"data.val_fraction={dcfg.val_fraction} and still train")
    train_T = _token_stream(tok, docs[:-n_val])
    val_T = _token_stream(tok, docs[-n_val:])
    check_token_ids(train_T, vocab_size, f"corpus {dcfg.corpus} (train)")
    check_token_ids(val_T, vocab_size, f"corpus {dcfg.corpus} (val)")
    h = hashlib.sha256(tok.name.encode())
    for stream_T in (train_T, val_T):
        # the length prefix keeps (train, val) splits of the same tokens apart
        h.update(len(stream_T).to_bytes(8, "little"))
        h.update(stream_T.numpy().astype("<i4").tobytes())
    return TokenData(train_T, val_T, h.hexdigest()[:16], len(docs) - n_val, n_val)


def _token_stream(tok: ByteTokenizer, docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids += tok.encode(doc)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------- batches

@functools.lru_cache(maxsize=4)   # consecutive steps almost always share an epoch
def _epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    # sha256, not hash(): Python salts str hashes per process, and every rank must agree
    digest = hashlib.sha256(f"fnmoe.data:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(n, generator=gen)


@dataclass(frozen=True, eq=False)
class Loader:
    """Sample ids of one optimizer step: the global batch j = 0..batch_size-1 is laid out
    micro-batch-major, j = (micro * dp_size + dp_rank) * B + b with B = batch_size //
    (dp_size * grad_accum), so each micro-batch is a contiguous slice of the global batch and
    each rank takes a contiguous part of it. Global sample g = step * batch_size + j belongs to
    epoch g // n_samples and is window perm_epoch[g % n_samples]."""

    data: TokenData
    seq_len: int
    batch_size: int
    grad_accum: int
    seed: int

    @property
    def n_samples(self) -> int:
        return (len(self.data.train_T) - 1) // self.seq_len

    def sample_ids(self, step: int, dp_rank: int, dp_size: int, micro: int) -> torch.Tensor:
        """int64 (B,) ids epoch * n_samples + window of the samples batch_at returns."""
        B = self._micro_batch(step, dp_rank, dp_size, micro)
        n = self.n_samples
        g_B = step * self.batch_size + (micro * dp_size + dp_rank) * B + torch.arange(B)
        epoch_B, pos_B = g_B // n, g_B % n
        window_B = torch.empty_like(g_B)
        for epoch in epoch_B.unique().tolist():
            in_epoch_B = epoch_B == epoch
            window_B[in_epoch_B] = _epoch_permutation(self.seed, epoch, n)[pos_B[in_epoch_B]]
        return epoch_B * n + window_B

    def batch_at(self, step: int, dp_rank: int, dp_size: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_BL, labels_BL) int64 of one rank's micro-batch; labels are inputs shifted by one."""
        window_B = self.sample_ids(step, dp_rank, dp_size, micro) % self.n_samples
        idx_BL = window_B[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        tokens_BL = self.data.train_T[idx_BL].long()
        return tokens_BL[:, :-1], tokens_BL[:, 1:]

    def _micro_batch(self, step: int, dp_rank: int, dp_size: int, micro: int) -> int:
        per_step = dp_size * self.grad_accum
        if dp_size < 1 or self.grad_accum < 1 or self.batch_size < 1 or self.batch_size % per_step:
            raise ValueError(f"batch_size={self.batch_size} must be a positive multiple of "
                             f"dp_size={dp_size} x grad_accum={self.grad_accum}")
        if not (0 <= dp_rank < dp_size and 0 <= micro < self.grad_accum and step >= 0):
            raise ValueError(f"need 0 <= dp_rank={dp_rank} < dp_size={dp_size}, "
                             f"0 <= micro={micro} < grad_accum={self.grad_accum}, step={step} >= 0")
        if self.n_samples < 1:
            raise ValueError(f"the training stream has {len(self.data.train_T)} tokens, fewer than "
                             f"one sample of seq_len+1={self.seq_len + 1}")
        return self.batch_size // per_step


def val_batches(data: TokenData, seq_len: int, batch: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first n_batches * batch windows of val_T, in order (fewer if val_T is short; the last
    batch may be smaller). Windows start at multiples of L like training samples; a val_T shorter
    than L+1 tokens gives one window of its whole length."""
    if batch < 1 or n_batches < 1:
        raise ValueError(f"val batch={batch} and n_batches={n_batches} must be >= 1")
    L = min(seq_len, len(data.val_T) - 1)
    if L < 1:
        raise ValueError(f"the validation stream has {len(data.val_T)} tokens; need at least 2")
    n_windows = min((len(data.val_T) - 1) // L, batch * n_batches)
    idx_NL = torch.arange(n_windows)[:, None] * L + torch.arange(L + 1)
    tokens_NL = data.val_T[idx_NL].long()
    return [(t_BL[:, :-1], t_BL[:, 1:]) for t_BL in tokens_NL.split(batch)]
