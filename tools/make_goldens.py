"""Regenerate tests/assets/golden_tiny_fp32.json: the first 20 losses of the tiny preset.

    python tools/make_goldens.py

Runs `fnmoe train --config configs/tiny.toml --model.compute-dtype float32 --model.no-compile`,
the preset's whole schedule (800 steps: a 20-step run would clamp its 50-step warmup to the run),
stopped by a SIGINT after step 20 (the test hook FNMOE_TEST_SIGNAL_AT_STEP), and records the
per-step losses. Regenerate only when a change is meant to alter the numerics, and say why in the
commit.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20

with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "fnmoe", "train", "--config", str(ROOT / "configs" / "tiny.toml"),
           "--model.compute-dtype", "float32", "--model.no-compile", "--train.eval-every", "0",
           "--train.run-dir", tmp]
    done = subprocess.run(cmd, timeout=600, env={**os.environ, "FNMOE_TEST_SIGNAL_AT_STEP": str(STEPS)})
    if done.returncode != 130:  # a run a signal stopped exits 130
        sys.exit(f"the run exited {done.returncode}, not 130 (stopped after step {STEPS})")
    rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
losses = [r["loss"] for r in rows if "loss" in r]
out = ROOT / "tests" / "assets" / "golden_tiny_fp32.json"
out.write_text(json.dumps({"preset": "configs/tiny.toml", "steps": STEPS, "compute_dtype": "float32",
                           "compile": False, "losses": losses}, indent=1) + "\n")
print(f"wrote {out}: {losses[0]:.4f} -> {losses[-1]:.4f}")
