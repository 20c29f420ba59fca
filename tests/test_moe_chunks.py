"""MoE token chunks (model.moe.token_chunks, fnmoe.models.moe_chunks): the unchunked losses and gradients in one
process and on a simulated 2x2 mesh with expert parallelism, the exchange overlapped with the experts
(recorded op order), one chunk's saved tensors at a time under recompute (measured), bad chunk counts
named, and compile's choice of regions. Legend: B batch, L sequence, T tokens, E experts.
"""
import dataclasses

import pytest
import torch

from fnmoe.models import moe
from fnmoe import compile as fcompile
from fnmoe.config import MemoryConfig, MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig, validate
from fnmoe.sampling.generate import generate
from fnmoe.memory import policies
from fnmoe.models.transformer import moe_region
from fnmoe.parallel import dispatch
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.parallel.fsdp import GATHER
from fnmoe.parallel.sharding import init_params
from fnmoe.plan.meters import StorageMeter
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict, tree_map, value_and_grad
from fnmoe._torch import TorchDispatchMode, all_to_all_ops, c10d_ops
from conftest import pin_routing, rel, step_on_2x2

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1))
B, L = 8, 8
TOKENS = torch.randint(0, CFG.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(0))


def _cfg(chunks: int, **moe_fields) -> ModelConfig:
    return dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, token_chunks=chunks, **moe_fields))


@pytest.fixture(autouse=True)
def pinned_routing(monkeypatch):
    """Routing pinned (conftest.pin_routing), so a last-bit difference in a chunk's GEMM cannot flip a
    near-tie in the next layer."""
    pin_routing(monkeypatch)


def _one_process(cfg: ModelConfig, mem: MemoryConfig = MemoryConfig()):
    """(loss, aux, grads) of one step on the whole batch in one process."""
    runner = policies.block_runner(mem, cfg.n_layers)
    (loss, aux), grads = value_and_grad(loss_fn, has_aux=True)(init_params(cfg, 0), TOKENS[:, :-1], TOKENS[:, 1:],
                                                               cfg, B * L, runner=runner)
    return loss, aux, flatten_dict(grads)


def _mesh(cfg: ModelConfig, mem: MemoryConfig = MemoryConfig()):
    """(loss, grads), whole, of the same step on a simulated 2x2 mesh (fsdp 2 x ep 2), resharding."""
    return step_on_2x2(cfg, mem, TOKENS)


def _assert_same(got, want, tol: float = 1e-5) -> None:
    assert abs(got[0].item() - want[0].item()) <= 1e-6 * abs(want[0].item()), (got[0], want[0])
    for path, g in want[-1].items():
        assert rel(got[-1][path], g) <= tol, (path, rel(got[-1][path], g))


@pytest.mark.parametrize("mem", [MemoryConfig(), MemoryConfig(recompute="full"), MemoryConfig(moe="full"),
                                 MemoryConfig(moe="selective")], ids=["none", "block-full", "moe-full", "moe-sel"])
def test_chunks_give_the_unchunked_loss_and_gradients_in_one_process(mem):
    """fp32, eager, 4 chunks of 16 tokens: dropless, and with a capacity (rows dropped, counted across
    chunks as unchunked) and a shared expert (run in the chunks too)."""
    for fields in ({}, {"capacity_factor": 0.5, "n_shared_experts": 1}):
        want = _one_process(_cfg(1, **fields))
        got = _one_process(_cfg(4, **fields), mem)
        _assert_same(got, want)
        assert torch.equal(got[1]["expert_counts_NE"], want[1]["expert_counts_NE"])
        assert torch.equal(got[1]["dropped_N"], want[1]["dropped_N"])
    assert want[1]["dropped_N"].sum() > 0  # the capacity bites


@pytest.mark.parametrize("mem", [MemoryConfig(), MemoryConfig(recompute="full"),
                                 MemoryConfig(recompute="full", keep_exchange=False),
                                 MemoryConfig(recompute="full", offload=True, offload_min_bytes=0)],
                         ids=["none", "full-keep", "full-replay", "full-offload"])
def test_chunks_on_a_2x2_mesh_with_expert_parallelism_give_one_process_loss_and_gradients(mem):
    """Each rank's 16 tokens in 2 chunks, their rows exchanged over ep: the same loss and gradients as
    one unchunked process, with no recompute, with full recompute keeping the exchange's outputs (in
    the host pool when offloading) and with it sending them again."""
    _assert_same(_mesh(_cfg(2), mem), _one_process(_cfg(1)))


def test_a_capacity_on_the_mesh_counts_each_experts_rows_over_all_chunks():
    """A capacity is a rank's own (its T*K rows), so the reference is the unchunked mesh."""
    fields = {"capacity_factor": 0.5, "n_shared_experts": 1}
    _assert_same(_mesh(_cfg(2, **fields), MemoryConfig(recompute="full")), _mesh(_cfg(1, **fields)))


class _Exchanges(TorchDispatchMode):
    """The forward and backward ops as letters: N the count all-to-all issued, n its wait; D a dispatch
    issued, d its wait; C a combine issued, c its wait; B an all-to-all in backward (its wait b); X where
    a chunk's local experts start, x where they end (`experts`). inflight notes an all-to-all issued
    while another was not yet waited for."""

    def __init__(self):
        super().__init__()
        self.seq, self.pending, self.inflight = [], {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in all_to_all_ops:
            what = fdist.last_entered()
            letter = "B" if "backward" in what else "N" if "count" in what else "D" if "dispatch" in what else "C"
            self.inflight += bool(self.pending)
            self.seq.append(letter)
            self.pending[id(out)] = letter.lower()
        elif func is c10d_ops.wait_tensor.default and id(args[0]) in self.pending:
            self.seq.append(self.pending.pop(id(args[0])))
        elif args and id(args[0]) in self.pending and "wrap" in func.__name__:  # torch 2.13's async wrapper
            self.pending[id(out)] = self.pending.pop(id(args[0]))
        return out

    def experts(self, local_experts):
        def run(*args):
            self.seq.append("X")
            y = local_experts(*args)
            self.seq.append("x")
            return y
        return run


@pytest.mark.parametrize("mem", [MemoryConfig(), MemoryConfig(recompute="full"),
                                 MemoryConfig(recompute="full", keep_exchange=False)],
                         ids=["none", "full-keep", "full-replay"])
def test_next_chunks_dispatch_is_issued_before_this_chunks_experts_and_waited_after(mem, monkeypatch):
    """3 chunks on a simulated 2x2: one count exchange; chunk c+1's dispatch goes out before chunk c's
    expert GEMMs and is waited for after them, before chunk c's combine, so one all-to-all at a time is
    in flight on the ep group (gloo's rule). Backward sends each chunk's two gradients back (kept
    exchange: 4 passes a layer in all) or, replaying, its rows and outputs again first (6 passes)."""
    cfg = dataclasses.replace(_cfg(3), n_layers=2, max_seq_len=16)
    tokens = torch.randint(0, CFG.vocab_size, (4 * 2, 13), generator=torch.Generator().manual_seed(1))  # 24 a rank
    with fdist.simulate(4):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        params = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), init_params(cfg, 0, mesh=mesh))
        part = fdist.rank_map(lambda r: tokens[r * 2:(r + 1) * 2].clone())
        runner = policies.block_runner(mem, cfg.n_layers, reshard=True)
        order = _Exchanges()
        monkeypatch.setattr(dispatch, "local_experts", order.experts(dispatch.local_experts))
        with order:
            loss, _ = loss_fn(params, part[:, :-1], part[:, 1:], cfg, tokens[:, 1:].numel(), runner=runner,
                              source=GATHER)
            order.seq.append("|")
            loss.backward()
    forward, backward = "".join(order.seq).split("|")
    assert forward == "NnDdDXxdCcDXxdCcXxCc", forward
    passes = {"B": 2 * 3} if mem.keep_exchange or mem.recompute != "full" else {"B": 2 * 3, "D": 3, "C": 3}
    assert {k: backward.count(k) for k in "NDCB" if k in backward} == passes, backward
    assert backward.count("X") == (3 if mem.recompute == "full" else 0), backward  # one recompute a chunk
    assert order.inflight == 0, "".join(order.seq)


def _moe_region_peaks(chunks: int, mem: MemoryConfig, T: int = 1024) -> tuple[int, int]:
    """(bytes the region leaves saved after its forward, backward's peak of the bytes it makes) for one
    MoE region run alone through a runner of mem, by fnmoe.plan.meters.StorageMeter."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64, max_seq_len=T,
                      moe=MoEConfig(n_experts=8, top_k=8, expert_hidden=128, first_k_dense=1, token_chunks=chunks))
    layer = init_params(cfg, 0)["layers"]["1"]
    p = tree_map(lambda t: t.detach().requires_grad_(), dict(layer["moe"], norm_D=layer["mlp_norm"]["w_D"]))
    x_BLD = torch.randn(1, T, cfg.dim, generator=torch.Generator().manual_seed(0)).requires_grad_()
    g_BLD = torch.randn(1, T, cfg.dim, generator=torch.Generator().manual_seed(1))
    runner = policies.Runner(mem, cfg.n_layers)
    meter = StorageMeter()
    meter.track((p, x_BLD, g_BLD), "params")
    with meter:
        y_BLD, _ = runner.region(1, "moe", moe_region, False, p, x_BLD, cfg, moe.expert_gemm(cfg, torch.float32),
                                 runner.chunk_recompute(1))
        saved = meter.live["activations"] - y_BLD.untyped_storage().nbytes()
        y_BLD.backward(g_BLD)
    return saved, meter.top["backward"]


def test_recompute_holds_one_chunks_saved_tensors_at_a_time():
    """A MoE region (T=1024, top-8 of 8 experts, F=128, D=32) under memory.moe=full: backward's peak is
    fixed + S/N, S what the chunks recompute plus their gradients' transients (measured, MB: 25.5, 13.4,
    7.2, 4.0 for N = 1, 2, 4, 8: fixed ~1.3, S ~24.3; unchunked without recompute it saves 18.5). Fixed:
    the router's recompute, the input's and the weights' gradients. Without recompute the forward saves
    what it saves unchunked (18.5 for every N): chunks bound what is alive at once, not what autograd
    keeps."""
    peak = {n: _moe_region_peaks(n, MemoryConfig(moe="full"))[1] for n in (1, 2, 4)}
    # fixed + S/N exactly would give (p1 - p4) / (p1 - p2) = 1.5
    assert 1.35 <= (peak[1] - peak[4]) / (peak[1] - peak[2]) <= 1.6, peak
    assert peak[4] <= 0.35 * peak[1], peak
    saved = {n: _moe_region_peaks(n, MemoryConfig(), T=256)[0] for n in (1, 4)}
    assert abs(saved[4] - saved[1]) <= 0.01 * saved[1], saved


def test_block_recompute_holds_one_chunks_saved_tensors_at_a_time():
    """The same under --memory.recompute full (the block's checkpoint: the chunks' recompute runs only
    in _Chunks' backward, one at a time), over a whole model's step of 512 tokens (measured, MB: the
    backward's peak 13.3, 7.4, 4.2, 2.7 and the step's 13.9, 8.0, 4.9, 3.3 for N = 1, 2, 4, 8)."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64, max_seq_len=256,
                      moe=MoEConfig(n_experts=8, top_k=8, expert_hidden=128, first_k_dense=1))
    tokens = torch.randint(0, 64, (2, 257), generator=torch.Generator().manual_seed(0))
    peak = {}
    for n in (1, 2, 4):
        c = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, token_chunks=n))
        params = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), init_params(c, 0))
        meter = StorageMeter()
        meter.track(params, "params")
        with meter:
            loss, _ = loss_fn(params, tokens[:, :-1], tokens[:, 1:], c, tokens[:, 1:].numel(),
                              runner=policies.block_runner(MemoryConfig(recompute="full"), c.n_layers))
            loss.backward()
        peak[n] = meter.top["backward"]
    assert 1.35 <= (peak[1] - peak[4]) / (peak[1] - peak[2]) <= 1.6, peak
    assert peak[4] <= 0.4 * peak[1], peak


def test_token_chunks_that_do_not_divide_the_rows_are_named():
    model = dataclasses.replace(_cfg(3), vocab_size=264, max_seq_len=128)  # the byte corpus's
    run = RunConfig(model=model, mesh=MeshConfig(fsdp=2, ep=2), train=TrainConfig(batch_size=8))
    with pytest.raises(ValueError, match=r"^invalid config: model.moe.token_chunks=3 must divide the tokens of a "
                                         r"rank's micro-batch: data.seq_len=128 x 2 sequences \(train.batch_size=8 / "
                                         r"\(4 ranks x train.grad_accum=1\)\) = 256$"):
        validate(run)
    validate(dataclasses.replace(run, model=dataclasses.replace(model, moe=_cfg(4).moe)))
    with pytest.raises(ValueError, match=r"model.moe.token_chunks=3 must divide the tokens of a MoE layer on a "
                                         r"rank, 16 here"):
        loss_fn(init_params(_cfg(3), 0), TOKENS[:2, :-1], TOKENS[:2, 1:], _cfg(3), 16)
    # decoding takes no chunks: a step's tokens are the batch's rows
    out = generate(init_params(_cfg(4), 0), TOKENS[:1, :4], _cfg(4), max_new_tokens=3)
    assert out.shape == (1, 7)


def test_compile_runs_a_recomputed_chunked_moe_region_eager_and_says_so(monkeypatch, caplog):
    """The chunks' own recompute (an autograd.Function whose backward runs autograd) cannot trace: under
    recompute the MoE region runs eager, said once; without it the chunked region is compiled."""
    seen = []
    monkeypatch.setattr(fcompile, "compiled", lambda fn: seen.append(fn.__name__) or fn)
    monkeypatch.setattr(fcompile, "_said", set())
    cfg = dataclasses.replace(_cfg(2), compile=True, compute_dtype="bfloat16")
    for mem in (MemoryConfig(), MemoryConfig(recompute="full")):
        seen.clear()
        _one_process(cfg, mem)
        assert ("moe_region" in seen) == (mem.recompute == "none"), (mem, seen)
        assert "attention_region" in seen
    assert "model.moe.token_chunks > 1 under recompute" in caplog.text
