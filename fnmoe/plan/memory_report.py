"""`fnmoe train --memory.report`: what each block keeps, offloads and recomputes, measured.

Each block's forward is run under the run's memory policy and, for the baseline, under `none`,
one block at a time (its output detached before the next, so at most one block's saved tensors
are alive and the baseline cannot run out of memory where the policy fits). Per block:

  saved       device bytes the block leaves alive for backward under `none`
  kept        the same under the run's policy (what stays on the device)
  offloaded   bytes the block copied into the host pool
  recomputed  saved - kept - offloaded: what backward recomputes instead

Live bytes are torch.cuda.memory_allocated on CUDA; elsewhere, the bytes of the storages the block
allocated (seen by a dispatch mode) that are still alive after it, the host pool excluded. On a
mesh each rank measures its own blocks: DTensor ops are counted by the local ops they run, and
blocks run as in training (with resharding, gathered weights are gathered again in backward, not
saved), so `saved` is activations only.

Legend: B batch, L sequence, D model.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from fnmoe._torch import TorchDispatchMode
from fnmoe.config import REGIONS, MemoryConfig, RunConfig
from fnmoe.memory.host_pool import HostPool
from fnmoe.memory.policies import Runner, regathers
from fnmoe.models.transformer import hidden_states
from fnmoe.parallel.fsdp import params_source
from fnmoe.plan.activations import pool_bytes
from fnmoe.plan.meters import plain_tensors
from fnmoe.tree import Tree, tree_leaves, tree_map

COLUMNS = ("saved", "kept", "offloaded", "recomputed")


class NewStorages(TorchDispatchMode):
    """Every storage an op outputs while active (weakly held), but for the ones in `old`."""

    def __init__(self, old: set[int]):
        super().__init__()
        self.old, self.refs = old, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # DTensor runs its local ops, which come back here (as in MemTracker)
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in plain_tensors(out):
            if t.untyped_storage().data_ptr() not in self.old:
                st = t.untyped_storage()
                seen = self.refs.get(st.data_ptr())
                if seen is None or seen[0].expired():  # a freed storage's address may be reused
                    self.refs[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def settled(read: Callable[[], int], pause_s: float = 0.01, max_reads: int = 100) -> int:
    """read() once two reads pause_s apart agree. A collective's backend thread (gloo's workers,
    NCCL's watchdog) drops its reference to the collective's tensors a moment after the caller's
    wait returns, so a block's last all-gather can still look alive right after the block: on a
    2x2 gloo mesh, one read in ~15 counted a 257,536-byte gathered weight that a read 50 ms later
    did not."""
    last = read()
    for _ in range(max_reads):
        time.sleep(pause_s)  # yields the CPU (and the GIL) to that thread
        now = read()
        if now == last:
            return now
        last = now
    return last


def _storages(*trees) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in plain_tensors(trees)}


def _measure(run: RunConfig, params: Tree, batch: tuple, mem: MemoryConfig) -> list[dict[str, int]]:
    """Per block: kept and offloaded bytes of its forward under mem."""
    inputs_BL, _, *positions = batch
    # on the params' device: a pool without one has no side stream, and its CUDA copies fail
    pool = HostPool(pool_bytes(run), tree_leaves(params)[0].device, run.memory.max_inflight_bytes)
    # as memory.train_runner: on a mesh with resharding, gathered weights are gathered again in backward
    measured = _Measured(Runner(mem, run.model.n_layers, pool, reshard=regathers(run)))
    # the params as value_and_grad gives them to the training loss: requiring grad, so each matmul
    # saves its input for the weight's gradient (without, a block's saved bytes were a third short)
    params = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), params)
    hidden_states(params, inputs_BL, run.model, measured, positions_BL=positions[0] if positions else None,
                  source=params_source(params))
    return measured.rows


class _Measured:
    """A BlockRunner that runs each block through `runner` on its own: the block input cut from the
    previous block's graph, and the block's output detached, so its graph and what it saved die
    after it is measured. rows[i]: block i's kept and offloaded bytes."""

    def __init__(self, runner: Runner):
        self.runner, self.rows = runner, []
        self.offloads, self.begin, self.region = runner.offloads, runner.begin, runner.region
        self.chunk_recompute, self.block_chunks = runner.chunk_recompute, runner.block_chunks

    def __call__(self, i: int, fn: Callable, p: dict, x_BLD: torch.Tensor, *rest):
        x_BLD = x_BLD.detach().requires_grad_().clone()  # not a leaf: offload may move it
        pool = self.runner.pool
        used, cuda = pool.used, x_BLD.is_cuda
        before = torch.cuda.memory_allocated() if cuda else 0
        # the block's inputs and the host pool exist already: only storages it allocates count
        mode = NewStorages(_storages((p, x_BLD, rest), pool.buffers))
        with mode:
            y_BLD, _ = self.runner(i, fn, p, x_BLD, *rest)
        out = y_BLD.untyped_storage().nbytes()
        kept = settled(lambda: torch.cuda.memory_allocated() - before if cuda else mode.live_bytes()) - out
        self.rows.append({"kept": max(kept, 0), "offloaded": pool.used - used})
        return y_BLD.detach(), None


def measure(run: RunConfig, params: Tree, batch: tuple) -> list[dict[str, int]]:
    """Per block: saved / kept / offloaded / recomputed bytes (see the module docstring). Off CUDA
    compiled regions are measured eager (see eager_note): dynamo cannot trace under the dispatch
    mode that counts storages there."""
    return measure_policies(run, params, batch, {"run": run.memory})["run"]


def measure_policies(run: RunConfig, params: Tree, batch: tuple,
                     policies: dict[str, MemoryConfig]) -> dict[str, list[dict[str, int]]]:
    """`measure` of each policy (name -> MemoryConfig) against one baseline measured once."""
    if run.model.compile and not torch.cuda.is_available():
        run = dataclasses.replace(run, model=dataclasses.replace(run.model, compile=False))
    _measure(run, params, batch, MemoryConfig())  # warm-up: one-time caches of a first forward are not a block's
    base = _measure(run, params, batch, MemoryConfig())
    out = {}
    for name, memory in policies.items():
        mine = _measure(dataclasses.replace(run, memory=memory), params, batch, memory)
        out[name] = [{"saved": b["kept"], "kept": m["kept"], "offloaded": m["offloaded"],
                      "recomputed": max(b["kept"] - m["kept"] - m["offloaded"], 0)} for b, m in zip(base, mine)]
    return out


def eager_note(run: RunConfig) -> str:
    """What the report says when it measured compiled regions eager: its dispatch mode makes dynamo
    run them eagerly, on CUDA as elsewhere."""
    if run.model.compile:
        return ("; regions measured eager (compiled ones save what inductor's partitioner picks, "
                "which can differ)")
    return ""


def table(rows: list[dict[str, int]], mem: MemoryConfig, note: str = "") -> str:
    policy = f"recompute={mem.recompute} offload={mem.offload} " + \
        " ".join(f"{r}={getattr(mem, r)}" for r in REGIONS)
    lines = [f"memory report ({policy}), MB per block of one micro-batch, measured{note}:",
             f"{'block':>6} " + " ".join(f"{c:>11}" for c in COLUMNS)]
    for i, row in enumerate(rows):
        lines.append(f"{i:>6} " + " ".join(f"{row[c] / 2**20:>11.2f}" for c in COLUMNS))
    total = {c: sum(r[c] for r in rows) for c in COLUMNS}
    lines.append(f"{'total':>6} " + " ".join(f"{total[c] / 2**20:>11.2f}" for c in COLUMNS))
    return "\n".join(lines)
