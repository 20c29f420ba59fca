"""Float8 block quantisation: e4m3 values with one power-of-two scale a 128x128 block of a matrix
(fnmoe.parallel.fp8's expert gathers send them; fnmoe.kernels.fp8_gemm's GEMMs take them).

Legend: I rows, O columns of a matrix (an expert's [in, out]); leading dims are batch dims.

`quantise(x)` splits each matrix (the last two dims) into BLOCK x BLOCK blocks (the trailing blocks
of a dim BLOCK does not divide are shorter), divides each by its scale s and rounds to e4m3; the
scales come back float32, one a block. `dequantise` is q * s. As DeepSeek-V3's 128x128 weight blocks
and torchao's float8 all-gather, but each scale a power of two, s = 2^ceil(log2(amax / 448)) (448:
e4m3's largest finite value; MX's E8M0 scales, torchao's round_scales_to_power_of_2): q * s is then
exact in the compute dtype (bf16 and fp32 hold every e4m3 value times 2^-126..2^127), so the gathered
stack is dequantised in place in the compute dtype, with no fp32 temporary the size of the stack.
The price is up to one bit of e4m3's range: amax / s lies in (224, 448].

A stack's blocks are made once (`weight_blocks`): an fp8 gather `remember`s the pack it dequantised a
stack from, and any other stack is quantised at its first GEMM; every later GEMM of that tensor (each
token chunk of a block, the input gradient) takes them as they are until the stack is written in place
or freed. Re-quantising a dequantised pack gives back its values exactly (tests/test_fp8_gemm.py), so
both ways the GEMMs see the same numbers.

Error bound, per element x of a block with largest |x| amax: y = x / s has |y| <= 448, and rounding
y to e4m3 (3 mantissa bits) errs by at most half an ulp: 2^-4 |y| for normal y (|y| >= 2^-6), 2^-10
(half the subnormal step 2^-9) below. So |x - dequantise(quantise(x))| <= max(2^-4 |x|, 2^-10 s)
<= 2^-4 amax. A block of zeros comes back zeros; one huge element leaves its neighbours in the
block only its own scale's resolution (the second term), and other blocks untouched.

"""
from __future__ import annotations

import itertools
import math
import weakref

import torch

from fnmoe import _torch

BLOCK = 128
E4M3 = getattr(torch, "float8_e4m3fn", None)
"""torch's e4m3 dtype (None in a torch build without it: fnmoe.config.check refuses the field then)"""
E4M3_MAX = 448.0
MIN_SCALE_EXP = -126  # the smallest normal exponent of fp32 and bf16: every scale is a normal number


def blocks(n: int) -> int:
    """Blocks along a dim of n elements (integer ops: n may be a simulated mesh's ragged row count)."""
    return (n + BLOCK - 1) // BLOCK


def scale_count(shape: tuple[int, ...]) -> int:
    """Scales of a tensor of this shape (one per block of each matrix of its last two dims)."""
    return math.prod(shape[:-2]) * blocks(shape[-2]) * blocks(shape[-1])


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The least power of two s with amax / s <= 448, at least 2^-126 (frexp: exact, no log2 rounding)."""
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # amax / 448 = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two needs no larger one
    return torch.ldexp(torch.ones_like(amax), exponent.clamp_min(MIN_SCALE_EXP))


def _spread(s: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Each block's scale over its elements: [..., I, O] from [..., blocks(I), blocks(O)]."""
    return s.repeat_interleave(BLOCK, -2)[..., :shape[-2], :].repeat_interleave(BLOCK, -1)[..., :shape[-1]]


def scalable(x: torch.Tensor) -> torch.Tensor:
    """x in a dtype that a power-of-two scale leaves exact (bf16 or float32: amax and x / s are the
    float32 copy's to the bit); other dtypes through float32, as a float32 copy would round them."""
    return x if x.dtype in (torch.bfloat16, torch.float32) else x.float()


def quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in e4m3, the float32 scale of each block) of x [..., I, O]; x ~ q * s blockwise.

    Block by block region (as dequantise_into), in x's dtype: |x|'s block maxima from max and min
    (no |x| copy), then x / s into one buffer the size of x, clamped in place; a bf16 stack takes 3
    bytes an element of temporaries and output (a float32 copy, its padding, |x|, the spread scales
    and x / s took 21: 22 GB for one of K2's expert stacks)."""
    x = scalable(x)
    I, O = x.shape[-2:]
    amax = torch.empty(*x.shape[:-2], blocks(I), blocks(O), dtype=x.dtype, device=x.device)
    for region, b in _regions(x):
        amax[b] = torch.maximum(region.amax(dim=(-3, -1)), region.amin(dim=(-3, -1)).neg())
    s = pow2_scale(amax.float())
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    inv = s.reciprocal().to(x.dtype)  # powers of two: exact
    for (region, b), (out, _) in zip(_regions(x), _regions(y)):
        torch.mul(region, inv[b].unsqueeze(-1).unsqueeze(-3), out=out)
    return y.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), s


def _regions(x: torch.Tensor):
    """(x's region of whole blocks [..., rn, BLOCK, cn, BLOCK] or of a shorter last block, the index of
    its blocks' scales), for each of the up to four regions of x's last two dims."""
    for (r0, r1, rn), (c0, c1, cn) in itertools.product(_ranges(x.shape[-2]), _ranges(x.shape[-1])):
        b0, b1 = r0 // BLOCK, c0 // BLOCK
        yield (x[..., r0:r1, c0:c1].unflatten(-2, (rn, -1)).unflatten(-1, (cn, -1)),
               (..., slice(b0, b0 + rn), slice(b1, b1 + cn)))


def _ranges(n: int) -> list[tuple[int, int, int]]:
    """(first element, stop, block count) of a dim's whole blocks and of its shorter last block."""
    whole = n // BLOCK * BLOCK
    return [r for r in ((0, whole, n // BLOCK), (whole, n, 1)) if r[1] > r[0]]


def dequantise_into(out: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """out (any float dtype, a view is fine) = q * s blockwise, in place: the cast, then each block
    region scaled by a broadcast of its scales (no temporary the size of out)."""
    out.copy_(q)
    s = s.to(out.dtype)  # powers of two: exact
    for region, b in _regions(out):
        region.mul_(s[b].unsqueeze(-1).unsqueeze(-3))
    return out


def dequantise(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * s blockwise, in dtype."""
    return dequantise_into(torch.empty(q.shape, dtype=dtype, device=q.device), q, s)


def round_trip(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x as an fp8 gather delivers it: quantised and dequantised (in dtype, else x's)."""
    return dequantise(*quantise(x), dtype or x.dtype)


_blocks: dict[int, tuple] = {}
"""a weight stack's storage key -> (a weak reference to the storage, the stack's version, shape, stride
and offset when its blocks were made, q, s), for as long as the storage lives"""


def _layout(w: torch.Tensor) -> tuple:
    return tuple(w.shape), tuple(w.stride()), w.storage_offset()


def remember(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """(q, s) are w's blocks: w == dequantise(q, s) (an fp8 gather's stack and its pack). Kept by w's
    storage, not by the tensor: backward's recompute receives the stack as a new view of the same
    storage (fnmoe.parallel.reshard regathers by as_strided, and detaches it), which an identity key
    missed: K2 quantised each stack again in backward, 22 GB of float32 temporaries and a pass a stack."""
    st = w.untyped_storage()
    key = _torch.storage_key(st)
    _blocks[key] = (weakref.ref(st, lambda _, key=key: _blocks.pop(key, None)), _torch.tensor_version(w),
                    _layout(w), q, s)


def remembered(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, s) remembered for w's elements (any tensor over the same storage, layout and version), else None."""
    hit = _blocks.get(_torch.storage_key(w))
    if hit is not None and hit[0]() is not None and hit[1:3] == (_torch.tensor_version(w), _layout(w)):
        return hit[3], hit[4]
    return None


@torch.compiler.disable(reason="a lookup by storage: dynamo cannot guard on it")
def weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantise(w)'s values, made once for a stack: the pack it was gathered from, else its first quantisation."""
    hit = remembered(w)
    if hit is not None:
        return hit
    with torch.no_grad():
        q, s = quantise(w.detach())
    remember(w, q, s)
    return q, s
