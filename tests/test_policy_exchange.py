"""The expert-parallel exchange under each memory policy, on a simulated 2x2 mesh (fsdp 2 x ep 2), fp32,
routing pinned (conftest.pin_routing): what a recompute keeps of it and for how long.

- Kept exchange outputs (fnmoe.models.moe_chunks): under a recompute that keeps the exchange, the backward of
  a MoE layer of N token chunks holds the kept outputs of chunks 0..c while it recomputes chunk c, and
  none once the layer's backward is over. Measured by weak references to the kept tensors' storages on
  every simulated rank, against the bytes the routing implies (each rank sends T/N·K rows a chunk and
  gets as many back; over the ranks, rows received = rows sent).
- Each memory policy's exchange mode, one test a policy: the token chunks' recompute mode that the
  runner names (Runner.chunk_recompute), and the all-to-all passes of the MoE layers' forward and
  backward (CommMeter): 4 a layer (dispatch and combine, then their gradients) when the forward's
  exchange is kept, by autograd or a recompute, and 6 when the recompute sends the rows again.

Legend: B batch, L sequence, T tokens a rank, N token chunks, K top-k, D model.
"""
import dataclasses

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fnmoe.models import moe_chunks
from fnmoe.config import MemoryConfig, MeshConfig, ModelConfig, MoEConfig
from fnmoe.memory import policies
from fnmoe.memory.host_pool import HostPool
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.parallel.fsdp import GATHER
from fnmoe.parallel.sharding import init_params
from fnmoe.plan.meters import CommMeter
from fnmoe.training.step import loss_fn
from fnmoe.tree import tree_map

from conftest import pin_routing

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1), compute_dtype="float32",
                  compile=False)
B, L, WORLD = 8, 16, 4
T = B * L // WORLD
N_MOE = CFG.n_layers - CFG.moe.first_k_dense
TOKENS_BL = torch.randint(0, CFG.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def pinned_routing(monkeypatch):
    pin_routing(monkeypatch)


def _cfg(chunks: int) -> ModelConfig:
    return dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, token_chunks=chunks))


def _step(cfg: ModelConfig, mem: MemoryConfig):
    """One forward and backward on the simulated 2x2 mesh (resharding, as train_runner runs a mesh):
    (runner, all-to-all calls by kind in forward, the same in backward)."""
    with fdist.simulate(WORLD):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        params = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), init_params(cfg, 0, mesh=mesh))
        b = B // WORLD
        x_BL = fdist.rank_map(lambda r: TOKENS_BL[r * b:(r + 1) * b].clone())
        pool = HostPool(16 << 20) if policies.offloads(mem) else None
        runner = policies.block_runner(mem, cfg.n_layers, pool, reshard=True)
        with CommMeter(sharding.group_axes(mesh)) as forward:
            loss, _ = loss_fn(params, x_BL[:, :-1], x_BL[:, 1:], cfg, B * L, runner=runner, source=GATHER)
        with CommMeter(sharding.group_axes(mesh)) as backward:
            loss.backward()
    a2a = [{r["kind"]: r["calls"] for r in m.rows() if r["kind"].startswith("all_to_all")} for m in (forward, backward)]
    return runner, *a2a


def _kept_storages(kept: list) -> list[tuple[StorageWeakRef, int]]:
    """(weak reference, bytes) of the storage of every simulated rank's kept tensor."""
    return [(StorageWeakRef(local.untyped_storage()), local.untyped_storage().nbytes()) for pair in kept
            for t in pair for local in fdist.rank_values(t).values()]


@pytest.mark.parametrize("mem", [MemoryConfig(recompute="full"), MemoryConfig(moe="full"),
                                 MemoryConfig(recompute="full", offload=True, offload_min_bytes=0)],
                         ids=["block-full", "moe-full", "block-full-offload"])
def test_a_chunks_kept_exchange_outputs_go_once_its_backward_is_done(mem, monkeypatch):
    N = 4
    runs = []  # per _Chunks backward: the kept storages (of the recompute that reproduced them) and what was alive
    forward, chunk = moe_chunks._Run.forward, moe_chunks._Run.chunk

    def recording_forward(run, *args, **kwargs):
        outs, kept = forward(run, *args, **kwargs)
        if kept and not kwargs.get("experts", True):  # the recompute around _Chunks, in backward
            runs.append({"refs": _kept_storages(kept), "alive": []})
        return outs, kept

    def recording_chunk(run, c, *args, **kwargs):
        assert runs, f"chunk {c} recomputed with no kept exchange"
        refs = runs[-1]["refs"]
        runs[-1]["alive"].append((c, sum(n for r, n in refs if not r.expired())))
        return chunk(run, c, *args, **kwargs)

    monkeypatch.setattr(moe_chunks._Run, "forward", recording_forward)
    monkeypatch.setattr(moe_chunks._Run, "chunk", recording_chunk)
    _step(_cfg(N), mem)

    # a chunk's pair over the ranks: WORLD x T/N·K rows sent and as many received, D fp32 each
    pair = 2 * WORLD * (T // N) * CFG.moe.top_k * CFG.dim * 4
    assert len(runs) == N_MOE, runs
    for got in runs:
        # recomputing chunk c (the last first), the pairs of chunks 0..c are all that is left
        assert got["alive"] == [(c, (c + 1) * pair) for c in reversed(range(N))], got["alive"]
        assert all(r.expired() for r, _ in got["refs"]), "kept exchange outputs alive after the backward"


# policy -> (the token chunks' recompute mode the runner names, all-to-all passes of a MoE layer's backward a chunk)
EXCHANGE_MODE = {
    "none": (MemoryConfig(), None, 2),
    "block-full": (MemoryConfig(recompute="full"), "keep", 2),
    "block-full-replay": (MemoryConfig(recompute="full", keep_exchange=False), "replay", 4),
    "block-full-offload": (MemoryConfig(recompute="full", offload=True, offload_min_bytes=0), "keep", 2),
    "block-offload": (MemoryConfig(offload=True, offload_min_bytes=0), None, 2),
    "moe-full": (MemoryConfig(moe="full"), "keep", 2),
    "moe-selective": (MemoryConfig(moe="selective"), None, 2),
    "moe-offload": (MemoryConfig(moe="offload", offload_min_bytes=0), None, 2),
    "attention-full": (MemoryConfig(attention="full", mlp="full"), None, 2),
}


@pytest.mark.parametrize("policy", list(EXCHANGE_MODE))
def test_each_memory_policys_exchange_mode(policy):
    """Unchunked and in 2 token chunks: the forward sends each chunk's rows and gets them back (2 passes
    a chunk) after one count exchange a layer; backward sends the gradients back (2 passes a chunk) and,
    replaying, the rows and outputs first (2 more); never the counts."""
    mem, mode, backward_passes = EXCHANGE_MODE[policy]
    for chunks in (1, 2):
        runner, forward, backward = _step(_cfg(chunks), mem)
        assert forward == {"all_to_all": 2 * chunks * N_MOE, "all_to_all counts": N_MOE}, (policy, chunks, forward)
        assert backward == {"all_to_all": backward_passes * chunks * N_MOE}, (policy, chunks, backward)
        named = runner.chunk_recompute(1) if runner is not None else None
        assert named == mode, (policy, named)
