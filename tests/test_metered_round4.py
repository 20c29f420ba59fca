"""Resources metered (issue 55, round 4), on a simulated 2x2 mesh (fsdp 2 x ep 2), routing pinned to
an exactly balanced table (conftest.pin_routing):

- one train step's collectives by phase (forward, backward, update) and kind against
  fnmoe.plan.comm.comm_bytes' parts, the expert-parallel all-to-alls included (a simulation counts
  their splits when every rank routes alike), and the calls against a count from the model and the
  params' placements: a block's gathers one call a process group, an exchange two calls a MoE layer
  each way, one reduce-scatter a sharded leaf;
- the forward of a MoE block in two chunks in flight (fnmoe.models.block_chunks.interleaved): a
  chunk's rows, once sent, are let go before the other chunk computes (StorageMeter: the live bytes
  drop by exactly their storage at each dispatch's window) and none is alive at the block's peak;
- on a serial process group (gloo: fnmoe.parallel.gather.is_serial) every collective of a step,
  the interleaved chunks' exchanges included, is waited for before the next one on its group is
  issued; on an NCCL-like group the chunks' exchanges do overlap (the recording sees both).

Legend: B batch, L sequence, T tokens a rank, K top-k, D model.
"""
import collections
import dataclasses
import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from fnmoe import _torch, optim
from fnmoe.config import (DataConfig, MemoryConfig, MeshConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig,
                          TrainConfig)
from fnmoe.memory import policies
from fnmoe.memory.policies import train_runner
from fnmoe.models import block_chunks
from fnmoe.parallel.sharding import init_params
from fnmoe.parallel import dispatch
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import gather as fgather
from fnmoe.parallel import sharding
from fnmoe.parallel.fsdp import GATHER
from fnmoe.plan.comm import comm_bytes
from fnmoe.plan.meters import CommMeter, StorageMeter, plain_tensors
from fnmoe._torch import TorchDispatchMode
from fnmoe.training.step import init_state, loss_fn, make_train_step
from fnmoe.tree import tree_flatten, tree_map
from conftest import pin_routing

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1), compute_dtype="float32",
                  compile=False)
WORLD, L = 4, 8
N_MOE = CFG.n_layers - CFG.moe.first_k_dense


@pytest.fixture(autouse=True)
def pinned_routing(monkeypatch):
    """Every simulated rank routes alike (the all-to-alls' splits are one value for all) and exactly
    balanced (what the planner assumes)."""
    pin_routing(monkeypatch)


def _tokens(B: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(seed))


def _rank_rows(tokens_BL: torch.Tensor):
    rows = tokens_BL.shape[0] // WORLD
    return fdist.rank_map(lambda r: tokens_BL[r * rows:(r + 1) * rows].clone())


# ------------------------------------------------------------------ one step's bytes and calls by phase

class _PhaseComm(CommMeter):
    """CommMeter keyed by the phase the collective runs in: forward, backward (autograd's engine
    running) or update (the optimizer's, fnmoe.models.seams' mark); CommMeter itself says "step" for
    the first two."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented
        calls = dict(self.calls)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        phase = "backward" if _torch.in_backward() else "forward"
        for key in [k for k, n in self.calls.items() if k[3] == "step" and n != calls.get(k, 0)]:
            self.bytes[(*key[:3], phase)] += self.bytes.pop(key)
            self.calls[(*key[:3], phase)] += self.calls.pop(key)
        return out


def _step_rows(run: RunConfig) -> tuple[list[dict], int]:
    """(_PhaseComm's rows of one train step of run on the simulated mesh, the sharded leaves: those
    whose gradients are reduce-scattered)."""
    tokens = _tokens(run.train.batch_size)  # drawn outside the simulation: one batch, not one a rank
    with fdist.simulate(WORLD):
        mesh = sharding.make_mesh(run.mesh)
        tx = optim.from_config(run.optim, 1)
        state = init_state(init_params(run.model, 0, mesh=mesh), tx)
        x_BL = _rank_rows(tokens)
        step = make_train_step(run, tx, train_runner(run))
        with _PhaseComm(sharding.group_axes(mesh)) as meter:
            step(state, [(x_BL[:, :-1], x_BL[:, 1:])])
        sharded = sum(isinstance(t, DTensor) and not t.placements[0].is_replicate()
                      for t in tree_flatten(state.params)[0])
    return meter.rows(), sharded


def test_one_steps_collectives_by_phase_are_the_planned_bytes_and_the_counted_calls():
    """bf16 compute, QK-clip on, resharding (backward gathers each block again): the bytes of each
    (phase, kind) equal comm_bytes' parts summed over where and link (forward and backward gathers,
    backward reduce-scatters, the exchange's all-to-alls each way), bf16 but the fp32 reduce-scatters.
    QK-clip's max-logit pass gathers in the forward, before each block (hidden_states), where its
    parts count it (they once said "update", where the step gathers nothing). The calls are those
    counted by hand: forward, one gather a block a group (dense over dp, expert stacks over fsdp),
    one max-logit gather a block (its attention and norm, on dp) and the embedding's, final norm's
    and head's; backward the blocks' again and one reduce-scatter a sharded leaf; two exchanges a
    MoE layer each way and one count exchange a MoE layer in forward."""
    run = RunConfig(model=dataclasses.replace(CFG, compute_dtype="bfloat16"),
                    mesh=MeshConfig(fsdp=2, ep=2), data=DataConfig(seq_len=L), train=TrainConfig(batch_size=8),
                    optim=OptimConfig(name="adamw", qk_clip=True, warmup_steps=0))
    rows, sharded = _step_rows(run)
    got_bytes, got_calls = collections.Counter(), collections.Counter()
    for r in rows:
        if r["kind"] in ("all_gather", "reduce_scatter", "all_to_all"):
            got_bytes[(r["phase"], r["kind"])] += r["bytes"]
            got_calls[(r["phase"], r["kind"])] += r["calls"]
            want_dtype = "float32" if r["kind"] == "reduce_scatter" else "bfloat16"
            assert r["dtype"] == want_dtype, r
        else:
            got_calls[(r["phase"], r["kind"])] += r["calls"]
    planned = collections.Counter()
    for key, link in comm_bytes(run)["parts"].items():
        phase, kind, _ = key.split("/")
        planned[(phase, kind)] += link["intra"] + link["inter"]
    assert dict(got_bytes) == dict(planned), (dict(got_bytes), dict(planned))
    assert set(planned) == {("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter"),
                            ("forward", "all_to_all"), ("backward", "all_to_all")}
    gathers = CFG.n_layers + N_MOE  # a block's dense leaves over dp, a MoE block's stacks over fsdp too
    # and a max-logit gather a block (its attention and norm: one call on dp), before the block
    assert got_calls[("forward", "all_gather")] == gathers + 3 + CFG.n_layers
    assert got_calls[("backward", "all_gather")] == gathers
    assert got_calls[("backward", "reduce_scatter")] == sharded
    assert got_calls[("forward", "all_to_all")] == got_calls[("backward", "all_to_all")] == 2 * N_MOE
    assert got_calls[("forward", "all_to_all counts")] == N_MOE
    assert not any(kind == "all_gather" for phase, kind in got_calls if phase == "update")


# ------------------------------------------------------------------ sent rows let go in the window


class _SentRowsMeter(StorageMeter):
    """StorageMeter that also knows the storages of the rows each dispatch sent (noted by `sent`) and,
    at the block's peak, how many bytes of them were alive."""

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[StorageWeakRef, int]] = []
        self.block_peak = 0
        self.sent_at_peak = 0

    def sent_alive(self) -> int:
        return sum(n for ref, n in self.sent if not ref.expired())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.total > self.block_peak:
            self.block_peak, self.sent_at_peak = self.total, self.sent_alive()
        return out


def test_a_chunks_sent_rows_are_let_go_before_the_other_chunk_computes(monkeypatch):
    """2 MoE blocks under full recompute in 2 block chunks a rank, forward only: each chunk's dispatch
    yields (dispatch.in_flight) so that the other chunk computes while its rows travel. At that
    window the meter's live bytes are those just after the dispatch was issued less exactly the
    storage of the rows it sent (nothing else is made or freed between), no sent rows are alive,
    and at each block's forward peak none of the chunks' sent rows is."""
    cfg = dataclasses.replace(CFG, n_layers=2, moe=dataclasses.replace(CFG.moe, first_k_dense=0))
    meter = _SentRowsMeter()
    after_send, windows, interleaved = [], [], []
    send, in_flight, run_interleaved = dispatch.send, dispatch.in_flight, block_chunks.interleaved

    def noted_send(x_RD, *args):
        sent = send(x_RD, *args)
        meter.sent += [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()) for t in plain_tensors(x_RD)]
        after_send.append((meter.total, sum(t.untyped_storage().nbytes() for t in plain_tensors(x_RD))))
        return sent

    def noted_in_flight(t, group):
        if len(windows) < len(after_send):  # the dispatch's window (the combine's comes after the experts)
            windows.append((meter.total, meter.sent_alive()))
        yield from in_flight(t, group)

    monkeypatch.setattr(dispatch, "send", noted_send)
    monkeypatch.setattr(dispatch, "in_flight", noted_in_flight)
    monkeypatch.setattr(block_chunks, "interleaved", lambda steps, modes: interleaved.append(len(steps)) or
                        run_interleaved(steps, modes))
    peaks = []
    forward = block_chunks._Chunks.forward

    def measured_forward(ctx, *args):  # the block's own peak: reset where it starts
        meter.block_peak, meter.sent_at_peak = meter.total, 0
        out = forward(ctx, *args)
        peaks.append((meter.block_peak, meter.sent_at_peak))
        return out
    monkeypatch.setattr(block_chunks._Chunks, "forward", staticmethod(measured_forward))
    tokens = _tokens(16)
    with fdist.simulate(WORLD):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        params = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), init_params(cfg, 0, mesh=mesh))
        x_BL = _rank_rows(tokens)
        runner = policies.block_runner(MemoryConfig(recompute="full", block_chunks=2), cfg.n_layers, reshard=True)
        with meter:
            loss_fn(params, x_BL[:, :-1], x_BL[:, 1:], cfg, tokens[:, 1:].numel(), runner=runner, source=GATHER)
    assert interleaved == [2, 2] and len(after_send) == len(windows) == 4 and len(peaks) == 2
    # a chunk's rows: T/2 tokens x K rows of D floats on each of the 4 simulated ranks
    T, K, D = tokens[:, 1:].numel() // WORLD, cfg.moe.top_k, cfg.dim
    assert all(n == WORLD * T // 2 * K * D * 4 for _, n in after_send), after_send
    for (total, n), (live, alive) in zip(after_send, windows):
        assert (live, alive) == (total - n, 0), (total, n, live, alive)
    assert all(alive == 0 for _, alive in peaks), peaks


# ------------------------------------------------------------------ issue and wait on a serial group

_C = torch.ops._c10d_functional
_ISSUE = (_C.all_gather_into_tensor_coalesced.default, _C.all_gather_into_tensor.default,
          _C.reduce_scatter_tensor.default, _C.all_to_all_single.default, _C.all_reduce.default)


class _IssueWait(TorchDispatchMode):
    """Each collective's issue and first wait, by process group: `early` lists every issue made
    while an earlier collective of its group was not yet waited for, as (its op, the group, the ops
    in flight there)."""

    def __init__(self):
        super().__init__()
        self.pending: dict[int, tuple] = {}  # id(output) -> (its weakref, [op, group, waited])
        self.early: list[tuple] = []
        self.issued = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ISSUE:
            group = next(a for a in reversed(args) if isinstance(a, str))
            ahead = sorted({r[0] for _, r in self.pending.values() if r[1] == group and not r[2]})
            if ahead:
                self.early.append((func._opname, group, ahead))
            record = [func._opname, group, False]
            self.issued[(func._opname, group)] += 1
            for t in out if isinstance(out, (list, tuple)) else [out]:
                self.pending[id(t)] = (weakref.ref(t), record)
        elif func in (_C._wrap_tensor_autograd.default, _C.wait_tensor.default):
            entry = self.pending.get(id(args[0]))
            if entry is not None and entry[0]() is args[0]:
                if func is _C.wait_tensor.default:
                    entry[1][2] = True
                else:  # an autograd collective's output, waited for through this wrapper of it
                    self.pending[id(out)] = (weakref.ref(out), entry[1])
        return out


def _recorded_step(serial: bool, monkeypatch) -> tuple[_IssueWait, str]:
    """The forward and backward of one micro-batch on 2x2, 2 block chunks a rank (the forward's chunks
    two in flight, the backward's recompute of chunk c-1 beside chunk c's backward), resharding:
    recorded with gather.is_serial answering `serial` for every group; and the ep group's name."""
    monkeypatch.setattr(fgather, "is_serial", lambda group: serial)
    tokens = _tokens(8)
    with fdist.simulate(WORLD):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        params = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), init_params(CFG, 0, mesh=mesh))
        x_BL = _rank_rows(tokens)
        runner = policies.block_runner(MemoryConfig(recompute="full", block_chunks=2), CFG.n_layers, reshard=True)
        with _IssueWait() as rec:
            loss, _ = loss_fn(params, x_BL[:, :-1], x_BL[:, 1:], CFG, tokens[:, 1:].numel(), runner=runner,
                              source=GATHER)
            loss.backward()
        ep = sharding.submesh(mesh, "ep").get_group().group_name
    return rec, ep


def test_on_a_serial_group_each_collective_is_waited_for_before_the_next_is_issued(monkeypatch):
    """gloo takes one collective in flight a process group (two corrupted its heap): with every group
    serial, no gather, reduce-scatter, all-reduce or all-to-all of the step is issued while another
    of its group is in flight, the two block chunks' exchanges included (dispatch.in_flight waits
    before it yields there). The same step on NCCL-like groups does issue a chunk's exchange while
    the other chunk's travels on ep, and gathers ahead of their waits: the recording would see a
    serial group break the rule."""
    serial, ep = _recorded_step(True, monkeypatch)
    assert serial.issued[("all_to_all_single", ep)] >= 8 * N_MOE and len(serial.issued) >= 4
    assert serial.early == [], serial.early[:5]
    nccl, _ = _recorded_step(False, monkeypatch)
    assert nccl.issued == serial.issued
    assert any(group == ep and op == "all_to_all_single" for op, group, _ in nccl.early), nccl.early[:5]
    assert any(op == "all_gather_into_tensor_coalesced" for op, _, _ in nccl.early)
