"""Offload's lifecycle, as the GPU runs it, on CPU: the pool and its handles run the same code on
both devices (only host_pool.Copier's copy primitives differ), so these tests see what a CUDA run
does: reloaded tensors live only while backward uses them, the peak falls by what is offloaded,
the pool pins exactly what it asks for. Legend: B batch, L sequence, D model."""
import weakref

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fnmoe.memory import host_pool
from fnmoe.memory import policies as memory
from fnmoe.config import MemoryConfig, ModelConfig, MoEConfig
from fnmoe.models.params import init_params
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict

CFG = ModelConfig(vocab_size=64, dim=64, n_layers=5, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=64, first_k_dense=1))
TOKENS = torch.randint(0, 64, (4, 65), generator=torch.Generator().manual_seed(0))


class _Watched:
    """A BlockRunner around memory.Runner that notes, when block i's backward has produced the
    gradient of its input, which blocks' reloaded tensors are still alive."""

    def __init__(self, runner: memory.Runner, backs: list):
        self.runner, self.backs, self.alive_after = runner, backs, {}
        self.offloads, self.region, self.block_chunks = runner.offloads, runner.region, runner.block_chunks

    def _alive(self) -> set[int]:
        hosts = {id(h.host): i for i, hs in self.runner.handles.items() for h in hs}
        return {hosts[host] for host, ref in self.backs if ref() is not None}

    def __call__(self, i, fn, p, x_BLD, *rest):
        def note(grad):
            self.alive_after.setdefault(i, self._alive())
        out = self.runner(i, fn, p, x_BLD, *rest)
        if x_BLD.requires_grad:  # after the runner's own hook on the block input
            x_BLD.register_hook(note)
        return out


def _offloaded_step(mem: MemoryConfig):
    backs = []

    class Copier(host_pool.Copier):  # the CPU primitives, noting each reloaded tensor
        def to_device(self, host, device, after):
            back, ready = super().to_device(host, device, after)
            backs.append((id(host), weakref.ref(back)))
            return back, ready
    pool = host_pool.HostPool(32 << 20)
    pool.copier = Copier(None)
    runner = _Watched(memory.Runner(mem, CFG.n_layers, pool), backs)
    params = init_params(CFG, 0)
    leaves = [v.requires_grad_(True) for k, v in flatten_dict(params).items() if not k.startswith("buffers.")]
    loss, _ = loss_fn(params, TOKENS[:, :-1], TOKENS[:, 1:], CFG, TOKENS[:, 1:].numel(), 1, runner)
    torch.autograd.grad(loss, leaves)
    return runner, backs


def test_reloaded_tensors_are_gone_after_their_blocks_backward_and_one_block_is_ahead():
    """After block k's backward only block k-1's reloaded tensors are alive (brought back while
    block k computed); the old runner kept every block's until the next forward."""
    for mem in (MemoryConfig(offload=True), MemoryConfig(attention="offload", moe="offload", mlp="offload")):
        runner, backs = _offloaded_step(mem)
        offloaded = sorted(runner.runner.handles)
        assert offloaded == list(range(CFG.n_layers - 1)) and backs, mem  # the last block is never offloaded
        for k in offloaded:
            assert runner.alive_after[k] <= {k - 1}, (mem, k, runner.alive_after)
        assert runner.alive_after[1] == {0}  # the lookahead: block 0 came back during block 1's backward


def _peak_bytes(mem: MemoryConfig) -> tuple[int, int]:
    """(peak device bytes of a forward + backward, bytes offloaded), the pool outside the count."""
    pool = host_pool.HostPool(32 << 20)
    runner = memory.block_runner(mem, CFG.n_layers, pool)
    params = init_params(CFG, 0)
    leaves = [v.requires_grad_(True) for k, v in flatten_dict(params).items() if not k.startswith("buffers.")]
    mt = MemTracker()
    for buffer in pool.buffers:
        mt.track_external(buffer)
    with mt:
        loss, _ = loss_fn(params, TOKENS[:, :-1], TOKENS[:, 1:], CFG, TOKENS[:, 1:].numel(), 1, runner)
        torch.autograd.grad(loss, leaves)
        peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    blocks = [s["offloaded"] for s in runner.stats.values()] if runner is not None else []
    return peak, blocks


def test_offload_lowers_the_peak_by_the_offloaded_bytes_but_two_blocks():
    none, _ = _peak_bytes(MemoryConfig())
    offload, blocks = _peak_bytes(MemoryConfig(offload=True))
    # backward holds at most the block it works on and the one coming back
    two_blocks = sum(sorted(blocks)[-2:])
    assert none - offload >= sum(blocks) - two_blocks, (none, offload, blocks)


def test_the_pool_pins_exactly_what_it_asks_for():
    """CUDA's caching host allocator rounds a pinned allocation up to a power of two: the pool asks
    for power-of-two segments that add up to its size (rounded to 2 MiB)."""
    for nbytes in (1, 2 << 20, (40 << 30) + 12345, 3 * (7 << 20) + 1):
        sizes = host_pool.pool_segments(nbytes)
        assert sum(sizes) == -(-nbytes // host_pool.PIN_UNIT) * host_pool.PIN_UNIT
        assert all(s & (s - 1) == 0 and s >= host_pool.PIN_UNIT for s in sizes) and sizes == sorted(sizes, reverse=True)
    assert host_pool.pool_segments((40 << 30) + 12345) == [32 << 30, 8 << 30, 2 << 20]
    pool = host_pool.HostPool((5 << 20) + 1)
    assert [b.numel() for b in pool.buffers] == [4 << 20, 2 << 20] and pool.nbytes == 6 << 20
    # a tensor that does not fit a segment's rest goes to the next one; one too big for any is refused
    pool.store(torch.zeros(3 << 18))  # 3 MiB into the 4 MiB segment
    pool.store(torch.zeros(1 << 18))  # 1 MiB: still fits the first
    pool.store(torch.zeros(1 << 18))  # the second segment
    assert pool.segment == 1 and pool.used == 5 << 20
