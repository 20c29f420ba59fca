"""Whole-block token chunks (memory.block_chunks, fnmoe.models.block_chunks): the unchunked loss, gradients and
whole-batch statistics in one process and on a simulated 2x2 mesh with expert parallelism (kept and
replayed exchange, offload, resharding), one chunk's recompute alive at a time (measured), the
planner's transient against the measured peak, and bad chunk counts named. Legend: B batch, L sequence.
"""
import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from fnmoe.models import block_chunks, seams
from fnmoe.config import (DataConfig, MemoryConfig, MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig,
                          load_config, validate)
from fnmoe.memory import policies
from fnmoe.models.params import init_params
from fnmoe.plan import meters
from fnmoe.plan.meters import StorageMeter
from fnmoe.plan.rehearse import compare, rehearse
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict, tree_map, value_and_grad
from conftest import pin_routing, rel, step_on_2x2

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1, aux_loss_coeff=0.01,
                                seq_aux_loss_coeff=0.01, z_loss_coeff=0.001))
B, L = 8, 8
TOKENS = torch.randint(0, CFG.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(0))
FULL = MemoryConfig(recompute="full")


@pytest.fixture(autouse=True)
def pinned_routing(monkeypatch):
    """Routing pinned (conftest.pin_routing): a last-bit difference in a chunk's GEMM cannot flip a
    near-tie in the next layer."""
    pin_routing(monkeypatch)


def _mem(chunks: int, **fields) -> MemoryConfig:
    return dataclasses.replace(FULL, block_chunks=chunks, **fields)


def _one_process(cfg: ModelConfig, mem: MemoryConfig, positions=None):
    """(loss, aux, grads) of one step on the whole batch in one process."""
    runner = policies.block_runner(mem, cfg.n_layers)
    (loss, aux), grads = value_and_grad(loss_fn, has_aux=True)(init_params(cfg, 0), TOKENS[:, :-1], TOKENS[:, 1:],
                                                               cfg, B * L, runner=runner, positions_BL=positions)
    return loss, aux, flatten_dict(grads)


def _assert_same(got, want, tol: float = 1e-5) -> None:
    assert abs(got[0].item() - want[0].item()) <= 1e-6 * abs(want[0].item()), (got[0], want[0])
    for path, g in want[-1].items():
        assert rel(got[-1][path], g) <= tol, (path, rel(got[-1][path], g))


@pytest.mark.parametrize("fields", [{}, {"n_shared_experts": 1}, {"score_func": "sigmoid"}],
                         ids=["plain", "shared", "sigmoid"])
def test_block_chunks_give_the_unchunked_loss_gradients_and_statistics(fields):
    """fp32, eager, 4 chunks of 2 sequences under full recompute against the whole block without
    recompute: the loss (with the Switch, sequence-wise and z losses), every gradient, and the
    statistics the step reads (expert counts exactly, the router logits in token order)."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, **fields))
    want = _one_process(cfg, MemoryConfig())
    got = _one_process(cfg, _mem(4))
    _assert_same(got, want)
    assert torch.equal(got[1]["expert_counts_NE"], want[1]["expert_counts_NE"])
    for key in ("balance_loss", "seq_balance_loss", "z_loss", "probs_sum_NE"):
        assert rel(got[1][key], want[1][key]) <= 1e-6, key
    # 2 chunks of whole sequences: the same op order per row, so the forward agrees to the bit
    assert torch.equal(_one_process(cfg, _mem(2))[1]["ce_loss"], _one_process(cfg, FULL)[1]["ce_loss"])


def test_packed_documents_slice_their_positions_and_masks_per_chunk():
    """Packed rows (positions restart per document): RoPE tables and the document mask are per
    sequence, so each chunk takes its own rows of them."""
    positions = torch.arange(L).repeat(B, 1) % torch.tensor([3, 5, 8, 4, 6, 8, 2, 7])[:, None]
    _assert_same(_one_process(CFG, _mem(4), positions), _one_process(CFG, MemoryConfig(), positions))


@pytest.mark.parametrize("mem", [_mem(2), _mem(2, keep_exchange=False), _mem(2, offload=True, offload_min_bytes=0)],
                         ids=["keep", "replay", "offload"])
def test_block_chunks_on_a_2x2_mesh_give_one_process_loss_and_gradients(mem):
    """Each rank's 2 sequences in 2 chunks, experts exchanged over ep and weights regathered in
    backward: the same loss and gradients as one unchunked process, keeping the exchange's outputs
    (in the host pool when offloading) or sending them again."""
    want = _one_process(CFG, MemoryConfig())
    got = step_on_2x2(CFG, mem, TOKENS)
    assert abs(got[0].item() - want[0].item()) <= 1e-6 * abs(want[0].item())
    for path, g in want[-1].items():
        assert rel(got[1][path], g) <= 1e-5, path


def test_two_chunks_in_flight_give_the_sequential_forward_to_the_bit(monkeypatch):
    """4 chunks a rank on a 2x2 mesh, the exchange replayed, the block inputs and routing offloaded:
    the forward runs two chunks at a time, each one's exchanges travelling while the other computes
    (block_chunks.interleaved, once a MoE layer): the loss and every gradient of one chunk after the
    other (the block's own code, no steps), to the bit."""
    tokens = torch.randint(0, CFG.vocab_size, (16, L + 1), generator=torch.Generator().manual_seed(1))
    mem = _mem(4, keep_exchange=False, offload=True, offload_min_bytes=0)
    calls, interleaved, run = [], block_chunks.interleaved, block_chunks.run
    monkeypatch.setattr(block_chunks, "interleaved", lambda steps, modes: calls.append(len(steps)) or
                        interleaved(steps, modes))
    got = step_on_2x2(CFG, mem, tokens)
    assert calls == [4, 4]  # the two MoE layers' forwards
    monkeypatch.setattr(block_chunks, "run", lambda *args: run(*args[:5]))
    want = step_on_2x2(CFG, mem, tokens)
    assert calls == [4, 4] and torch.equal(got[0], want[0])
    for path, g in want[1].items():
        assert torch.equal(got[1][path], g), path


def test_chunks_in_flight_take_turns_at_each_exchange():
    """interleaved's order: a chunk runs until it yields, the other resumes; a chunk that ends lets
    the next begin ahead of the one left. Steps here: a, yield, b, yield, c (a chunk's attention,
    dispatch travelling, experts, combine travelling, output)."""
    log = []

    def steps(c):
        def gen():
            log.append(f"a{c}")
            yield
            log.append(f"b{c}")
            yield
            log.append(f"c{c}")
            return c
        return gen

    modes = [contextlib.nullcontext() for _ in range(4)]
    assert block_chunks.interleaved([steps(c) for c in range(4)], modes) == [0, 1, 2, 3]
    assert log == ["a0", "a1", "b0", "b1", "c0", "a2", "c1", "a3", "b2", "b3", "c2", "c3"]


def _backward_peak(chunks: int) -> int:
    """Backward's peak of the bytes a step makes (fnmoe.plan.meters.StorageMeter) over a model of
    two MoE blocks on 8 sequences of 128 tokens, full recompute in `chunks` block chunks."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64, max_seq_len=128,
                      moe=MoEConfig(n_experts=8, top_k=8, expert_hidden=64))
    tokens = torch.randint(0, 64, (8, 129), generator=torch.Generator().manual_seed(0))
    params = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), init_params(cfg, 0))
    meter = StorageMeter()
    meter.track(params, "params")
    with meter:
        loss, _ = loss_fn(params, tokens[:, :-1], tokens[:, 1:], cfg, tokens[:, 1:].numel(),
                          runner=policies.block_runner(_mem(chunks), cfg.n_layers))
        loss.backward()
    return meter.top["backward"]


def test_the_recompute_holds_one_chunks_activations_at_a_time():
    """Backward's peak is fixed + S/N, S the block's recompute: (p1 - p4) / (p1 - p2) = 1.5 for an
    exact fixed + S/N; the fixed part (the blocks' inputs, their gradients, the weights' gradients)
    is small here."""
    peak = {n: _backward_peak(n) for n in (1, 2, 4)}
    assert 1.3 <= (peak[1] - peak[4]) / (peak[1] - peak[2]) <= 1.6, peak
    assert peak[4] <= 0.45 * peak[1], peak


def test_bad_block_chunks_are_named():
    run = RunConfig(model=dataclasses.replace(CFG, vocab_size=264, max_seq_len=128), memory=_mem(3),
                    train=TrainConfig(batch_size=8), data=DataConfig(seq_len=16))
    with pytest.raises(ValueError, match=r"memory.block_chunks=3 must divide a rank's micro-batch of 8 sequences"):
        validate(run)
    with pytest.raises(ValueError, match=r"memory.block_chunks=2 needs memory.recompute='full'"):
        validate(dataclasses.replace(run, memory=MemoryConfig(block_chunks=2)))
    capped = dataclasses.replace(run.model, moe=dataclasses.replace(run.model.moe, capacity_factor=1.0))
    with pytest.raises(ValueError, match=r"memory.block_chunks=2 needs a dropless MoE"):
        validate(dataclasses.replace(run, model=capped, memory=_mem(2)))
    tokens = dataclasses.replace(run.model, moe=dataclasses.replace(run.model.moe, token_chunks=2))
    with pytest.raises(ValueError, match=r"memory.block_chunks=2 takes model.moe.token_chunks=1 \(it is 2\)"):
        validate(dataclasses.replace(run, model=tokens, memory=_mem(2)))
    validate(dataclasses.replace(run, memory=_mem(4)))
    with pytest.raises(ValueError, match=r"memory.block_chunks=3 must divide the sequences of a rank's micro-batch, "
                                         r"8 here"):
        _one_process(CFG, _mem(3))


def test_each_block_gathers_its_weights_once_a_pass_and_holds_none_from_forward_to_backward(monkeypatch):
    """One rank of a 2x2 mesh rehearsed on fake tensors (fnmoe.plan.rehearse), offload and resharding:
    every chunk of a block computes on one gather of its weights (as many all-gathers a step as the
    whole block), and when backward reaches a block none of the forward's gathered weights is alive
    (the chunks' run holds them nowhere: resharding regathers them)."""
    alive = []
    backward = block_chunks._Chunks.backward

    def noting(ctx, *grads):
        meter = next((m for m in seams._listeners if isinstance(m, meters.StorageMeter)), None)
        if meter is not None:  # the rehearsal's step (not the planner's proxy step, which records the order)
            alive.append(meter.live["gathered"])
        return backward(ctx, *grads)
    monkeypatch.setattr(block_chunks._Chunks, "backward", staticmethod(noting))
    run = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")
    calls = {}
    for n in (1, 2):
        r = dataclasses.replace(run, mesh=MeshConfig(fsdp=2, ep=2), memory=_mem(n, offload=True),
                                train=dataclasses.replace(run.train, batch_size=16))
        report = rehearse(r, 0, fresh_process=False)
        assert compare(report)["ok"], compare(report)
        calls[n] = sorted((c["axis"], c["phase"], c["calls"], c["bytes"]) for c in report["collectives"]
                          if c["kind"] == "all_gather")
    assert calls[1] == calls[2], calls
    assert alive and alive[0] == 0, alive
