"""The host pool offload copies into: power-of-two segments of host memory (pinned on CUDA), a bump
allocator rewound at each forward, and the device-specific copies behind one small interface
(Copier: CUDA side stream and events; CPU copies that finish at once), so CPU tests run the code
the GPU runs. fnmoe.memory.policies's offload hooks and recompute keep their saved tensors here as Handles.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch

PIN_UNIT = 2 << 20
"""the pool's size is a multiple of this; its segments are powers of two of at least this size"""


def pool_segments(nbytes: int) -> list[int]:
    """Sizes of the host pool's segments: nbytes rounded up to PIN_UNIT, as powers of two, largest
    first. CUDA's caching host allocator rounds every pinned allocation up to a power of two (a
    40 GiB pool would pin 64 GiB); segments of those sizes pin exactly what was asked."""
    units = -(-max(nbytes, 1) // PIN_UNIT)
    return [PIN_UNIT << b for b in reversed(range(units.bit_length())) if units >> b & 1]


POOL_MARGIN = 1.25
"""the host pool holds the planned offload bytes whose size follows the routing (the expert rows of
an offloaded MoE region, a kept exchange's outputs) times this: routing above the planned imbalance
must not fill it mid-step. Bytes that do not depend on routing (block inputs, the routing itself)
take no margin."""


def pool_bytes_for(offload_bytes: int, routed_bytes: int = 0) -> int:
    """What a pool for offload_bytes of saved tensors pins (0 for none), routed_bytes of them sized
    by the routing: those with the margin, plus 1 MiB, in whole segments. The one rule the run
    (fnmoe.memory.policies), its host-memory check and the planner use."""
    if not offload_bytes:
        return 0
    return sum(pool_segments(int(offload_bytes + routed_bytes * (POOL_MARGIN - 1)) + (1 << 20)))


class _Done:
    """A copy that has finished (CPU copies run at once): torch.cuda.Event's API."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = _Done()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a dense, non-overlapping t (any dim order) as one flat uint8 view: its elements
    fill one block of memory from its storage offset."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


class Copier:
    """The pool's copy primitives, the one place that differs by device. CUDA: copies run on a side
    stream and return events; the other stream waits on an event before using a copy. CPU: the same
    calls copy at once and return DONE, so everything around them (the handles' lifecycle, the
    in-flight bound, the reload order) runs the same code on CPU as on CUDA."""

    def __init__(self, device: torch.device | str | None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(torch.device(device)) if self.cuda else None

    def to_host(self, slot: torch.Tensor, t: torch.Tensor):
        """slot <- t; the event of the copy. t's memory may be freed by its owner at once."""
        if not self.cuda:
            slot.copy_(t)
            return DONE
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
        with torch.cuda.stream(self.stream):
            slot.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)  # the allocator keeps t's memory until the copy has read it
        return done

    def to_device(self, host: torch.Tensor, device: torch.device, after) -> tuple[torch.Tensor, object]:
        """(a new device tensor that will hold host's values, the event of that copy), the copy
        started once `after` (the copy into host) is done."""
        # allocated here, on the compute stream: memory from the side stream's pool could not be
        # reused by the compute stream once backward frees it (reserved memory would grow a block)
        back = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        if not self.cuda:
            back.copy_(host)
            return back, DONE
        # back's memory is free in the compute stream's order only: kernels queued there may still
        # read it (seen on an H200: a compiled backward read a half-copied index out of bounds)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            back.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        back.record_stream(self.stream)  # freed before the copy ended (never used): not reused early
        return back, ready

    def pieces_to_host(self, pieces: list[torch.Tensor], t: torch.Tensor):
        """to_host for a tensor whose bytes go to several slots, in order: one event for them all."""
        src, at = flat_bytes(t), 0
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for piece in pieces:
                piece.copy_(src[at:at + piece.numel()], non_blocking=self.cuda)
                at += piece.numel()
            done = self._record()
        if self.cuda:
            t.record_stream(self.stream)
        return done

    def pieces_to_device(self, pieces: tuple, like: tuple, device: torch.device, after):
        """to_device for a tensor stored in pieces: a new tensor of like's shape, strides and dtype."""
        shape, stride, dtype = like
        back = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        dst, at = flat_bytes(back), 0
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(device))  # as to_device
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for piece in pieces:
                dst[at:at + piece.numel()].copy_(piece, non_blocking=self.cuda)
                at += piece.numel()
            ready = self._record()
        if self.cuda:
            back.record_stream(self.stream)
        return back, ready

    def _record(self):
        if not self.cuda:
            return DONE
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event, device: torch.device) -> None:
        """The compute stream waits for event (nothing to wait for on CPU)."""
        if self.cuda:
            torch.cuda.current_stream(device).wait_event(event)


@dataclasses.dataclass(eq=False)
class Handle:
    """A saved tensor in the pool: its host copy (host, with the tensor's shape and strides; or, split
    over segments, its bytes in pieces), and while backward needs it its device copy."""
    host: torch.Tensor | None
    device: torch.device
    done: object  # the device-to-host copy's event
    pieces: tuple = ()  # the bytes in order, when host is None
    like: tuple = ()  # (shape, stride, dtype)
    uses: int = 1  # unpacks still to come (a tensor saved twice is stored once)
    back: torch.Tensor | None = None  # the device copy, from prefetch until the last unpack
    ready: object = None  # the host-to-device copy's event


class HostPool:
    """Host memory that offloaded saved tensors are copied into (a bump allocator over segments,
    rewound at the start of each forward pass, when the previous backward has consumed every copy).

    On CUDA the segments are pinned and copies run on a side stream (Copier), so the forward does
    not wait for them; at most max_inflight_bytes of copies are in flight (the oldest is waited for
    beyond that). On CPU the same code runs with copies that finish at once."""

    def __init__(self, nbytes: int, device: torch.device | str | None = None, max_inflight_bytes: int = 1 << 30):
        self.copier = Copier(device)
        self.buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=self.copier.cuda) for n in pool_segments(nbytes)]
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight: collections.deque = collections.deque()  # (event, bytes) of copies not known done
        self._inflight_bytes = 0
        self.segment, self.offset, self.used = 0, 0, 0
        self.peak_used = 0  # the most bytes one forward has offloaded

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def rewind(self) -> None:
        # every copy into the slots waited for, not only those over the bound: after a forward whose
        # backward never ran (an error, an abandoned step) copies may still be writing where the next
        # forward's go
        while self.inflight:
            self.inflight.popleft()[0].synchronize()
        self._inflight_bytes = 0
        self.segment, self.offset, self.used = 0, 0, 0

    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    def _wait_inflight(self, room: int) -> None:
        """Forget the copies that have finished; wait for the oldest while room more would pass the bound."""
        while self.inflight and (self.inflight[0][0].query()
                                 or self._inflight_bytes + room > self.max_inflight_bytes):
            event, n = self.inflight.popleft()
            event.synchronize()
            self._inflight_bytes -= n

    def _take(self, n: int) -> torch.Tensor | None:
        """n bytes of the current segment from a 64-byte aligned offset (like the allocator: kernels,
        and so rounding, do not change), or what is left of it; None when nothing is."""
        buffer = self.buffers[self.segment]
        start = -(-self.offset // 64) * 64
        n = min(n, buffer.numel() - start)
        if n <= 0:
            return None
        self.offset, self.used = start + n, self.used + n
        self.peak_used = max(self.peak_used, self.used)
        return buffer[start:start + n]

    def _slots(self, n: int) -> list[torch.Tensor]:
        """Room for n bytes, in order: one slot when the current segment holds them whole, else pieces
        filling what is left of it and of the next, so that the pool holds its bytes whatever the
        sizes of the tensors (a pool is its planned bytes, not its planned tensors)."""
        pieces, left = [], n
        while left and self.segment < len(self.buffers):
            piece = self._take(left)
            if piece is not None:
                pieces.append(piece)
                left -= piece.numel()
            if left:
                self.segment, self.offset = self.segment + 1, 0
        if left:
            raise RuntimeError(f"offload host pool of {self.nbytes} bytes is full; plan it larger "
                               "(fnmoe plan reports offload_host)")
        return pieces

    def store(self, t: torch.Tensor) -> Handle:
        """A copy of t in the pool with its shape, dtype and strides (t must be non-overlapping and
        dense: the same strides keep backward's kernels, and so its rounding, unchanged). The handle
        holds no reference to t."""
        n = t.numel() * t.element_size()
        self._wait_inflight(n)
        slots = self._slots(n)
        if len(slots) == 1:
            host = slots[0].view(t.dtype).as_strided(t.shape, t.stride())
            done = self.copier.to_host(host, t)
        else:
            host = None
            done = self.copier.pieces_to_host(slots, t)
        self.inflight.append((done, n))
        self._inflight_bytes += n
        return Handle(host, t.device, done, pieces=tuple(slots) if host is None else (),
                      like=(t.shape, t.stride(), t.dtype))

    def prefetch(self, handle: Handle) -> None:
        """Start bringing handle back to its device (idempotent while its copy is there)."""
        if handle.back is None and handle.host is None:
            handle.back, handle.ready = self.copier.pieces_to_device(handle.pieces, handle.like, handle.device,
                                                                     handle.done)
        elif handle.back is None:
            handle.back, handle.ready = self.copier.to_device(handle.host, handle.device, handle.done)

    def load(self, handle: Handle) -> torch.Tensor:
        """handle's device tensor for one unpack; after its last unpack the handle lets it go, so
        the tensor lives only as long as backward uses it."""
        self.prefetch(handle)
        self.copier.wait(handle.ready, handle.device)
        back = handle.back
        handle.uses -= 1
        if handle.uses <= 0:
            handle.back = handle.ready = None
        return back
