"""Documents from corpus files, read lazily: text, JSONL (.gz), Parquet, `datasets` directories.

A document is a str, or the pair (prompt, completion) of an SFT set (prompt_field). Every reader
yields documents one at a time in file order and holds at most one line (JSONL), one document
(text) or one record batch of BATCH_ROWS rows (Parquet, Arrow) beside it, so a corpus of any size
is read in bounded memory. count_documents says how many documents a file holds without keeping
them (Parquet: its footer; Arrow: its batch headers; JSONL: its non-blank lines), which is what
`fnmoe prepare` needs to place the held-out split before it reads.

Inputs (expand_inputs): a file; a glob ("shards/*.parquet", sorted by name); a directory written by
`datasets.Dataset.save_to_disk` (state.json and data-*.arrow Arrow IPC streams, in state.json's
order); a directory of .parquet files (sorted by name); "bundled", the small corpus in
fnmoe/assets. Parquet and Arrow need pyarrow (pip install fnmoe[parquet]), imported only when
such a file is read, so `import fnmoe` works without it.
"""
from __future__ import annotations

import glob
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUNDLED = "bundled"
BATCH_ROWS = 1024
"""rows of a Parquet / Arrow column converted to Python strings at a time"""


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str
    """'jsonl' (.jsonl, .jsonl.gz), 'parquet', 'arrow' (Arrow IPC, as `datasets` writes) or 'text'"""
    bundled: bool = False
    """fnmoe/assets/corpus.jsonl.gz, whose field is always "text" """

    def fields(self, text_field: str, prompt_field: str) -> tuple[str, str]:
        return ("text", "") if self.bundled else (text_field, prompt_field)


def _kind(path: Path) -> str:
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return "text"


def expand_inputs(names: list[str]) -> list[Source]:
    """The files behind names, in order: each glob's matches and each directory's shards sorted."""
    sources: list[Source] = []
    for name in names:
        if name == BUNDLED:
            path = Path(str(resources.files("fnmoe").joinpath("assets/corpus.jsonl.gz")))
            sources.append(Source(path, "jsonl", bundled=True))
            continue
        path = Path(name)
        if path.is_file():
            sources.append(Source(path, _kind(path)))
        elif path.is_dir():
            sources += [Source(p, _kind(p)) for p in _directory_shards(path)]
        elif any(c in name for c in "*?["):
            matches = sorted(glob.glob(name))
            if not matches:
                raise FileNotFoundError(f"corpus: no files match {name}")
            sources += expand_inputs(matches)
        else:
            raise FileNotFoundError(f"corpus file not found: {name}")
    return sources


def _directory_shards(path: Path) -> list[Path]:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ValueError(f"corpus {path} is a datasets DatasetDict: give one split's directory, e.g. "
                         f"{path / (splits[0] if splits else 'train')}")
    state = path / "state.json"
    if state.is_file():  # Dataset.save_to_disk: its shards in the order state.json lists them
        try:
            files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"corpus {state}: not a datasets state.json ({e!r})") from None
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"corpus {path}: shard {f.name} listed in state.json is missing")
        return files
    files = sorted(path.glob("*.parquet"))
    if not files:
        raise ValueError(f"corpus {path}: a directory must be a datasets save_to_disk directory (state.json, "
                         "data-*.arrow) or hold .parquet files; it has neither")
    return files


# ---------------------------------------------------------------- reading

def read_documents(corpus: str, text_field: str = "text", prompt_field: str = "") -> list:
    """Documents of `corpus` in a list: "bundled" (fnmoe/assets/corpus.jsonl.gz); a .jsonl or
    .jsonl.gz file with one {"text": ...} object per line; a .parquet file, a glob, a directory of
    .parquet files or a `datasets` save_to_disk directory (text_field names the column); or any other
    file read as UTF-8 text (gunzipped if its name ends in .gz) in which a line holding only a form
    feed ('\\f') separates documents (no such line: the file is one document); newlines around a
    separator are not kept. With prompt_field (JSONL, Parquet, Arrow) each document is the pair
    (prompt, completion) of an SFT set. For inputs larger than memory: iter_documents."""
    docs = [d for src in expand_inputs([corpus]) for d in iter_documents(src, text_field, prompt_field)]
    if not docs:
        raise ValueError(f"corpus {corpus} has no documents")
    return docs


def iter_documents(src: Source, text_field: str = "text", prompt_field: str = "") -> Iterator:
    field, prompt = src.fields(text_field, prompt_field)
    if src.kind == "jsonl":
        return _jsonl_documents(src.path, field, prompt)
    if src.kind in ("parquet", "arrow"):
        return _table_documents(src, field, prompt)
    if prompt:
        raise ValueError(f"corpus {src.path}: a prompt field ({prompt!r}) needs a JSONL, Parquet or datasets corpus")
    return _text_documents(src.path)


def count_documents(src: Source, text_field: str = "text", prompt_field: str = "") -> int:
    """How many documents iter_documents(src) yields, without parsing them where the format allows
    (JSONL: non-blank lines, so a broken line is found by the read that follows, not here). A
    table's columns are checked here: a bad column fails before anything is tokenised."""
    field, prompt = src.fields(text_field, prompt_field)
    if src.kind == "jsonl":
        return sum(1 for raw, _ in _lines(src.path) if raw.strip())
    if src.kind == "parquet":
        pf = _parquet_file(src.path)
        _check_columns(src.path, pf.schema_arrow, field, prompt)
        return pf.metadata.num_rows
    if src.kind == "arrow":
        pa = _pyarrow()
        # memory-mapped, only the batch headers are read: the column data is never paged in
        with pa.memory_map(str(src.path)) as f:
            reader = _arrow_reader(src.path, f)
            _check_columns(src.path, reader.schema, field, prompt)
            return _guard_arrow(src.path, lambda: sum(b.num_rows for b in _arrow_batches(reader)))
    return sum(1 for _ in iter_documents(src, field, prompt))


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _guard_gzip(path: Path, fn):
    try:
        return fn()
    except (gzip.BadGzipFile, EOFError) as e:
        raise ValueError(f"corpus {path}: not a valid gzip file ({e})") from None


def _decode(raw: bytes, where, offset: int = 0) -> str:
    """raw as UTF-8; an error names the byte at which raw starts in its file plus the bad one's."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {where}: not valid UTF-8 at byte {offset + e.start}") from None


def _lines(path: Path) -> Iterator[tuple[bytes, int]]:
    """(line, its byte offset) of a file, gunzipped if its name ends in .gz."""
    with _open(path) as f:
        it, offset = iter(f), 0
        while (raw := _guard_gzip(path, lambda: next(it, None))) is not None:
            yield raw, offset
            offset += len(raw)


def _jsonl_documents(path: Path, field: str, prompt_field: str = "") -> Iterator:
    """One document per non-blank line; a blank line is ASCII whitespace only (as count_documents
    counts them)."""
    for lineno, (raw, offset) in enumerate(_lines(path), start=1):
        if raw.strip():
            yield _parse_jsonl_line(_decode(raw, path, offset), path, lineno, field, prompt_field)


def _parse_jsonl_line(line: str, where, lineno: int, field: str, prompt_field: str = ""):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"corpus {where}, line {lineno}: invalid JSON ({e.msg})") from None
    for name in (prompt_field, field) if prompt_field else (field,):
        if not isinstance(obj, dict) or not isinstance(obj.get(name), str):
            raise ValueError(f'corpus {where}, line {lineno}: expected an object with a string "{name}"')
    return (obj[prompt_field], obj[field]) if prompt_field else obj[field]


def _text_documents(path: Path) -> Iterator[str]:
    """Documents separated by lines that hold only '\\f', read a line at a time (one document is
    held whole: it is tokenised whole)."""
    lines: list[str] = []
    for raw, offset in _lines(path):
        line = _decode(raw, path, offset)
        if line in ("\f\n", "\f"):
            yield from _text_document(lines)
            lines = []
        else:
            lines.append(line)
    yield from _text_document(lines)


def _text_document(lines: list[str]) -> Iterator[str]:
    doc = "".join(lines).strip("\n")
    if doc.strip():
        yield doc


# ---------------------------------------------------------------- Parquet and Arrow (pyarrow)

def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (the submodule, used as pa.parquet)
    except ImportError:
        raise ValueError("reading Parquet or datasets (Arrow) corpora needs pyarrow: pip install fnmoe[parquet]") \
            from None
    return pyarrow


def _parquet_file(path: Path):
    pa = _pyarrow()
    # Read page by page through a small buffer: by default (pre_buffer) a whole row group's column
    # chunk is read at once, and pyarrow writes one row group per 1M rows (GBs of text). Not
    # memory-mapped: pages read are freed, where a mapping would keep them resident.
    try:
        return pa.parquet.ParquetFile(str(path), memory_map=False, buffer_size=1 << 20, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"corpus {path}: not a readable Parquet file ({e})") from None


def _arrow_reader(path: Path, f):
    pa = _pyarrow()
    try:  # datasets writes IPC streams; the IPC file format (Feather v2) too
        return pa.ipc.open_stream(f)
    except (pa.ArrowException, OSError):
        pass
    try:
        f.seek(0)
        return pa.ipc.open_file(f)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"corpus {path}: not a readable Arrow IPC file ({e})") from None


def _arrow_batches(reader) -> Iterator:
    if hasattr(reader, "num_record_batches"):  # the IPC file format
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def _guard_arrow(path: Path, fn):
    pa = _pyarrow()
    try:
        return fn()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"corpus {path}: unreadable data ({e})") from None


def _check_columns(path: Path, schema, field: str, prompt_field: str) -> None:
    pa = _pyarrow()
    for name in (prompt_field, field) if prompt_field else (field,):
        if name not in schema.names:
            raise ValueError(f"corpus {path}: no column {name!r} (its columns: {', '.join(schema.names)})")
        t = schema.field(name).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
            raise ValueError(f"corpus {path}: column {name!r} holds {t}, not strings")


def _table_documents(src: Source, field: str, prompt_field: str) -> Iterator:
    pa = _pyarrow()
    names = [prompt_field, field] if prompt_field else [field]
    if src.kind == "parquet":
        pf = _parquet_file(src.path)
        _check_columns(src.path, pf.schema_arrow, field, prompt_field)
        batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=names, use_threads=False)
        yield from _rows(src.path, batches, names)
        return
    # read, not memory-mapped: a mapping would keep every page read resident to the end
    with pa.OSFile(str(src.path)) as f:
        reader = _arrow_reader(src.path, f)
        _check_columns(src.path, reader.schema, field, prompt_field)
        yield from _rows(src.path, _arrow_batches(reader), names)


def _rows(path: Path, batches, names: list[str]) -> Iterator:
    """Documents of record batches: a column's str values, or (prompt, text) pairs; a null is an error."""
    row, it = 0, iter(batches)
    while (batch := _guard_arrow(path, lambda: next(it, None))) is not None:
        cols = []
        for name in names:
            col = batch.column(name)
            if col.null_count:
                first = row + next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
                raise ValueError(f"corpus {path}: column {name!r} is null at row {first}")
            cols.append(col.to_pylist())
        yield from zip(*cols) if len(cols) == 2 else cols[0]
        row += batch.num_rows
