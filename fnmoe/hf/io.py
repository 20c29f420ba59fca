"""`load` and `save`: a Hugging Face checkpoint directory (config.json, safetensors files and
their index) to a (ModelConfig, params) pair and back.

Legend: no shape-suffixed tensors here; leaves are handled by dotted path, HF tensors by key.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fnmoe.config import ModelConfig
from fnmoe.config.types import read_json
from fnmoe.hf.config import config_from_hf, config_to_hf, fp8_block, hf_architecture
from fnmoe.hf.keys import ERNIE, LAYER_KEY, mtp_keys, key_map
from fnmoe.hf.tokenizer import TokenizerFiles
from fnmoe.hf.weights import hf_tensors, read_leaf, HFReader
from fnmoe.models.params import leaf_inits
from fnmoe.parallel.sharding import distribute
from fnmoe.tree import Tree, flatten_dict, unflatten_dict
from fnmoe.tree_io import check_target, new_dir, plain_name, save_safetensors

log = logging.getLogger("fnmoe")

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


# ---------------------------------------------------------------- load

def _open(hf_dir: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """HF key -> the open (memory-mapped) safetensors file holding it."""
    if (hf_dir / INDEX).is_file():
        weight_map = read_json(hf_dir / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{hf_dir / INDEX}: no 'weight_map' of tensor names to files")
        bad = next((key for key, name in weight_map.items() if not plain_name(name)), None)
        if bad is not None:
            raise ValueError(f"{hf_dir / INDEX}: weight_map['{bad}'] = {weight_map[bad]!r} is not a file name in "
                             f"{hf_dir}")
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
        reader = HFReader(_open(hf_dir, stack), block)
        if arch == ERNIE:
            cfg = _without_zero_bias(cfg, reader)
            inits = flatten_dict(leaf_inits(cfg))
        keys, A = key_map(cfg, arch), cfg.head_dim_
        if mesh is None:
            flat = {path: read_leaf(reader, how, k, inits[path].shape, head_dim=A) for path, (how, k) in keys.items()}
        else:
            flat = flatten_dict(distribute(unflatten_dict(inits), mesh,
                                           lambda path, idx: read_leaf(reader, *keys[path], inits[path].shape, idx, A)))
        skipped = mtp_keys(list(reader.files), hf, arch, cfg.n_layers)
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


def _without_zero_bias(cfg: ModelConfig, reader: HFReader) -> ModelConfig:
    """Ernie 4.5 keeps a score-correction bias (moe_statics) in every MoE layer; all zero (as fnmoe
    exports a model without one) or absent (transformers then makes it zero), cfg has no router
    bias, so the tree is the one exported."""
    keys = [k[0] for how, k in key_map(cfg, ERNIE).values() if how == "row"]
    if not all(reader.read(k, reader.shape(k)).eq(0).all() for k in keys if k in reader.files):
        return cfg
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router_bias=False))


# ---------------------------------------------------------------- save

def save(hf_dir: str | Path, params: Tree, cfg: ModelConfig, max_shard_bytes: int = 5 * 2**30,
         tokenizer: TokenizerFiles | None = None, overwrite: bool = False) -> Path:
    """Write params as a Hugging Face checkpoint (config.json + safetensors, sharded with an index
    above max_shard_bytes) that transformers loads, into a new or empty directory, or with
    overwrite in place of an existing one (removed once the new one is complete); weights keep
    the params' dtype. With a tokenizer (fnmoe.hf.tokenizer), its files too, and its end-of-text id
    in config.json and generation_config.json; without, config.json states no token ids (rather
    than the architecture's defaults, which would name a token of another vocabulary). Weights
    holding NaN or inf are refused before anything is written."""
    hf_dir = Path(hf_dir)
    check_target(hf_dir, overwrite, "hf.save: ")  # before the weights are converted, or anything written
    broken = [p for p, t in flatten_dict(params).items()
              if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise ValueError(f"hf.save: refusing to write {hf_dir}: the weights hold non-finite values (NaN or inf) in "
                         f"{len(broken)} leaves, e.g. {broken[:3]}; nothing was written")
    arch = hf_architecture(cfg)
    tensors = hf_tensors(params, cfg, arch)
    with new_dir(hf_dir, overwrite) as tmp:  # stale shards or an index would mix with ours: never written into
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
            save_safetensors(shards[0], tmp / SINGLE)
        else:
            names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
            for name, shard in zip(names, shards):
                save_safetensors(shard, tmp / name)
            weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=1))
        dtype = flatten_dict(params)["embed.w_VD"].dtype
        eos = tokenizer.eos_token_id if tokenizer else None
        ids = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": None}
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, arch, dtype) | ids, indent=1) + "\n")
        if tokenizer:
            tokenizer.write(tmp)
    return hf_dir
