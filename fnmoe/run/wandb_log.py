"""--train.wandb: the metrics rows, the expert-load histograms and the resolved config, logged to
Weights & Biases (the optional extra `fnmoe[wandb]`).

Legend: N MoE layers, E experts.

Imported only when a run asks for it, so `import fnmoe` never imports wandb. The W&B run's id is
kept in <run-dir>/wandb_id: a resumed run (--resume) continues the same W&B run
(`wandb.init(id=..., resume="allow")`), a fresh run in the directory starts a new one. Every row
carries fnmoe's own `step`, which is each chart's x axis (wandb.define_metric), so the rows a
resume writes again after its checkpoint's step land on the same steps instead of being refused
as W&B's internal step goes back. WANDB_MODE=offline writes the run under <run-dir>/wandb/ with no
network; `wandb sync` uploads it later.
"""
from __future__ import annotations

import secrets
from pathlib import Path

import torch

from fnmoe.run import rundir
from fnmoe.config import RunConfig, to_dict

ID_FILE = "wandb_id"
INSTALL = "pip install 'fnmoe[wandb]'"


def _wandb():
    try:
        import wandb
    except ImportError:
        raise ValueError(f"train.wandb needs the wandb package: {INSTALL} (or pip install wandb)") from None
    return wandb


class WandbWriter:
    """A mirror of metrics.jsonl (fnmoe.run.metrics.MetricsWriter): the numeric values of each row, and
    for a step row a histogram of tokens per expert for each MoE layer, as TensorBoardWriter writes."""

    def __init__(self, run: RunConfig, run_dir: Path, resumed: bool):
        self.wandb = wandb = _wandb()
        id_path = Path(run_dir) / ID_FILE
        run_id = id_path.read_text().strip() if resumed and id_path.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)  # W&B run ids: lowercase letters and digits
            rundir.write_text(id_path, run_id + "\n")
        t = run.train
        try:
            self.run = wandb.init(project=t.wandb_project, name=t.wandb_name or run.name, id=run_id, resume="allow",
                                  dir=str(run_dir), config=to_dict(run),
                                  # fnmoe's progress lines stay on the terminal alone; the metrics go as data
                                  settings=wandb.Settings(console="off"))
        except Exception as e:  # wandb raises its own error types (no network, no login, a refused run)
            raise ValueError(f"train.wandb: wandb.init failed ({type(e).__name__}: {e}); WANDB_MODE=offline logs "
                             "without a network (`wandb sync` uploads the run later)") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, row: dict, expert_counts_NE: torch.Tensor | None = None) -> None:
        data = {key: value for key, value in row.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if expert_counts_NE is not None:
            for layer, counts_E in enumerate(expert_counts_NE.float().cpu()):
                # one sample per expert, its token count: the load distribution (TensorBoard's too)
                data[f"expert_load/moe_layer_{layer}"] = self.wandb.Histogram(counts_E.numpy())
        self.run.log(data)

    def close(self) -> None:
        self.run.finish()
