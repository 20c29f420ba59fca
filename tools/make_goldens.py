"""Regenerate tests/assets/golden_tiny_fp32.json: the first 20 losses of the tiny preset.

    python tools/make_goldens.py

Runs `fnmoe train --config configs/tiny.toml --train.steps 20 --model.compute-dtype float32
--model.no-compile` and records the per-step losses. Regenerate only when a change is meant to
alter the numerics, and say why in the commit.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20

with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "fnmoe", "train", "--config", str(ROOT / "configs" / "tiny.toml"),
           "--train.steps", str(STEPS), "--model.compute-dtype", "float32", "--model.no-compile",
           "--train.eval-every", "0", "--train.run-dir", tmp]
    subprocess.run(cmd, check=True, timeout=600)
    rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
losses = [r["loss"] for r in rows if "loss" in r]
out = ROOT / "tests" / "assets" / "golden_tiny_fp32.json"
out.write_text(json.dumps({"preset": "configs/tiny.toml", "steps": STEPS, "compute_dtype": "float32",
                           "compile": False, "losses": losses}, indent=1) + "\n")
print(f"wrote {out}: {losses[0]:.4f} -> {losses[-1]:.4f}")
