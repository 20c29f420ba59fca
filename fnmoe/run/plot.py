"""`fnmoe plot RUN_DIR`: PNG charts of a run's metrics.jsonl (matplotlib, an optional extra).

Charts: loss.png (train loss and held-out loss over steps; for a data mixture also one held-out
curve per source), tokens_per_s.png, mfu.png (only
when the run had a peak configured), expert_load.png (per-MoE-layer busiest-expert load over the
mean, a heatmap over steps). Each returns the series it drew so tests can check them against the
file. A file that cannot be read or written is one error naming it and the reason; a chart is written
to a temporary name and renamed, so a failure (a full disk) leaves no partial PNG behind.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from fnmoe.run.rundir import RunDirError, no_link_below, open_file, os_reason


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(step rows, val rows) of run_dir/metrics.jsonl, the last value winning for a repeated step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    steps: dict[int, dict] = {}
    vals: dict[int, dict] = {}
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # a run killed mid-write leaves a torn last line: the rest stands
                continue
            raise ValueError(f"{path}, line {lineno}: invalid JSON") from None
        if ("loss" in row or "val_loss" in row) and not isinstance(row.get("step"), int):
            raise ValueError(f"{path}, line {lineno}: a metrics row without an integer 'step'")
        if "loss" in row:
            steps[row["step"]] = row
        elif "val_loss" in row:
            vals[row["step"]] = row
    return [steps[k] for k in sorted(steps)], [vals[k] for k in sorted(vals)]


def _source_curves(vals: list[dict]) -> dict[str, tuple[list, list]]:
    """A mixture's held-out curve per source ("held-out <name>" from its val_loss/<name> keys), in the
    order the sources first appear."""
    names = list(dict.fromkeys(k.removeprefix("val_loss/") for v in vals for k in v if k.startswith("val_loss/")))
    return {f"held-out {name}": ([v["step"] for v in vals if v.get(f"val_loss/{name}") is not None],
                                 [v[f"val_loss/{name}"] for v in vals if v.get(f"val_loss/{name}") is not None])
            for name in names}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("fnmoe plot needs matplotlib: pip install 'fnmoe[plot]' (or matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _line_chart(plt, path: Path, root: Path, title: str, ylabel: str, series: dict[str, tuple[list, list]]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, (x, y) in series.items():
        ax.plot(x, y, label=label, marker="o" if len(x) < 30 else None)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    _save(plt, fig, path, root)


def _save(plt, fig, path: Path, root: Path) -> None:
    """fig as a PNG at path, via a new file at a temporary name opened as a run's files are (no
    symlink under root, no file shared by a hard link: fnmoe.run.rundir.open_file); an OSError (a
    full disk) removes it and is one line naming path and the OS's reason (matplotlib's names no file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    made = False
    try:
        with os.fdopen(open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "writing", root), "wb") as f:
            made = True
            fig.savefig(f, format="png")
        os.replace(tmp, path)
    except OSError as e:
        raise ValueError(f"writing {path} failed: {os_reason(e)}") from None
    finally:
        plt.close(fig)
        if made:
            with contextlib.suppress(OSError):
                tmp.unlink()


def moe_layers(run_dir: str | Path, n: int) -> list[int]:
    """The model layer of each of the n MoE layers the metrics list, from the run's config.toml (the
    dense layers, e.g. a dense first layer, are not in the metrics); 0..n-1 when it cannot be read."""
    from fnmoe.config import load_config

    try:
        cfg = load_config(Path(run_dir) / "config.toml", validate_config=False).model
    except (OSError, ValueError):
        return list(range(n))
    layers = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    return layers if len(layers) == n else list(range(n))


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, dict]:
    """Write the PNGs; returns {file name: {series label: (x, y)}} of what was drawn."""
    plt = _pyplot()
    rows, vals = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step rows to plot")
    out = Path(out_dir or Path(run_dir) / "plots")
    root = Path(out_dir or run_dir)  # a directory named by --out may be a link; plots/ in a run may not
    no_link_below(root, out / "loss.png", "writing")
    made = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"creating {out} failed: {os_reason(e)}") from None
    try:
        return _draw(plt, run_dir, rows, vals, out, root)
    except BaseException:  # a failed plot leaves no directory it made
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def _draw(plt, run_dir, rows: list[dict], vals: list[dict], out: Path, root: Path) -> dict[str, dict]:
    x = [r["step"] for r in rows]
    drawn: dict[str, dict] = {
        "loss.png": {"train": (x, [r["loss"] for r in rows]),
                     **({"held-out": ([v["step"] for v in vals], [v["val_loss"] for v in vals])} if vals else {}),
                     **_source_curves(vals)},
    }
    if any("tokens_per_s" in r for r in rows):
        tps_rows = [r for r in rows if "tokens_per_s" in r]
        drawn["tokens_per_s.png"] = {"tokens/s": ([r["step"] for r in tps_rows], [r["tokens_per_s"] for r in tps_rows])}
    if any(r.get("mfu") is not None for r in rows):
        mfu_rows = [r for r in rows if r.get("mfu") is not None]
        drawn["mfu.png"] = {"MFU %": ([r["step"] for r in mfu_rows], [100 * r["mfu"] for r in mfu_rows])}
    titles = {"loss.png": ("loss", "cross-entropy (nats/token)"), "tokens_per_s.png": ("throughput", "tokens/s"),
              "mfu.png": ("model FLOPs utilisation", "MFU %")}
    for name, series in drawn.items():
        _line_chart(plt, out / name, root, *titles[name], series)
    loads = [r["expert_load_by_layer"] for r in rows if r.get("expert_load_by_layer")]
    if loads:
        steps = [r["step"] for r in rows if r.get("expert_load_by_layer")]
        fig, ax = plt.subplots(figsize=(8, 3 + 0.25 * len(loads[0])), dpi=100)
        im = ax.imshow(list(map(list, zip(*loads))), aspect="auto", cmap="magma", interpolation="nearest",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, len(loads[0]) - 0.5, -0.5))
        layers = moe_layers(run_dir, len(loads[0]))
        ax.set(title="busiest expert / mean load per MoE layer", xlabel="step", ylabel="layer")
        ax.set_yticks(range(len(layers)), [str(i) for i in layers])  # whole rows, named by model layer
        fig.colorbar(im, ax=ax, label="max / mean")
        fig.tight_layout()
        _save(plt, fig, out / "expert_load.png", root)
        drawn["expert_load.png"] = {f"layer {i}": (steps, [l[k] for l in loads]) for k, i in enumerate(layers)}
    return drawn
