"""Float8 expert-weight gathers (--mesh.expert-gather-dtype float8_e4m3fn): block quantisation of an
expert shard, what a rank sends of it, and the gathered stack dequantised in the compute dtype.

Legend: I rows, O columns of a matrix (an expert's [in, out]); leading dims are batch dims.

The block quantisation itself (`quantise`, `dequantise`, their scales and error bound) is
fnmoe.kernels.fp8_blocks'.

What is sent (`pack`): a rank's shard padded to the gather's `rows` along the split dim (zeros, as
fnmoe.parallel.gather pads), quantised in its natural layout (so blocks are [in, out] blocks of each
expert), the split dim moved first, both parts as bytes: gloo all-gathers no float8 dtype ("Invalid
scalar type"), and its coalesced all-gather of tensors of different dtypes returns garbage (both
checked on torch 2.13), so fnmoe.parallel.gather sends these uint8 tensors in a call of their own.
`payload` keeps it for the step: every micro-batch and backward's regathers (fnmoe.parallel.reshard)
send the same bytes, quantised once a step; it is let go where the step's update begins (or the
shard is written or freed), so the step holds 1 byte an element of the rank's expert shards plus
the scales until then.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from fnmoe import _torch, caches

from fnmoe.models import seams
from fnmoe.parallel import dist as fdist
from fnmoe.kernels import fp8_gemm
from fnmoe.kernels.fp8_blocks import (BLOCK, E4M3, E4M3_MAX, MIN_SCALE_EXP, blocks, dequantise,  # noqa: F401
                                      dequantise_into, pow2_scale, quantise, remember, round_trip, scale_count)


def pad(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """x with zeros after its rows along dim, to `rows` (the gather's padding, in x's layout)."""
    if x.shape[dim] == rows:
        return x
    out = x.new_zeros((*x.shape[:dim], rows, *x.shape[dim + 1:]))
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def pack(local: torch.Tensor, dim: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rank sends of its shard: (q, scales) of the shard padded to rows along dim, dim moved
    first, each as contiguous bytes."""
    q, s = quantise(pad(local, dim, rows))
    return q.movedim(dim, 0).contiguous().view(torch.uint8), s.movedim(dim, 0).contiguous().view(torch.uint8)


def unpack(q_bytes: torch.Tensor, s_bytes: torch.Tensor, w: int, dim: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The gathered leaf in dtype from the w ranks' packs (each `pack`'s, concatenated along dim 0):
    its first n rows along dim, contiguous. Split along the experts (dim 0), the leaf keeps the packs
    as its blocks under fp8 expert GEMMs (fnmoe.kernels.fp8_blocks.remember): they take them, quantising
    nothing."""
    # [w, natural padded shard]: each rank's q and scales with the split dim back in its place
    q = q_bytes.view(E4M3).unflatten(0, (w, -1)).movedim(1, dim + 1)
    s = s_bytes.view(torch.float32).unflatten(0, (w, -1)).movedim(1, dim + 1)
    shape = list(q.shape[1:])
    shape[dim] *= w
    with _made():
        out = torch.empty(shape, dtype=dtype, device=q.device)
        dequantise_into(out.unflatten(dim, (w, -1)).movedim(dim, 0), q, s)
        out = out if n == shape[dim] else out.narrow(dim, 0, n).contiguous()
    if dim == 0 and fp8_gemm.active():  # split along the experts: the packs are the stack's own blocks
        remember(out, q.flatten(0, 1)[:n], s.flatten(0, 1)[:n])
    return out


_making = 0
"""how many gathered-weight makers (unpack, payload) are running: fnmoe.plan.meters counts what they
allocate as gathered weights"""


def making() -> bool:
    """Whether a gathered stack or a pack is being made now (its storages are gathered weights)."""
    return _making > 0


@contextlib.contextmanager
def _made():
    global _making
    _making += 1
    try:
        yield
    finally:
        _making -= 1


_payloads: dict[tuple[int, ...], tuple[weakref.ref, tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
"""the storages of a shard (one a simulated rank) -> (the first, weakly; the shard's versions; its pack)"""


@caches.register
def clear() -> None:
    """Forget every kept pack."""
    _payloads.clear()


class _Updates:
    """Forgets the packs where a train step's update begins (fnmoe.models.seams.mark("update")): the next
    step's params are new or written in place, and the update's peak does not hold the packs."""

    @staticmethod
    def marked(phase: str, tree) -> None:
        if phase == "update":
            clear()


seams.listen(_Updates)


def payload(leaf: torch.Tensor, local: torch.Tensor, dim: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack(local, dim, rows) of a sharded leaf (local: its to_local()), made once a step: kept by
    the shard's storage, which every micro-batch's leaf shares (fnmoe.tree.value_and_grad detaches
    the params each time), until the step's update, the storage's end, or a write in place to the
    leaf or its shard (a version moves)."""
    plain = list(fdist.rank_values(local).values())
    key = tuple(_torch.storage_key(p) for p in plain)
    version = (_torch.tensor_version(leaf), _torch.tensor_version(local))
    hit = _payloads.get(key)
    if hit is not None and hit[0]() is not None and hit[1] == version:
        return hit[2]
    with torch.no_grad(), _made():
        packed = pack(local.detach(), dim, rows)

    def forget(ref, key=key):
        if (entry := _payloads.get(key)) is not None and entry[0] is ref:
            del _payloads[key]
    _payloads[key] = (weakref.ref(plain[0].untyped_storage(), forget), version, packed)
    return packed
