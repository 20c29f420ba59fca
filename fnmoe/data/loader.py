"""Tokenizers, corpus loading (text, JSONL, `fnmoe prepare` directories), and a deterministic,
resumable batch loader.

Shape suffixes: B batch (sequences), L sequence length, T tokens of a flat token stream,
N windows (all validation batches together), S document starts.

A corpus is a list of documents. Tokenized, each document is followed by EOS and the documents
are concatenated into one stream; the last `val_fraction` of the documents form the validation
stream. Training samples are the windows of L+1 tokens that start at multiples of L, so
neighbouring windows share one boundary token and every token is predicted at most once per epoch.
`Loader.batch_at` is a pure function of (seed, step, rank, micro-batch), so resuming needs only
the step, and any data-parallel layout of the same global batch sees the same samples.

Packing with document masks (data.doc_mask): a window still spans documents, but each sample also
carries positions_BL, each token's position in its own document (0 where one starts), from which
RoPE restarts and attention stays within the document (model.hidden_states), and the label of a
document's first token is ignored (nothing before it in its document predicts it). SFT corpora
(data.prompt_field) hold (prompt, completion) pairs; prompt tokens are inputs but never labels.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fnmoe import caches
from fnmoe.config import DataConfig
from fnmoe.config.types import kind, read_json, show
from fnmoe.data.sources import BUNDLED, read_documents

EOS_ID = 256
IGNORE = -100
"""the label of a token that has no loss (cross_entropy's ignore_index)"""
PREPARED_FORMAT, PREPARED_VERSION = "fnmoe-tokens", 1
"""a `fnmoe prepare` directory's index.json (its layout: fnmoe/data/prepare.py)"""
PREPARED_TOKENIZER = "tokenizer.json"  # the copy of a tokenizers tokenizer a prepared directory keeps


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; EOS_ID ends a document. Nothing to download."""

    vocab_size: int = 257
    name: str = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in map(int, ids) if 0 <= i < 256).decode("utf-8", errors="replace")


def load_tokenizer(spec: str):
    """(name, encode(str) -> list[int], vocab_size, eos_id) for 'byte' or a tokenizer.json path."""
    if spec == "byte":
        tok = ByteTokenizer()
        return "byte", tok.encode, tok.vocab_size, EOS_ID
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {spec} (use 'byte' or a tokenizer.json)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("a tokenizer.json needs the `tokenizers` package: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{spec}: not a Hugging Face tokenizer.json ({e})") from None
    eos = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
                if tok.token_to_id(t) is not None), None)
    if eos is None:
        raise ValueError(f"{spec}: no end-of-text token (<|endoftext|>, </s>, <eos>) in the vocabulary")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return f"tokenizers:{digest}", (lambda s: tok.encode(s, add_special_tokens=False).ids), \
        tok.get_vocab_size(), eos


def encode_documents(encode, docs: list, eos: int) -> tuple[list[int], list[int] | None]:
    """(ids, loss mask) of docs, EOS after each: the mask is 1 where a token is a loss target and
    0 on SFT prompts (None when no document is a pair). Completion and EOS are targets."""
    ids: list[int] = []
    mask: list[int] | None = [] if any(isinstance(d, tuple) for d in docs) else None
    for doc in docs:
        prompt, text = doc if isinstance(doc, tuple) else ("", doc)
        p, t = (encode(prompt) if prompt else []), encode(text)
        ids += p + t + [eos]
        if mask is not None:
            mask += [0] * len(p) + [1] * (len(t) + 1)
    return ids, mask


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
    eos_id: int = EOS_ID
    train_loss_T: torch.Tensor | None = None
    """uint8, 1 where a token of train_T is a loss target (0 on SFT prompts); None: all are"""
    val_loss_T: torch.Tensor | None = None

    def stream(self, split: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return (self.train_T, self.train_loss_T) if split == "train" else (self.val_T, self.val_loss_T)

    @functools.cached_property
    def _starts(self) -> dict[str, torch.Tensor]:
        return {split: torch.cat([torch.zeros(1, dtype=torch.long),
                                  (self.stream(split)[0] == self.eos_id).nonzero().flatten() + 1])
                for split in ("train", "val")}

    def doc_starts(self, split: str) -> torch.Tensor:
        """int64 [S]: where each document of the split's stream starts (0 and after every EOS)."""
        return self._starts[split]


def check_token_ids(tokens, vocab_size: int, where: str) -> None:
    """Raise ValueError naming the first id outside 0..vocab_size-1 and its (flat) position; ids of
    any integer dtype (uint16 and wider unsigned ones compared as int64: torch compares no others)."""
    flat_T = torch.as_tensor(tokens).reshape(-1)
    if flat_T.dtype.is_floating_point or flat_T.dtype.is_complex or flat_T.dtype == torch.bool:
        raise ValueError(f"{where}: token ids must be integers, got {flat_T.dtype}")
    flat_T = flat_T if flat_T.dtype in (torch.int32, torch.int64) else flat_T.long()
    bad_T = (flat_T < 0) | (flat_T >= vocab_size)
    if bad_T.any():
        pos = int(bad_T.nonzero()[0])
        tok = int(flat_T[pos])
        why = "is negative" if tok < 0 else f"is >= model.vocab_size={vocab_size}"
        raise ValueError(f"token id {tok} at position {pos} of {where} {why}")


# ---------------------------------------------------------------- prepared directories (`fnmoe prepare`)

CHECKSUM_AT_OPEN_BYTES = 64 << 20
"""a prepared corpus this small has its sha256 checksums checked each time it is opened (~0.1 s);
a larger one by `fnmoe prepare --verify DIR`"""


def read_prepared_index(dir_: str | Path) -> dict:
    """The index.json of a prepared directory, or a ValueError naming the file and what is wrong."""
    d = Path(dir_)
    path = d / "index.json"
    if not d.is_dir():
        raise FileNotFoundError(f"corpus directory not found: {d}")
    if not path.is_file():
        raise ValueError(f"{path} is missing: {d} is not a prepared corpus (`fnmoe prepare --out DIR` writes one)")
    index = read_json(path)
    if (index.get("format"), index.get("version")) != (PREPARED_FORMAT, PREPARED_VERSION):
        raise ValueError(f"{path}: not a {PREPARED_FORMAT} v{PREPARED_VERSION} index")
    problem = _field_problem(index, _INDEX_FIELDS, "") or next(filter(None, (
        _field_problem(e["loss_mask"], _MASK_FIELDS, f"splits.{s}.loss_mask")
        for s, e in index["splits"].items() if isinstance(e, dict) and "loss_mask" in e)), None)
    if problem:
        raise ValueError(f"{path}: {problem} (not as `fnmoe prepare` writes it: prepare {d} again)")
    return index


_SPLIT_FIELDS = {"file": str, "tokens": int, "docs": int, "sha256": str}
_MASK_FIELDS = {"file": str, "sha256": str}
_INDEX_FIELDS = {"tokenizer": str, "vocab_size": int, "eos_id": int, "dtype": str, "fingerprint": str,
                 "splits": {"train": _SPLIT_FIELDS, "val": _SPLIT_FIELDS}}
"""the fields of a prepared index.json that its readers use (others are allowed): a type, or a dict
of field -> such a spec for an object"""


def _field_problem(value: object, spec: type | dict, where: str) -> str | None:
    """The first field of value, named by its dotted path, that is missing or not of spec's type."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where} = {show(value)} is {kind(value)}, expected an object"
        prefix = f"{where}." if where else ""
        return next(filter(None, (f"no field '{prefix}{k}'" if k not in value else
                                  _field_problem(value[k], sub, prefix + k) for k, sub in spec.items())), None)
    if isinstance(value, spec) and not (spec is int and isinstance(value, bool)):
        return None
    return f"{where} = {show(value)} is {kind(value)}, expected {spec.__name__}"


def _token_dtype(d: Path, index: dict) -> np.dtype:
    """The token files' dtype: any integer dtype that holds the ids 0..vocab_size-1 (fnmoe prepare writes
    uint16 or uint32; a uint8 or int16 set of another tool reads as well); a float, or an integer too
    narrow for the vocabulary, would misread the ids and is refused."""
    try:
        dtype = np.dtype(index["dtype"])
    except TypeError:
        raise ValueError(f"{d / 'index.json'}: dtype {index['dtype']!r} is not a numpy dtype") from None
    vocab = index.get("vocab_size")
    if dtype.kind not in "iu":
        raise ValueError(f"{d / 'index.json'}: token dtype {dtype.name!r} is not an integer type")
    if isinstance(vocab, int) and vocab - 1 > np.iinfo(dtype).max:
        raise ValueError(f"{d / 'index.json'}: token dtype {dtype.name!r} holds ids up to {np.iinfo(dtype).max}, "
                         f"fewer than its vocab_size={vocab}")
    return dtype


def _prepared_files(d: Path, index: dict) -> list[tuple[str, Path, int, str]]:
    """(array name, path, bytes, sha256) of every file a prepared index lists."""
    out = []
    if isinstance(index, dict) and "dtype" in index:
        _token_dtype(d, index)  # its own message; a missing dtype is the malformed index's below
    try:
        itemsize = np.dtype(index["dtype"]).itemsize
        for split, entry in index["splits"].items():
            out.append((split, d / entry["file"], entry["tokens"] * itemsize, entry["sha256"]))
            if "loss_mask" in entry:
                m = entry["loss_mask"]
                out.append((split + ".loss_mask", d / m["file"], entry["tokens"], m["sha256"]))
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # valid JSON of the wrong shape
        raise ValueError(f"{d / 'index.json'} is malformed ({type(e).__name__}: {e})") from None
    return out


def check_prepared_checksums(dir_: str | Path) -> dict:
    """Each file of a prepared directory against its size and sha256 in index.json (what
    `fnmoe prepare --verify` runs); the index, or a ValueError naming the first bad file."""
    d = Path(dir_)
    index, _ = open_prepared(d, checksums=False)
    for _, path, _, sha in _prepared_files(d, index):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        if h.hexdigest() != sha:
            raise ValueError(f"{path} does not match its sha256 checksum in {d / 'index.json'} (corrupt)")
    return index


def open_prepared(dir_: str | Path, checksums: bool | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(index, {split: memory-mapped token array}) of a prepared directory, each file's size checked
    against the index; checksums too when asked, or (None) when the files are small enough to be cheap."""
    d = Path(dir_)
    index = read_prepared_index(d)
    files = _prepared_files(d, index)
    for _, path, size, _ in files:
        if not path.is_file() or path.stat().st_size != size:
            raise ValueError(f"{path}: missing or truncated (expected {size} bytes, {d / 'index.json'} says)")
    if checksums or (checksums is None and sum(f[2] for f in files) <= CHECKSUM_AT_OPEN_BYTES):
        check_prepared_checksums(d)
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    # copy-on-write: readers never write, and torch wants a writable buffer to wrap
    arrays = {name: np.memmap(path, dtype=np.uint8 if name.endswith(".loss_mask") else dtype, mode="c")
              for name, path, _, _ in files}
    return index, arrays


def corpus_codec(dir_: str | Path) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str], int]:
    """(encode, decode, eos_id) of the tokenizer a prepared directory's tokens were made with."""
    d = Path(dir_)
    index = read_prepared_index(d)
    if index["tokenizer"] == "byte":
        tok = ByteTokenizer()
        return tok.encode, tok.decode, index["eos_id"]
    path = d / index.get("tokenizer_file", PREPARED_TOKENIZER)
    if not path.is_file():
        raise ValueError(f"{d} keeps no copy of its tokenizer ({index['tokenizer']}; prepared before copies were "
                         "kept): run fnmoe prepare again")
    name, encode, _, eos = load_tokenizer(str(path))
    if name != index["tokenizer"]:
        raise ValueError(f"{path} is not the tokenizer {d} was prepared with ({index['tokenizer']})")
    from tokenizers import Tokenizer
    return encode, Tokenizer.from_file(str(path)).decode, eos


def load_prepared(path: Path, vocab_size: int) -> TokenData:
    """A `fnmoe prepare` directory: memory-mapped streams, validated against the model's vocab."""
    index, arrays = open_prepared(path)
    if index["vocab_size"] > vocab_size:
        raise ValueError(f"corpus {path} was tokenised with a vocabulary of {index['vocab_size']} "
                         f"ids (> model.vocab_size={vocab_size})")
    train_T, val_T = (torch.from_numpy(arrays[s]) for s in ("train", "val"))
    masks = [torch.from_numpy(arrays[s + ".loss_mask"]) if s + ".loss_mask" in arrays else None
             for s in ("train", "val")]
    return TokenData(train_T, val_T, index["fingerprint"], index["splits"]["train"]["docs"],
                     index["splits"]["val"]["docs"], index["eos_id"], *masks)


def load_data(dcfg: DataConfig, vocab_size: int) -> TokenData:
    if dcfg.corpus != BUNDLED and Path(dcfg.corpus).is_dir():  # a prepared corpus, or a broken one to name
        return load_prepared(Path(dcfg.corpus), vocab_size)
    if dcfg.tokenizer != "byte":
        raise ValueError(f"data.tokenizer={dcfg.tokenizer!r} is not supported (only 'byte')")
    tok = ByteTokenizer()
    docs = read_documents(dcfg.corpus, dcfg.text_field, dcfg.prompt_field)
    n_val = max(1, round(len(docs) * dcfg.val_fraction))
    if n_val >= len(docs):
        raise ValueError(f"corpus {dcfg.corpus} has {len(docs)} documents, too few to hold out "
                         f"data.val_fraction={dcfg.val_fraction} and still train")
    (train_T, train_loss_T), (val_T, val_loss_T) = (_token_stream(tok, d) for d in (docs[:-n_val], docs[-n_val:]))
    check_token_ids(train_T, vocab_size, f"corpus {dcfg.corpus} (train)")
    check_token_ids(val_T, vocab_size, f"corpus {dcfg.corpus} (val)")
    h = hashlib.sha256(tok.name.encode())
    for stream_T in (train_T, val_T, train_loss_T, val_loss_T):
        if stream_T is not None:  # the length prefix keeps (train, val) splits of the same tokens apart
            h.update(len(stream_T).to_bytes(8, "little"))
            h.update(stream_T.numpy().astype("<i4").tobytes())
    return TokenData(train_T, val_T, h.hexdigest()[:16], len(docs) - n_val, n_val, EOS_ID, train_loss_T, val_loss_T)


def _token_stream(tok: ByteTokenizer, docs: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids, mask = encode_documents(tok.encode, docs, EOS_ID)
    return torch.tensor(ids, dtype=torch.int32), None if mask is None else torch.tensor(mask, dtype=torch.uint8)


# ---------------------------------------------------------------- batches

def keyed_permutation(key: str, n: int) -> torch.Tensor:
    """A permutation of range(n) that is a function of key alone (the one rule of the loaders' epoch
    orders): sha256, not hash(), since Python salts str hashes per process and every rank must agree."""
    digest = hashlib.sha256(key.encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(n, generator=gen)


@caches.register
@functools.lru_cache(maxsize=4)   # consecutive steps almost always share an epoch
def _epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    # the key names the module this lived in before fnmoe/data/ and must not follow it: a checkpoint
    # keeps only the step and seed, so a changed key gives a resumed run other samples
    return keyed_permutation(f"fnmoe.data:{seed}:{epoch}", n)


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
    doc_mask: bool = False
    """batches carry positions_BL and ignore each document's first label (packing with document masks)"""

    @property
    def n_samples(self) -> int:
        return (len(self.data.train_T) - 1) // self.seq_len

    def position(self, step: int) -> dict:
        """The data position after `step` optimizer steps, as a checkpoint keeps it (index.json's
        train.data): batch_at is a pure function of the step, so this, with the seed and corpus
        fingerprint to check against, is all a resume needs."""
        seen = step * self.batch_size
        return {"step": step, "epoch": seen // self.n_samples, "samples_seen": seen, "seed": self.seed,
                "corpus_fingerprint": self.data.fingerprint}

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

    def batch_at(self, step: int, dp_rank: int, dp_size: int, micro: int) -> tuple[torch.Tensor, ...]:
        """(inputs_BL, labels_BL) int64 of one rank's micro-batch, plus positions_BL with doc_mask;
        labels are inputs shifted by one (IGNORE where they have no loss)."""
        window_B = self.sample_ids(step, dp_rank, dp_size, micro) % self.n_samples
        idx_BL = window_B[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        return windows(self.data, "train", idx_BL, self.doc_mask)

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


def windows(data: TokenData, split: str, idx_BL: torch.Tensor, doc_mask: bool) -> tuple[torch.Tensor, ...]:
    """(inputs_BL, labels_BL[, positions_BL]) of the split's windows at stream indices idx_BL [B, L+1]."""
    stream_T, loss_T = data.stream(split)
    tokens_BL = stream_T[idx_BL].long()
    inputs_BL, labels_BL = tokens_BL[:, :-1], tokens_BL[:, 1:].clone()
    if loss_T is not None:
        labels_BL[loss_T[idx_BL[:, 1:]] == 0] = IGNORE
    if not doc_mask:
        return inputs_BL, labels_BL
    starts_S = data.doc_starts(split)
    positions_BL = idx_BL - starts_S[torch.searchsorted(starts_S, idx_BL, right=True) - 1]
    labels_BL[positions_BL[:, 1:] == 0] = IGNORE
    return inputs_BL, labels_BL, positions_BL[:, :-1]


def val_batches(data: TokenData, seq_len: int, batch: int, n_batches: int,
                doc_mask: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """The first n_batches * batch windows of val_T, in order (fewer if val_T is short; the last
    batch may be smaller), as Loader.batch_at gives them. Windows start at multiples of L like
    training samples; a val_T shorter than L+1 tokens gives one window of its whole length."""
    if batch < 1 or n_batches < 1:
        raise ValueError(f"val batch={batch} and n_batches={n_batches} must be >= 1")
    L = min(seq_len, len(data.val_T) - 1)
    if L < 1:
        raise ValueError(f"the validation stream has {len(data.val_T)} tokens; need at least 2")
    n_windows = min((len(data.val_T) - 1) // L, batch * n_batches)
    idx_NL = torch.arange(n_windows)[:, None] * L + torch.arange(L + 1)
    return [windows(data, "val", idx_BL, doc_mask) for idx_BL in idx_NL.split(batch)]
