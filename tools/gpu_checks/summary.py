"""The summary of tools/gpu_check.sh: `python tools/gpu_checks/summary.py --results DIR [--dry-run]`.

Reads the per-step files the checks (tools/gpu_checks/, run by tools/gpu_check.py) wrote in DIR
(<step>.json: rows and notes, <step>.rc: the step's exit status from gpu_check.sh) and prints one
table, also written to $OUT/gpu_check.txt (with each step's JSON) when $OUT is set. Exit status 1
when a check failed or a step died.

Imports neither torch nor fnmoe (a second or two of the dry run's time on a small CPU): the steps
record the torch version and device they ran on in their JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SECTIONS = {"correctness": "1 correctness", "k2layer": "2 K2 MoE layer", "moe": "3 moe bench",
            "model": "4 model 16B-cut", "determinism": "5 determinism"}
STEPS = list(SECTIONS)


def summary(results: Path, dry: bool) -> int:
    """Print the table of every step's rows (and $OUT/gpu_check.txt); 1 when a check failed or a step died."""
    rows, notes, bad, env = [], [], 0, ""
    for step in STEPS:
        section = SECTIONS[step]
        path, rc_path = results / f"{step}.json", results / f"{step}.rc"
        data = json.loads(path.read_text()) if path.is_file() else {"rows": [], "notes": []}
        notes += [n for n in data.get("notes", []) if n not in notes]
        env = env or data.get("env", "")
        rc = rc_path.read_text().strip() if rc_path.is_file() else "not run"
        for check, result, st in data["rows"]:
            rows.append((section, check, result, st))
            bad += st == "FAIL"
        if rc != "0":
            why = {"124": "TIMEOUT (partial rows above)", "137": "KILLED after timeout", "not run": "NOT RUN",
                   "skipped": "SKIPPED (time budget spent)"}.get(rc, f"exit {rc}")
            rows.append((section, "step", why, "FAIL" if rc != "skipped" else "skip"))
            bad += rc != "skipped"
        if not data["rows"] and rc == "0":
            rows.append((section, "step", "no rows", "FAIL"))
            bad += 1
    w = [max(len(r[i]) for r in rows + [("section", "check", "result", "status")]) for i in range(3)]
    w = [min(x, cap) for x, cap in zip(w, (18, 58, 120))]
    head = f"{'section':<{w[0]}}  {'check':<{w[1]}}  {'result':<{w[2]}}  status"
    lines = ["", "GPU CHECK SUMMARY" + (" (dry run on CPU, tiny sizes)" if dry else ""), head, "-" * len(head)]
    for s, c, r, st in rows:
        r = r if len(r) <= w[2] else r[:w[2] - 3] + "..."
        lines.append(f"{s:<{w[0]}}  {c[:w[1]]:<{w[1]}}  {r:<{w[2]}}  {st}")
    env = env or f"python {sys.version.split()[0]} (no step recorded its torch)"
    lines += ["-" * len(head), f"{env}; {bad} failed", *[f"note: {n}" for n in notes]]
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_check.txt").write_text(text + "\n")
        for step in STEPS:
            if (results / f"{step}.json").is_file():
                (Path(out) / f"gpu_check_{step}.json").write_text((results / f"{step}.json").read_text())
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True, help="directory of the per-step JSON files")
    ap.add_argument("--dry-run", action="store_true", help="say so in the title")
    args = ap.parse_args(argv)
    return summary(Path(args.results), args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
