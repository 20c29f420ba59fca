"""HF tensors <-> fnmoe leaves: reads with shape checks and block-FP8 dequantization, the
[out, in] -> [in, out] transpose, per-expert matrices stacked into [E, in, out], and the reverse.

Legend: E experts, N a query/key projection's outputs (heads x head dim); HF matrices are [out, in],
fnmoe's [*batch, in, out]; leaves by dotted path.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from fnmoe.config import ModelConfig
from fnmoe.hf.keys import ERNIE, hf_shape_of, key_map, rope_rows
from fnmoe.models.params import leaf_inits
from fnmoe.tree import Tree, flatten_dict

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-FP8 [out, in] weights times their per-block scales (ceil(out/b0), ceil(in/b1)), fp32."""
    b0, b1 = block
    scale = scale_inv.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    return w.float() * scale[:w.shape[0], :w.shape[1]]


class HFReader:
    """Reads HF tensors by key with shape checks and FP8 dequantization; records what it used."""

    def __init__(self, files: dict[str, Any], block: tuple[int, int] | None):
        self.files, self.block, self.used = files, block, set()

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.files:
            raise ValueError(f"missing tensor '{key}'")
        return tuple(self.files[key].get_slice(key).get_shape())

    def read(self, key: str, want: tuple[int, ...], index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The tensor (its slice at index: only those bytes are read, but for block-FP8 tensors,
        which are dequantized whole first) in fp32."""
        if self.shape(key) != want:
            raise ValueError(f"tensor '{key}' has shape {list(self.shape(key))}, expected {list(want)}")
        self.used.add(key)
        if key + "_scale_inv" in self.files:
            return self._dequantized(key, want)[index]
        t = _floating(key, self.files[key].get_slice(key)[index] if index else self.files[key].get_tensor(key))
        if t.dtype in FP8_DTYPES:
            raise ValueError(f"tensor '{key}' is {t.dtype} without '{key}_scale_inv'")
        return t.float()

    def _dequantized(self, key: str, want: tuple[int, ...]) -> torch.Tensor:
        scale_key = key + "_scale_inv"
        if self.block is None:
            raise ValueError(f"tensor '{scale_key}' needs quantization_config.weight_block_size in config.json")
        b0, b1 = self.block
        want_s = (math.ceil(want[0] / b0), math.ceil(want[1] / b1))
        if self.shape(scale_key) != want_s:
            raise ValueError(f"tensor '{scale_key}' has shape {list(self.shape(scale_key))}, expected {list(want_s)}")
        self.used.add(scale_key)
        return dequantize_fp8(_floating(key, self.files[key].get_tensor(key)),
                              _floating(scale_key, self.files[scale_key].get_tensor(scale_key)), self.block)


def _floating(key: str, t: torch.Tensor) -> torch.Tensor:
    """t, refused unless floating point: cast to fp32, an integer or bool tensor (a q_proj stored as
    int32) would load without a word as weights the checkpoint does not mean."""
    if not t.is_floating_point():
        raise ValueError(f"tensor '{key}' is {t.dtype}, not a floating-point dtype: fnmoe reads weights as floats")
    return t


def read_leaf(reader: HFReader, how: str, keys: tuple[str, ...], shape: tuple[int, ...],
          index: tuple[slice, ...] = (), head_dim: int = 0) -> torch.Tensor:
    """The leaf, or its slice at index (one slice per leading dim), reading only that slice's bytes
    (an HF [out, in] matrix is the transpose of the leaf's, so the index is reversed for it).
    head_dim: the heads' width, for 'rope' leaves (whose HF rows are read whole and reordered)."""
    hf_shape = hf_shape_of(how, shape)
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if how == "copy":
        return reader.read(keys[0], hf_shape, index)
    if how == "row":
        return reader.read(keys[0], hf_shape, (slice(None), *index))[0]
    if how == "linear":
        return reader.read(keys[0], hf_shape, index[::-1]).T.contiguous()
    if how == "rope":  # leaf column c is HF row inverse_N[c] (rope_rows inverted)
        inverse_N = torch.argsort(rope_rows(shape[1], head_dim))
        return reader.read(keys[0], hf_shape, (slice(None), index[0]))[inverse_N][index[1]].T.contiguous()
    experts = range(*index[0].indices(shape[0]))
    reader.used.update(keys)  # the experts this rank skips, other ranks read
    return torch.stack([reader.read(keys[j], hf_shape, index[:0:-1]).T for j in experts]) if experts else \
        torch.empty(0, *[len(range(*i.indices(n))) for i, n in zip(index[1:], shape[1:])])


def hf_tensors(params: Tree, cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    flat = flatten_dict(params)
    kmap = key_map(cfg, arch)
    extra = sorted(set(flat) - set(kmap))
    if extra:
        raise ValueError(f"hf.save: leaf '{extra[0]}' is not part of the model that cfg describes")
    inits = flatten_dict(leaf_inits(cfg))
    out = {}
    for path, (how, keys) in kmap.items():
        if path not in flat:
            raise ValueError(f"hf.save: params lack leaf '{path}'")
        t = flat[path].detach().cpu()
        if tuple(t.shape) != inits[path].shape:
            raise ValueError(f"hf.save: leaf '{path}' has shape {list(t.shape)}, expected {list(inits[path].shape)}")
        if how == "experts":
            out |= {key: t[j].T.contiguous() for j, key in enumerate(keys)}
        elif how == "rope":
            out[keys[0]] = t.T[rope_rows(t.shape[1], cfg.head_dim_)].contiguous()
        elif how == "row":
            out[keys[0]] = t[None].contiguous()
        else:
            out[keys[0]] = (t.T if how == "linear" else t).contiguous()
    if arch == ERNIE and not cfg.moe.router_bias:  # Ernie has the bias in every MoE layer: zero, no change
        zeros_1E = torch.zeros(1, cfg.moe.n_experts, dtype=flat["embed.w_VD"].dtype)
        out |= {f"model.layers.{i}.mlp.moe_statics.e_score_correction_bias": zeros_1E.clone()
                for i in range(cfg.n_layers) if cfg.is_moe_layer(i)}
    return out
