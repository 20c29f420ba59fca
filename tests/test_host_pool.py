"""The offload host pool's placement and reuse, against an independent check: every tensor stored in
one forward reads back byte for byte (odd sizes, every dtype, strided layouts, tensors that straddle
segments), and no slot is written again before the copy still in flight into it is waited for (a
copier whose copies complete late, recording the order of copies and waits)."""
from __future__ import annotations

import random

import pytest
import torch

from fnmoe.memory import host_pool
from fnmoe.memory.host_pool import HostPool, pool_segments

DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.int64, torch.float64]


def _tensors(seed: int, n: int) -> list[torch.Tensor]:
    """Tensors of odd sizes and every dtype, some transposed (dense, not contiguous)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        shape = (rng.randint(1, 377), rng.randint(1, 291))
        t = torch.randint(0, 250, shape, dtype=torch.int64).to(dtype) if not dtype.is_floating_point \
            else torch.randn(shape, dtype=torch.float32).to(dtype)
        out.append(t.t() if i % 3 == 0 else t)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_every_stored_tensor_reads_back_byte_for_byte(seed):
    """All tensors stored before any is loaded (one forward's offload): a slot placed over another's
    bytes (an offset rounded down, a segment end passed) changes an earlier tensor's bytes. The pool
    is sized to the bytes alone, so tensors straddle its segments."""
    tensors = _tensors(seed, 60)
    total = sum(t.numel() * t.element_size() + 64 for t in tensors)  # each slot may start up to 63 B later
    if len(pool_segments(total)) == 1:
        total += host_pool.PIN_UNIT  # a second segment
    pool = HostPool(total)
    assert len(pool_segments(total)) > 1  # the sizes make some tensors straddle segments
    handles = [pool.store(t) for t in tensors]
    assert any(h.host is None for h in handles)  # some went in pieces
    for t, h in zip(tensors, handles):
        back = pool.load(h)
        assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
        assert torch.equal(back.view(torch.uint8) if back.dtype == torch.uint8 else back, t)
    starts = [h.host.data_ptr() for h in handles if h.host is not None]
    assert all(p % 64 == 0 for p in starts)  # 64-byte aligned, as the allocator gives a kernel


class _LateEvent:
    """A copy that is done only once waited for, as a side-stream copy may still run."""

    def __init__(self, log: list, name: int):
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log.append(("wait", self.name))
        self.done = True


class _LateCopier(host_pool.Copier):
    """The CPU copier's copies, each reported done only when its event is waited for; it logs each
    copy into the pool with the byte range it writes."""

    def __init__(self, log: list):
        super().__init__("cpu")
        self.log, self.n = log, 0

    def _copy(self, ranges: list[tuple[int, int]]):
        self.n += 1
        self.log.append(("copy", self.n, ranges))
        return _LateEvent(self.log, self.n)

    def to_host(self, slot, t):
        super().to_host(slot, t)
        return self._copy([(slot.data_ptr(), slot.data_ptr() + t.numel() * t.element_size())])

    def pieces_to_host(self, pieces, t):
        super().pieces_to_host(pieces, t)
        return self._copy([(p.data_ptr(), p.data_ptr() + p.numel()) for p in pieces])


def test_no_slot_is_written_again_before_its_copy_is_waited_for():
    """Two forwards' offload through a pool whose copies complete late: the second forward's copies
    reuse the first's bytes, so each must come after a wait for every earlier copy that wrote them
    (the in-flight bound set high: the rewind's wait alone guards the reuse)."""
    log: list = []
    tensors = _tensors(7, 30)
    pool = HostPool(sum(t.numel() * t.element_size() + 64 for t in tensors), max_inflight_bytes=1 << 40)
    pool.copier = _LateCopier(log)
    for _ in range(2):
        pool.rewind()
        for t in tensors:
            pool.store(t)
    waited, written = set(), []  # written: (copy, ranges) in order
    for entry in log:
        if entry[0] == "wait":
            waited.add(entry[1])
            continue
        _, name, ranges = entry
        for earlier, earlier_ranges in written:
            overlaps = any(a < d and c < b for a, b in ranges for c, d in earlier_ranges)
            assert not overlaps or earlier in waited, f"copy {name} wrote over copy {earlier} before it was waited for"
        written.append((name, ranges))
    assert len(written) == 2 * len(tensors) and len(waited) == len(tensors)  # the first forward's, at the rewind
