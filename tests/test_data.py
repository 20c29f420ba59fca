"""Tests of fnmoe.data.loader: tokenizer, corpus reading, train/val split, loader layout, val batches."""
from __future__ import annotations

import collections
import gzip
import json
import re

import pytest
import torch

from fnmoe.config import DataConfig
from fnmoe.data.loader import (EOS_ID, ByteTokenizer, Loader, TokenData, _epoch_permutation, check_token_ids,
                               load_data, read_documents, val_batches)


@pytest.fixture(scope="module")
def bundled() -> TokenData:
    return load_data(DataConfig(), vocab_size=264)


def stream_data(n_tokens: int) -> TokenData:
    """Token i is the number i, so a window's first token tells where it starts."""
    return TokenData(torch.arange(n_tokens, dtype=torch.int32), torch.arange(50, dtype=torch.int32),
                     "synthetic", 1, 1)


def write_jsonl(path, texts) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- tokenizer

def test_byte_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and EOS_ID == 256
    assert tok.encode("hé") == [0x68, 0xC3, 0xA9]
    text = "naïve café, 東京, emoji 🙂\n\ttab"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor([*ids, EOS_ID])) == text     # EOS is dropped
    assert tok.decode([0x68, 0xC3]) == "h\ufffd"                # a cut character is replaced


# ---------------------------------------------------------------- bundled corpus

def test_bundled_corpus_is_large_english_text():
    docs = read_documents("bundled")
    assert len(docs) > 100
    assert sum(len(d.encode("utf-8")) for d in docs) > 500_000
    words = collections.Counter(w for d in docs for w in re.findall(r"[a-z]+", d.lower()))
    top10 = {w for w, _ in words.most_common(10)}
    assert {"the", "a", "to", "of", "is"} <= top10, top10


def test_bundled_streams_and_fingerprint_are_stable(bundled):
    docs = read_documents("bundled")
    n_val = round(len(docs) * 0.05)
    assert len(bundled.train_T) == sum(len(d.encode("utf-8")) + 1 for d in docs[:-n_val])
    assert _split_eos(bundled.val_T.tolist()) == [d.encode("utf-8") for d in docs[-n_val:]]
    assert bundled.train_T.dtype == torch.int32
    again = load_data(DataConfig(), vocab_size=264)
    assert again.fingerprint == bundled.fingerprint and re.fullmatch(r"[0-9a-f]{8,64}", bundled.fingerprint)
    assert torch.equal(again.train_T, bundled.train_T) and torch.equal(again.val_T, bundled.val_T)


def test_val_docs_are_the_last_five_percent(tmp_path, bundled):
    texts = [f"document {i}: ünïcode {i * 7}" for i in range(100)]
    data = load_data(DataConfig(corpus=write_jsonl(tmp_path / "c.jsonl", texts)), vocab_size=257)
    assert (data.n_train_docs, data.n_val_docs) == (95, 5)
    assert [p.decode("utf-8") for p in _split_eos(data.val_T.tolist())] == texts[95:]
    assert [p.decode("utf-8") for p in _split_eos(data.train_T.tolist())] == texts[:95]
    n = bundled.n_train_docs + bundled.n_val_docs
    assert n > 100 and bundled.n_val_docs == round(n * 0.05)


def _split_eos(ids: list[int]) -> list[bytes]:
    out, cur = [], []
    for i in ids:
        if i == EOS_ID:
            out.append(bytes(cur))
            cur = []
        else:
            cur.append(i)
    assert not cur, "stream must end with EOS"
    return out


# ---------------------------------------------------------------- loader

def test_sample_order_is_the_one_saved_runs_resume_with(bundled):
    """A checkpoint keeps only the step and seed, so the order of samples must not change between
    releases: these are the ids the loader gave before fnmoe/data/ existed (moving the module once
    changed the permutation's key, and with it every run's data)."""
    assert _epoch_permutation(0, 1, 1000)[:6].tolist() == [411, 892, 581, 756, 346, 219]
    assert _epoch_permutation(7, 0, 1000)[:6].tolist() == [413, 277, 448, 607, 450, 458]
    loader = Loader(bundled, seq_len=256, batch_size=8, grad_accum=1, seed=0)
    assert loader.sample_ids(0, 0, 1, 0).tolist() == [801, 2254, 1342, 2087, 2102, 913, 775, 1774]


def test_batch_at_is_deterministic_and_seeded():
    data = stream_data(10_000)
    a = Loader(data, seq_len=16, batch_size=8, grad_accum=2, seed=0)
    b = Loader(data, seq_len=16, batch_size=8, grad_accum=2, seed=0)
    for step in (0, 5, 300):
        xa, ya = a.batch_at(step, 1, 2, 1)
        xb, yb = b.batch_at(step, 1, 2, 1)
        assert xa.dtype == ya.dtype == torch.int64 and xa.shape == (2, 16)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = Loader(data, seq_len=16, batch_size=8, grad_accum=2, seed=1)
    assert not torch.equal(a.sample_ids(0, 0, 1, 0), c.sample_ids(0, 0, 1, 0))


def test_windows_are_aligned_slices_and_labels_shift_by_one():
    L = 16
    loader = Loader(stream_data(1000), seq_len=L, batch_size=6, grad_accum=1, seed=3)
    assert loader.n_samples == (1000 - 1) // L
    for step in range(25):                       # crosses several epochs of 62 samples
        x, y = loader.batch_at(step, 0, 1, 0)
        assert torch.equal(x[:, 1:], y[:, :-1])
        start = x[:, 0]                          # token i is i: the window's start offset
        assert torch.all(start % L == 0) and torch.all(start // L < loader.n_samples)
        assert torch.equal(x, start[:, None] + torch.arange(L))
        assert torch.equal(y, start[:, None] + torch.arange(1, L + 1))
        assert torch.equal(start // L, loader.sample_ids(step, 0, 1, 0) % loader.n_samples)


@pytest.mark.parametrize("dp_size,grad_accum", [(3, 2), (2, 3), (6, 1), (1, 6)])
def test_ranks_and_micro_batches_partition_the_global_batch(dp_size, grad_accum):
    data = stream_data(800)                      # 49 samples of L=16: steps cross epochs
    split = Loader(data, seq_len=16, batch_size=24, grad_accum=grad_accum, seed=7)
    whole = Loader(data, seq_len=16, batch_size=24, grad_accum=1, seed=7)
    for step in range(6):
        parts = [split.sample_ids(step, r, dp_size, m) for r in range(dp_size) for m in range(grad_accum)]
        assert all(p.shape == (24 // (dp_size * grad_accum),) for p in parts)
        union = torch.cat(parts)
        assert len(set(union.tolist())) == 24    # no sample twice across ranks / micro-batches
        assert sorted(union.tolist()) == sorted(whole.sample_ids(step, 0, 1, 0).tolist())
        rows = torch.cat([split.batch_at(step, r, dp_size, m)[0] for r in range(dp_size) for m in range(grad_accum)])
        assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, whole.batch_at(step, 0, 1, 0)[0].tolist()))


def test_every_sample_once_per_epoch():
    loader = Loader(stream_data(47 * 8 + 1), seq_len=8, batch_size=10, grad_accum=1, seed=0)
    n = loader.n_samples
    assert n == 47
    ids = torch.cat([loader.sample_ids(s, 0, 1, 0) for s in range(10)]).tolist()   # 100 samples
    assert sorted(ids[:47]) == list(range(47))                 # epoch 0
    assert sorted(ids[47:94]) == list(range(47, 94))           # epoch 1, a different order
    assert [i % n for i in ids[:47]] != [i % n for i in ids[47:94]]
    assert all(94 <= i < 141 for i in ids[94:])


def test_loader_errors_name_the_values():
    loader = Loader(stream_data(1000), seq_len=16, batch_size=10, grad_accum=2, seed=0)
    with pytest.raises(ValueError, match=r"batch_size=10.*dp_size=3.*grad_accum=2"):
        loader.batch_at(0, 0, 3, 0)
    with pytest.raises(ValueError, match=r"dp_rank=5.*dp_size=5"):
        loader.batch_at(0, 5, 5, 0)
    with pytest.raises(ValueError, match=r"micro=2.*grad_accum=2"):
        loader.batch_at(0, 0, 1, 2)
    short = Loader(stream_data(16), seq_len=16, batch_size=2, grad_accum=1, seed=0)
    with pytest.raises(ValueError, match=r"16 tokens.*seq_len\+1=17"):
        short.batch_at(0, 0, 1, 0)


# ---------------------------------------------------------------- validation batches

def test_val_batches_are_consecutive_windows():
    data = stream_data(10)                       # val_T = 0..49
    batches = val_batches(data, seq_len=8, batch=2, n_batches=2)
    starts = [int(x[0]) for inputs, _ in batches for x in inputs]
    assert starts == [0, 8, 16, 24]
    for inputs, labels in batches:
        assert inputs.shape == labels.shape == (2, 8) and inputs.dtype == torch.int64
        assert torch.equal(labels, inputs + 1)
    fewer = val_batches(data, seq_len=8, batch=4, n_batches=10)   # 6 windows fit in 50 tokens
    assert [len(x) for x, _ in fewer] == [4, 2]
    (x, y), = val_batches(data, seq_len=100, batch=4, n_batches=2)  # shorter than one window
    assert torch.equal(x, torch.arange(49)[None]) and torch.equal(y, torch.arange(1, 50)[None])


def test_val_batches_on_bundled_corpus(bundled):
    batches = val_batches(bundled, seq_len=128, batch=8, n_batches=4)
    assert len(batches) == 4 and all(x.shape == (8, 128) for x, _ in batches)
    assert torch.equal(batches[0][0][0], bundled.val_T[:128].long())


# ---------------------------------------------------------------- errors at the boundaries

def test_check_token_ids_names_id_and_position(tmp_path):
    ids = torch.zeros(40, dtype=torch.int32)
    check_token_ids(ids, 264, "ok")
    ids[17], ids[30] = 300, 400
    with pytest.raises(ValueError, match=r"token id 300 at position 17 of shard\.bin is >= model\.vocab_size=264"):
        check_token_ids(ids, 264, "shard.bin")
    with pytest.raises(ValueError, match=r"token id -1 at position 2 of list"):
        check_token_ids([5, 6, -1], 264, "list")
    corpus = write_jsonl(tmp_path / "two.jsonl", ["ab", "cd"])   # train stream: a b EOS
    with pytest.raises(ValueError, match=r"token id 256 at position 2 of corpus .*two\.jsonl \(train\) "
                                         r"is >= model\.vocab_size=256"):
        load_data(DataConfig(corpus=corpus), vocab_size=256)


def test_bad_corpus_files_are_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        read_documents(str(missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=re.escape(str(bad)) + r", line 2: invalid JSON"):
        read_documents(str(bad))
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=re.escape(str(no_text)) + r", line 1"):
        read_documents(str(no_text))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=re.escape(str(empty)) + " has no documents"):
        read_documents(str(empty))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(str(latin1)) + r": not valid UTF-8 at byte 3"):
        read_documents(str(latin1))


def test_text_and_gzip_corpus_formats(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("first doc\nline two\n\f\nsecond\n\f\n")
    assert read_documents(str(txt)) == ["first doc\nline two", "second"]
    one = tmp_path / "one.txt"
    one.write_text("a single\n\ndocument, with \f inside a line\n")
    assert read_documents(str(one)) == ["a single\n\ndocument, with \f inside a line"]
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"text": "x\\u00e9"}\n\n{"text": ""}\n'))
    assert read_documents(str(gz)) == ["x\u00e9", ""]
