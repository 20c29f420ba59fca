"""The planner and the large presets: shapes and counts, byte formulas against MemTracker, the CLI."""
import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fnmoe import optim
from fnmoe.cli import main
from fnmoe.config import load_config
from fnmoe.plan.flops import param_counts
from fnmoe.params import init_params
from fnmoe.plan.activations import attention_bytes
from fnmoe.plan.summary import plan
from fnmoe.train import loss_fn
from fnmoe.tree import flatten_dict

ROOT = Path(__file__).resolve().parent.parent
LARGE = ["kimi_k2_1t", "deepseek_v3_671b", "deepseek_v3_16b", "qwen3_30b_a3b"]
# published totals (DeepSeek-V3 without its MTP layer; Qwen3's "30.5B")
TOTALS = {"kimi_k2_1t": 1.026e12, "deepseek_v3_671b": 671e9, "deepseek_v3_16b": 15.7e9, "qwen3_30b_a3b": 30.5e9}


@pytest.mark.parametrize("name", LARGE)
def test_large_presets_load_count_and_plan(name):
    run = load_config(ROOT / "configs" / f"{name}.toml")
    assert run.model.compute_dtype == "bfloat16" and run.micro_batch >= 1
    total, active = param_counts(run.model)
    assert abs(total / TOTALS[name] - 1) < 0.005
    p = plan(run)
    assert p["fits"]["device"] and p["fits"]["host"], (name, p["per_rank_bytes"])


def test_kimi_k2_counts_and_reference_layout():
    run = load_config(ROOT / "configs" / "kimi_k2_1t.toml")
    total, active = param_counts(run.model)
    assert abs(total / 1.026e12 - 1) < 0.005 and abs(active / 3.17e10 - 1) < 0.01
    # the layout `fnmoe plan --search` ranks first for 384 GH200 (tests/test_plan_search.py checks it stays so)
    assert (run.mesh.fsdp, run.mesh.ep, run.optim.name) == (1, 384, "muon")
    # what full recompute keeps (the EP exchange's outputs: 4.2 GB a MoE layer) must go to the host to fit
    assert run.memory.recompute == "full" and run.memory.offload


def test_plan_cli_json_for_1t_on_384_ranks_is_fast(capsys):
    start = time.perf_counter()
    assert main(["plan", "--config", str(ROOT / "configs" / "kimi_k2_1t.toml"), "--mesh.fsdp", "48",
                 "--mesh.ep", "8", "--json"]) == 0
    assert time.perf_counter() - start < 30
    p = json.loads(capsys.readouterr().out)
    for key in ("total_params", "active_params", "flops_per_token", "comm_bytes_per_step"):
        assert p[key] > 0
    assert set(p["per_rank_bytes"]) >= {"params", "grads", "optim", "gathered", "activations", "offload_host"}
    assert p["step_time"]["model"].startswith("stated rates")
    # Muon keeps one fp32 moment on matrices: ~12 B/param sharded over 384 ranks (ANCHORS: 32.1 GB)
    r = p["per_rank_bytes"]
    assert abs((r["params"] + r["grads"] + r["optim"]) / 32.1e9 - 1) < 0.01


def test_plan_table_and_policies(capsys):
    cfg = str(ROOT / "configs" / "kimi_k2_1t.toml")
    assert main(["plan", "--config", cfg, "--memory.recompute", "none", "--memory.no-offload"]) == 0
    assert "fits 96 GB: False" in capsys.readouterr().out
    assert main(["plan", "--config", cfg]) == 0
    assert "fits 96 GB: True" in capsys.readouterr().out


def test_attention_bytes_double_with_sequence_length():
    for name in ("tiny", "tiny_mla", "kimi_k2_1t"):
        cfg = load_config(ROOT / "configs" / f"{name}.toml").model
        assert attention_bytes(cfg, 2 * 4096, 2) == 2 * attention_bytes(cfg, 4096, 2)


def _live(mt: MemTracker) -> int:
    return mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]


def _measure(run):
    """Live-byte deltas at phase boundaries of one fp32 eager step, measured by MemTracker."""
    params = init_params(run.model, 0)
    leaves = flatten_dict(params)
    tx, _ = optim.from_config(run.optim, 10)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.model.vocab_size, (run.micro_batch, run.data.seq_len + 1), generator=g)
    mt = MemTracker()
    mt.track_external(*leaves.values())
    with mt:
        base = _live(mt)
        state = tx.init(params)
        after_init = _live(mt)
        trainable = {k: v.requires_grad_(True) for k, v in leaves.items() if not k.startswith("buffers.")}
        loss, _ = loss_fn(params, tokens[:, :-1], tokens[:, 1:], run.model, tokens[:, 1:].numel())
        after_forward = _live(mt)
        grads = torch.autograd.grad(loss, list(trainable.values()))
        del loss
        after_backward = _live(mt)
    del state, grads
    return {"params": base, "optim": after_init - base, "activations": after_forward - after_init,
            "grads": after_backward - after_forward + (after_forward - after_init)}


@pytest.mark.parametrize("name,seq_len,batch", [("tiny", 128, 16), ("tiny_qwen3", 512, 4)])
def test_plan_matches_measured_bytes(name, seq_len, batch):
    run = load_config(ROOT / "configs" / f"{name}.toml")
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, seq_len=seq_len),
                              train=dataclasses.replace(run.train, batch_size=batch))
    measured = _measure(run)
    planned = plan(run)["per_rank_bytes"]
    for key, value in measured.items():
        assert abs(planned[key] / value - 1) < 0.10, (key, planned[key], value)
