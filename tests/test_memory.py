"""Activation offload: gradients equal `none`'s bitwise, originals are freed, bytes leave the device."""
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.multiprocessing.reductions import StorageWeakRef

from fnmoe import memory
from fnmoe.config import MemoryConfig, load_config
from fnmoe.model import init_params
from fnmoe.train import loss_fn
from fnmoe.tree import flatten_dict

ROOT = Path(__file__).resolve().parent.parent
RUN = load_config(ROOT / "configs" / "tiny.toml")


def _step(mem: MemoryConfig, pool=None, tokens=None):
    params = init_params(RUN.model, 0)
    leaves = {k: v.requires_grad_(True) for k, v in flatten_dict(params).items()}
    runner = memory.block_runner(mem, RUN.model.n_layers, pool) if mem.offload else memory.block_runner(mem)
    loss, _ = loss_fn(params, tokens[:, :-1], tokens[:, 1:], RUN.model, tokens[:, 1:].numel(), 1, runner)
    return loss, leaves, runner


def _tokens(batch=4, seq=64):
    return torch.randint(0, RUN.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_offload_gradients_equal_none_bitwise(recompute):
    tokens = _tokens()
    # the reference is the same recompute setting without offload
    loss0, leaves0, _ = _step(MemoryConfig(recompute=recompute), tokens=tokens)
    g0 = torch.autograd.grad(loss0, list(leaves0.values()))
    loss1, leaves1, runner = _step(MemoryConfig(recompute=recompute, offload=True), memory.HostPool(64 << 20), tokens)
    g1 = torch.autograd.grad(loss1, list(leaves1.values()))
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert sorted(runner.stats) == list(range(RUN.model.n_layers - 1))  # the last block stays
    assert all(s["offloaded"] > 0 for s in runner.stats.values())


def test_offloaded_originals_die_and_copies_are_bitwise(monkeypatch):
    refs, pairs = [], []
    store = memory.HostPool.store

    def spy(self, t):
        refs.append(StorageWeakRef(t.untyped_storage()))
        pairs.append((t.detach().clone(), store(self, t)))
        return pairs[-1][1]

    monkeypatch.setattr(memory.HostPool, "store", spy)
    loss, leaves, _ = _step(MemoryConfig(offload=True), memory.HostPool(64 << 20), _tokens())
    assert refs and all(r.expired() for r in refs)  # after forward, before backward
    assert all(torch.equal(a, b) for a, b in pairs)
    torch.autograd.grad(loss, list(leaves.values()))


def _forward_device_bytes(mem: MemoryConfig) -> int:
    pool = memory.HostPool(64 << 20)
    mt = MemTracker()
    mt.track_external(pool.buffer)
    with mt:
        before = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        loss, leaves, _ = _step(mem, pool, _tokens(8, 128))
        after = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
    del loss, leaves
    return after - before  # the pool is preallocated before: offloaded copies add nothing


def test_offload_moves_saved_bytes_off_the_device():
    none = _forward_device_bytes(MemoryConfig())
    offload = _forward_device_bytes(MemoryConfig(offload=True))
    full_offload = _forward_device_bytes(MemoryConfig(recompute="full", offload=True))
    n = RUN.model.n_layers
    # blocks 0..n-2 are offloaded; the last block, the head and the params stay
    assert offload < none * (1 - 0.9 * (n - 2) / n), (none, offload)
    assert full_offload < offload


def test_train_runner_refuses_unbuilt_region_policies():
    run = dataclasses.replace(RUN, memory=MemoryConfig(attention="full"))
    with pytest.raises(ValueError, match="memory.attention='full'"):
        memory.train_runner(run)
