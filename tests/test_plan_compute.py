"""The step-time model's compute on the busiest rank: routed experts at `plan.imbalance` times the
mean rows, each expert GEMM at the roofline max(FLOPs / rate, bytes / HBM bandwidth); checked
against FLOPs and bytes counted here from the leaf shapes."""
import dataclasses
import math

import pytest

from fnmoe.config import load_config
from fnmoe.config.hardware import hardware
from fnmoe.plan.flops import flops_per_token
from fnmoe.plan.gemm_time import rows_per_expert
from fnmoe.plan.state import leaf_shapes
from fnmoe.plan.step_time import step_time
from fnmoe.plan.comm import comm_bytes
from fnmoe.tree import leaf_kind

PRESET = load_config("configs/kimi_k2_1t.toml")
# the layout these figures were written on (issue 42's preset): 14 sequences a GPU, the MoE layer in
# 16 token chunks, bf16 gathers; the token-chunk terms are the ones checked here
K2 = dataclasses.replace(PRESET, train=dataclasses.replace(PRESET.train, batch_size=5376),
                         memory=dataclasses.replace(PRESET.memory, block_chunks=1),
                         mesh=dataclasses.replace(PRESET.mesh, expert_gather_dtype="compute"),
                         model=dataclasses.replace(PRESET.model, moe=dataclasses.replace(PRESET.model.moe,
                                                                                         token_chunks=16)))


def with_plan(run, **plan):
    return dataclasses.replace(run, plan=dataclasses.replace(run.plan, **plan))


def compute_s(run) -> float:
    """The model FLOPs' compute: the step's less the extra work it charges (test_plan_nccl_costs.py)."""
    fpt = flops_per_token(run.model, run.data.seq_len)
    t = step_time(run, fpt, comm_bytes(run), 0)
    return t["compute_s"] - sum(t["overheads_s"].values())


def routed_params_per_token(run) -> float:
    """Routed-expert weights a token multiplies, all layers: K of E experts of every expert stack."""
    m = run.model.moe
    return sum(math.prod(s) * m.top_k / m.n_experts for p, s in leaf_shapes(run.model) if leaf_kind(p) == "expert")


def flat_compute_s(run) -> float:
    """The step's compute at the stated rates with balanced routing, from the FLOPs formula alone:
    fpt (GEMMs and attention's core, forward and backward) plus full recompute's forward again."""
    hw, cfg, L = hardware(run.plan), run.model, run.data.seq_len
    core = 3.0 * cfg.n_layers * L * cfg.n_heads * (cfg.qk_head_dim_ + cfg.v_head_dim_)
    gemm_fpt = flops_per_token(cfg, L) - core
    layer_gemm = sum(2 * math.prod(s) * (cfg.moe.top_k / cfg.moe.n_experts if leaf_kind(p) == "expert" else 1)
                     for p, s in leaf_shapes(cfg) if p.startswith("layers.") and len(s) >= 2)
    tokens = run.micro_batch * L * run.train.grad_accum
    return tokens * ((gemm_fpt + layer_gemm) / (hw.matmul_tflops * 1e12)
                     + (core + core / 3) / (hw.attention_tflops * 1e12))


def test_balanced_routing_with_unbounded_hbm_is_the_flat_formula():
    """imbalance 1 and an HBM so fast no GEMM is bound by it: the FLOPs formula at the stated rates."""
    run = with_plan(K2, imbalance=1.0, hbm_tbps=1e6)
    assert compute_s(run) == pytest.approx(flat_compute_s(run), rel=1e-9)


def test_the_busiest_ranks_routed_experts_take_imbalance_times_as_long():
    """Every rank waits for the busiest: its routed-expert GEMMs (forward, input and weight
    gradients, the recomputed forward: 4 x 2 FLOPs a weight a row) run imbalance times the mean rows."""
    fast = dict(hbm_tbps=1e6)
    balanced = compute_s(with_plan(K2, imbalance=1.0, **fast))
    busiest = compute_s(with_plan(K2, imbalance=1.25, **fast))
    tokens = K2.micro_batch * K2.data.seq_len * K2.train.grad_accum
    routed_s = tokens * 8 * routed_params_per_token(K2) / (hardware(K2.plan).matmul_tflops * 1e12)
    assert busiest - balanced == pytest.approx(0.25 * routed_s, rel=1e-9)
    assert 0.14 < (busiest - balanced) / balanced < 0.17  # the issue's +15% on the preset
    one_ep = dataclasses.replace(K2, mesh=dataclasses.replace(K2.mesh, fsdp=384, ep=1))
    assert compute_s(with_plan(one_ep, imbalance=1.25, **fast)) == pytest.approx(
        compute_s(with_plan(one_ep, imbalance=1.0, **fast)))  # one ep rank: no other rank to wait for


def with_chunks(run, n: int):
    return dataclasses.replace(run, model=dataclasses.replace(run.model, moe=dataclasses.replace(run.model.moe,
                                                                                                   token_chunks=n)))


def test_few_rows_a_chunk_are_bound_by_reading_the_expert_weights():
    """In 64 chunks K2's busiest rank gives an expert 93 rows a chunk: reading its 29 MB bf16 matrix
    at the HBM rate outlasts its FLOPs, so the routed experts' time follows the bandwidth; in one
    chunk (5,973 rows) the FLOPs bound it and the bandwidth does not matter."""
    many = with_chunks(K2, 64)
    assert rows_per_expert(many) == pytest.approx(57344 * 8 * 1.25 * 4 / 384 / 64)
    I, O, r, s = 7168, 2048, rows_per_expert(many), 2
    hw = hardware(K2.plan)
    assert s * (I * O + r * (I + O)) / (hw.hbm_tbps * 1e12) > 2 * r * I * O / (hw.matmul_tflops * 1e12)
    assert compute_s(with_plan(many, hbm_tbps=hw.hbm_tbps / 2)) > compute_s(many) * 1.2
    one = with_chunks(K2, 1)
    assert compute_s(with_plan(one, hbm_tbps=hw.hbm_tbps / 2)) == pytest.approx(compute_s(one), rel=1e-9)
    assert compute_s(one) < compute_s(K2) < compute_s(many)


def test_each_chunk_reads_and_writes_the_weight_gradient_autograd_accumulates():
    """The weight gradient of N chunks: each chunk's GEMM writes its result and autograd adds it in
    place into the gradient (reads both, writes one) every chunk but the first: 4N - 3 passes over
    the weight's I·O, so with the HBM the only bound, time grows with N at fixed rows a step."""
    from fnmoe.plan.gemm_time import routed_expert_s
    slow = dict(matmul_tflops=1e9)  # FLOPs free: bytes alone
    hw = hardware(with_plan(K2, **slow).plan)
    X, s, n_moe = 384 // 4, 2, 60
    for n in (1, 16):
        run = with_plan(with_chunks(K2, n), **slow)
        r = rows_per_expert(run)
        grad = sum(s * (r * (I + O) + I * O * (4 * n - 3) / n) for I, O in ((7168, 2048), (7168, 2048), (2048, 7168)))
        fwd = sum(s * (I * O + r * (I + O)) for I, O in ((7168, 2048), (7168, 2048), (2048, 7168)))
        want = X * n * n_moe * (fwd + grad) / (hw.hbm_tbps * 1e12)  # input and weight gradients (no recompute)
        assert routed_expert_s(run, recomputed=False)["backward"] == pytest.approx(want, rel=1e-9)


def test_memory_figures_are_decimal_gb_of_what_cuda_sees():
    """GB is 1e9 B everywhere: a card sold as 96 GB of HBM holds 96 GiB (CUDA sees ~97.9k MiB =
    102.7 GB), so its usable figure is taken from that, not from 96 read as decimal; the plan says
    its unit where it prints it."""
    from fnmoe.plan.summary import format_plan, plan
    assert hardware(K2.plan).hbm_gb == 96.0 < 97_900 * 2**20 / 1e9
    assert hardware(with_plan(K2, hardware="dgx-h100").plan).hbm_gb == 80.0 < 81_559 * 2**20 / 1e9
    assert "(GB = 1e9 bytes, TB = 1e12)" in format_plan(plan(K2, as_built=False))


def test_a_dense_model_is_priced_at_the_flat_formula():
    """No routed experts: nothing at the roofline, the whole step at the stated rates."""
    dense = load_config("tiny")
    dense = dataclasses.replace(dense, model=dataclasses.replace(
        dense.model, moe=dataclasses.replace(dense.model.moe, n_experts=0)),
        memory=dataclasses.replace(dense.memory, recompute="full"))  # flat_compute_s counts full recompute
    assert compute_s(dense) == pytest.approx(flat_compute_s(dense), rel=1e-9)


@pytest.mark.parametrize("gather", ["float8_e4m3fn", "compute"])
def test_fp8_expert_gemms_at_the_fp8_rate_with_one_byte_operands_and_their_quantisation(gather):
    """--mesh.expert-gemm-dtype float8_e4m3fn: each expert GEMM at the roofline of the fp8 rate (55% of
    the 1,979 TFLOP/s fp8 dense peak on GH200) with 1-byte operands and 2-byte outputs, plus the pass
    that quantises its operands (read 2 bytes, write 1): the activations every GEMM; the weight once a
    gather for all 14 chunks (fnmoe.kernels.fp8_blocks.weight_blocks), and not at all behind the
    preset's fp8 gathers of whole experts, whose packs the GEMMs take. Written out for the preset's
    busiest rank: 96 experts, 14 chunks, 853 rows."""
    from fnmoe.plan.gemm_time import routed_expert_s
    run = dataclasses.replace(PRESET, mesh=dataclasses.replace(PRESET.mesh, expert_gemm_dtype="float8_e4m3fn",
                                                               expert_gather_dtype=gather))
    hw, r, X, N = hardware(run.plan), rows_per_expert(run), 96, 14
    rate, hbm = 1979.0 * 0.55 * 1e12, hw.hbm_tbps * 1e12
    assert hw.fp8_matmul_tflops * 1e12 == pytest.approx(rate)
    weight_passes = 0 if gather == "float8_e4m3fn" else 1 / N
    fwd = bwd = 0.0
    for I, O in ((7168, 2048), (7168, 2048), (2048, 7168)):
        f = 2 * r * I * O
        fwd += max(f / rate, (I * O + r * I + 2 * r * O) / hbm) + 3 * (r * I + I * O * weight_passes) / hbm
        bwd += max(f / rate, (I * O + r * O + 2 * r * I) / hbm) + 3 * r * O / hbm
        bwd += max(f / rate, (r * (I + O) + 2 * I * O * (4 * N - 3) / N) / hbm) + 3 * r * (I + O) / hbm
    per_step = X * N * 60
    got = routed_expert_s(run, recomputed=True)
    assert got["forward"] == pytest.approx(per_step * fwd, rel=1e-9)
    assert got["backward"] == pytest.approx(per_step * (fwd + bwd), rel=1e-9)
    bf16 = routed_expert_s(PRESET, recomputed=True)
    # the GEMMs at twice the rate, the rows' quantisation (read 2, write 1) taking some of it back
    assert 0.55 < got["forward"] / bf16["forward"] < 0.7


def test_fp8_gemms_keep_the_computing_layers_stacks_in_e4m3_and_take_packs_of_whole_experts_only():
    """Under fp8 expert GEMMs the gathered row holds the computing layer's expert stacks once more at
    1 byte an element (their blocks: fnmoe.kernels.fp8_blocks.weight_blocks): K2's 96 experts a GPU of
    three 7168 x 2048 matrices, 4.23 GB. The packs stand for the blocks only where fsdp x ep divides
    the experts, each rank's shard whole experts: not on 768 ranks (fsdp 192 x ep 4 > 384 experts,
    so fsdp splits each expert's rows), nor behind compute-dtype gathers."""
    from fnmoe.plan.gemm_time import gathered_packs
    from fnmoe.plan.state import gathered_bytes
    fp8 = dataclasses.replace(PRESET, mesh=dataclasses.replace(PRESET.mesh, expert_gemm_dtype="float8_e4m3fn"))
    assert gathered_bytes(fp8) - gathered_bytes(PRESET) == 96 * 3 * 7168 * 2048
    assert gathered_packs(fp8)
    rows = dataclasses.replace(fp8, mesh=dataclasses.replace(fp8.mesh, fsdp=192))  # 768 ranks: rows split
    assert not gathered_packs(rows)
    bf16_gathers = dataclasses.replace(fp8, mesh=dataclasses.replace(fp8.mesh, expert_gather_dtype="compute"))
    assert not gathered_packs(bf16_gathers)
