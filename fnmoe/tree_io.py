"""The native tree format (docs/design.md §3): one model's params as safetensors under dotted paths.

A tree directory holds

  params.safetensors   every leaf (buffers included) under its dotted path ("layers.0.attn.w_q_DN")
  index.json           {"format": "fnmoe-tree", "version": 1, "model": {ModelConfig fields},
                        "tensors": {PATH: {"file": "params.safetensors", "dtype": "float32", "shape": [...]}}}

`fnmoe convert` reads and writes it; checkpoints (fnmoe/checkpoint/format.py) extend the format with
optimizer state, shards and checksums, never redefine it.

Legend: no shape-suffixed tensors here; leaves are handled by dotted path.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fnmoe.config import ModelConfig, from_dict, to_dict, validate_model
from fnmoe.config.types import kind, read_json, show
from fnmoe.models.params import current_path, shape_mismatches
from fnmoe.run.rundir import os_reason
from fnmoe.tree import Tree, flatten_dict, unflatten_dict

FORMAT, VERSION = "fnmoe-tree", 1
PARAMS, INDEX = "params.safetensors", "index.json"


def umask() -> int:
    """The process's umask (read from /proc where it can be, else by setting it and back)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_target(out_dir: str | Path, overwrite: bool = False, who: str = "") -> None:
    """Refuse (ValueError, one line) an out_dir that new_dir could not end in, before anything is
    written: a symbolic link (overwrite would replace the link, not what it names, and rmtree
    refuses links), a file, or without overwrite a directory that is not empty."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        raise ValueError(f"{who}{out_dir} is a symbolic link (to {os.readlink(out_dir)}); name the directory itself "
                         "or remove the link; nothing was written")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{who}{out_dir} is a file, not a directory; remove it or choose another; nothing was written")
    if not overwrite and out_dir.is_dir() and any(out_dir.iterdir()):
        raise ValueError(f"{who}{out_dir} is not empty" + ("; pass overwrite=True to replace it" if who else ""))


@contextlib.contextmanager
def new_dir(out_dir: str | Path, overwrite: bool = False):
    """A temporary sibling of out_dir (new or empty, or with overwrite any directory: `check_target`
    first) to write into, renamed to out_dir when the block ends without an error and removed when
    it raises, with the parents made for it: a full disk or a crash never leaves half a model that
    a rerun would refuse as "not empty", and an overwritten out_dir is removed only once its
    replacement is complete. An OSError in the block (a full disk, a file-size limit) is one line
    naming the file as out_dir would hold it and the OS's reason."""
    out_dir = Path(out_dir)
    check_target(out_dir, overwrite)
    made = [p for p in reversed(out_dir.parents) if not p.exists()]
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as e:
        _remove(made)
        raise ValueError(f"creating a directory for {out_dir} failed: {os_reason(e)}") from None
    try:
        yield tmp
        # mkdtemp's 0700, and safetensors' 0600 files, would hide the result from those the umask admits
        mask = umask()
        tmp.chmod(0o777 & ~mask)
        for path in tmp.rglob("*"):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
        if out_dir.exists() and overwrite:
            shutil.rmtree(out_dir)
        elif out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove(made)
        name = Path(e.filename) if e.filename else None
        path = out_dir / name.relative_to(tmp) if name and name.is_relative_to(tmp) else name or out_dir
        raise ValueError(f"writing {path} failed: {os_reason(e)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove(made)
        raise


def _remove(made: list[Path]) -> None:
    """The directories made for a failed write, deepest first, where they are still empty."""
    for p in reversed(made):
        with contextlib.suppress(OSError):
            p.rmdir()


def plain_name(name) -> bool:
    """Whether name, read from an index, is a file name in the index's own directory: an index that
    names "../x" or "/x" would have its reader open a file outside it."""
    return isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and Path(name).name == name


def save_safetensors(tensors: dict, path: Path) -> None:
    """safetensors' save_file (metadata format "pt"), its failure an OSError naming path: safetensors
    raises its own error, which names no file ("I/O error: File too large (os error 27)")."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except OSError as e:
        raise OSError(e.errno, e.strerror, e.filename or str(path)) from None
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise ValueError(f"writing {path} failed: {e}") from None
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def save_tree(out_dir: str | Path, params: Tree, cfg: ModelConfig) -> Path:
    """Write params and their model config to out_dir (created; must be new or empty)."""
    with new_dir(out_dir) as tmp:
        flat = {path: t.detach().cpu().contiguous() for path, t in flatten_dict(params).items()}
        save_safetensors(flat, tmp / PARAMS)
        tensors = {path: {"file": PARAMS, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                   for path, t in flat.items()}
        index = {"format": FORMAT, "version": VERSION, "model": to_dict(cfg), "tensors": tensors}
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return Path(out_dir)


def load_tree(tree_dir: str | Path) -> tuple[ModelConfig, Tree]:
    """(ModelConfig, params) of a tree directory written by save_tree."""
    tree_dir = Path(tree_dir)
    if not (tree_dir / INDEX).is_file():
        raise FileNotFoundError(f"{tree_dir}: no {INDEX} (not an fnmoe tree directory)")
    index = read_json(tree_dir / INDEX)
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{tree_dir / INDEX}: format {index.get('format')!r} version {index.get('version')!r}, "
                         f"expected {FORMAT!r} version {VERSION}")
    if not isinstance(index.get("model"), dict) or not isinstance(index.get("tensors"), dict):
        raise ValueError(f"{tree_dir / INDEX}: needs a 'model' config and a 'tensors' table")
    cfg = from_dict(ModelConfig, index["model"], "model.", source=str(tree_dir / INDEX))
    errors = validate_model(cfg)
    if errors:
        raise ValueError(f"{tree_dir / INDEX}: invalid model config:\n  " + "\n  ".join(errors))
    flat = {}
    files: dict[str, object] = {}
    for path, meta in index["tensors"].items():
        problem = _entry_problem(meta)
        if problem:
            raise ValueError(f"{tree_dir / INDEX}: tensors['{path}'] {problem}")
        if meta["file"] not in files:
            files[meta["file"]] = read_safetensors(tree_dir / meta["file"])
        stored = files[meta["file"]]
        if path not in stored:
            raise ValueError(f"{tree_dir / meta['file']}: missing tensor '{path}' listed in {INDEX}")
        problem = _stored_problem(meta, stored[path])
        if problem:
            raise ValueError(f"{tree_dir / INDEX}: tensors['{path}'] {problem}")
        flat[current_path(path)] = stored[path]  # an earlier release's leaf name reads as today's
    params = unflatten_dict(flat)
    diff = shape_mismatches(params, cfg)
    if diff:  # a tree that does not hold the model its index describes would run, wrongly
        raise ValueError(f"{tree_dir}: its tensors do not fit the model in {INDEX}: {'; '.join(diff)}")
    return cfg, params


def _entry_problem(meta: object) -> str | None:
    """How an index's tensor entry differs from what save_tree writes ({"file": a file name in the
    tree directory, "dtype": str, "shape": [int]}); None when it does not."""
    if not isinstance(meta, dict):
        return f"= {show(meta)} is {kind(meta)}, expected an object"
    missing = [k for k in ("file", "dtype", "shape") if k not in meta]
    if missing:
        return f"has no field '{missing[0]}'"
    file, dtype, shape = meta["file"], meta["dtype"], meta["shape"]
    if not isinstance(file, str) or file in ("", ".", "..") or Path(file).name != file:
        return f"file = {show(file)} is not the name of a file in the tree directory"
    if not isinstance(dtype, str):
        return f"dtype = {show(dtype)} is {kind(dtype)}, expected a str"
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return f"shape = {show(shape)} is not a list of sizes (ints >= 0)"
    return None


def _stored_problem(meta: dict, t: torch.Tensor) -> str | None:
    """How the index entry's dtype and shape differ from the tensor its file holds; None when not."""
    held = str(t.dtype).removeprefix("torch.")
    if meta["dtype"] != held:
        named = getattr(torch, meta["dtype"], None) if meta["dtype"].isidentifier() else None
        if not isinstance(named, torch.dtype):
            return f"dtype = {show(meta['dtype'])} names no torch dtype ({meta['file']} holds it as {held})"
        return f"dtype = {show(meta['dtype'])} differs from the {held} that {meta['file']} holds"
    if meta["shape"] != list(t.shape):
        return f"shape = {meta['shape']} differs from the {list(t.shape)} that {meta['file']} holds"
    return None


def read_safetensors(path: Path) -> dict:
    """Every tensor of a safetensors file, or a ValueError naming the file (truncated, not one)."""
    try:
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None
