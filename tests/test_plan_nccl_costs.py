"""What a real NCCL step costs beside its model FLOPs and bytes (issue 52), each term against a count
made without the planner's helpers: torch's FlopCounterMode for the FLOPs fnmoe's own functions run,
and hand-written step times for the link and slowdown terms. Each fails on the formula before: no
slowdown, sent bytes alone for an all-to-all, links summed as one, the extra work uncharged.

Legend: T tokens a rank, D model, V vocab, E experts.
"""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fnmoe.cli.commands import parse_run
from fnmoe.config import (DataConfig, MeshConfig, ModelConfig, MoEConfig, OptimConfig, PlanConfig, RunConfig,
                          TrainConfig, load_config)
from fnmoe.config.hardware import hardware
from fnmoe.optim.muon_update import newton_schulz
from fnmoe.plan import overheads, rates
from fnmoe.plan import step_time as st
from fnmoe.run.metrics import rank_load_max_over_mean
from fnmoe.run.progress import progress_line

GB = 1e9
CFG = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1))


def _run(plan: PlanConfig = PlanConfig(), **sections) -> RunConfig:
    base = dict(model=CFG, mesh=MeshConfig(fsdp=2, ep=2), train=TrainConfig(batch_size=8),
                data=DataConfig(seq_len=16), plan=plan)
    return RunConfig(**{**base, **sections})


def _comm(parts: dict) -> dict:
    """comm_bytes's shape with only `parts` (bytes by phase/kind/where and link)."""
    flat = dict.fromkeys(("fsdp_intra_node", "fsdp_inter_node", "ep_intra_node", "ep_inter_node"), 0.0)
    for key, link in parts.items():
        kind = "ep" if "all_to_all" in key else "fsdp"
        flat[f"{kind}_intra_node"] += link["intra"]
        flat[f"{kind}_inter_node"] += link["inter"]
    return dict(flat, parts=parts)


def _phase(run, parts, exposed=None, fpt=0.0):
    return st.step_time(run, fpt, _comm(parts), 0, exposed or {})["as_built_s"]


def _quiet(**figures) -> PlanConfig:
    """A plan with every overhead's figure off but those given."""
    return PlanConfig(**{"nccl_ring_slowdown": 0.0, "nccl_a2a_slowdown": 0.0, "host_sync_us": 0.0, **figures})


def test_hidden_traffic_of_the_nic_and_nvlink_is_bounded_by_the_busier_link_not_their_sum():
    """A forward whose hidden ring crosses the NIC 10 s and whose hidden all-to-all moves NVLink 10 s
    hides behind 12 s of compute: the links run side by side (the sum, 20 s, would bound the phase)."""
    hw = hardware(PlanConfig())
    run = _run(_quiet(), optim=OptimConfig(name="adamw"))
    parts = {"forward/all_gather/blocks": {"intra": 0.0, "inter": 10 * hw.network_gbps * GB},
             "forward/all_to_all/blocks": {"intra": 10 * hw.nvlink_a2a_gbps * GB / st.ep_receive_factor(run),
                                           "inter": 0.0}}
    exposed = {("forward", "all_gather"): 0.0, ("forward", "all_to_all"): 0.0}
    a = _phase(run, parts, exposed)["forward"]
    assert a["hidden_by_link"]["nic"] == pytest.approx(10.0)
    assert a["hidden_by_link"]["nvlink"] == pytest.approx(10.0)
    assert a["hidden"] == pytest.approx(10.0)


def test_nccl_kernels_beside_compute_slow_it_on_the_share_they_overlap():
    """The slowdown of each kind on the compute a hidden collective overlaps: all of a collective
    shorter than its phase's compute, the compute when longer; nothing for the exposed part, during
    which no GEMM runs."""
    hw = hardware(PlanConfig())
    run = _run(_quiet(nccl_ring_slowdown=0.05, nccl_a2a_slowdown=0.10), optim=OptimConfig(name="adamw"))
    fpt = 3.0 * hw.matmul_tflops * 1e12 * 30.0 / 32  # ~30 s of compute for a rank's 32 tokens
    ring = {"forward/all_gather/blocks": {"intra": 0.0, "inter": 4 * hw.network_gbps * GB}}
    a2a = {"backward/all_to_all/blocks": {"intra": 6 * hw.nvlink_a2a_gbps * GB / st.ep_receive_factor(run),
                                          "inter": 0.0}}
    half = {("forward", "all_gather"): 0.5, ("backward", "all_to_all"): 0.0}
    a = st.step_time(run, fpt, _comm({**ring, **a2a}), 0, half)["as_built_s"]
    assert a["forward"]["compute"] > 2.0 and a["backward"]["compute"] > 6.0
    assert a["forward"]["nccl_slowdown"] == pytest.approx(0.05 * 2.0)  # the hidden half of 4 s
    assert a["backward"]["nccl_slowdown"] == pytest.approx(0.10 * 6.0)
    assert a["forward"]["exposed"] == pytest.approx(2.0)
    long = {"forward/all_gather/blocks": {"intra": 0.0, "inter": 400 * hw.network_gbps * GB}}
    a = st.step_time(run, fpt, _comm(long), 0, {("forward", "all_gather"): 0.0})["as_built_s"]["forward"]
    assert a["nccl_slowdown"] == pytest.approx(0.05 * a["compute"])
    assert a["hidden"] == pytest.approx(400.0)


def test_an_all_to_all_lasts_as_long_as_the_busiest_ranks_receive_side():
    """The busiest rank sends T·K rows and receives imbalance x T·K in a dispatch (the combine the
    reverse): each pass lasts imbalance x a balanced pass, where the sent bytes (1 + imbalance)/2 a
    pass on the average say less."""
    for imb in (1.0, 1.25, 2.0):
        run = _run(_quiet(imbalance=imb))
        assert st.ep_receive_factor(run) == pytest.approx(2 * imb / (1 + imb))
        hw = hardware(run.plan)
        sent = 3.0 * hw.nvlink_a2a_gbps * GB  # 3 s of sent bytes
        a = _phase(run, {"forward/all_to_all/blocks": {"intra": sent, "inter": 0.0}})["forward"]
        assert a["exposed"] == pytest.approx(3.0 * 2 * imb / (1 + imb))
    assert st.ep_receive_factor(_run(_quiet(imbalance=1.25, dispatch="node_dedup"))) == 1.25


def test_newton_schulz_flops_are_what_torch_counts_on_fnmoes_own_iteration():
    """muon_ns_s's FLOPs against FlopCounterMode on fnmoe.optim.muon_update.newton_schulz, one matrix
    of each Muon leaf's shape (the experts' stacks batched), spread over the world."""
    run = _run(optim=OptimConfig(name="muon"))
    counted = 0
    from fnmoe.plan.state import leaf_shapes
    from fnmoe.optim.base import default_label
    from fnmoe.tree import leaf_kind
    for path, shape in leaf_shapes(CFG):
        if leaf_kind(path) == "buffer" or default_label(path, len(shape), True) != "muon":
            continue
        with FlopCounterMode(display=False) as fc:
            newton_schulz(torch.randn(*shape), steps=run.optim.ns_steps, dtype=torch.float32)
        counted += fc.get_total_flops()
    want = counted / run.mesh.world / (hardware(run.plan).matmul_tflops * 1e12)
    assert overheads.muon_ns_s(run) == pytest.approx(want, rel=1e-9)
    assert overheads.muon_ns_s(_run(optim=OptimConfig(name="adamw"))) == 0.0


def test_ce_chunks_charge_the_head_logits_backward_recomputes():
    """2·T·D·V FLOPs more in backward under CE chunks: what FlopCounterMode counts of fnmoe's own
    chunked cross-entropy's backward over the unchunked one's."""
    from fnmoe.training.step import ce_loss_sum
    T, D, V = 32, CFG.dim, CFG.vocab_size
    x, norm, w = torch.randn(1, T, D, requires_grad=True), torch.ones(D), torch.randn(D, V)
    labels = torch.randint(0, V, (1, T))

    def flops(chunks: int) -> int:
        with FlopCounterMode(display=False) as fc:
            ce_loss_sum(x, norm, w, labels, 1e-6, chunks).backward()
        return fc.get_total_flops()
    assert flops(4) - flops(1) == 2 * T * D * V
    run = _run(train=TrainConfig(batch_size=8, ce_chunks=4))
    tokens = 8 * 16 // 4
    assert overheads.head_recompute_s(run) == pytest.approx(
        2.0 * tokens * D * V / (hardware(run.plan).matmul_tflops * 1e12))
    assert overheads.head_recompute_s(_run()) == 0.0


def test_the_extra_work_is_charged_to_its_phase():
    """The K2 preset: every named term in the as-built compute of its phase, and the figures the audit
    recomputed by hand (Muon ~0.23 s, fp8 dequantise ~0.42 s, count syncs 0.04-0.22 s)."""
    run = load_config("configs/kimi_k2_1t.toml")
    terms = overheads.overheads_s(run)
    assert terms["muon newton-schulz"][1] == pytest.approx(0.23, abs=0.01)
    fp8 = terms["fp8 gather dequantise"][1] + terms["fp8 gather dequantise (backward)"][1]
    assert fp8 == pytest.approx(0.42, abs=0.01)
    syncs = terms["count exchange syncs"][1] + terms["count exchange syncs (recompute)"][1]
    assert 0.04 <= syncs <= 0.22
    comm = {k: 0.0 for k in ("fsdp_intra_node", "fsdp_inter_node", "ep_intra_node", "ep_inter_node")}
    with_terms = st.step_time(run, 1e9, dict(comm, parts={}), 0, {})["as_built_s"]
    zero = dataclasses.replace(run, optim=dataclasses.replace(run.optim, name="adamw"),
                               train=dataclasses.replace(run.train, ce_chunks=1),
                               mesh=dataclasses.replace(run.mesh, expert_gather_dtype="compute"),
                               plan=dataclasses.replace(run.plan, host_sync_us=0.0))
    without = st.step_time(zero, 1e9, dict(comm, parts={}), 0, {})["as_built_s"]
    for phase in ("forward", "backward"):
        want = sum(s for name, (ph, s) in terms.items() if ph == phase)
        assert with_terms[phase]["compute"] - without[phase]["compute"] == pytest.approx(want, rel=1e-6)
    assert with_terms["update"]["compute"] > terms["muon newton-schulz"][1]


def test_measured_rates_take_the_nearest_row_and_name_what_was_measured():
    """--plan.rates measured: the rate table's row of the profile's GPU nearest the run's expert GEMM
    shape; a figure the user gives wins; a GPU without rows keeps every stated figure, all assumed."""
    k2 = load_config("configs/kimi_k2_1t.toml")
    at, report = rates.measured_run(k2)
    assert report["measured"]["expert_matmul_tflops"]["shape"][0] == 853  # the busiest rank's rows: x1.25
    balanced = dataclasses.replace(k2, plan=dataclasses.replace(k2.plan, imbalance=1.0))
    assert rates.measured_run(balanced)[1]["measured"]["expert_matmul_tflops"]["value"] == 532.0
    assert hardware(at.plan).expert_matmul_tflops == 521.0 and "nvlink_a2a_gbps" in report["assumed"]
    mine = dataclasses.replace(k2, plan=dataclasses.replace(k2.plan, matmul_tflops=600.0))
    at, report = rates.measured_run(mine)
    assert hardware(at.plan).matmul_tflops == 600.0 and report["given"] == ["matmul_tflops"]
    b200 = dataclasses.replace(k2, plan=dataclasses.replace(k2.plan, hardware="dgx-b200"))
    at, report = rates.measured_run(b200)
    assert report["measured"] == {} and hardware(at.plan) == hardware(b200.plan)


def test_plan_rates_measured_from_the_command_line_puts_the_stated_figure_beside():
    from fnmoe.plan.summary import format_plan, plan
    flags = ["--config", "configs/kimi_k2_1t.toml", "--mesh.fsdp", "8", "--mesh.ep", "4", "--train.batch-size", "32",
             "--memory.block-chunks", "1"]
    stated = plan(parse_run(flags, "fnmoe plan"), as_built=False)
    measured = plan(parse_run(flags + ["--plan.rates", "measured"], "fnmoe plan"), as_built=False)
    assert measured["rates"]["mode"] == "measured" and measured["step_time_beside"]["rates"] == "stated"
    assert measured["step_time"]["tokens_per_s_per_gpu_serial"] == pytest.approx(
        stated["step_time_beside"]["tokens_per_s_per_gpu_serial"])
    # 427 rows an expert: the 683-row row's 532 TFLOP/s, under the stated 544
    assert measured["step_time"]["compute_s"] > stated["step_time"]["compute_s"]
    text = format_plan(stated)
    assert "at measured rates" in text and "expert_matmul_tflops 532" in text and "nccl slowdown" in text


def test_the_busiest_ep_ranks_load_is_reported_beside_the_busiest_experts():
    """Experts [10, 0, 5, 5] on 2 ep ranks: the busiest expert is twice the mean, the ranks even."""
    counts_NE = torch.tensor([[10, 0, 5, 5], [8, 0, 0, 0]])
    assert rank_load_max_over_mean(counts_NE[:1], 2) == pytest.approx(1.0)
    assert rank_load_max_over_mean(counts_NE, 2) == pytest.approx(2.0)  # layer 2: 8 against 0
    assert rank_load_max_over_mean(counts_NE, 1) is None
    row = {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "mfu": None,
           "expert_load_max_over_mean": 2.0, "ep_rank_load_max_over_mean": 1.0, "skipped": 0, "time_s": 1.0}
    assert "load max/mean 2.00 (ep rank 1.00)" in progress_line([row], 10)


def test_an_exchange_longer_than_its_window_is_waited_for_by_what_it_outlasts():
    """Two block chunks in flight hide each exchange behind the other chunk's compute; the op order
    says only that some compute runs between. K2's passes (2.4 ms a chunk a layer) fit their shortest
    window (a chunk's attention, 4.8 ms): nothing more waited for. At an all-to-all of 20 GB/s a pass
    outlasts every window, and the as-built step waits for each excess: the forward's four windows a
    pair of chunks, backward's two replayed exchanges for every chunk but the last (none kept)."""
    from fnmoe.plan import windows
    from fnmoe.plan.comm import comm_bytes
    k2 = load_config("configs/kimi_k2_1t.toml")
    recv = st.ep_receive_factor(k2)
    assert windows.window_excess_s(k2, comm_bytes(k2), recv) == {"forward": 0.0, "backward": 0.0}
    slow = dataclasses.replace(k2, plan=dataclasses.replace(k2.plan, nvlink_a2a_gbps=20.0))
    comm, w, n_moe, N = comm_bytes(slow), windows.windows_s(slow), 60, 14
    t = recv * comm["parts"]["forward/all_to_all/blocks"]["intra"] / 20e9 / (2 * n_moe * N)
    assert t > w["experts"] > w["attention"]
    forward = (4 * t - w["attention"] - 2 * w["experts"] - w["output"] - w["attention"]) * n_moe * N / 2
    backward = (2 * t - w["moe_backward"] - w["attention_backward"]) * n_moe * (N - 1)
    got = windows.window_excess_s(slow, comm, recv)
    assert got["forward"] == pytest.approx(forward) and got["backward"] == pytest.approx(backward)
    exposed = {("forward", "all_to_all"): 0.0, ("backward", "all_to_all"): 0.5}
    with_late = st.step_time(slow, 1e9, comm, 0, exposed)
    assert with_late["window_excess_s"] == got
    for phase in ("forward", "backward"):
        assert with_late["as_built_s"][phase]["exposed"] >= got[phase] > 0
    kept = dataclasses.replace(slow, memory=dataclasses.replace(slow.memory, keep_exchange=True))
    assert windows.window_excess_s(kept, comm_bytes(kept), recv)["backward"] == 0.0
