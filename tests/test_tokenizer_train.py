"""`fnmoe tokenizer train`: a byte-level BPE that `fnmoe prepare --tokenizer` takes, a run trains on
and evaluates with (bits per byte from its pieces' bytes against the decoded text's), and an export
carries."""
import json

import pytest

from fnmoe.cli import main
from fnmoe.data.loader import read_documents
from conftest import tiny_flags

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 documents of the bundled corpus as JSONL, a tokenizer of 320 ids trained on them, and the
    corpus prepared with it."""
    root = tmp_path_factory.mktemp("tok")
    docs = read_documents("bundled")[:40]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert main(["tokenizer", "train", "--input", str(root / "docs.jsonl"), "--vocab-size", "320",
                 "--out", str(root / "tok" / "tokenizer.json")]) == 0
    assert main(["prepare", "--input", str(root / "docs.jsonl"), "--tokenizer", str(root / "tok" / "tokenizer.json"),
                 "--out", str(root / "data"), "--workers", "1"]) == 0
    return root, docs


def test_the_tokenizer_is_a_byte_level_bpe_prepare_takes(corpus, capsys):
    root, docs = corpus
    tok = tokenizers.Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    assert tok.get_vocab_size() == 320 and tok.token_to_id("<|endoftext|>") == 0
    text = "naïve 😀 text it never saw \x00\x7f"  # every byte is in the alphabet: nothing unknown
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges shorten the bytes
    index = json.loads((root / "data" / "index.json").read_text())
    assert index["vocab_size"] == 320 and index["eos_id"] == 0 and index["tokenizer"].startswith("tokenizers:")
    from fnmoe.data.loader import open_prepared

    _, arrays = open_prepared(root / "data")
    n_val = index["splits"]["val"]["docs"]
    assert tok.decode(arrays["val"].tolist(), skip_special_tokens=False) == \
        "".join(d + "<|endoftext|>" for d in docs[-n_val:])


def test_a_run_on_it_evaluates_in_bits_per_byte_and_exports_it(corpus, tmp_path, capsys):
    """Bits per byte count each labelled token's bytes: their sum over the held-out labels (one
    contiguous stretch of the stream) is the UTF-8 length of that stretch decoded; the export's
    AutoTokenizer encodes as the tokenizer does."""
    from transformers import AutoTokenizer

    root, _ = corpus
    flags = [*tiny_flags(2), "--model.vocab-size", "320", "--data.corpus", str(root / "data")]
    assert main(["train", "--train.steps", "2", *flags, "--train.run-dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["eval", "--from", str(tmp_path / "run"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["sources"][""]
    from fnmoe.data.loader import open_prepared

    _, arrays = open_prepared(root / "data")
    labels = arrays["val"][1:1 + got["tokens"]].tolist()  # 2 batches of 4 windows of 32: tokens 1..256
    tok = tokenizers.Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    assert got["tokens"] == 256 and got["bytes"] == len(tok.decode(labels).encode())
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The list of things"
    assert auto.encode(text) == tok.encode(text, add_special_tokens=False).ids and auto.eos_token_id == 0


def test_bad_requests_are_one_error(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    assert main(["tokenizer", "train", "--input", str(tmp_path / "a.txt"), "--vocab-size", "100",
                 "--out", str(tmp_path / "t.json")]) == 2
    assert "--vocab-size must be >= 257" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--input", str(tmp_path / "nope.txt"), "--vocab-size", "300",
                 "--out", str(tmp_path / "t.json")]) == 2
    assert "not found" in capsys.readouterr().err
