"""`fnmoe plan --search` and the two-level network model under fnmoe.plan.summary's step time."""
import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from fnmoe.cli import main
from fnmoe.config import load_config
from fnmoe.config.check import validate
from fnmoe.config.hardware import hardware
from fnmoe.plan.comm import comm_bytes
from fnmoe.plan.summary import plan
from fnmoe.plan.search import POLICIES, search, with_layout

ROOT = Path(__file__).resolve().parent.parent
KIMI = ROOT / "configs" / "kimi_k2_1t.toml"


@pytest.fixture(scope="module")
def kimi():
    return load_config(KIMI)


@pytest.fixture(scope="module")
def kimi_search(kimi):
    start = time.perf_counter()
    s = search(kimi)
    return s, time.perf_counter() - start


def _mesh(run, fsdp, ep, **plan_fields):
    """run on fsdp x ep (fp8 expert gathers only where fsdp shards the experts)."""
    gather = run.mesh.expert_gather_dtype if fsdp > 1 else "compute"
    return dataclasses.replace(run, mesh=dataclasses.replace(run.mesh, fsdp=fsdp, ep=ep, expert_gather_dtype=gather),
                               plan=dataclasses.replace(run.plan, **plan_fields))


def test_search_returns_only_valid_fitting_layouts_sorted(kimi, kimi_search):
    s, seconds = kimi_search
    assert seconds < 120 and s["world"] == 384 and len(s["ranking"]) == 10 and s["fitting"] > 10
    E, hw = kimi.model.moe.n_experts, hardware(kimi.plan)
    for r in s["ranking"]:
        assert r["fsdp"] * r["ep"] == 384 and E % r["ep"] == 0 and r["policy"] in POLICIES
        assert r["device_bytes"] <= hw.hbm_gb * 1e9 and r["host_bytes"] <= hw.host_gb * 1e9
        assert r["tokens_per_gpu"] * 384 <= s["max_global_tokens"] and r["as_built"]
        assert r["tokens_per_s_per_gpu_serial"] <= r["tokens_per_s_per_gpu"] <= r["tokens_per_s_per_gpu_overlapped"]
    rates = [r["tokens_per_s_per_gpu"] for r in s["ranking"]]
    assert rates == sorted(rates, reverse=True)
    assert s["candidates"] > s["fitting"]  # no recompute does not fit a 1T model on 92 GB


def test_the_preset_is_the_best_layout_and_passes_the_config_check(kimi, kimi_search):
    best = kimi_search[0]["ranking"][0]
    run = with_layout(kimi, best["fsdp"], best["ep"], best["policy"], best["micro_batch"],
                      best["sequences_per_gpu"], best["reduce_dtype"], best["token_chunks"],
                      expert_gather=best["expert_gather_dtype"])
    run = dataclasses.replace(run, memory=dataclasses.replace(run.memory, block_chunks=best["block_chunks"]))
    assert (run.mesh, run.memory, run.train.batch_size, run.train.grad_accum, run.model.moe.token_chunks) == \
        (kimi.mesh, kimi.memory, kimi.train.batch_size, kimi.train.grad_accum, kimi.model.moe.token_chunks)
    assert best["ce_chunks"] == kimi.train.ce_chunks
    assert plan(kimi)["step_time"]["tokens_per_s_per_gpu_as_built"] == pytest.approx(best["tokens_per_s_per_gpu"])


@pytest.mark.parametrize("fsdp,ep", [(1, 1), (4, 1), (1, 4), (2, 2), (48, 8), (1, 384), (96, 4), (32, 12), (64, 6)])
def test_node_split_sums_to_comm_bytes(kimi, fsdp, ep):
    c = comm_bytes(_mesh(kimi, fsdp, ep))
    assert c["fsdp_intra_node"] + c["fsdp_inter_node"] == c["fsdp"]
    assert c["ep_intra_node"] + c["ep_inter_node"] == c["ep"]
    assert c["total"] == c["fsdp"] + c["ep"]


def test_split_follows_the_node_layout(kimi):
    inside = comm_bytes(_mesh(kimi, 1, 4))  # one node: everything over NVLink
    assert inside["fsdp_inter_node"] == inside["ep_inter_node"] == 0 < inside["ep_intra_node"]
    c = comm_bytes(_mesh(kimi, 48, 8))  # an ep group of 8 spans 2 nodes: 3 of 7 peers on the own node
    assert c["ep_intra_node"] / c["ep"] == pytest.approx(3 / 7, rel=1e-6)
    # experts every 8th rank, one a node: every ring hop crosses; dense leaves over 384 ranks, 4 a
    # node: a ring crosses once per 4 hops, from another of the 4 GPUs' NICs each time (NCCL channels)
    assert 0 < c["fsdp_intra_node"] < c["fsdp_inter_node"]
    flat = comm_bytes(_mesh(kimi, 8, 1))  # every leaf over 2 nodes of 4: a NIC carries a quarter
    assert flat["fsdp_inter_node"] == pytest.approx(flat["fsdp"] / 4) and flat["ep"] == 0
    # a world of 4 is one 4-GPU node: the strided expert groups stay inside it too
    assert comm_bytes(_mesh(kimi, 2, 2))["fsdp_inter_node"] == 0


def test_group_limited_routing_cuts_cross_node_ep_bytes(kimi):
    run = _mesh(kimi, 1, 384, dispatch="node_dedup")
    limited = dataclasses.replace(run, model=dataclasses.replace(
        run.model, moe=dataclasses.replace(run.model.moe, n_group=96, topk_group=4)))  # a group a node
    validate(limited)
    across, across_limited = comm_bytes(run)["ep_inter_node"], comm_bytes(limited)["ep_inter_node"]
    assert across_limited < 0.55 * across  # at most 4 other nodes a token, against ~7.7 of 8 copies
    # fnmoe's own exchange sends every row: routing groups do not change its expected bytes
    rows = [with_plan_field(r, dispatch="rows") for r in (run, limited)]
    assert comm_bytes(rows[1])["ep_inter_node"] == comm_bytes(rows[0])["ep_inter_node"] > across


def with_plan_field(run, **fields):
    return dataclasses.replace(run, plan=dataclasses.replace(run.plan, **fields))


def test_node_dedup_reaches_the_as_built_step_and_replays_its_passes(kimi):
    """--plan.dispatch node_dedup (a what-if) changes the bytes every figure is built from, the
    as-built step included, and a replayed exchange sends it 6 passes a layer as fnmoe's own does."""
    rows, dedup = _mesh(kimi, 4, 96), _mesh(kimi, 4, 96, dispatch="node_dedup")
    assert comm_bytes(dedup)["ep_inter_node"] < comm_bytes(rows)["ep_inter_node"]
    parts = {k: v for k, v in comm_bytes(dedup)["parts"].items() if "all_to_all" in k}
    forward, backward = parts["forward/all_to_all/blocks"], parts["backward/all_to_all/blocks"]
    assert kimi.memory.recompute == "full" and not kimi.memory.keep_exchange  # the preset replays
    assert backward["inter"] == pytest.approx(2 * forward["inter"])
    kept = dataclasses.replace(dedup, memory=dataclasses.replace(dedup.memory, keep_exchange=True))
    assert comm_bytes(kept)["parts"]["backward/all_to_all/blocks"]["inter"] == pytest.approx(forward["inter"])
    as_built = [plan(r)["step_time"]["step_s_as_built"] for r in (rows, dedup)]
    assert as_built[1] < as_built[0]


def test_two_level_model_drives_fnmoe_plan(kimi):
    fast = plan(_mesh(kimi, 1, 384, network_gbps=400.0))["step_time"]
    slow = plan(_mesh(kimi, 1, 384))["step_time"]
    assert slow["bound"] == "ep across nodes" and fast["bound"] == "compute"
    one_node = plan(_mesh(kimi, 1, 4))["step_time"]
    assert one_node["terms_s"]["ep across nodes"] == 0 < one_node["terms_s"]["ep inside node"]


def test_plan_search_json_cli(capsys, monkeypatch, kimi, kimi_search):
    """The CLI hands --world, --top and --max-global-tokens to the search (the module's one search of
    384 ranks stands for it: the search itself is tested above) and prints its ranking as JSON or
    as the table."""
    from fnmoe.plan import search as fsearch

    calls = []

    def searched(run, world, top, cap):
        calls.append((run, world, top, cap))
        return kimi_search[0]

    monkeypatch.setattr(fsearch, "search", searched)
    assert main(["plan", "--search", "--config", str(KIMI), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == kimi_search[0]
    assert calls[-1] == (kimi, None, 10, fsearch.MAX_GLOBAL_TOKENS)
    assert main(["plan", "--search", "--config", str(KIMI), "--world", "768", "--json", "--top", "3",
                 "--max-global-tokens", "9000000"]) == 0
    capsys.readouterr()
    assert calls[-1] == (kimi, 768, 3, 9_000_000)
    assert main(["plan", "--search", "--config", str(KIMI)]) == 0
    out = capsys.readouterr().out
    assert out == fsearch.format_search(kimi_search[0]) + "\n" and "as built" in out


@pytest.mark.parametrize("args,said", [
    (["--search", "--world", "0"], ["--world must be >= 1"]),
    # the closest layout's miss named (K2 on one node: 3 meshes, up to 12 sequences a GPU)
    (["--search", "--world", "4", "--max-global-tokens", "200000"],
     ["no layout of 4 ranks fits jupiter-gh200", "misses device by"]),
    (["--search", "--top", "0"], ["--top must be >= 1"]),
    (["--search", "--max-global-tokens", "1000"], ["a sequence a GPU (1,572,864 tokens a step) is over"]),
    (["--max-global-tokens", "1000"], ["--world and --max-global-tokens go with --search"]),
])
def test_plan_search_errors(capsys, args, said):
    assert main(["plan", "--config", str(KIMI), *args]) == 2
    err = capsys.readouterr().err
    assert all(s in err for s in said), err


def test_world_without_search_and_indivisible_experts(capsys):
    assert main(["plan", "--config", str(KIMI), "--world", "384"]) == 2
    assert "--world and --max-global-tokens go with --search" in capsys.readouterr().err
    # 7 experts on 8 ranks: no ep > 1 divides both, so every layout is fsdp 8 x ep 1
    run = load_config(ROOT / "configs" / "tiny.toml")
    odd = dataclasses.replace(run, model=dataclasses.replace(
        run.model, moe=dataclasses.replace(run.model.moe, n_experts=7, n_group=1, topk_group=1)))
    s = search(odd, world=8, top=100, max_global_tokens=8 * 16 * odd.data.seq_len)
    assert {r["ep"] for r in s["ranking"]} == {1}


def test_the_memory_plan_page_is_the_planners(kimi_search):
    """docs/memory_plan.md's figures are tools/plan_doc.py's blocks: regenerated, not typed (the
    dgx-h100 search, ~30 s more, is left to `python tools/plan_doc.py --check`)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import plan_doc

    doc = plan_doc.DOC.read_text()
    assert plan_doc.block_text(doc, "search-384") == plan_doc.search_table(kimi_search[0]), \
        "docs/memory_plan.md is stale: run python tools/plan_doc.py"
    for name in ("preset", "levers", "seed"):
        assert plan_doc.block_text(doc, name) == plan_doc.BLOCKS[name](), \
            f"block {name} of docs/memory_plan.md is stale: run python tools/plan_doc.py"
