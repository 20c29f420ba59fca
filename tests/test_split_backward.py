"""The split expert backward of whole-block chunks under expert parallelism (fnmoe.models.moe_steps.Split,
fnmoe.kernels.wgrad): the combine's and the dispatch's gradients sent by hand, the experts' weight
gradients put off until the dispatch's gradient travels; values to the bit of the block's backward
without steps (one autograd pass a chunk), in the compute dtype and under fp8 expert GEMMs.
Legend: R rows, D in, F out, E experts, B batch, L sequence."""
import pytest
import torch

from fnmoe.config import MemoryConfig, ModelConfig, MoEConfig
from fnmoe.kernels import fp8_gemm, wgrad
from fnmoe.kernels import gemm as cpu_gemm
from fnmoe.models import block_chunks
from fnmoe.parallel import dispatch
from conftest import step_on_2x2

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1, n_shared_experts=1,
                                aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01))
TOKENS = torch.randint(0, CFG.vocab_size, (16, 9), generator=torch.Generator().manual_seed(3))
MEM = MemoryConfig(recompute="full", block_chunks=4, keep_exchange=False)

needs_kernels = pytest.mark.skipif(not cpu_gemm.available(), reason="fnmoe's C++ CPU kernels did not build")


@pytest.fixture(autouse=True)
def skewed_routing(monkeypatch):
    """Routing pinned by a table (passed where the score-correction bias goes) that loads the ep ranks
    unevenly: a rank's first 12 tokens of 16 go to experts 0 and 1 (ep rank 0's), the rest to 2 and 3.
    Each exchange's splits then differ by direction, so a gradient sent back by the wrong splits
    shows (with even splits it would not)."""
    from fnmoe.models import moe

    route = moe.route

    def pinned(x_TD, w_router_DE, cfg, bias_E=None, router=None, **given):
        T, E = x_TD.shape[0], w_router_DE.shape[1]
        first = (torch.arange(T, device=x_TD.device) % 16 < 12)[:, None]
        low = torch.arange(E, device=x_TD.device) < 2
        return route(x_TD, w_router_DE, cfg, (first == low).float() * 10, router, **given)

    monkeypatch.setattr(moe, "route", pinned)


@needs_kernels
@pytest.mark.parametrize("gemm_dtype", [None, torch.float8_e4m3fn], ids=["compute", "fp8"])
def test_the_split_backward_gives_one_pass_a_chunk_to_the_bit(monkeypatch, gemm_dtype):
    """4 chunks a rank on a 2x2 mesh, the exchange replayed: the loss and every gradient of the split
    backward equal those of the block run without steps (each chunk's backward one autograd pass)."""
    splits = []
    backward = dispatch.grad_to_tokens
    monkeypatch.setattr(dispatch, "grad_to_tokens", lambda *a: splits.append(1) or backward(*a))
    with fp8_gemm.expert_gemm_dtype(gemm_dtype):
        got = step_on_2x2(CFG, MEM, TOKENS)
        assert len(splits) == 4  # 4 chunks of the one MoE layer (a simulated mesh: all ranks a call)
        run = block_chunks.run
        monkeypatch.setattr(block_chunks, "run", lambda *args: run(*args[:5]))
        want = step_on_2x2(CFG, MEM, TOKENS)
    assert len(splits) == 4 and torch.equal(got[0], want[0])
    for path, g in want[1].items():
        assert torch.equal(got[1][path], g), path


@needs_kernels
def test_the_weight_gradients_run_while_the_dispatch_gradient_travels(monkeypatch):
    """Each chunk's order on each rank: its combine's gradient issued and waited for, the experts'
    input gradient, the dispatch's gradient issued, then the 3 weight-gradient GEMMs of the chunk,
    then its wait. (The op order against the chunk before's recompute is the planner's recording:
    tests/test_plan_hardware.py.)"""
    log = []
    for name in ("grad_to_experts", "grad_to_tokens", "waited"):
        fn = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _fn=fn, _name=name: log.append(_name) or _fn(*a))
    flush = wgrad.flush
    monkeypatch.setattr(wgrad, "flush", lambda store: log.append(f"weight grads {len(store)}") or flush(store))
    recompute = block_chunks._recompute
    monkeypatch.setattr(block_chunks, "_recompute", lambda *a: log.append("recompute") or recompute(*a))
    step_on_2x2(CFG, MEM, TOKENS)
    chunk = ["grad_to_experts", "waited", "grad_to_tokens", "weight grads 3", "waited"]
    # a simulated mesh runs each call for all 4 ranks at once: the log is one rank's order
    moe = ["recompute"] + ["recompute", *chunk] * 3 + chunk  # the last chunk's recompute first
    assert log == moe + ["recompute"] * 4, log  # then the dense block's 4 chunks (no exchange)


def test_weight_gradients_put_off_are_autograds_to_the_bit():
    """A leaf stack in two grouped GEMMs: under wgrad.deferred its gradient is none until flush, then
    autograd's (its two parts summed first, then added to what .grad held); a pass whose inputs leave
    the stack out puts nothing off; a stack that is not a leaf takes its gradient at once."""
    if not cpu_gemm.available():
        pytest.skip("fnmoe's C++ CPU kernels did not build")
    end_E = torch.tensor([5, 5, 17, 24])

    def deferred():
        g = torch.Generator().manual_seed(0)
        x_RD = torch.randn(24, 32, generator=g, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(4, 32, 16, generator=g, dtype=torch.bfloat16).requires_grad_()
        w.grad = torch.full_like(w, 0.25)  # an earlier chunk's part
        loss = (cpu_gemm.grouped_mm(x_RD, w, end_E) * cpu_gemm.grouped_mm(x_RD.flip(0), w, end_E)).square().sum()
        with wgrad.deferred() as later:
            loss.backward(inputs=[x_RD, w])
        assert len(later) == 2 and torch.equal(w.grad, torch.full_like(w, 0.25))
        wgrad.flush(later)
        return x_RD.grad, w.grad

    def plain():
        g = torch.Generator().manual_seed(0)
        x_RD = torch.randn(24, 32, generator=g, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(4, 32, 16, generator=g, dtype=torch.bfloat16).requires_grad_()
        w.grad = torch.full_like(w, 0.25)
        (cpu_gemm.grouped_mm(x_RD, w, end_E) * cpu_gemm.grouped_mm(x_RD.flip(0), w, end_E)).square().sum().backward()
        return x_RD.grad, w.grad

    got, want = deferred(), plain()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x_RD = torch.randn(24, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 32, 16, dtype=torch.bfloat16, requires_grad=True)
    with wgrad.deferred() as later:
        cpu_gemm.grouped_mm(x_RD, w, end_E).sum().backward(inputs=[x_RD])
        assert later == [] and w.grad is None
        cpu_gemm.grouped_mm(x_RD, w * 2, end_E).sum().backward(inputs=[w])
    assert later == [] and w.grad is not None
