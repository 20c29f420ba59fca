"""--train.wandb: an offline W&B run holds the metrics.jsonl scalars, the expert-load histograms and
the resolved config; a resumed run continues the same W&B run; the core never imports wandb."""
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fnmoe.cli import main
from conftest import tiny_flags

SMALL = tiny_flags(1)
BLOCK = 32768
"""the W&B transaction log (run-<id>.wandb) is a leveldb-style log of 32 KiB blocks"""


def wandb_records(path: Path) -> list:
    """The protobuf Records of an offline run's run-<id>.wandb file: a 7-byte file header, then
    records of (crc32, length, type) + data, split across blocks (type 1 whole, 2..4 first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a record header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def offline_runs(run_dir: Path) -> list[tuple[str, dict, list[dict]]]:
    """(run id, config, history rows) of each offline W&B run under run_dir, oldest first."""
    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        run_id, config, history = "", {}, []
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
                config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
            elif kind == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        out.append((run_id, config, history))
    return out


def test_offline_run_holds_the_metrics_histograms_and_config_and_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    argv = ["train", "--train.wandb", "--train.wandb-project", "fnmoe-test", "--train.run-dir", str(run_dir),
            "--checkpoint.every", "2", "--train.eval-every", "2", *SMALL]
    assert main([*argv, "--train.steps", "3"]) == 0
    run_id = (run_dir / "wandb_id").read_text().strip()
    # resume from step 2: step 3 again, then 4
    (run_dir / "checkpoints" / "step_3").rename(tmp_path / "step_3")
    assert main([*argv, "--train.steps", "4", "--resume", "auto"]) == 0
    assert (run_dir / "wandb_id").read_text().strip() == run_id

    runs = offline_runs(run_dir)
    assert [r[0] for r in runs] == [run_id, run_id]  # one W&B run, continued
    _, config, first = runs[0]
    assert config["train"]["steps"] == 3 and config["model"]["dim"] == 32 and config["data"]["seq_len"] == 32
    assert runs[1][1]["train"]["steps"] == 4

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [h for _, _, history in runs for h in history]
    for row in rows:
        if "event" in row:
            continue
        match = [h for h in logged if h.get("step") == row["step"] and ("loss" in h) == ("loss" in row)]
        assert match, row
        h = match[-1]
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert h[key] == pytest.approx(value, rel=1e-12), key
        if "loss" in row:  # a step row: one histogram of tokens per expert per MoE layer
            n_moe = len(row["expert_load_by_layer"])
            assert all(h[f"expert_load/moe_layer_{k}/_type"] == "histogram" for k in range(n_moe))
            assert sum(h["expert_load/moe_layer_0/values"]) == 8  # one sample per expert
    assert [h["step"] for h in runs[1][2] if "loss" in h] == [3, 4]


@pytest.mark.launch
def test_the_core_never_imports_wandb_and_a_missing_wandb_says_how_to_install(tmp_path, monkeypatch, capsys):
    code = "import sys, fnmoe, fnmoe.training.loop, fnmoe.cli; assert 'wandb' not in sys.modules, 'imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert main(["train", "--train.wandb", "--train.steps", "1", "--train.run-dir", str(tmp_path), *SMALL]) == 2
    assert "pip install 'fnmoe[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()
