"""The planner's newest terms against a hand computation for a small config (the formulas of
fnmoe/plan/activations.py's and step_time.py's docstrings, written out here with the config's numbers,
not by calling the planner's helpers):

- activations per block under full recompute on a 2x2 mesh (fsdp 2 x ep 2): what each block keeps
  and what its recompute holds at once, and the step's transient, where block i's recompute meets
  block i+1's reduce-scatter input (its fp32 gradients) and the embedding's backward meets block 0's;
- compute seconds by phase under each memory policy: forward a third of the FLOPs, backward two
  thirds plus the recompute, GEMMs at the matmul rate and attention's core (q·k, p·v) at the
  attention rate, in backward's recompute too.

Legend: B batch, L sequence, T tokens a rank, D model, F dense hidden, H heads, G kv heads, A head dim,
N = H·A, M = G·A, E experts, K top-k, X expert hidden, V vocab, s bytes of the compute dtype.
"""
import dataclasses

import pytest

from fnmoe.config import (DataConfig, MemoryConfig, MeshConfig, ModelConfig, MoEConfig, PlanConfig, RunConfig,
                          TrainConfig)
from fnmoe.plan import step_time as st
from fnmoe.plan.activations import activation_plan

V, D, LAYERS, H, G, F, E, K, X = 128, 64, 3, 4, 2, 512, 4, 2, 32
A, N, M = D // H, D, G * D // H
B, L, S = 4, 32, 2  # a batch of 4 on 4 ranks: T = 32 tokens a rank, bfloat16
T = B * L // 4
CFG = ModelConfig(vocab_size=V, dim=D, n_layers=LAYERS, n_heads=H, n_kv_heads=G, ffn_hidden=F, max_seq_len=L,
                  moe=MoEConfig(n_experts=E, top_k=K, expert_hidden=X, first_k_dense=1), compute_dtype="bfloat16")
MESH = MeshConfig(fsdp=2, ep=2)


def _run(mem: MemoryConfig, cfg: ModelConfig = CFG, plan: PlanConfig = PlanConfig()) -> RunConfig:
    return RunConfig(model=cfg, mesh=MESH, train=TrainConfig(batch_size=B), data=DataConfig(seq_len=L), memory=mem,
                     plan=plan)


def _norm(n: int) -> int:
    """RMSNorm over n features of T tokens: fp32 input, rsqrt, normalised and weighted outputs."""
    return T * n * (4 + 2 * S) + 4 * T


# saved bytes of each region with no policy (bfloat16: q and k, v at the kv heads, the output, fp32 lse)
ATTENTION = _norm(D) + T * S * (2 * N + 2 * M) + 4 * T * H
MLP = _norm(D) + 4 * T * F * S
R = T * K  # rows a rank's experts receive, balanced
ROUTER = (T * D * 4 - T * D * S) + T * E * 4 + T * K * (8 + S) + T * K * 4 + 4 * T  # fp32 copy, scores, top-k, renorm
MOE = _norm(D) + ROUTER + R * 16 + 2 * R * D * S + 4 * R * X * S
EXCHANGE = 2 * T * K * D * S  # the rows received and the rows back
TOPK = T * 12 * K
COUNTS = E * 8  # the count exchange's output, E int64 counts (ep > 1), kept by a recompute like the top-k
# elements of each block a rank gathers (expert stacks: E/ep), and the largest layer leaf (the dense w_gate)
ATTN_PARAMS = D * N + 2 * D * M + N * D
DENSE_BLOCK = 2 * D + ATTN_PARAMS + 3 * D * F
MOE_BLOCK = 2 * D + ATTN_PARAMS + D * E + 3 * E * D * X // 2
LARGEST = D * F


def test_full_recompute_activations_per_block_and_the_steps_transient():
    acts = activation_plan(_run(MemoryConfig(recompute="full")))
    kept = [T * D * S, T * D * S + EXCHANGE + TOPK + COUNTS, T * D * S + EXCHANGE + TOPK + COUNTS]
    # the recompute holds the block's regions, the kept exchange again, and one weight's gradient
    transient = [ATTENTION + MLP + LARGEST * S, ATTENTION + MOE + EXCHANGE + LARGEST * S,
                 ATTENTION + MOE + EXCHANGE + LARGEST * S]
    for i, block in enumerate(acts["blocks"]):
        assert (block["device"], block["transient"], block["host"]) == (kept[i], transient[i], 0), (i, block)
    # block i's recompute beside block i+1's fp32 gradients on their way out (the last: none); the
    # embedding's backward (the largest leaf's gradient, bfloat16 and its fp32 copy) beside block 0's
    sends = [DENSE_BLOCK * 4, MOE_BLOCK * 4, MOE_BLOCK * 4, 0]
    want = max(max(transient[i] + sends[i + 1] for i in range(LAYERS)), LARGEST * (S + 4) + sends[0])
    assert acts["transient"] == want, (acts["transient"], want)


def test_region_recompute_activations_per_block():
    """attention full, moe selective, mlp offload: what each region keeps, per block (the last block
    keeps its offloaded region on the device)."""
    acts = activation_plan(_run(MemoryConfig(attention="full", moe="selective", mlp="offload")))
    x = T * D * S
    moe_kept = x + T * E * 4 + TOPK + R * (2 * X + D) * S + T * D * S  # input, logits, top-k, GEMMs, combine
    want = [{"device": x, "host": MLP, "transient": ATTENTION},
            {"device": x + moe_kept, "host": 0, "transient": max(ATTENTION, MOE - moe_kept)},
            {"device": x + moe_kept, "host": 0, "transient": max(ATTENTION, MOE - moe_kept)}]
    for i, block in enumerate(acts["blocks"]):
        assert {k: block[k] for k in want[i]} == want[i], (i, block, want[i])


MATMUL, ATTN = 100.0, 20.0  # TFLOP/s, unequal so a term at the wrong rate shows
# expert GEMMs bound by FLOPs; no host syncs: model FLOPs alone (the extra work: test_plan_nccl_costs.py)
FAST_HBM = PlanConfig(matmul_tflops=MATMUL, attention_tflops=ATTN, hbm_tbps=1e6, host_sync_us=0.0)


def _flops(cfg: ModelConfig) -> dict:
    """FLOPs a token by kind, forward: attention's GEMMs, its core (q·k and p·v, causal: L·H·2A a layer),
    the MoE regions' (router and K of E experts), the dense MLPs', and the rest (norms, head)."""
    moe_layers = LAYERS - cfg.moe.first_k_dense if cfg.moe.n_experts else 0
    return {"attention": 2.0 * LAYERS * ATTN_PARAMS, "core": 1.0 * LAYERS * L * H * 2 * A,
            "moe": 2.0 * moe_layers * (D * E + 3 * D * X * K), "mlp": 2.0 * (LAYERS - moe_layers) * 3 * D * F,
            "rest": 2.0 * (2 * LAYERS * D + D + D * V)}


# policy -> the regions whose forward backward repeats
RECOMPUTED = {"none": (MemoryConfig(), ()),
              "block-full": (MemoryConfig(recompute="full"), ("attention", "core", "moe", "mlp")),
              "attention-full": (MemoryConfig(attention="full"), ("attention", "core")),
              "moe-full": (MemoryConfig(moe="full"), ("moe",)),
              "selective": (MemoryConfig(attention="selective", moe="selective", mlp="selective"), ())}


@pytest.mark.parametrize("policy", list(RECOMPUTED))
@pytest.mark.parametrize("dense", [False, True], ids=["moe", "dense"])
def test_compute_seconds_by_phase(policy, dense):
    mem, recomputed = RECOMPUTED[policy]
    cfg = dataclasses.replace(CFG, moe=MoEConfig(n_experts=0)) if dense else CFG
    f = _flops(cfg)
    gemm = f["attention"] + f["moe"] + f["mlp"] + f["rest"]
    fpt = 3 * gemm + 3 * f["core"]  # the planner's flops_per_token: 6·N_active + 3·layers·L·H·(A + A)
    re_gemm = sum(f[k] for k in recomputed if k != "core") / (MATMUL * 1e12)
    re_core = (f["core"] if "core" in recomputed else 0.0) / (ATTN * 1e12)
    want = {"forward": T * (gemm / (MATMUL * 1e12) + f["core"] / (ATTN * 1e12)),
            "backward": T * (2 * gemm / (MATMUL * 1e12) + 2 * f["core"] / (ATTN * 1e12) + re_gemm + re_core)}
    comm = {k: 0.0 for k in ("fsdp_intra_node", "fsdp_inter_node", "ep_intra_node", "ep_inter_node")}
    got = st.step_time(_run(mem, cfg, FAST_HBM), fpt, dict(comm, parts={}), 0, exposed={})["as_built_s"]
    for phase in want:
        assert got[phase]["compute"] == pytest.approx(want[phase], rel=1e-9), (phase, got[phase], want[phase])
