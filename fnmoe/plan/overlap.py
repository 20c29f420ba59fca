"""Which of a step's collectives overlap compute, read from the code: one training step of a small
proxy of the run (the same memory policy, mesh kinds, token chunks, optimizer and QK-clip; two
layers, one dense, one MoE) on simulated ranks, its op order recorded by meters.OrderMeter.

The step-time model (step_time.py) charges a collective's time to the step only where fnmoe waits
for it at issue: what the code prefetches, or issues ahead of the compute that needs it, hides
behind that compute. Because the answer is recorded, not asserted, it changes when the code does.

Legend: B batch, L sequence.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import torch

from fnmoe.config import MemoryConfig, MeshConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig, TrainConfig

PROXY = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                    moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1))
B, L = 8, 8


def overlap_key(run: RunConfig) -> tuple:
    """What of a run decides the order of its collectives (not its sizes)."""
    m = run.memory
    moe = run.model.moe
    # offload moves saved tensors to host memory on a stream of its own: no collective changes order
    return (run.mesh.fsdp > 1, run.mesh.ep > 1, run.mesh.reshard_after_forward, m.recompute,
            *("none" if r == "offload" else r for r in (m.attention, m.moe, m.mlp)), m.keep_exchange,
            _proxy_chunks(moe.token_chunks), m.block_chunks > 1,
            run.optim.name, run.optim.qk_clip, run.model.tie_embeddings)


def _proxy_chunks(n: int) -> int:
    """The proxy's token chunks: the run's where they divide its 16 rows a rank, else 2 (any N > 1
    runs the same code)."""
    return n if n == 1 or 16 % n == 0 else 2


def exposed_fractions(run: RunConfig) -> dict[tuple[str, str], float]:
    """{(phase, kind): the fraction of a MoE layer's collectives of that kind fnmoe waits for at
    issue}: from proxies of 2 and 3 layers, the third adding one MoE layer, so the ends of the
    passes (embedding, head, the first and last block) cancel out. In whole-block chunks the proxy
    runs 2 and then 4 of them: a layer's collectives, and those hidden, grow by the same count with
    each chunk (one more chunk's exchanges; its recompute's hidden behind the backward of the chunk
    after it), so the two give the run's own chunks' counts. (An even count: with an odd one the
    forward's last chunk runs alone at the end, its combine waited for, 1 of the layer's 2N forward
    exchanges that this count calls hidden.)"""
    counts = _layer_counts(run, 2)
    n = run.memory.block_chunks
    if n > 1:
        more = _layer_counts(run, 4)
        counts = {k: tuple(a + (n - 2) * (b - a) / 2 for a, b in zip(counts.get(k, (0, 0)), more.get(k, (0, 0))))
                  for k in counts.keys() | more.keys()}
    return {k: min(max(1.0 - hidden / issued, 0.0), 1.0) for k, (issued, hidden) in counts.items() if issued > 0}


def _layer_counts(run: RunConfig, chunks: int) -> dict[tuple[str, str], tuple[int, int]]:
    """{(phase, kind): (issued, overlapped)} of one MoE layer of the proxy (chunks: its block chunks
    where the run has them)."""
    two, three = recorded_overlap(run, 2, chunks), recorded_overlap(run, 3, chunks)
    return {k: (issued - two.get(k, (0, 0))[0], overlapped - two.get(k, (0, 0))[1])
            for k, (issued, overlapped) in three.items()}


def recorded_overlap(run: RunConfig, n_layers: int = 3, chunks: int = 2) -> dict[tuple[str, str], tuple[int, int]]:
    """{(phase, kind): (issued, overlapped)} of one step of run's proxy with n_layers (the first
    dense) and, where the run chunks its blocks, that many block chunks (a rank's sequences), recorded
    by meters.OrderMeter; kept in the cache directory under the hash of fnmoe's source and torch's
    version, so it is recorded again when the code changes."""
    key = overlap_key(run)
    chunks = chunks if run.memory.block_chunks > 1 else 2  # unchunked: one recording serves every call
    tag = hashlib.sha256(repr((key, n_layers, chunks)).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{_source_hash()}-{tag}.json"
    try:
        return {tuple(k.split("/")): tuple(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        pass
    out = _record(key, n_layers, chunks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"/".join(k): v for k, v in out.items()}))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache costs the next plan a recording, nothing else
    return out


def _cache_dir() -> Path:
    """FNMOE_CACHE_DIR, else $XDG_CACHE_HOME/fnmoe (~/.cache/fnmoe), its overlap/ folder."""
    if os.environ.get("FNMOE_CACHE_DIR"):
        return Path(os.environ["FNMOE_CACHE_DIR"]) / "overlap"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fnmoe" / "overlap"


@lru_cache(maxsize=1)
def _source_hash() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=128)
def _record(key: tuple, n_layers: int, chunks: int = 2) -> dict[tuple[str, str], tuple[int, int]]:
    from fnmoe import _torch, optim
    from fnmoe.caches import clear_caches
    from fnmoe.parallel import dist as fdist
    from fnmoe.parallel import sharding
    from fnmoe.plan.meters import OrderMeter
    from fnmoe.memory.policies import train_runner
    from fnmoe.training.step import init_state, make_train_step

    run = _proxy(key, n_layers, chunks)
    n, B = run.mesh.world, run.train.batch_size
    # meshes, DTensor's sharding plans and fnmoe's per-mesh caches are keyed by values an earlier
    # simulation of another world size shares
    clear_caches()
    _torch.clear_dtensor_caches()
    tokens_BL = torch.randint(0, PROXY.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(0))
    # simulated ranks with real values: fake tensors' collectives complete differently (a gradient's
    # reduce-scatter is met by its wait at once), which would misreport the overlap
    with fdist.simulate(n):
        mesh = sharding.make_mesh(run.mesh, run.dist)
        tx = optim.from_config(run.optim, 1)
        state = init_state(sharding.init_params(run.model, 0, mesh=mesh), tx)
        part = fdist.rank_map(lambda r: tokens_BL[r * (B // n):(r + 1) * (B // n)].clone())
        step = make_train_step(run, tx, train_runner(run))  # nothing offloaded: no pool
        with OrderMeter() as order:
            step(state, [(part[:, :-1], part[:, 1:])])
    return order.finish()


def _proxy(key: tuple, n_layers: int, block_chunks: int = 2) -> RunConfig:
    fsdp, ep, reshard, recompute, attention, moe, mlp, keep, chunks, blocks, opt, qk_clip, tied = key
    model = dataclasses.replace(PROXY, n_layers=n_layers, tie_embeddings=tied,
                                moe=dataclasses.replace(PROXY.moe, token_chunks=chunks))
    # block chunks: 2 (or 4) of the 4 ranks' sequences each (8 or 16 in all)
    memory = MemoryConfig(recompute=recompute, attention=attention, moe=moe, mlp=mlp, keep_exchange=keep,
                          block_chunks=block_chunks if blocks else 1)
    return RunConfig(model=model, memory=memory,
                     mesh=MeshConfig(fsdp=2 if fsdp else 1, ep=2 if ep else 1, reshard_after_forward=reshard),
                     optim=OptimConfig(name=opt, qk_clip=qk_clip, warmup_steps=0),
                     train=TrainConfig(batch_size=4 * block_chunks if blocks else B, steps=1))
