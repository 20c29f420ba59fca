"""Model numerics against independent references written here (naive einsum / per-token loops)."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fnmoe.models.attention import gqa, rope_tables
from fnmoe.config import ModelConfig, MoEConfig
from fnmoe.models.transformer import forward
from fnmoe.models.params import LeafInit, draw_leaf, init_params, leaf_inits
from fnmoe.kernels import gemm as cpu_gemm
from fnmoe.models.moe import PAD_ROWS, expert_gemm, expert_mlp, grouped_ok, moe_block, padded_slots
from fnmoe.tree import flatten_dict, map_with_path
from conftest import rel

SMALL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                    moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1, first_k_dense=1))



# ---------------------------------------------------------------- attention

def naive_attention(p, x, cfg, positions):
    """Per-head causal attention with explicit repeat of kv heads and explicit RoPE pairs."""
    B, L, _ = x.shape
    H, G, A = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim_
    q = torch.einsum("bld,dn->bln", x, p["w_q_DN"]).view(B, L, H, A)
    k = torch.einsum("bld,dm->blm", x, p["w_k_DM"]).view(B, L, G, A)
    v = torch.einsum("bld,dm->blm", x, p["w_v_DM"]).view(B, L, G, A)
    if cfg.qk_norm:
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + cfg.norm_eps) * p["q_norm_A"]
        k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + cfg.norm_eps) * p["k_norm_A"]
    half = A // 2
    freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / A)
    ang = positions[:, None].double() * freq[None]
    c, s = ang.cos().float(), ang.sin().float()

    def rot(t):  # rotate pairs (i, i + A/2)
        a, b = t[..., :half], t[..., half:]
        c_, s_ = c[:, None, :], s[:, None, :]
        return torch.cat([a * c_ - b * s_, b * c_ + a * s_], -1)

    q, k = rot(q), rot(k)
    k = k.repeat_interleave(H // G, dim=2)
    v = v.repeat_interleave(H // G, dim=2)
    scores = torch.einsum("bqha,bkha->bhqk", q, k) / math.sqrt(A)
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    o = torch.einsum("bhqk,bkha->bqha", scores.softmax(-1), v).reshape(B, L, H * A)
    return o @ p["w_o_ND"]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("kv", [4, 2, 1])
def test_attention_matches_naive(qk_norm, kv):
    cfg = dataclasses.replace(SMALL, qk_norm=qk_norm, n_kv_heads=kv)
    p = init_params(cfg, seed=1)["layers"]["0"]["attn"]
    if qk_norm:  # non-trivial norm weights
        p["q_norm_A"] = torch.rand(cfg.head_dim_) + 0.5
        p["k_norm_A"] = torch.rand(cfg.head_dim_) + 0.5
    x = torch.randn(2, 10, cfg.dim)
    pos = torch.arange(10)
    cos, sin = rope_tables(pos, cfg.head_dim_, cfg.rope_theta)
    assert rel(gqa(p, x, cos, sin, cfg), naive_attention(p, x, cfg, pos)) <= 1e-5


# ---------------------------------------------------------------- MoE

def naive_moe(p, x_TD, cfg):
    m = cfg.moe
    out = torch.zeros_like(x_TD)
    counts = torch.zeros(m.n_experts, dtype=torch.int64)
    for t in range(x_TD.shape[0]):
        probs = torch.softmax(x_TD[t] @ p["w_router_DE"], -1)
        w, idx = probs.topk(m.top_k)
        if m.norm_topk_prob:
            w = w / w.sum()
        for wk, e in zip(w * m.routed_scaling_factor, idx.tolist()):
            h = F.silu(x_TD[t] @ p["w_gate_EDF"][e]) * (x_TD[t] @ p["w_up_EDF"][e])
            out[t] += wk * (h @ p["w_down_EFD"][e])
            counts[e] += 1
        if "shared" in p:
            s = p["shared"]
            out[t] += (F.silu(x_TD[t] @ s["w_gate_DF"]) * (x_TD[t] @ s["w_up_DF"])) @ s["w_down_FD"]
    return out, counts


@pytest.mark.parametrize("norm_topk,scale,shared", [(True, 1.0, 1), (False, 2.5, 0)])
def test_moe_matches_per_token_loop(norm_topk, scale, shared):
    cfg = dataclasses.replace(SMALL, moe=dataclasses.replace(
        SMALL.moe, norm_topk_prob=norm_topk, routed_scaling_factor=scale, n_shared_experts=shared))
    p = init_params(cfg, seed=2)["layers"]["1"]["moe"]
    p["w_router_DE"] = p["w_router_DE"] * 50  # decisive routing
    x = torch.randn(3, 7, cfg.dim)
    out, stats = moe_block(p, x, cfg, gemm="loop")
    counts = stats["counts_E"]
    ref, ref_counts = naive_moe(p, x.reshape(-1, cfg.dim), cfg)
    assert rel(out.reshape(-1, cfg.dim), ref) <= 1e-5
    assert torch.equal(counts, ref_counts)


def test_moe_extreme_routing_all_to_one_expert_and_empty_experts():
    cfg = SMALL
    p = init_params(cfg, seed=3)["layers"]["1"]["moe"]
    p["w_router_DE"] = torch.zeros_like(p["w_router_DE"])
    p["w_router_DE"][:, 2] = 100.0  # every token prefers expert 2
    x = torch.rand(2, 5, cfg.dim) + 0.1
    out, stats = moe_block(p, x, cfg, gemm="loop")
    counts = stats["counts_E"]
    ref, _ = naive_moe(p, x.reshape(-1, cfg.dim), cfg)
    assert counts[2] == 10 and (counts == 0).sum() >= 1
    assert rel(out.reshape(-1, cfg.dim), ref) <= 1e-5


@pytest.mark.parametrize("gemm", ["grouped", "padded"])
def test_batched_expert_gemms_match_loop_in_bf16(gemm):
    """bf16 tolerance: both paths round operands to bf16 but accumulate in different orders;
    2e-2 relative to the output's max is the bf16 noise floor for K=2 sums of D=64 products."""
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=64,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32, first_k_dense=0),
                      compute_dtype="bfloat16")
    p = {k: v.bfloat16() for k, v in init_params(cfg, seed=4)["layers"]["0"]["moe"].items()}
    x = torch.randn(2, 16, cfg.dim).bfloat16()
    assert grouped_ok(x, cfg.dim, cfg.moe.expert_hidden)
    out_g, s_g = moe_block(p, x, cfg, gemm=gemm)
    out_l, s_l = moe_block(p, x, cfg, gemm="loop")
    assert torch.equal(s_g["counts_E"], s_l["counts_E"])
    assert rel(out_g.float(), out_l.float()) <= 2e-2


@pytest.mark.parametrize("gemm", ["padded", "grouped"])
def test_batched_expert_mlp_matches_loop_in_fp32(gemm):
    """The padded path and the CPU grouped op against the per-expert loop, outputs and every
    gradient, with an expert that gets no rows and one that gets more than a slab's rounding; two
    threads, so the grouped op's row shares cut expert 2 and its weight gradient sums two parts."""
    g = torch.Generator().manual_seed(3)
    E, D, F_ = 5, 24, 40
    counts = torch.tensor([7, 0, 19, 1, 13])
    R = int(counts.sum())
    leaves = [torch.randn(R, D, generator=g), torch.randn(E, D, F_, generator=g), torch.randn(E, D, F_, generator=g),
              torch.randn(E, F_, D, generator=g)]
    gy = torch.randn(R, D, generator=g)

    def run(gemm):
        ls = [t.clone().requires_grad_(True) for t in leaves]
        y = expert_mlp(*ls, counts, gemm=gemm)
        return [y, *torch.autograd.grad(y, ls, gy)]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for a, b in zip(run(gemm), run("loop")):
            assert rel(a, b) <= 1e-6
    finally:
        torch.set_num_threads(threads)


def test_cpu_grouped_op_checks_its_rows():
    x, w = torch.randn(10, 8), torch.randn(3, 8, 4)
    with pytest.raises(RuntimeError, match="add up to the 10 rows"):
        cpu_gemm.grouped_mm(x, w, torch.tensor([2, 5, 9]))
    with pytest.raises(RuntimeError, match="one int64 row end per expert"):
        cpu_gemm.grouped_mm(x, w, torch.tensor([2, 10]))


def test_padded_slots_are_distinct_and_per_expert():
    counts = torch.tensor([3, 0, 17, 16])
    R = int(counts.sum())
    slot_R, src_P, C = padded_slots(counts, R)
    assert C == 32  # the largest count rounded up to PAD_ROWS
    expected = [e * C + j for e, n in enumerate(counts.tolist()) for j in range(n)]
    assert slot_R.tolist() == expected
    assert src_P.shape == (4 * C,) and torch.equal(src_P[slot_R], torch.arange(R))  # inverse on the filled slots
    assert int((src_P == R).sum()) == 4 * C - R  # every other slot is empty
    assert padded_slots(torch.zeros(3, dtype=torch.int64), 0)[2] == PAD_ROWS


def test_expert_gemm_choice(monkeypatch, caplog):
    cfg = ModelConfig(dim=64, moe=MoEConfig(expert_hidden=32))
    odd = dataclasses.replace(cfg, dim=60)
    grouped = dataclasses.replace(odd, moe=dataclasses.replace(odd.moe, impl="grouped"))
    for dtype, dims in ((torch.bfloat16, cfg), (torch.float32, cfg), (torch.bfloat16, odd)):
        assert expert_gemm(dims, dtype, "cpu") == "grouped"  # fnmoe.kernels.gemm: any dtype, any dims
    assert expert_gemm(cfg, torch.bfloat16, "cuda") == "grouped"
    assert expert_gemm(cfg, torch.float32, "cuda") == "loop"
    assert expert_gemm(dataclasses.replace(cfg, moe=MoEConfig(impl="padded")), torch.float32) == "padded"
    monkeypatch.setattr(cpu_gemm, "build_error", lambda: "RuntimeError: no C++ compiler")
    monkeypatch.setattr(cpu_gemm, "_loaded", False)
    assert expert_gemm(cfg, torch.bfloat16, "cpu") == "padded"
    assert "did not build (RuntimeError: no C++ compiler)" in caplog.text
    assert expert_gemm(odd, torch.bfloat16, "cpu") == "loop"
    with pytest.raises(ValueError, match="impl='grouped' needs, on CPU, fnmoe's grouped GEMM extension"):
        expert_gemm(grouped, torch.bfloat16)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler.*impl='padded'"):
        cpu_gemm.grouped_mm(torch.randn(2, 8), torch.randn(1, 8, 4), torch.tensor([2]))


# ---------------------------------------------------------------- whole model

def test_forward_shapes_aux_and_bf16_close():
    """bf16 compute tracks fp32: measured on this CPU 4.8e-3..6.8e-3 relative over 8 token seeds
    (6.2e-3 for seed 0), bound 1.5e-2; logits of other params differ by ~1.5."""
    params = init_params(SMALL, seed=0)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, aux = forward(params, tokens, SMALL)
    assert logits.shape == (2, 12, SMALL.vocab_size) and logits.dtype == torch.float32
    counts = aux["expert_counts_NE"]
    assert counts.shape == (1, 4) and counts.sum() == 2 * 12 * 2
    logits16, _ = forward(params, tokens, dataclasses.replace(SMALL, compute_dtype="bfloat16"))
    assert rel(logits16, logits) < 1.5e-2


def test_forward_is_causal():
    """Later tokens do not reach earlier logits. Not bitwise: changing them changes how many rows
    each expert's GEMM takes, and a GEMM's blocking (so its fp32 rounding) depends on that."""
    params = init_params(SMALL, seed=0)
    for seed in range(4):
        a = torch.randint(0, SMALL.vocab_size, (1, 12), generator=torch.Generator().manual_seed(seed))
        b = a.clone()
        b[0, 8:] = (b[0, 8:] + 1) % SMALL.vocab_size
        la, _ = forward(params, a, SMALL)
        lb, _ = forward(params, b, SMALL)
        assert (la[0, :8] - lb[0, :8]).abs().max() < 1e-5
        assert (la[0, 8:] - lb[0, 8:]).abs().max() > 1e-3


def test_bad_token_ids_are_named():
    params = init_params(SMALL, seed=0)
    with pytest.raises(ValueError, match=r"token id 64 at position \[0, 3\]"):
        forward(params, torch.tensor([[1, 2, 3, 64]]), SMALL)
    with pytest.raises(ValueError, match="token id -1"):
        forward(params, torch.tensor([[-1, 2]]), SMALL)


def test_gradient_check_fp64():
    """Directional finite differences of the fp64 loss against autograd, every leaf at once."""
    cfg = dataclasses.replace(SMALL, compute_dtype="float64")
    params = map_with_path(lambda _, t: t.double(), init_params(cfg, seed=5))
    tokens = torch.randint(0, cfg.vocab_size, (2, 6))

    def loss(p):
        logits, _ = forward(p, tokens, cfg)
        return logits.double().logsumexp(-1).mean()

    leaves = flatten_dict(params)
    for v in leaves.values():
        v.requires_grad_(True)
    grads = torch.autograd.grad(loss(params), list(leaves.values()))
    gen = torch.Generator().manual_seed(0)
    dirs = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in leaves.items()}
    eps = 1e-6
    with torch.no_grad():
        plus = map_with_path(lambda k, t: t + eps * dirs[k], params)
        minus = map_with_path(lambda k, t: t - eps * dirs[k], params)
        fd = (loss(plus) - loss(minus)) / (2 * eps)
    analytic = sum((g * dirs[k]).sum() for g, k in zip(grads, leaves))
    assert abs(fd - analytic) <= 1e-6 * max(1.0, abs(analytic))


# ---------------------------------------------------------------- init

def test_init_is_order_independent_and_deterministic():
    a = flatten_dict(init_params(SMALL, seed=7))
    inits = flatten_dict(leaf_inits(SMALL))
    b = {path: draw_leaf(init, 7, path) for path, init in reversed(inits.items())}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = flatten_dict(init_params(SMALL, seed=8))
    assert not torch.equal(a["layers.1.moe.w_up_EDF"], c["layers.1.moe.w_up_EDF"])


@pytest.mark.parametrize("shape,index", [
    ((1000, 48), (slice(300, 777),)),          # rows across chunk borders
    ((1000, 48), (slice(0, 1000), slice(5, 20))),
    ((6, 40, 24), (slice(2, 5),)),              # experts
    ((6, 40, 24), (slice(1, 3), slice(10, 30))),  # experts, then rows (fsdp on dim 1)
])
def test_draw_sub_block_is_slice_of_full(shape, index):
    init = LeafInit(shape, 0.02)
    full = draw_leaf(init, 3, "x.w")
    assert torch.equal(draw_leaf(init, 3, "x.w", index), full[index])


def test_drawing_an_eighth_peaks_below_twice_the_slice():
    from torch.distributed._tools.mem_tracker import MemTracker

    init = LeafInit((8192, 512), 0.02)
    tracker = MemTracker()
    with tracker:
        part = draw_leaf(init, 0, "big.w_DF", (slice(3 * 1024, 4 * 1024),))
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peak < 2 * part.numel() * part.element_size(), peak


def test_meta_init_allocates_nothing():
    p = init_params(SMALL, device="meta")
    assert all(t.is_meta for t in flatten_dict(p).values())
    assert p["layers"]["1"]["moe"]["w_down_EFD"].shape == (4, 16, 32)


def test_balance_loss_from_its_definition():
    cfg = SMALL
    p = init_params(cfg, seed=6)["layers"]["1"]["moe"]
    x = torch.randn(2, 9, cfg.dim)
    _, stats = moe_block(p, x, cfg, gemm="loop")
    counts, bl = stats["counts_E"], stats["balance_loss"]
    x_TD = x.reshape(-1, cfg.dim)
    probs = torch.stack([torch.softmax(x_TD[t] @ p["w_router_DE"], -1) for t in range(18)])
    frac = torch.tensor([sum(e in probs[t].topk(2).indices.tolist() for t in range(18)) for e in range(4)]) / 36
    assert torch.equal(counts, (frac * 36).long())
    assert abs(bl - 4 * (frac * probs.mean(0)).sum()) <= 1e-6


def test_sigmoid_balance_losses_normalise_scores_per_token():
    """Sigmoid scores do not sum to 1 over experts; the Switch and sequence-wise losses read each
    token's scores divided by their sum (DeepSeek-V3), else a balanced router scores ~E/2 not 1."""
    B, L, E, K = 2, 9, 4, 2
    cfg = dataclasses.replace(SMALL, moe=dataclasses.replace(
        SMALL.moe, score_func="sigmoid", seq_aux_loss_coeff=0.1, router_bias=True))
    p = init_params(cfg, seed=6)["layers"]["1"]["moe"]
    p["w_router_DE"] = p["w_router_DE"] * 30  # scores far from 1/2, so loads and sequences differ
    p["router_bias_E"] = torch.tensor([0.05, -0.05, 0.0, 0.02])  # chooses experts but is not a score
    x = torch.randn(B, L, cfg.dim)
    _, stats = moe_block(p, x, cfg, gemm="loop")
    x_TD = x.reshape(-1, cfg.dim)
    probs, chosen = [], []
    for t in range(B * L):
        s = [1 / (1 + math.exp(-float(x_TD[t] @ p["w_router_DE"][:, e]))) for e in range(E)]
        probs.append([v / sum(s) for v in s])
        chosen.append(sorted(range(E), key=lambda e: -(s[e] + float(p["router_bias_E"][e])))[:K])
    switch = sum(E * sum(e in c for c in chosen) / (B * L * K) * sum(q[e] for q in probs) / (B * L)
                 for e in range(E))
    seq = sum(E * sum(e in c for c in chosen[b * L:(b + 1) * L]) / (L * K)
              * sum(q[e] for q in probs[b * L:(b + 1) * L]) / L for b in range(B) for e in range(E)) / B
    assert abs(stats["balance_loss"].item() - switch) <= 1e-5 * switch
    assert abs(stats["seq_balance_loss"].item() - seq) <= 1e-5 * seq
    assert rel(stats["probs_sum_E"], torch.tensor([sum(q[e] for q in probs) for e in range(E)])) <= 1e-5
