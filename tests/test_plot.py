"""`fnmoe plot`: every PNG decodes, and its series and point counts match metrics.jsonl."""
import json

import pytest

from fnmoe.cli import main
from fnmoe.run.plot import plot_run
from conftest import tiny_flags

pytest.importorskip("matplotlib")
SMALL = tiny_flags(1)


def test_plots_match_the_metrics_file(tmp_path):
    import matplotlib.image

    run_dir = tmp_path / "run"
    assert main(["train", "--train.steps", "6", "--train.eval-every", "2", "--train.peak-tflops", "1",
                 "--train.run-dir", str(run_dir), *SMALL]) == 0
    assert main(["plot", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    vals = [r for r in rows if "val_loss" in r]
    drawn = plot_run(run_dir, tmp_path / "again")
    assert set(drawn) == {"loss.png", "tokens_per_s.png", "mfu.png", "expert_load.png"}
    for name in drawn:
        img = matplotlib.image.imread(run_dir / "plots" / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert drawn["loss.png"]["train"] == ([r["step"] for r in steps], [r["loss"] for r in steps])
    assert drawn["loss.png"]["held-out"] == ([r["step"] for r in vals], [r["val_loss"] for r in vals])
    assert len(vals) == 3  # steps 2, 4 and the final one
    assert drawn["tokens_per_s.png"]["tokens/s"][1] == [r["tokens_per_s"] for r in steps]
    assert drawn["mfu.png"]["MFU %"][1] == [100 * r["mfu"] for r in steps]
    n_moe = len(steps[0]["expert_load_by_layer"])
    assert n_moe == 3 and len(drawn["expert_load.png"]) == n_moe
    # named by model layer: the tiny preset's first layer is dense, so its MoE layers are 1, 2, 3
    assert list(drawn["expert_load.png"]) == ["layer 1", "layer 2", "layer 3"]
    assert all(len(x) == len(steps) for x, _ in drawn["expert_load.png"].values())


def test_plot_errors_name_the_problem(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5, "tokens_per_s": 9}\n{"step": 3, "lo')
    drawn = plot_run(tmp_path)  # a killed run's torn last line is skipped; a row without tokens/s is not drawn there
    assert drawn["loss.png"]["train"] == ([1, 2], [2.0, 1.5]) and drawn["tokens_per_s.png"]["tokens/s"] == ([2], [9])
    metrics.write_text('{"loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert "line 1: a metrics row without an integer 'step'" in capsys.readouterr().err


def test_tensorboard_scalars_and_expert_histograms(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    assert main(["train", "--train.steps", "3", "--train.tensorboard", "--train.run-dir", str(run_dir), *SMALL]) == 0
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(losses, rel=1e-6)
    assert acc.Scalars("val_loss")[-1].value == pytest.approx(rows[-1]["val_loss"], rel=1e-6)
    hists = [t for t in acc.Tags()["histograms"] if t.startswith("expert_load/")]
    assert len(hists) == 3 and len(acc.Histograms(hists[0])) == 3
