"""`fnmoe prepare` from Parquet files, globs and `datasets` directories (the same tokens as the same
text given as JSONL), their errors, resuming after an interrupt, and memory bounded whatever the
input's size."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fnmoe.data.prepare
from fnmoe.cli import main
from fnmoe.data.loader import open_prepared
from fnmoe.data.prepare import PART_DOCS, prepare, save_part

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def documents(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "béta", "gamma", "δέλτα", "epsilon", "zeta", "ēta", "\u4e2d\u6587", "line\nbreak"]
    return [f"doc {i}: " + " ".join(rng.choice(words, rng.integers(1, 30))) for i in range(n)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, columns, row_group_size=50):
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def prepared(out):
    index, arrays = open_prepared(out)
    return index, {k: v.tolist() for k, v in arrays.items()}


def test_parquet_files_globs_and_directories_give_the_jsonl_tokens(tmp_path):
    docs = documents(700)
    write_jsonl(tmp_path / "all.jsonl", [{"text": d} for d in docs])
    prepare([str(tmp_path / "all.jsonl")], "byte", tmp_path / "ref")
    shards = tmp_path / "shards"
    shards.mkdir()
    for k, (a, b) in enumerate([(0, 250), (250, 251), (251, 700)]):  # several files, one of one row
        write_parquet(shards / f"part-{k:02d}.parquet", {"id": list(range(a, b)), "body": docs[a:b]})
    ref = prepared(tmp_path / "ref")
    assert main(["prepare", "--input", str(shards / "part-*.parquet"), "--text-field", "body",
                 "--out", str(tmp_path / "glob")]) == 0
    prepare([str(shards)], "byte", tmp_path / "dir", text_field="body")
    prepare([str(shards / f"part-{k:02d}.parquet") for k in range(3)], "byte", tmp_path / "files", text_field="body")
    for out in ("glob", "dir", "files"):
        index, arrays = prepared(tmp_path / out)
        assert arrays == ref[1] and index["splits"] == ref[0]["splits"], out


def test_sft_pairs_from_parquet_match_jsonl(tmp_path):
    prompts, answers = documents(300, seed=1), documents(300, seed=2)
    write_jsonl(tmp_path / "sft.jsonl", [{"q": p, "a": a} for p, a in zip(prompts, answers)])
    write_parquet(tmp_path / "sft.parquet", {"a": answers, "q": prompts})
    for name in ("sft.jsonl", "sft.parquet"):
        assert main(["prepare", "--input", str(tmp_path / name), "--text-field", "a", "--prompt-field", "q",
                     "--out", str(tmp_path / name.replace(".", "_"))]) == 0
    (index, arrays), (ref_index, ref_arrays) = prepared(tmp_path / "sft_parquet"), prepared(tmp_path / "sft_jsonl")
    assert index["splits"] == ref_index["splits"] and arrays == ref_arrays
    assert "loss_mask" in index["splits"]["train"]


def test_datasets_save_to_disk_directory_gives_the_jsonl_tokens(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = documents(600, seed=3)
    write_jsonl(tmp_path / "all.jsonl", [{"content": d} for d in docs])
    ds = datasets.Dataset.from_dict({"content": docs, "n": list(range(len(docs)))})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    assert len(list((tmp_path / "ds").glob("data-*.arrow"))) == 3
    prepare([str(tmp_path / "all.jsonl")], "byte", tmp_path / "ref", text_field="content")
    assert main(["prepare", "--input", str(tmp_path / "ds"), "--text-field", "content",
                 "--out", str(tmp_path / "out")]) == 0
    assert prepared(tmp_path / "out") == prepared(tmp_path / "ref")
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=f"{tmp_path / 'dd'} is a datasets DatasetDict: give one split's "
                                         f"directory, e.g. {tmp_path / 'dd' / 'train'}"):
        prepare([str(tmp_path / "dd")], "byte", tmp_path / "out2")


def test_bad_tables_are_named_with_file_and_column(tmp_path, capsys):
    good = write_parquet(tmp_path / "good.parquet", {"text": ["a", "b", "c"], "n": [1, 2, 3]})
    nulls = write_parquet(tmp_path / "nulls.parquet", {"text": ["a", None, "c"]})
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1" + bytes(range(256)) * 4)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[:-30])
    cases = {(str(good), "body"): f"corpus {good}: no column 'body' (its columns: text, n)",
             (str(good), "n"): f"corpus {good}: column 'n' holds int64, not strings",
             (str(nulls), "text"): f"corpus {nulls}: column 'text' is null at row 1",
             (str(corrupt), "text"): f"corpus {corrupt}: not a readable Parquet file",
             (str(truncated), "text"): f"corpus {truncated}: not a readable Parquet file",
             (str(tmp_path / "none-*.parquet"), "text"): f"corpus: no files match {tmp_path / 'none-*.parquet'}",
             (str(tmp_path / "empty"), "text"): f"corpus {tmp_path / 'empty'}: a directory must be a datasets "
                                                "save_to_disk directory"}
    (tmp_path / "empty").mkdir()
    for (src, field), message in cases.items():
        assert main(["prepare", "--input", src, "--text-field", field, "--out", str(tmp_path / "out")]) == 2, src
        assert message in capsys.readouterr().err, (src, field)
    assert main(["prepare", "--input", str(good), "--prompt-field", "n", "--out", str(tmp_path / "out")]) == 2
    assert f"corpus {good}: column 'n' holds int64, not strings" in capsys.readouterr().err
    # an unreadable shard of a datasets directory: the shard is named
    shard = tmp_path / "ds" / "data-00000-of-00001.arrow"
    shard.parent.mkdir()
    (tmp_path / "ds" / "state.json").write_text(json.dumps({"_data_files": [{"filename": shard.name}]}))
    shard.write_bytes(b"not arrow at all")
    assert main(["prepare", "--input", str(shard.parent), "--out", str(tmp_path / "out")]) == 2
    assert f"corpus {shard}: not a readable Arrow IPC file" in capsys.readouterr().err
    assert not (tmp_path / "out" / "index.json").exists()


@pytest.mark.launch
def test_without_pyarrow_core_imports_and_parquet_says_what_to_install(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["pyarrow"] = None  # as if not installed: importing it raises ImportError
        import fnmoe, fnmoe.data.prepare, fnmoe.data.loader
        from fnmoe.cli import main
        assert main(["prepare", "--input", {str(tmp_path / "x.parquet")!r}, "--out", {str(tmp_path / "o")!r}]) == 2
    """)
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "x.parquet")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "needs pyarrow: pip install fnmoe[parquet]" in r.stderr


def test_an_interrupted_parquet_run_resumes(tmp_path, monkeypatch):
    docs = documents(3 * PART_DOCS, seed=4)
    src = write_parquet(tmp_path / "in.parquet", {"text": docs}, row_group_size=300)
    prepare([str(src)], "byte", tmp_path / "ref")
    real_add, calls = fnmoe.data.prepare._Progress.add, []

    def interrupt_at_second_part(self, n_bytes, tokens):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_add(self, n_bytes, tokens)

    monkeypatch.setattr(fnmoe.data.prepare._Progress, "add", interrupt_at_second_part)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], "byte", tmp_path / "out", workers=1)
    monkeypatch.undo()
    parts = sorted((tmp_path / "out" / "parts").glob("0*.npy"))
    assert [p.name for p in parts] == ["000000.npy", "000001.npy"]  # saved; the 2nd interrupted after its rename
    marked = np.load(parts[0])
    marked[0] = ord("X")  # so the output shows the part was reused, not redone
    save_part(parts[0], marked)  # with its record, as prepare saves it
    prepare([str(src)], "byte", tmp_path / "out")
    index, arrays = prepared(tmp_path / "out")
    expected = prepared(tmp_path / "ref")[1]
    expected["train"][0] = ord("X")
    assert arrays == expected


# VmHWM, not getrusage(RUSAGE_SELF): Linux carries ru_maxrss across exec, so a child of pytest would
# report pytest's own peak. The tokeniser workers are forked by the script before they read anything.
RSS_SCRIPT = """
import resource, sys
from fnmoe.cli import main
assert main(["prepare", "--input", sys.argv[1], "--out", sys.argv[2], "--workers", "2"]) == 0
hwm_kb = open("/proc/self/status").read().split("VmHWM:")[1].split()[0]
print(hwm_kb, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_peak_memory_does_not_grow_with_the_input(tmp_path, fmt):
    """Peak RSS of the prepare process and of its tokeniser workers, for inputs of 16 and 112 MB of
    text (Parquet: one row group, pyarrow's default up to 1M rows): the larger may cost a little,
    far less than half its extra 96 MB. The prepare process's peak moves by up to ~25 MB from run
    to run whatever the input (allocator and reader batches: 12 vs 48 MB grew 23 MB once under load,
    24 vs 72 MB 24 MB on a quiet machine), so the inputs differ by far more than that."""
    rng = np.random.default_rng(5)
    letters = np.frombuffer("abcdefghijklmnopqrstuvwxyzé    \n".encode(), np.uint8)
    block = letters[rng.integers(0, len(letters), 112 << 20)].tobytes()  # incompressible-ish text
    peaks, sizes = [], []
    for mb in (16, 112):
        texts = [block[i:i + 4096].decode("utf-8", errors="ignore") for i in range(0, mb << 20, 4096)]
        src = tmp_path / f"in{mb}.{fmt}"
        if fmt == "jsonl":
            write_jsonl(src, [{"text": t} for t in texts])
        else:
            pq.write_table(pa.table({"text": texts}), src)
            assert pq.ParquetFile(src).metadata.num_row_groups == 1
        sizes.append(sum(len(t.encode()) for t in texts))
        del texts
        r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(src), str(tmp_path / f"out{mb}")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "MB/s" in r.stderr and "tokens/s" in r.stderr
        peaks.append([int(kb) * 1024 for kb in r.stdout.split()[-2:]])
        src.unlink()
    grown = max(big - small for small, big in zip(*peaks))
    assert grown < (sizes[1] - sizes[0]) / 2, (peaks, sizes)
