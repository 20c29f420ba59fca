"""`fnmoe prepare`: shards round-trip, the held-out split, resume after interruption, tokenizers."""
import json

import numpy as np
import pytest
import torch

from fnmoe.cli import main
from fnmoe.config import DataConfig
from fnmoe.data.loader import EOS_ID, load_data, open_prepared, read_documents
from fnmoe.data.prepare import PART_DOCS, prepare, read_inputs, save_part, scan


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "other": 1}) + "\n" for d in docs))
    return path


def byte_stream(docs):
    return [t for d in docs for t in list(d.encode()) + [EOS_ID]]


def test_round_trip_split_and_same_stream_as_raw_text(tmp_path):
    docs = [f"document {i}: " + "héllo wörld " * (i % 7 + 1) for i in range(150)]
    src = write_jsonl(tmp_path / "in.jsonl", docs, field="body")
    assert main(["prepare", "--input", str(src), "--text-field", "body", "--out", str(tmp_path / "out")]) == 0
    index, arrays = open_prepared(tmp_path / "out")
    n_val = round(150 * 0.05)
    assert index["splits"]["val"]["docs"] == n_val and index["dtype"] == "uint16"
    assert arrays["train"].tolist() == byte_stream(docs[:-n_val])
    assert arrays["val"].tolist() == byte_stream(docs[-n_val:])
    assert not (tmp_path / "out" / "parts").exists()
    data = load_data(DataConfig(corpus=str(tmp_path / "out")), 264)
    assert data.train_T.tolist() == byte_stream(docs[:-n_val])


def test_prepared_bundled_corpus_equals_the_raw_loader(tmp_path):
    src = write_jsonl(tmp_path / "bundled.jsonl", read_documents("bundled"))
    prepare([str(src)], "byte", tmp_path / "out")
    raw = load_data(DataConfig(), 264)
    prepared = load_data(DataConfig(corpus=str(tmp_path / "out")), 264)
    assert torch.equal(prepared.train_T.long(), raw.train_T.long())
    assert torch.equal(prepared.val_T.long(), raw.val_T.long())


def test_an_interrupted_run_resumes_from_finished_parts(tmp_path):
    docs = [f"doc {i} " * 5 for i in range(3 * PART_DOCS)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    parts = tmp_path / "out" / "parts"
    parts.mkdir(parents=True)
    # a part finished before the interruption (marked so we can see it was reused, not redone)
    marked = np.asarray(byte_stream(docs[:PART_DOCS]), dtype="uint16")
    marked[0] = ord("X")
    save_part(parts / "000000.npy", marked)  # as prepare saves a part: with its record
    (parts / "000001.tmp.npy").write_bytes(b"torn")  # an unfinished write is ignored
    np.save(parts / "split_val.npy", marked)  # the interrupted run's split of the boundary part: redone
    (parts / "key.txt").write_text(scan([str(src)], "byte").key)
    prepare([str(src)], "byte", tmp_path / "out")
    _, arrays = open_prepared(tmp_path / "out")
    n_val = round(len(docs) * 0.05)
    expected = byte_stream(docs[:-n_val])
    expected[0] = ord("X")
    assert arrays["train"].tolist() == expected and arrays["val"].tolist() == byte_stream(docs[-n_val:])


def test_a_finished_part_cut_short_is_redone_on_resume(tmp_path, capsys, monkeypatch):
    """A part that still reads (a whole .npy header and its data) but holds fewer tokens than were
    saved: the resume names it and tokenises it again, and the corpus is an uninterrupted run's (it
    lost the tokens, rc 0 and the same document count, before)."""
    import fnmoe.data.prepare as prep

    docs = [f"doc {i} " * (i % 7 + 2) for i in range(3 * PART_DOCS)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    prepare([str(src)], "byte", tmp_path / "ref", workers=1)
    real_add, calls = prep._Progress.add, []

    def interrupt_at_third_part(self, n_bytes, tokens):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_add(self, n_bytes, tokens)
    monkeypatch.setattr(prep._Progress, "add", interrupt_at_third_part)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], "byte", tmp_path / "out", workers=1)
    monkeypatch.undo()
    part = tmp_path / "out" / "parts" / "000001.npy"
    full = np.load(part)
    np.save(part, full[: len(full) * 9 // 10])  # readable, 10% short
    capsys.readouterr()
    index = prepare([str(src)], "byte", tmp_path / "out", workers=1)
    err = capsys.readouterr().err
    assert f"prepare: {part} is damaged ({len(full) * 9 // 10} tokens in " in err, err
    assert "which do not match its record 000001.json" in err and "; tokenising it again\n" in err, err
    ref = json.loads((tmp_path / "ref" / "index.json").read_text())
    assert index["splits"] == ref["splits"] and index["fingerprint"] == ref["fingerprint"]
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_parts_of_other_inputs_are_not_resumed(tmp_path):
    """An interrupted run on corpus A, then corpus B into the same directory: B's tokens only (A's
    parts used to be taken as B's)."""
    a = write_jsonl(tmp_path / "a.jsonl", [f"alpha {i} " * 3 for i in range(2 * PART_DOCS)])
    b_docs = [f"beta {i} " * 4 for i in range(2 * PART_DOCS)]
    b = write_jsonl(tmp_path / "b.jsonl", b_docs)
    prepare([str(a)], "byte", tmp_path / "out")
    index_a = json.loads((tmp_path / "out" / "index.json").read_text())
    (tmp_path / "out" / "index.json").unlink()  # as if A's run stopped before its end; its parts stay
    parts = tmp_path / "out" / "parts"
    parts.mkdir()
    save_part(parts / "000000.npy", np.asarray(byte_stream(read_inputs([str(a)], "text")[:PART_DOCS]), dtype="uint16"))
    (parts / "key.txt").write_text(scan([str(a)], "byte").key)
    index = prepare([str(b)], "byte", tmp_path / "out")
    _, arrays = open_prepared(tmp_path / "out")
    n_val = round(len(b_docs) * 0.05)
    assert arrays["train"].tolist() == byte_stream(b_docs[:-n_val]) and index["fingerprint"] != index_a["fingerprint"]


def test_truncated_shard_is_named(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [f"d{i}" * 10 for i in range(40)])
    prepare([str(src)], "byte", tmp_path / "out")
    with open(tmp_path / "out" / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="train.bin: missing or truncated"):
        open_prepared(tmp_path / "out")


def test_tokenizers_tokenizer_json(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    docs = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(60)]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    index = prepare([str(src)], str(tmp_path / "tokenizer.json"), tmp_path / "out")
    eos = tok.token_to_id("</s>")
    assert index["eos_id"] == eos and index["vocab_size"] == tok.get_vocab_size()
    _, arrays = open_prepared(tmp_path / "out")
    expected = [t for d in docs[:-3] for t in tok.encode(d).ids + [eos]]
    assert arrays["train"].tolist() == expected
    with pytest.raises(ValueError, match="model.vocab_size=10"):
        load_data(DataConfig(corpus=str(tmp_path / "out")), 10)
    # a model trained on it generates in its tokens: the prompt encoded and the output decoded by the
    # tokenizer the corpus keeps a copy of (bytes before, printing garbage)
    run_dir = str(tmp_path / "run")
    assert main(["train", "--data.corpus", str(tmp_path / "out"), "--train.steps", "1", "--train.run-dir", run_dir,
                 "--model.vocab-size", "80", "--model.dim", "32", "--model.ffn-hidden", "64",
                 "--model.moe.expert-hidden", "32", "--train.batch-size", "2", "--data.seq-len", "16",
                 "--train.eval-batches", "1"]) == 0
    from fnmoe.cli import load_model
    from fnmoe.sampling.generate import generate
    cfg, params = load_model(tmp_path / "run")
    prompt = tok.encode("the quick brown", add_special_tokens=False).ids
    new_ids = generate(params, torch.tensor([prompt]), cfg, 6, stop_id=eos)[0, len(prompt):].tolist()
    capsys.readouterr()
    assert main(["generate", "--from", run_dir, "--prompt", "the quick brown", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == "the quick brown" + tok.decode(new_ids) + "\n"
    (tmp_path / "out" / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text() + " ")  # another file
    assert main(["generate", "--from", run_dir, "--prompt", "the"]) == 2
    assert "is not the tokenizer" in capsys.readouterr().err


def test_checksums_verified_and_broken_indexes_named(tmp_path, capsys):
    """`fnmoe prepare --verify DIR` checks each file's sha256 (a small corpus also at open); a
    missing or broken index.json is named with its path, a path that does not exist as such."""
    src = write_jsonl(tmp_path / "in.jsonl", [f"d{i}" * 10 for i in range(40)])
    out = tmp_path / "out"
    prepare([str(src)], "byte", out)
    assert main(["prepare", "--verify", str(out)]) == 0
    assert "train.bin, val.bin match the sizes and sha256 checksums" in capsys.readouterr().out
    data = bytearray((out / "train.bin").read_bytes())
    data[5] ^= 0xFF  # same size: only the checksum tells
    (out / "train.bin").write_bytes(bytes(data))
    assert main(["prepare", "--verify", str(out)]) == 2
    assert f"{out / 'train.bin'} does not match its sha256 checksum" in capsys.readouterr().err
    with pytest.raises(ValueError, match="train.bin does not match its sha256"):
        load_data(DataConfig(corpus=str(out)), 264)
    (out / "index.json").write_text('{"format": ')
    with pytest.raises(ValueError, match=f"{out / 'index.json'}: not valid JSON"):
        load_data(DataConfig(corpus=str(out)), 264)
    (out / "index.json").unlink()
    with pytest.raises(ValueError, match=f"{out / 'index.json'} is missing: {out} is not a prepared corpus"):
        load_data(DataConfig(corpus=str(out)), 264)
    with pytest.raises(FileNotFoundError, match=f"corpus file not found: {tmp_path / 'nope'}"):
        load_data(DataConfig(corpus=str(tmp_path / "nope")), 264)
    assert main(["prepare", "--verify", str(tmp_path / "nope")]) == 2
    assert f"corpus directory not found: {tmp_path / 'nope'}" in capsys.readouterr().err


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_workers_must_be_positive(tmp_path, capsys, workers):
    src = write_jsonl(tmp_path / "in.jsonl", ["a", "b"])
    assert main(["prepare", "--input", str(src), "--out", str(tmp_path / "out"), "--workers", workers]) == 2
    assert capsys.readouterr().err == f"fnmoe prepare: error: --workers must be >= 1, got {workers}\n"
    assert not (tmp_path / "out").exists()


def test_progress_off_a_terminal_is_whole_lines(tmp_path, capsys, monkeypatch):
    """stderr a file or a pipe (not a terminal): the progress is whole lines, no carriage returns;
    on a terminal one line redrawn in place, ended once."""
    import sys

    docs = [f"document {i} " * 20 for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    assert main(["prepare", "--input", str(src), "--out", str(tmp_path / "a"), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if line]
    assert "\r" not in err and lines and all(line.startswith("prepare [") for line in lines)
    assert lines[-1].startswith("prepare [##############################] ")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["prepare", "--input", str(src), "--out", str(tmp_path / "b"), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("\rprepare [") and err.endswith("tokens/s\n") and err.count("\n") == 1
