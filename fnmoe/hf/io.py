"""`load` and `save`: a Hugging Face checkpoint directory (config.json, safetensors files and
their index) to a (ModelConfig, params) pair and back.

Legend: no shape-suffixed tensors here; leaves are handled by dotted path, HF tensors by key.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fnmoe.config import ModelConfig
from fnmoe.hf.config import config_from_hf, config_to_hf, fp8_block, hf_architecture
from fnmoe.hf.keys import LAYER_KEY, _mtp_keys, key_map
from fnmoe.hf.weights import _hf_tensors, _leaf, _Reader
from fnmoe.params import leaf_inits
from fnmoe.parallel.sharding import distribute
from fnmoe.tree import Tree, flatten_dict, unflatten_dict
from fnmoe.tree_io import new_dir

log = logging.getLogger("fnmoe")

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


# ---------------------------------------------------------------- load

def _open(hf_dir: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """HF key -> the open (memory-mapped) safetensors file holding it."""
    if (hf_dir / INDEX).is_file():
        weight_map = read_json(hf_dir / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{hf_dir / INDEX}: no 'weight_map' of tensor names to files")
        files = {name: _safe_open(hf_dir / name, stack) for name in sorted(set(weight_map.values()))}
        return {key: files[name] for key, name in weight_map.items()}
    if (hf_dir / SINGLE).is_file():
        f = _safe_open(hf_dir / SINGLE, stack)
        return {key: f for key in f.keys()}
    raise FileNotFoundError(f"{hf_dir}: neither {SINGLE} nor {INDEX} found")


def _safe_open(path: Path, stack: contextlib.ExitStack):
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (listed in {INDEX})")
    try:
        return stack.enter_context(safe_open(path, framework="pt"))
    except SafetensorError as e:  # a truncated or foreign file: its message names no file
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None


def read_json(path: Path) -> dict:
    """A JSON object from path, or a ValueError naming the file."""
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


def load(hf_dir: str | Path, mesh=None) -> tuple[ModelConfig, Tree]:
    """(ModelConfig, fp32 params tree) of a Hugging Face checkpoint directory; with a mesh, this
    rank's shards (DTensor leaves laid out by fnmoe.parallel.sharding), each rank reading only the experts
    it holds (dense matrices are read whole, one at a time, and sliced)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json (not a Hugging Face checkpoint directory)")
    hf = read_json(hf_dir / "config.json")
    cfg, arch = config_from_hf(hf, str(hf_dir / "config.json"))
    block = fp8_block(hf, str(hf_dir / "config.json"))
    inits = flatten_dict(leaf_inits(cfg))
    with contextlib.ExitStack() as stack:
        reader = _Reader(_open(hf_dir, stack), block)
        keys = key_map(cfg, arch)
        if mesh is None:
            flat = {path: _leaf(reader, how, k, inits[path].shape) for path, (how, k) in keys.items()}
        else:
            flat = flatten_dict(distribute(unflatten_dict(inits), mesh,
                                           lambda path, idx: _leaf(reader, *keys[path], inits[path].shape, idx)))
        skipped = _mtp_keys(list(reader.files), hf, arch, cfg.n_layers)
        unexpected = sorted(set(reader.files) - reader.used - set(skipped))
        if cfg.tie_embeddings and "lm_head.weight" in unexpected:  # a redundant copy some exporters write
            unexpected.remove("lm_head.weight")
            log.info("hf.load: tied embeddings; ignoring lm_head.weight")
    if unexpected:
        raise ValueError(f"unexpected tensor '{unexpected[0]}' ({len(unexpected)} in all) for {arch}")
    if skipped:
        layers = sorted({int(LAYER_KEY.match(k).group(1)) for k in skipped})
        log.info("hf.load: skipped %d tensors of multi-token-prediction layers %s (fnmoe has no MTP head)",
                 len(skipped), layers)
    return cfg, unflatten_dict(flat)


# ---------------------------------------------------------------- save

def save(hf_dir: str | Path, params: Tree, cfg: ModelConfig, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write params as a Hugging Face checkpoint (config.json + safetensors, sharded with an index
    above max_shard_bytes) that transformers loads, into a new or empty directory; weights keep
    the params' dtype."""
    arch = hf_architecture(cfg)
    tensors = _hf_tensors(params, cfg, arch)
    with new_dir(hf_dir) as tmp:  # stale shards or an index in hf_dir would mix with ours: new or empty
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE, metadata={"format": "pt"})
        else:
            names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
            for name, shard in zip(names, shards):
                save_file(shard, tmp / name, metadata={"format": "pt"})
            weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=1))
        dtype = flatten_dict(params)["embed.w_VD"].dtype
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, arch, dtype), indent=1) + "\n")
    return Path(hf_dir)
