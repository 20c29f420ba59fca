"""The CLI: flags of docs/design.md §3, overrides, run-directory files, errors, Ctrl-C."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fnmoe.cli import main, parse_run
from fnmoe.config import load_config
from conftest import tiny_flags

ROOT = Path(__file__).resolve().parent.parent
CONTRACT_FLAGS = [
    "--config", "--train.steps", "--train.seed", "--train.grad-accum", "--train.ce-chunks",
    "--train.run-dir", "--checkpoint.every", "--checkpoint.keep-last", "--resume",
    "--mesh.fsdp", "--mesh.ep", "--mesh.reshard-after-forward", "--mesh.no-reshard-after-forward",
    "--dist.timeout-s", "--model.compute-dtype", "--model.compile", "--model.no-compile",
    "--compile-cache", "--profile.steps", "--plan.imbalance", "--train.tokens", "--train.sample-every",
]
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu",
               "expert_load_max_over_mean", "time_s"}
SMALL = tiny_flags(2)


def fnmoe(*args, cwd, timeout=240):
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fnmoe", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_subcommands_and_contract_flags(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert all(f"\n  {sub} " in top for sub in ("train", "eval", "tokenizer train", "generate", "convert"))
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    missing = [f for f in CONTRACT_FLAGS if f not in out]
    assert not missing


def test_every_train_flag_has_a_description():
    """`fnmoe train --help` describes each flag (a config field's docstring is its help), beyond the
    default tyro appends; --resume says what auto picks and that the run's config is the base."""
    import warnings

    import tyro

    from fnmoe.cli.commands import TrainArgs, _flag_types
    from fnmoe.config import RunConfig

    with warnings.catch_warnings():  # get_parser is deprecated; the help is built from its parser
        warnings.simplefilter("ignore")
        parser = tyro.extras.get_parser(TrainArgs, default=TrainArgs(config="", run=RunConfig(name="tiny")),
                                        registry=_flag_types())
    helps = {a.option_strings[-1]: (a.help or "").split("(default:")[0].strip()
             for a in parser._actions if a.option_strings}
    assert len(helps) > 140
    assert [flag for flag, text in helps.items() if not text] == []
    assert "auto: continue from the newest" in helps["--resume"] and "config.toml" in helps["--resume"]


def test_overrides_apply_on_top_of_a_preset():
    run = parse_run(["--config", str(ROOT / "configs/tiny.toml"), "--train.steps", "7",
                     "--model.compute-dtype", "bfloat16", "--model.compile", "--mesh.no-reshard-after-forward",
                     "--model.moe.top-k", "3", "--resume", "none"], "fnmoe train")
    assert run.name == "tiny" and run.train.steps == 7 and run.model.compute_dtype == "bfloat16"
    assert run.model.compile and not run.mesh.reshard_after_forward and run.model.moe.top_k == 3
    assert run.model.dim == load_config(ROOT / "configs/tiny.toml").model.dim


def test_train_tokens_sets_the_steps_and_a_disagreement_is_refused(tmp_path):
    """--train.tokens N: ceil(N / (batch x seq_len)) steps for the batch the flags leave; given with
    --train.steps they must agree; --train.steps alone replaces a preset's token budget."""
    assert parse_run(["--train.tokens", "100000"], "t").train.steps == 49  # 16 x 128 = 2048 a step: 48.8
    run = parse_run(["--train.tokens", "100000", "--train.batch-size", "8"], "t")
    assert (run.train.steps, run.train.tokens) == (98, 100000)
    assert parse_run(["--train.tokens", "4096", "--train.steps", "2"], "t").train.steps == 2
    with pytest.raises(ValueError, match=r"train.steps=3 and train.tokens=4096 disagree: 4096 tokens at "
                       r"train.batch_size=16 x data.seq_len=128 tokens a step are 2 steps; set one of them"):
        parse_run(["--train.tokens", "4096", "--train.steps", "3"], "t")
    preset = tmp_path / "budget.toml"
    preset.write_text("[train]\ntokens = 8192\n")
    assert load_config(preset).train.steps == 4
    assert parse_run(["--config", str(preset), "--train.batch-size", "8"], "t").train.steps == 8
    run = parse_run(["--config", str(preset), "--train.steps", "7"], "t")
    assert (run.train.steps, run.train.tokens) == (7, 0)
    preset.write_text("[train]\ntokens = 8192\nsteps = 5\n")
    with pytest.raises(ValueError, match="train.steps=5 and train.tokens=8192 disagree"):
        load_config(preset)


@pytest.mark.launch
def test_train_writes_the_run_files_in_a_fresh_process(tmp_path):
    r = fnmoe("train", "--train.steps", "3", "--train.log-every", "1", "--train.ce-chunks", "2", *SMALL,
              cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run_dir = tmp_path / "runs" / "tiny"
    resolved = load_config(run_dir / "config.toml")
    assert resolved.train.steps == 3 and resolved.model.dim == 32 and resolved.train.ce_chunks == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(METRIC_KEYS <= r.keys() for r in steps)
    assert steps[-1]["tokens"] == 3 * 4 * 32 and steps[0]["mfu"] is None
    assert rows[-1].keys() == {"step", "val_loss", "val_ppl"} and rows[-1]["step"] == 3
    assert abs(rows[-1]["val_ppl"] - math.exp(rows[-1]["val_loss"])) <= 1e-9 * rows[-1]["val_ppl"]
    assert "step 3/3" in r.stdout and "held-out loss" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--model.moe.top-k", "9"], "model.moe.top_k=9 must be in 1..model.moe.n_experts=8"),
    (["--train.batch-size", "6", "--train.grad-accum", "4"], "train.batch_size=6 must be divisible"),
    (["--config", "nope.toml"], "config file not found: nope.toml"),
    (["--mesh.fsdp", "2"], "mesh.fsdp=2 x mesh.ep=1 = 2 ranks, but the job has 1"),
    (["--profile.steps", "5"], "profile.steps must be A:B"),
    (["--train.steps", "2", "--profile.steps", "1:3"], "profile.steps=1:3 ends after train.steps=2"),
    (["--plan.matmul-tflops", "0"], "plan.matmul_tflops must be > 0"),
    (["--plan.network-gbps", "-1"], "plan.network_gbps must be > 0"),
    (["--optim.ns-steps", "0"], "optim.ns_steps must be >= 1"),
    (["--train.threads", "-1"], "invalid config: train.threads must be in [0, 1024], got -1"),
    (["--optim.lr", "inf"], "invalid config: optim.lr must be finite, got inf"),
    (["--optim.beta2", "nan"], "invalid config: optim.beta2 must be finite, got nan"),
    (["--config", "."], "config . is a directory; it must name a TOML file"),
])
def test_bad_configs_are_named(args, message, capsys, tmp_path):
    assert main(["train", "--train.run-dir", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--model.dim", "2.5"), ("--model.dim", "x"), ("--optim.lr", "x"),
                                        ("--model.qk-norm", "1"), ("--model.moe.dense-layers", "a")])
def test_flags_are_typed_before_anything_is_created(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--train.run-dir", str(tmp_path / "run"), flag, value])
    assert e.value.code == 2 and not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert (flag in err or "Unrecognized options" in err) and value in err


def test_the_last_line_labels_its_losses_and_the_run_dir_keeps_the_console(tmp_path, capsys):
    """The done line's train loss is the last step's, beside the mean the last progress line showed
    (both from metrics.jsonl here); <run-dir>/console.log holds the log lines, a resume's appended."""
    assert main(["train", *SMALL, "--train.steps", "4", "--train.log-every", "4", "--train.run-dir",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
    mean = sum(loss[s] for s in (2, 3, 4)) / 3
    assert (f"final train loss {loss[4]:.4f} (step 4; {mean:.4f} the mean of steps 2-4, as on the progress line)"
            in out), out
    assert f"loss {mean:.4f} |" in out  # the progress line's figure
    console = (tmp_path / "console.log").read_text()
    assert console == out, (console, out)
    assert main(["train", *SMALL, "--train.steps", "5", "--train.run-dir", str(tmp_path), "--resume", "auto"]) == 0
    more = capsys.readouterr().out
    resumed = more[more.index("resuming from"):]  # the lines before the run took its directory are the CLI's
    assert (tmp_path / "console.log").read_text() == out + resumed
    assert "final train loss" in resumed and "(step 5)" in resumed


def test_convert_help_says_a_run_directory_works(capsys):
    assert main(["--help"]) == 0
    assert "--to-hf SRC --out DST: a run directory" in capsys.readouterr().out


def test_bad_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--train.stepz", "3"])
    assert e.value.code == 2
    assert "--train.stepz" in capsys.readouterr().err


def test_unknown_subcommand(capsys):
    assert main(["trian"]) == 2
    assert "unknown subcommand 'trian'" in capsys.readouterr().err


def test_profile_steps_writes_a_trace(tmp_path):
    assert main(["train", "--train.steps", "3", "--profile.steps", "2:3", "--train.run-dir", str(tmp_path),
                 *SMALL]) == 0
    trace = tmp_path / "profile" / "trace_steps_2_3.json"
    assert json.loads(trace.read_text())["traceEvents"]
    # resumed inside the window: the run profiles what is left of it (stopping a profiler it never
    # started used to raise)
    assert main(["train", "--train.steps", "5", "--profile.steps", "3:4", "--train.run-dir", str(tmp_path),
                 "--resume", "auto", *SMALL]) == 0
    assert json.loads((tmp_path / "profile" / "trace_steps_4_4.json").read_text())["traceEvents"]


@pytest.mark.launch
def test_ctrl_c_stops_cleanly_and_says_what_was_done(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "fnmoe", "train", "--train.steps", "100000", *SMALL],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted at step" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))


def test_checkpoint_verify_is_a_subcommand_and_names_a_missing_index(capsys, tmp_path):
    assert main(["--help"]) == 0
    assert "checkpoint verify DIR" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(tmp_path)]) == 2
    assert f"{tmp_path / 'index.json'} is missing" in capsys.readouterr().err


def test_checkpoint_flags_are_fields_of_the_config():
    run = parse_run(["--checkpoint.every", "5", "--checkpoint.keep-last", "2", "--checkpoint.async-save",
                     "--train.deterministic", "--resume", "auto"], "fnmoe train")
    assert (run.checkpoint.every, run.checkpoint.keep_last, run.checkpoint.async_save) == (5, 2, True)
    assert run.train.deterministic and run.resume == "auto"


def test_a_run_saves_a_checkpoint_every_500_steps_by_default():
    """A SIGKILL or the OOM killer loses at most 500 steps (TorchTitan's and HF Trainer's interval)
    unless --checkpoint.every says otherwise; every shipped preset keeps the default."""
    from fnmoe.config.toml import preset_path

    assert parse_run([], "fnmoe train").checkpoint.every == 500
    for preset in sorted(preset_path("tiny").parent.glob("*.toml")):
        assert parse_run(["--config", str(preset)], "fnmoe train").checkpoint.every == 500, preset
    assert parse_run(["--checkpoint.every", "0"], "fnmoe train").checkpoint.every == 0


def test_outputs_that_cannot_be_written_are_one_error(tmp_path, capsys, monkeypatch):
    """plot, prepare, convert and inspect into a directory under a file (and, not as root, under a
    read-only directory), a directory part that is a file mid-write, and generate into a full stdout:
    exit 2 and one line naming the path and the OS's reason, nothing written."""
    from fnmoe.config import ModelConfig, MoEConfig
    from fnmoe.models.params import init_params
    from fnmoe.tree_io import save_tree

    (tmp_path / "file").write_text("x")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    cfg = ModelConfig(dim=32, ffn_hidden=64, attention_impl="sdpa", moe=MoEConfig(impl="padded"))  # no C++ build
    save_tree(tmp_path / "tree", init_params(cfg), cfg)
    dests = {tmp_path / "file" / "sub": f"cannot make a directory under {tmp_path / 'file'}: Not a directory"}
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        dests[tmp_path / "ro" / "sub"] = f"cannot write in {tmp_path / 'ro'}: Permission denied"
    for dest, reason in dests.items():
        for cmd in (["plot", str(tmp_path / "run"), "--out", str(dest)],
                    ["prepare", "--input", str(tmp_path / "in.jsonl"), "--out", str(dest)],
                    ["convert", "--to-hf", str(tmp_path / "tree"), "--out", str(dest)],
                    ["inspect", "--dump", str(dest)]):
            assert main(cmd) == 2, cmd
            assert capsys.readouterr().err == f"fnmoe {cmd[0]}: error: --{cmd[-2].lstrip('-')} {dest}: {reason}\n"
    assert main(["plot", str(tmp_path / "file")]) == 2  # its default --out, RUN_DIR/plots, lies under a file
    assert "Not a directory" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "parts").write_text("x")  # found only when prepare makes it
    assert main(["prepare", "--input", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"fnmoe prepare: error: {tmp_path / 'out' / 'parts'}: File exists\n"

    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")
        flush = write
    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["generate", "--from", str(tmp_path / "tree"), "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == "fnmoe generate: error: cannot write the output to stdout: " \
                                      "No space left on device\n"


@pytest.mark.parametrize("args,message", [
    (["--top-p", "5"], "--top-p must be in (0, 1], got 5.0"), (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["--temperature", "nan"], "--temperature must be >= 0, got nan"),
])
def test_generate_flags_out_of_range(args, message, tmp_path, capsys):
    assert main(["generate", "--from", str(tmp_path), *args]) == 2
    assert capsys.readouterr().err == f"fnmoe generate: error: {message}\n"


def test_paths_that_do_not_exist_are_named_as_such(tmp_path, capsys):
    for cmd in (["checkpoint", "verify"], ["generate", "--from"], ["convert", "--out", str(tmp_path / "o"), "--to-hf"]):
        assert main([*cmd, str(tmp_path / "nope")]) == 2
        assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err
