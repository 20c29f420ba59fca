"""`fnmoe prepare`: text, JSONL, Parquet and `datasets` corpora -> memory-mapped token shards with an
index and a fingerprint, in memory bounded independently of the input's size.

Legend: T tokens.

Layout of a prepared directory (read by fnmoe.data.loader when `--data.corpus DIR`):

    index.json   {"format": "fnmoe-tokens", "version": 1, "tokenizer": ..., "vocab_size", "eos_id",
                  "dtype": "uint16" | "uint32", "splits": {"train"|"val": {"file", "tokens", "docs",
                  "sha256"}}, "fingerprint"}
    train.bin    the training documents' tokens, EOS after each (raw little-endian dtype)
    val.bin      the held-out documents (the last val_fraction of all documents, in input order)
    train.loss_mask.bin, val.loss_mask.bin   SFT sets only (--prompt-field): uint8 per token, 0 on
                 prompt tokens (never labels), 1 elsewhere; in the index as splits.<s>.loss_mask
    tokenizer.json   a copy of the tokenizers tokenizer (not for 'byte'), for what decodes the tokens

Inputs are read by fnmoe.data.sources in two streaming passes. The first counts documents (Parquet:
from its footer; Arrow: batch headers; JSONL: non-blank lines), which places the held-out split
before anything is read. The second reads documents lazily into parts of PART_DOCS (a part never
spans the split), tokenised by a process pool with at most IN_FLIGHT parts a worker queued or
running; each finished part is saved into `parts/` as it comes, and the parts are concatenated
at the end. So the process holds a few parts and one input record batch at a time, whatever the
input's size: peak RSS is the interpreter (~0.33 GB with torch and pyarrow imported) plus
about 3·IN_FLIGHT·workers parts of text and tokens, under 1 GB while documents average under
~50 KB. Measured on 2 GB of 4 KB documents, 2 workers, byte tokenizer, 2 shared AMD EPYC cores:
Parquet 0.44 GB peak, 45 s; JSONL 0.35 GB, 42 s (tests/test_prepare_sources.py checks that
the peak does not grow with the input).

An interrupted run resumes at the missing parts, only for the same inputs and settings:
`parts/key.txt` holds a digest of each input file's (path, size, mtime) -- nothing that needs the
documents in memory -- with the fields, the tokenizer, the part size and the split. Each finished
part `parts/<k>.npy` has a record `parts/<k>.json` (its tokens, bytes and sha256), written after it;
a resume reuses a part only where the two agree. A part found damaged (no readable .npy header,
one whose size, dtype or shape the file does not match, or one that does not match its record, as
a part cut short but still readable, or none) is named in one line and tokenised again: it would
fail every rerun at the end, or silently lose its tokens from the corpus. The final files are written
to temporary names and renamed, so a crash never leaves a half-written `train.bin` behind an index
that claims it, and an error writing one (a full disk) removes its temporary file and names the file
and the OS's reason. SIGTERM and SIGHUP stop a run as Ctrl-C does (`Stopped`): the workers (which
leave signals to this process, and end should it die) finish the part in hand and end, finished
parts stay, and the same command resumes from them.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fnmoe.data.loader import PREPARED_FORMAT, PREPARED_TOKENIZER, PREPARED_VERSION, encode_documents, load_tokenizer
from fnmoe.data.sources import Source, count_documents, expand_inputs, iter_documents
from fnmoe.run import faults
from fnmoe.run.rundir import os_reason

PART_DOCS = 512
IN_FLIGHT = 2
"""parts a worker has queued or running: enough to keep it busy, few enough to bound memory"""
KEY_VERSION = 2  # 1 hashed the documents themselves


def read_inputs(inputs: list[str], text_field: str, prompt_field: str = "") -> list:
    """All documents of inputs in one list: for small inputs and tests (prepare streams them)."""
    docs = [d for src in expand_inputs(inputs) for d in iter_documents(src, text_field, prompt_field)]
    if not docs:
        raise ValueError(f"no documents in {inputs}")
    return docs


@dataclass(frozen=True)
class Scan:
    """What the first pass over the inputs found: their files, how many documents, where val starts."""
    sources: list[Source]
    text_field: str
    prompt_field: str
    n_docs: int
    split: int
    """documents [0, split) train, [split, n_docs) are held out"""
    dtype: str
    key: str
    """the digest in parts/key.txt: parts of another key are not resumed"""

    def part_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) documents of each part: PART_DOCS at a time from 0, again from the split."""
        return [(a, min(a + PART_DOCS, stop)) for start, stop in ((0, self.split), (self.split, self.n_docs))
                for a in range(start, stop, PART_DOCS)]


def scan(inputs: list[str], tokenizer: str, text_field: str = "text", prompt_field: str = "",
         val_fraction: float = 0.05) -> Scan:
    name, _, vocab, _ = load_tokenizer(tokenizer)
    if not 0 < val_fraction < 1:  # nan too
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    sources = expand_inputs(inputs)
    n_docs = sum(count_documents(src, text_field, prompt_field) for src in sources)
    if not n_docs:
        raise ValueError(f"no documents in {inputs}")
    n_val = max(1, round(n_docs * val_fraction))
    if n_val >= n_docs:
        raise ValueError(f"{n_docs} documents cannot hold out val_fraction={val_fraction} and still train")
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    h = hashlib.sha256(json.dumps([KEY_VERSION, name, dtype, PART_DOCS, text_field, prompt_field, n_docs,
                                   n_docs - n_val]).encode())
    for src in sources:  # the files' identities, not their bytes: a rerun need not read them twice
        st = src.path.stat()
        h.update(json.dumps([str(src.path.resolve()), st.st_size, st.st_mtime_ns, src.bundled]).encode())
    return Scan(sources, text_field, prompt_field, n_docs, n_docs - n_val, dtype, h.hexdigest())


def _parts(sc: Scan) -> Iterator[list]:
    """The documents of each part of sc.part_ranges(), read lazily from the inputs."""
    ranges, part, k = sc.part_ranges(), [], 0
    for i, doc in enumerate(d for src in sc.sources for d in iter_documents(src, sc.text_field, sc.prompt_field)):
        if i >= sc.n_docs:
            raise ValueError(f"the inputs changed while being prepared: more than the {sc.n_docs} documents counted")
        part.append(doc)
        if i + 1 == ranges[k][1]:
            yield part
            part, k = [], k + 1
    if k != len(ranges):
        raise ValueError(f"the inputs changed while being prepared: fewer than the {sc.n_docs} documents counted")


_worker: dict = {}  # a pool process's tokenizer, loaded once by _init_worker


def _init_worker(spec: str, dtype: str) -> None:
    # the main process decides on signals (a terminal's Ctrl-C reaches every process of its group)
    for s in _STOP_SIGNALS + (signal.SIGINT,):
        signal.signal(s, signal.SIG_IGN)
    threading.Thread(target=_end_with, args=(os.getppid(),), daemon=True).start()
    _, encode, _, eos = load_tokenizer(spec)
    _worker.update(encode=encode, eos=eos, dtype=dtype, byte=spec == "byte")


def _end_with(parent: int) -> None:
    """A worker whose main process died (SIGKILL: no shutdown) ends too: the pool's queue, whose
    write end its sibling workers hold open, would never tell it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP during prepare: stop as Ctrl-C does (parts written so far stay)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def _stopping_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Stopped in the body (main thread only); handlers restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)
    before = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def _replacing(path: Path, tmp: Path) -> Iterator[Path]:
    """tmp, to write path's new content into, renamed over path when the block ends; on an error (a
    stop's too) tmp is removed, and an OSError is one line naming path and the OS's reason (numpy's
    and a close's errors name neither)."""
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise ValueError(f"writing {path} failed: {os_reason(e)}") from None
        raise


def _encode_part(docs: list) -> tuple[np.ndarray, int]:
    """([T] token ids, or [2, T] ids and loss mask for SFT pairs; UTF-8 bytes of docs)."""
    w = _worker
    faults.part_delay()
    if w["byte"] and not isinstance(docs[0], tuple):  # the bytes are the ids: numpy, not a list per byte
        raw = [d.encode() for d in docs]
        ids_T = np.insert(np.frombuffer(b"".join(raw), np.uint8).astype(w["dtype"]),
                          np.cumsum([len(r) for r in raw]), w["eos"])
        return ids_T, ids_T.size - len(docs)
    ids, mask = encode_documents(w["encode"], docs, w["eos"])
    n_bytes = sum(len(s.encode()) for d in docs for s in (d if isinstance(d, tuple) else (d,)))
    return np.asarray(ids if mask is None else [ids, mask], dtype=w["dtype"]), n_bytes


class _Progress:
    """`prepare [###...] parts, MB/s of text, tokens/s` on stderr, at most twice a second redrawn in
    place on a terminal; elsewhere (a log file, a pipe) as whole lines, at most one every 10 s and
    the last; rates count this run's parts only (not those resumed)."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.n_bytes, self.tokens = total, done, 0, 0
        self.t0 = self.shown = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._show()

    def add(self, n_bytes: int, tokens: int) -> None:
        self.done, self.n_bytes, self.tokens = self.done + 1, self.n_bytes + n_bytes, self.tokens + tokens
        if self.done == self.total or time.perf_counter() - self.shown >= (0.5 if self.tty else 10.0):
            self._show()

    def _show(self) -> None:
        self.shown = time.perf_counter()
        dt, n = max(self.shown - self.t0, 1e-9), 30 * self.done // self.total
        head, tail = ("\r", "") if self.tty else ("", "\n")
        sys.stderr.write(f"{head}prepare [{'#' * n}{'.' * (30 - n)}] {self.done}/{self.total} parts  "
                         f"{self.n_bytes / dt / 1e6:.1f} MB/s  {self.tokens / dt / 1e6:.2f}M tokens/s{tail}")
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty:  # the line drawn in place ends here
            sys.stderr.write("\n")


def _tokenise_parts(sc: Scan, pool: ProcessPoolExecutor, workers: int, parts_dir: Path) -> list[Path]:
    """The part files of sc, tokenised where an earlier run of the same key left none."""
    key_file = parts_dir / "key.txt"
    if parts_dir.is_dir() and (not key_file.is_file() or key_file.read_text() != sc.key):
        print(f"prepare: {parts_dir} holds parts of other inputs or another tokenizer; starting over", file=sys.stderr)
        for p in parts_dir.glob("*"):
            p.unlink()
    parts_dir.mkdir(parents=True, exist_ok=True)
    with _replacing(key_file, parts_dir / "key.txt.tmp") as tmp:
        tmp.write_text(sc.key)
    files = [parts_dir / f"{k:06d}.npy" for k in range(len(sc.part_ranges()))]
    for f in files:
        if f.exists() and (why := _part_damage(f, sc.dtype, 2 if sc.prompt_field else 1)):
            print(f"prepare: {f} is damaged ({why}); tokenising it again", file=sys.stderr)
            f.unlink()
            with contextlib.suppress(FileNotFoundError):
                _record(f).unlink()
    progress = _Progress(len(files), sum(f.exists() for f in files))
    pending: dict = {}  # future -> part number

    def save(futures) -> None:
        for fut in futures:
            k = pending.pop(fut)
            ids_T, n_bytes = fut.result()
            save_part(files[k], ids_T)
            progress.add(n_bytes, ids_T.shape[-1])

    for k, part in enumerate(_parts(sc)):
        if files[k].exists():  # read past, not tokenised: finished by an interrupted run
            continue
        while len(pending) >= IN_FLIGHT * workers:
            save(wait(pending, return_when=FIRST_COMPLETED).done)
        pending[pool.submit(_encode_part, part)] = k
    save(wait(pending).done)
    progress.end()
    return files


def _record(part: Path) -> Path:
    return part.with_suffix(".json")


def save_part(path: Path, ids_T: np.ndarray) -> None:
    """A finished part at path, then its record (tokens, bytes, sha256 of the file): a resume
    reuses the part only where the two agree (`_part_damage`)."""
    buf = io.BytesIO()  # numpy's own file write loses the OS's reason ("N requested and M written")
    np.save(buf, ids_T)
    data = buf.getbuffer()
    with _replacing(path, path.with_name(f"{path.stem}.tmp.npy")) as tmp:
        tmp.write_bytes(data)
    record = {"tokens": int(ids_T.shape[-1]), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with _replacing(_record(path), path.with_name(f"{path.stem}.tmp.json")) as tmp:
        tmp.write_text(json.dumps(record))


def _part_damage(path: Path, dtype: str, rows: int) -> str:
    """Why the part at path is not a whole array of dtype and rows rows matching its record ('' when
    it is): a torn, garbled or shortened part (a disk fault, a copy) kept for resuming would fail
    every rerun at concatenation, or lose its tokens from the corpus."""
    why = _header_damage(path, dtype, rows)
    if why:
        return why
    try:
        record = json.loads(_record(path).read_text())
        data = path.read_bytes()
    except FileNotFoundError:
        return f"no record {_record(path).name} of its length and checksum: its save did not finish"
    except (OSError, ValueError) as e:
        return f"its record {_record(path).name} is unreadable ({e})"
    tokens = np.load(io.BytesIO(data)).shape[-1]
    if not isinstance(record, dict) or record.get("tokens") != tokens or record.get("bytes") != len(data) or \
            record.get("sha256") != hashlib.sha256(data).hexdigest():
        return (f"{tokens} tokens in {len(data)} bytes, which do not match its record {_record(path).name} "
                f"({record.get('tokens') if isinstance(record, dict) else '?'} tokens and a checksum)")
    return ""


def _header_damage(path: Path, dtype: str, rows: int) -> str:
    """Why the part at path is not a whole array of dtype and rows rows by its .npy header and size
    ('' when it is)."""
    fmt = np.lib.format
    try:
        with open(path, "rb") as f:
            version = fmt.read_magic(f)
            read_header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
            if read_header is None:
                return f".npy version {version}, which prepare never writes"
            shape, _, got = read_header(f)
            data_start = f.tell()
    except OSError as e:
        return os_reason(e)
    except ValueError:  # numpy's words quote the bytes it found
        return "no readable .npy header"
    if got != np.dtype(dtype) or len(shape) != (1 if rows == 1 else 2) or (rows > 1 and shape[0] != rows):
        return f"a {got} array of shape {shape}, not {dtype} in {rows} row(s)"
    size, expected = path.stat().st_size, data_start + int(np.prod(shape)) * got.itemsize
    return f"{size} bytes where its header says {expected}" if size != expected else ""


def _concat(parts: list[Path], out: Path, dtype: str, row: int = 0) -> dict:
    """Stream row `row` of parts (1: the SFT loss mask) into out (via a temp name); its index entry."""
    h, n = hashlib.sha256(), 0
    with _replacing(out, out.with_suffix(".tmp")) as tmp, open(tmp, "wb") as f:
        for part in parts:
            b = np.atleast_2d(np.load(part))[row].astype(np.dtype(dtype).newbyteorder("<")).tobytes()
            f.write(b)
            h.update(b)
            n += len(b) // np.dtype(dtype).itemsize
        f.flush()
        os.fsync(f.fileno())
    return {"file": out.name, "tokens": n, "sha256": h.hexdigest()}


def prepare(inputs: list[str], tokenizer: str, out_dir: str | Path, text_field: str = "text",
            val_fraction: float = 0.05, workers: int = 2, prompt_field: str = "") -> dict:
    """Tokenise inputs into out_dir (resuming an interrupted run there); returns the index.
    prompt_field: SFT pairs, whose prompt tokens are written with loss mask 0. SIGTERM and SIGHUP
    raise Stopped (a KeyboardInterrupt, as Ctrl-C raises) once the workers have ended."""
    with _stopping_on_signals():
        return _prepare(inputs, tokenizer, Path(out_dir), text_field, val_fraction, workers, prompt_field)


def _prepare(inputs: list[str], tokenizer: str, out: Path, text_field: str, val_fraction: float, workers: int,
             prompt_field: str) -> dict:
    name, _, vocab, eos = load_tokenizer(tokenizer)
    # forked before pyarrow starts its threads (a fork copies no thread, and no lock one held)
    pool = ProcessPoolExecutor(max_workers=max(1, workers), initializer=_init_worker,
                               initargs=(tokenizer, "uint16" if vocab <= 2**16 else "uint32"))
    try:
        pool.submit(int).result()  # with fork, the first submit starts every worker
        sc = scan(inputs, tokenizer, text_field, prompt_field, val_fraction)
        parts_dir = out / "parts"
        parts = _tokenise_parts(sc, pool, max(1, workers), parts_dir)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    n_train = -(-sc.split // PART_DOCS)
    train_parts, val_parts = parts[:n_train], parts[n_train:]
    dtype = sc.dtype
    splits = {"train": _concat(train_parts, out / "train.bin", dtype) | {"docs": sc.split},
              "val": _concat(val_parts, out / "val.bin", dtype) | {"docs": sc.n_docs - sc.split}}
    if prompt_field:
        for s, s_parts in (("train", train_parts), ("val", val_parts)):
            splits[s]["loss_mask"] = _concat(s_parts, out / f"{s}.loss_mask.bin", "uint8", row=1)
    hashes = [e["sha256"] for e in splits.values()] + \
        [e["loss_mask"]["sha256"] for e in splits.values() if "loss_mask" in e]
    fingerprint = hashlib.sha256((name + "".join(hashes)).encode())
    index = {"format": PREPARED_FORMAT, "version": PREPARED_VERSION, "tokenizer": name,
             "tokenizer_spec": tokenizer, "vocab_size": vocab, "eos_id": eos, "dtype": dtype, "splits": splits,
             "fingerprint": fingerprint.hexdigest()[:16]}
    if tokenizer != "byte":  # a copy beside the tokens: what reads them (fnmoe generate) needs no other path
        with _replacing(out / PREPARED_TOKENIZER, out / (PREPARED_TOKENIZER + ".tmp")) as tmp:
            shutil.copyfile(tokenizer, tmp)
        index["tokenizer_file"] = PREPARED_TOKENIZER
    with _replacing(out / "index.json", out / "index.json.tmp") as tmp:
        tmp.write_text(json.dumps(index, indent=1))
    for p in parts_dir.glob("*"):
        p.unlink()
    parts_dir.rmdir()
    return index
