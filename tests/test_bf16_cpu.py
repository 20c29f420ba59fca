"""bf16 GEMMs on a CPU without native bf16 run as fp32 GEMMs of the bf16 values, each result rounded
once to bf16 (fnmoe.kernels.bf16): bitwise round_bf16(fp32 GEMM), within half a bf16 ulp plus fp32's
accumulation error of an fp64 reference; the model's GEMMs, recomputed ones and the experts' C++
grouped GEMM included, take that path in a bf16 step. Timing: tools/bench_bf16_cpu.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fnmoe.config import ModelConfig, RunConfig
from fnmoe.kernels import bf16, gemm

BF16 = torch.bfloat16


@pytest.fixture(params=["fp32", "native"])
def choice(request, monkeypatch):
    monkeypatch.setenv(bf16.ENV, request.param)
    return request.param


def within_fp64(y: torch.Tensor, ref: torch.Tensor, absprod: torch.Tensor, K: int) -> bool:
    """|y - ref| <= half a bf16 ulp of ref (2^-9 of 2^e <= |ref|, bounded by 2^-8 |ref|) plus fp32
    accumulation over K terms (K 2^-24 sum |a||b|)."""
    return bool(((y.double() - ref).abs() <= 2 ** -8 * ref.abs() + K * 2 ** -24 * absprod).all())


def test_each_gemm_is_one_fp32_gemm_rounded_once(monkeypatch):
    monkeypatch.setenv(bf16.ENV, "fp32")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g).to(BF16), torch.randn(96, 48, generator=g).to(BF16)
    a3, b3 = a.view(4, 16, 96), torch.randn(4, 96, 48, generator=g).to(BF16)
    cases = {
        "@": (lambda: a @ b, lambda: (a.float() @ b.float()).to(BF16), a.double() @ b.double(),
              a.double().abs() @ b.double().abs()),
        "einsum": (lambda: torch.einsum("ik,kj->ij", a, b), lambda: (a.float() @ b.float()).to(BF16),
                   a.double() @ b.double(), a.double().abs() @ b.double().abs()),
        "linear": (lambda: torch.nn.functional.linear(a, b.T), lambda: (a.float() @ b.float()).to(BF16),
                   a.double() @ b.double(), a.double().abs() @ b.double().abs()),
        "bmm": (lambda: torch.bmm(a3, b3), lambda: torch.bmm(a3.float(), b3.float()).to(BF16),
                torch.bmm(a3.double(), b3.double()), torch.bmm(a3.double().abs(), b3.double().abs())),
    }
    for name, (run, expect, ref, absprod) in cases.items():
        with bf16.fp32_gemms(a):
            y = run()
        assert y.dtype == BF16 and torch.equal(y, expect()), name
        assert within_fp64(y, ref, absprod, 96), name
    x = torch.randn(8, 8, generator=g)  # fp32 compute: nothing changes
    with bf16.fp32_gemms(x):
        assert torch.equal(x @ x, x @ x) and (x @ x).dtype == torch.float32


def test_the_backward_gemms_are_fp32_too(monkeypatch):
    """Autograd records the upcasts: each gradient is an fp32 GEMM of bf16 values rounded once."""
    monkeypatch.setenv(bf16.ENV, "fp32")
    g = torch.Generator().manual_seed(1)
    a = torch.randn(32, 64, generator=g).to(BF16).requires_grad_()
    b = torch.randn(64, 16, generator=g).to(BF16).requires_grad_()
    dy = torch.randn(32, 16, generator=g).to(BF16)
    with bf16.fp32_gemms(a):
        y = a @ b
    ga, gb = torch.autograd.grad(y, (a, b), dy)
    assert torch.equal(ga, (dy.float() @ b.detach().float().T).to(BF16))
    assert torch.equal(gb, (a.detach().float().T @ dy.float()).to(BF16))


@pytest.mark.skipif(not gemm.available(), reason="fnmoe's C++ CPU kernels did not build")
def test_the_experts_grouped_gemm_takes_the_fp32_path(choice):
    g = torch.Generator().manual_seed(2)
    end_E = torch.tensor([5, 5, 19, 40])
    x = torch.randn(40, 32, generator=g).to(BF16).requires_grad_()
    w = torch.randn(4, 32, 24, generator=g).requires_grad_()  # fp32 master weights, bf16 compute
    y = gemm.grouped_mm(x, w, end_E)
    dy = torch.randn(40, 24, generator=g).to(BF16)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    starts = [0, *end_E[:-1].tolist()]
    wb = w.detach().to(BF16)
    for e, (s, f) in enumerate(zip(starts, end_E.tolist())):
        xe = x.detach()[s:f]
        ref = xe.double() @ wb[e].double()
        assert within_fp64(y[s:f].detach(), ref, xe.double().abs() @ wb[e].double().abs(), 32)
        if choice == "fp32":  # bitwise: one fp32 GEMM of the bf16 values, rounded once
            assert torch.equal(y[s:f], (xe.float() @ wb[e].float()).to(BF16))
            assert torch.equal(gx[s:f], (dy[s:f].float() @ wb[e].float().T).to(BF16))
            assert torch.equal(gw[e], (xe.float().T @ dy[s:f].float()).to(BF16).float())


class _GemmDtypes(TorchDispatchMode):
    """The dtypes of every aten GEMM dispatched in its body."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm,
                                   torch.ops.aten.baddbmm):
            self.seen.add(args[-1].dtype if func.overloadpacket is torch.ops.aten.mm else args[1].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", ["none", "full", "regions"])
def test_a_bf16_step_multiplies_in_fp32_recomputes_included(choice, recompute):
    """Forward, backward and a recompute in backward (whole blocks, or each region) dispatch no bf16
    GEMM on the fp32 path; the native choice keeps them (the check can fail)."""
    from fnmoe.config import MemoryConfig
    from fnmoe.memory.policies import train_runner
    from fnmoe.models.params import init_params
    from fnmoe.training.step import loss_fn
    from fnmoe.tree import value_and_grad

    cfg = dataclasses.replace(ModelConfig(dim=32, ffn_hidden=64, n_heads=2, n_kv_heads=1), compute_dtype="bfloat16",
                              moe=dataclasses.replace(ModelConfig().moe, expert_hidden=32, impl="padded"))
    mem = {"none": MemoryConfig(), "full": MemoryConfig(recompute="full"),
           "regions": MemoryConfig(attention="full", moe="full", mlp="full")}[recompute]
    run = RunConfig(model=cfg, memory=mem)
    tok = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    with _GemmDtypes() as seen:
        value_and_grad(loss_fn, has_aux=True)(init_params(cfg, 0), tok[:, :-1], tok[:, 1:], cfg, None, 2,
                                              train_runner(run))
    assert torch.float32 in seen.seen
    assert (BF16 in seen.seen) == (choice == "native"), seen.seen
