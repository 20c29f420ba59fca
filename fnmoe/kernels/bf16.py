"""bf16 GEMMs on a CPU without native bf16 (no AVX512-BF16, no AMX: an AVX2 machine) run in fp32.

torch's CPU bf16 GEMMs have no fast path there and run 10-45x slower than fp32 ones (measured by
tools/bench_bf16_cpu.py). A bf16 value is exact in fp32, so such a GEMM runs as one fp32 GEMM of
the bf16 operands, its result rounded once to bf16: bitwise round_bf16(fp32 GEMM of the bf16
values), i.e. fp32 accumulation then one rounding, which is what a native bf16 GEMM with fp32
accumulation (oneDNN's) computes up to the order of its sums. Autograd records the upcasts, so the
backward's GEMMs run in fp32 the same way and each gradient is rounded once to bf16. The cost: a
GEMM's saved operands are kept in fp32 (twice their bf16 bytes) until its backward.

`fp32_gemms(x)` is the context the model's GEMM sites enter (the blocks, recomputed or not, and
the output head): a TorchFunctionMode that runs matmul / mm / bmm / einsum / linear of plain
bf16 CPU tensors so; the experts' C++ grouped GEMM takes the same choice as an argument
(`wanted()`). FNMOE_BF16_GEMMS=native keeps torch's bf16 GEMMs (=fp32 forces the fp32 ones).

Legend: no shapes here.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from fnmoe import _torch, caches

log = logging.getLogger("fnmoe")

ENV = "FNMOE_BF16_GEMMS"


@caches.register
@functools.cache
def native() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX tiles)."""
    return bool(_torch.cpu_avx512_bf16() or _torch.cpu_amx_tile())


@torch.compiler.assume_constant_result  # compiled code (the grouped GEMM's argument) takes it as traced
def wanted() -> bool:
    """Whether CPU bf16 GEMMs run as fp32 ones here: FNMOE_BF16_GEMMS=fp32|native, else where the
    CPU has no native bf16."""
    choice = os.environ.get(ENV, "")
    if choice not in ("", "fp32", "native"):
        raise ValueError(f"{ENV}={choice!r}: expected 'fp32' or 'native'")
    return choice == "fp32" or (not choice and not native())


def _plain_bf16(t) -> bool:
    return type(t) is torch.Tensor and t.dtype == torch.bfloat16 and t.device.type == "cpu" and not _torch.is_fake(t)


def _operands(func, args: tuple) -> list:
    """The tensors func multiplies: einsum's after its equation (given apart or as one list)."""
    if func is torch.einsum:
        rest = args[1:]
        return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    return [a for a in args if isinstance(a, torch.Tensor)]


def _up(a):
    if isinstance(a, torch.Tensor):
        return a.float()
    if isinstance(a, (list, tuple)):
        return type(a)(_up(x) for x in a)
    return a


class _Fp32Gemms(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS:
            ops = _operands(func, args)
            if ops and all(_plain_bf16(t) for t in ops):
                return func(*(_up(a) for a in args), **{k: _up(v) for k, v in kwargs.items()}).to(torch.bfloat16)
        return func(*args, **kwargs)


_GEMMS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
                    torch.Tensor.bmm, torch.einsum, torch.nn.functional.linear, torch.addmm, torch.baddbmm})
_active = [False]  # entered once: the sites nest (a block inside the step)


@contextlib.contextmanager
def fp32_gemms(x: torch.Tensor, on: bool = True) -> Iterator[None]:
    """The GEMMs of plain bf16 CPU tensors in the body run in fp32, rounded once to bf16, where x
    (the activations the body computes on) is such a tensor, `on` and wanted(); else nothing
    changes. Never around or inside compiled code (on=False where the body calls a compiled
    region: model.compile; inductor picks its own kernels)."""
    if not on or _active[0] or torch.compiler.is_compiling() or not _plain_bf16(x) or not wanted():
        yield
        return
    say_once()
    _active[0] = True
    try:
        with _Fp32Gemms():
            yield
    finally:
        _active[0] = False


@caches.register
@functools.cache
def say_once() -> None:
    log.info("bf16 compute on a CPU without native bf16 (no AVX512-BF16 / AMX): its GEMMs run in fp32 on the bf16 "
             "values, each result rounded once to bf16 (torch's bf16 GEMMs are 10-45x slower here; "
             "%s=native keeps them)", ENV)
