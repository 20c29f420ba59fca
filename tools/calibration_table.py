"""docs/memory_plan.md's "Validation against measured runs", from fnmoe/plan/calibration.py and the
planner: each block between `<!-- calibration:NAME -->` and `<!-- /calibration:NAME -->` there is
what BLOCKS[NAME] returns, so the section is regenerated, not typed.

  python tools/calibration_table.py           # print the blocks (~30 s on 2 cores, cold)
  python tools/calibration_table.py --write   # rewrite them in docs/memory_plan.md

tests/test_calibration.py checks that the page holds what this prints.
"""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "memory_plan.md"
GB = 1e9
ROWS = ("params", "grads", "optim", "gathered", "activations", "recompute_transient", "logits", "ep_buffers",
        "update_transient")
# (label, flags added to the first run's): item 8's memory table
# (the functional update, as issue 42 measured them; then the donated update, issue 43's default)
MEMORY_COLUMNS = (("NeMo's layout", "--train.no-donate"),
                  ("the preset's policy (the issue's 137 GB)",
                   "--memory.offload --memory.keep-exchange --train.no-donate"),
                  ("bf16 moments", "--plan.state-dtype bfloat16 --train.no-donate"),
                  ("NeMo's layout, the update donated (`--train.donate`, the default)", "--train.donate"))


def parsed(flags: str):
    """The RunConfig `fnmoe plan FLAGS` plans."""
    from fnmoe.cli.commands import parse_run
    return parse_run(shlex.split(flags), "fnmoe plan")


def planned() -> list[tuple]:
    """(measured run, its RunConfig, its plan as built, its residuals) for every run of RUNS."""
    from fnmoe.plan.calibration import RUNS, residuals
    from fnmoe.plan.summary import plan
    out = []
    for m in RUNS:
        run = parsed(m.flags)
        p = plan(run)
        out.append((m, run, p, residuals(run, p, m.tokens_per_s_per_gpu)))
    return out


def runs_block() -> str:
    rows = ["| run | source | layout | `fnmoe plan` | planned as built, stated rates | at measured rates | measured | "
            "measured / planned (stated) | (measured rates) | left out |", "|---|---|---|---|---|---|---|---|---|---|"]
    spread: dict[str, list[float]] = {"stated": [], "measured": []}
    for m, run, p, res in planned():
        at = {p["rates"]["mode"]: p["step_time"], p["step_time_beside"]["rates"]: p["step_time_beside"]}
        for k in spread:
            spread[k].append(res[k])
        rows.append(f"| {m.name} | {m.source} | {m.layout} | `{m.flags}` | "
                    f"{at['stated']['tokens_per_s_per_gpu_as_built']:,.0f} | "
                    f"{at['measured']['tokens_per_s_per_gpu_as_built']:,.0f} | {m.tokens_per_s_per_gpu:,.0f} | "
                    f"{res['stated']:.2f} | {res['measured']:.2f} | {m.left_out} |")
    return "\n".join(rows) + "\n\n" + " ".join(
        f"At the {k} rates the residuals span {min(v):.2f} to {max(v):.2f} ({max(v) / min(v):.1f}x)."
        for k, v in spread.items())


def unexpressed_block() -> str:
    from fnmoe.plan.calibration import UNEXPRESSED
    return "\n".join(["| run | source | why not planned |", "|---|---|---|"]
                     + [f"| {run} | {source} | {why} |" for run, source, why in UNEXPRESSED])


def memory_block() -> str:
    from fnmoe.plan.calibration import RUNS
    from fnmoe.plan.summary import plan
    plans = [plan(parsed(f"{RUNS[0].flags} {extra}"), as_built=False)["per_rank_bytes"] for _, extra in MEMORY_COLUMNS]
    rows = ["| GB a GPU | " + " | ".join(label for label, _ in MEMORY_COLUMNS) + " |",
            "|---|" + "---|" * len(MEMORY_COLUMNS)]
    rows += [f"| {key} | " + " | ".join(f"{r[key] / GB:.2f}" for r in plans) + " |" for key in ROWS]
    rows.append("| **total** (the larger of the step's and the update's peak) | "
                + " | ".join(f"**{r['total_device'] / GB:.2f}**" for r in plans) + " |")
    return "\n".join(rows)


BLOCKS = {"runs": runs_block, "unexpressed": unexpressed_block, "memory": memory_block}


def written(text: str, blocks: dict[str, str]) -> str:
    """text with each calibration block replaced by its new contents."""
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- calibration:{name} -->\n)(?:.*?\n)?(<!-- /calibration:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{DOC}: no <!-- calibration:{name} --> block")
        text = pattern.sub(lambda mt: mt.group(1) + body + "\n" + mt.group(2), text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the blocks in docs/memory_plan.md")
    args = ap.parse_args()
    blocks = {name: make() for name, make in BLOCKS.items()}
    if args.write:
        DOC.write_text(written(DOC.read_text(), blocks))
    else:
        print("\n\n".join(f"<!-- calibration:{n} -->\n{b}\n<!-- /calibration:{n} -->" for n, b in blocks.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
