"""Planner branches no preset reaches (issue 55, round 4), each against a measurement on a simulated
2x2 mesh (fsdp 2 x ep 2) or a hand computation from the formulas' docstrings:

- a tied embedding (model.tie_embeddings) with bf16 reduce-scatters (mesh.reduce_dtype) and the
  donated update: the embedding gathered twice (the embedding's lookup and the head) and its two
  gradients reduce-scattered in bf16, the fsdp bytes of a measured step; the gradients a rank holds
  after backward as they arrived (bf16, but the tied leaf's two summed in float32) against
  state_bytes' grads, and float32 for every leaf under the pure update;
- the whole-block chunk branch of the full-recompute activations (memory.block_chunks = 2): what each
  block keeps and what its recompute holds at once, and the step's transient, written out by hand.

Legend: B batch, L sequence, T tokens a rank, D model, F dense hidden, H heads, G kv heads, A head dim,
N = H·A, M = G·A, E experts, K top-k, X expert hidden, V vocab, S bytes of the compute dtype.
"""
import collections
import dataclasses

import torch
from torch.distributed.tensor import DTensor

from fnmoe import _torch, optim
from fnmoe.config import (DataConfig, MemoryConfig, MeshConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig,
                          TrainConfig)
from fnmoe.memory.policies import train_runner
from fnmoe.parallel.sharding import init_params
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import gather as fgather
from fnmoe.parallel import sharding
from fnmoe.parallel.fsdp import GATHER
from fnmoe.plan.activations import activation_plan
from fnmoe.plan.comm import comm_bytes
from fnmoe.plan.meters import CommMeter
from fnmoe.plan.state import state_bytes
from fnmoe.training.step import init_state, loss_fn, make_train_step
from fnmoe.tree import flatten_dict, leaf_kind, value_and_grad
from conftest import pin_routing

# ------------------------------------------------------------------ tied embedding, bf16 reduce, donated

TIED = ModelConfig(vocab_size=96, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=8,
                   moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1), compute_dtype="float32",
                   compile=False, tie_embeddings=True)
WORLD, B, L = 4, 8, 8
TOKENS_BL = torch.randint(0, TIED.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(3))


def _tied_run(donate: bool = True) -> RunConfig:
    return RunConfig(model=TIED, mesh=MeshConfig(fsdp=2, ep=2, reduce_dtype="bfloat16"), data=DataConfig(seq_len=L),
                     train=TrainConfig(batch_size=B, donate=donate), optim=OptimConfig(name="adamw", warmup_steps=0))


def test_a_tied_embedding_with_bf16_reduce_scatters_sends_the_planned_bytes(monkeypatch):
    """One donated step: the fsdp bytes sent (all-gathers and reduce-scatters, the tied embedding's
    gathered twice and its gradient reduce-scattered twice, bf16) and the ep bytes equal comm_bytes';
    every reduce-scatter sends bf16, one a sharded leaf and one more for the tied embedding (a plan
    that counted it once would be short by its gather and its reduce-scatter)."""
    pin_routing(monkeypatch)  # balanced, every rank alike: the all-to-alls' bytes are countable and planned
    run = _tied_run()
    rows = B // WORLD
    with fdist.simulate(WORLD):
        mesh = sharding.make_mesh(run.mesh)
        tx = optim.from_config(run.optim, 1)
        state = init_state(init_params(TIED, 0, mesh=mesh), tx)
        x_BL = fdist.rank_map(lambda r: TOKENS_BL[r * rows:(r + 1) * rows].clone())
        with CommMeter(sharding.group_axes(mesh)) as meter:
            make_train_step(run, tx, train_runner(run), donate=True)(state, [(x_BL[:, :-1], x_BL[:, 1:])])
        sharded = sum(isinstance(t, DTensor) and not t.placements[0].is_replicate()
                      for t in flatten_dict(state.params).values())
    sent, calls = collections.Counter(), collections.Counter()
    for r in meter.rows():
        sent[r["kind"]] += r["bytes"]
        calls[(r["kind"], r["dtype"])] += r["calls"]
    planned = comm_bytes(run)
    assert sent["all_gather"] + sent["reduce_scatter"] == planned["fsdp"], (dict(sent), planned)
    assert sent["all_to_all"] == planned["ep"]
    assert calls[("reduce_scatter", "bfloat16")] == sharded + 1 and calls[("reduce_scatter", "float32")] == 0
    # the tie moves the head's traffic onto the embedding (its [V, D] leaf gathered and reduced twice)
    untied = comm_bytes(dataclasses.replace(run, model=dataclasses.replace(TIED, tie_embeddings=False)))
    assert planned["fsdp"] == untied["fsdp"]


def test_a_tied_embeddings_gradients_as_they_arrive_are_the_planned_grads():
    """Backward of one micro-batch with bf16 reduce-scatters: each sharded gradient arrives bf16 (kept
    so until the donated update casts a leaf's copy) but the tied embedding's, whose two arrivals
    autograd sums in float32. A rank's bytes of them, as they arrived, equal state_bytes' grads for the
    donated update: (elements - the embedding's shard) x 2 + the embedding's shard x 4; the pure
    update casts every gradient: 4 bytes an element."""
    run = _tied_run()
    rows = B // WORLD
    with fdist.simulate(WORLD), fgather.reducing(torch.bfloat16):
        mesh = sharding.make_mesh(run.mesh)
        x_BL = fdist.rank_map(lambda r: TOKENS_BL[r * rows:(r + 1) * rows].clone())
        _, grads = value_and_grad(loss_fn, has_aux=True)(init_params(TIED, 0, mesh=mesh), x_BL[:, :-1], x_BL[:, 1:],
                                                         TIED, TOKENS_BL[:, 1:].numel(), source=GATHER)
        held, dtypes, elements = 0, {}, 0
        for path, g in flatten_dict(grads).items():
            if leaf_kind(path) == "buffer":
                continue
            arrived = _torch.as_arrived(g.to_local())
            n = arrived._local_tensors[0].numel()  # rank 0's shard (every dim here divides the mesh)
            held += n * arrived.element_size()
            elements += n
            dtypes[path] = arrived.dtype
    assert "head.w_DV" not in dtypes and dtypes.pop("embed.w_VD") == torch.float32
    assert set(dtypes.values()) == {torch.bfloat16}
    embed = TIED.vocab_size * TIED.dim // WORLD
    assert held == (elements - embed) * 2 + embed * 4
    assert state_bytes(run)["grads"] == held
    assert state_bytes(_tied_run(donate=False))["grads"] == elements * 4


# ------------------------------------------------------------------ block chunks' recompute transient

V, D, LAYERS, H, G, F, E, K, X = 128, 64, 3, 4, 2, 512, 4, 2, 32
A, N, M = D // H, D, G * D // H
BATCH, SEQ, S, CHUNKS = 8, 32, 2, 2  # 2 sequences a rank: T = 64 tokens, bfloat16, 2 block chunks
T = BATCH * SEQ // WORLD
CHUNK_CFG = ModelConfig(vocab_size=V, dim=D, n_layers=LAYERS, n_heads=H, n_kv_heads=G, ffn_hidden=F, max_seq_len=SEQ,
                        moe=MoEConfig(n_experts=E, top_k=K, expert_hidden=X, first_k_dense=1),
                        compute_dtype="bfloat16")


def _norm(t: int, n: int) -> int:
    """RMSNorm over n features of t tokens: fp32 input, rsqrt, normalised and weighted outputs."""
    return t * n * (4 + 2 * S) + 4 * t


def _attention(t: int) -> int:
    """bfloat16: q and k, v at the kv heads, the output, fp32 log-sum-exp; its input norm."""
    return _norm(t, D) + t * S * (2 * N + 2 * M) + 4 * t * H


def _mlp(t: int) -> int:
    return _norm(t, D) + 4 * t * F * S


def _routing(t: int) -> int:
    """The MoE input norm and the router: the fp32 copy of the normed tokens, fp32 scores, top-k
    (values, indices, bf16 weights), the renormalised ones and their sum."""
    return _norm(t, D) + (t * D * 4 - t * D * S) + t * E * 4 + t * K * (8 + S) + t * K * 4 + 4 * t


def _moe(t: int) -> int:
    """Routing, then the t·K rows a rank's experts receive (balanced): their index bytes, the rows in
    and out, the SwiGLU's four."""
    r = t * K
    return _routing(t) + r * 16 + 2 * r * D * S + 4 * r * X * S


ATTN_PARAMS = D * N + 2 * D * M + N * D
DENSE_BLOCK = 2 * D + ATTN_PARAMS + 3 * D * F
MOE_BLOCK = 2 * D + ATTN_PARAMS + D * E + 3 * E * D * X // 2  # a rank's E/ep experts
LARGEST = D * F  # the largest layer leaf a rank gathers (w_gate of the dense MLP)


def test_the_block_chunk_recompute_transient_by_hand():
    """Full recompute in 2 whole-block chunks on 2x2, the exchange kept: a block keeps its input, and a
    MoE block its exchange's two outputs, its top-k and the count exchange's E int64 counts of each
    chunk. Its recompute holds one chunk's regions (T/2 tokens), the input gradients of the chunk done
    before it, and for a MoE block under expert parallelism the next chunk's attention and routing
    (recomputed up to its dispatch while the split backward differentiates the experts), the kept
    exchange again, and every weight gradient of the block summed over the chunks beside one
    chunk's new one (the largest layer leaf). The step's transient: block i's beside block i+1's fp32
    gradients on their way out, and the embedding's backward (the largest leaf, bf16 and fp32) beside
    block 0's."""
    run = RunConfig(model=CHUNK_CFG, mesh=MeshConfig(fsdp=2, ep=2), train=TrainConfig(batch_size=BATCH),
                    data=DataConfig(seq_len=SEQ), memory=MemoryConfig(recompute="full", block_chunks=CHUNKS))
    acts = activation_plan(run)
    c = T // CHUNKS
    exchange = 2 * T * K * D * S
    kept = [T * D * S] + [T * D * S + exchange + T * 12 * K + E * 8 * CHUNKS] * 2
    earlier = (CHUNKS - 1) * c * D * S  # the input gradients of the chunks differentiated before
    transient = [_attention(c) + _mlp(c) + earlier + (DENSE_BLOCK + LARGEST) * S] + [
        _attention(c) + _moe(c) + (_attention(c) + _routing(c)) + earlier + exchange + (MOE_BLOCK + LARGEST) * S] * 2
    for i, block in enumerate(acts["blocks"]):
        assert (block["device"], block["transient"], block["host"]) == (kept[i], transient[i], 0), (i, block)
    sends = [DENSE_BLOCK * 4, MOE_BLOCK * 4, MOE_BLOCK * 4, 0]
    want = max(max(transient[i] + sends[i + 1] for i in range(LAYERS)), LARGEST * (S + 4) + sends[0])
    assert acts["transient"] == want, (acts["transient"], want)
