"""Files a command finds in place that are not what they should be (issue 46): integer weights in a
Hugging Face checkpoint are refused naming the tensor and its dtype (they were cast to float
silently); symlinks planted in a run directory are refused, not written through; a kernel build
killed mid-way leaves nothing that blocks the next one."""
import fcntl
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fnmoe import hf
from fnmoe.cli import main
from fnmoe.config import ModelConfig, MoEConfig
from fnmoe.kernels import gemm
from fnmoe.models.params import init_params
from fnmoe.run import rundir
from fnmoe.run.metrics import drop_rows_after
from conftest import tiny_flags

ROOT = Path(__file__).resolve().parent.parent
PRECIOUS = "a file outside the run\n"


# ---------------------------------------------------------------- HF weights of a non-float dtype

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = ModelConfig(dim=32, ffn_hidden=64, n_layers=2, moe=MoEConfig(expert_hidden=32, n_experts=4))
    return hf.save(tmp_path_factory.mktemp("hf") / "model", init_params(cfg), cfg)


def _with(src: Path, dst: Path, key: str, dtype: torch.dtype) -> Path:
    """A copy of the checkpoint src with tensor key cast to dtype."""
    shutil.copytree(src, dst)
    tensors = load_file(src / hf.SINGLE)
    save_file(tensors | {key: tensors[key].to(dtype)}, dst / hf.SINGLE)
    return dst


def test_integer_weights_are_refused_naming_the_tensor_and_dtype(hf_dir, tmp_path, capsys):
    """convert and generate (as eval and train.init_from_hf, through hf.load): exit 2, one line."""
    key = "model.layers.0.self_attn.q_proj.weight"
    bad = _with(hf_dir, tmp_path / "int32", key, torch.int32)
    line = f"tensor '{key}' is torch.int32, not a floating-point dtype: fnmoe reads weights as floats\n"
    assert main(["convert", "--from-hf", str(bad), "--out", str(tmp_path / "tree")]) == 2
    assert capsys.readouterr().err == "fnmoe convert: error: " + line
    assert not (tmp_path / "tree").exists()
    assert main(["generate", "--from", str(bad), "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == "fnmoe generate: error: " + line
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    with pytest.raises(ValueError, match=f"^tensor '{key}' is torch.bool, not a floating-point dtype"):
        hf.load(_with(hf_dir, tmp_path / "bool", key, torch.bool))
    assert hf.load(hf_dir)  # the float original loads


# ---------------------------------------------------------------- symlinks in a run directory

def _train_error(capsys, run_dir: Path) -> str:
    argv = [*tiny_flags(1), "--train.steps", "1", "--train.eval-every", "0", "--train.run-dir", str(run_dir),
            "--model.moe.impl", "padded", "--model.attention-impl", "sdpa"]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _refused(what: str, path: Path) -> str:
    return (f"fnmoe train: error: {what} {path} refused: it is a symbolic link, and a run writes only its own "
            "files; remove the link")


def test_symlinks_planted_in_the_run_directory_are_refused(tmp_path, capsys):
    """fnmoe.lock or metrics.jsonl linked to a file outside: exit 2 naming the link, the file it
    names unchanged; a config.toml link is replaced by the run's own file, not written through."""
    victim = tmp_path / "victim.txt"
    victim.write_text(PRECIOUS)
    for name, what in ((rundir.LOCK, "creating the lock file"), ("metrics.jsonl", "opening")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / name).symlink_to(victim)
        (run_dir / "config.toml").symlink_to(victim)
        assert _train_error(capsys, run_dir) == _refused(what, run_dir / name)
        assert victim.read_text() == PRECIOUS and (run_dir / name).is_symlink()
    assert not (tmp_path / "metrics.jsonl" / "config.toml").is_symlink()  # written, as a file of its own
    assert not list(tmp_path.glob(f"metrics.jsonl/{rundir.LOCK}"))  # released


def test_resume_and_whole_file_writes_follow_no_symlink(tmp_path):
    """drop_rows_after (a resume's rewrite of metrics.jsonl) and write_text (config.toml,
    stopped.json, wandb_id) through a link at the file or at its temp file: refused, nothing written."""
    victim = tmp_path / "victim.txt"
    victim.write_text(PRECIOUS)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(rundir.RunDirError, match=f"^rewriting {tmp_path / 'metrics.jsonl'} refused: it is a symbolic"):
        drop_rows_after(tmp_path / "metrics.jsonl", 0)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "metrics.jsonl.tmp").symlink_to(victim)
    with pytest.raises(rundir.RunDirError, match=f"^rewriting {tmp_path / 'metrics.jsonl.tmp'} refused"):
        drop_rows_after(tmp_path / "metrics.jsonl", 1)
    (tmp_path / "config.toml.tmp").symlink_to(victim)
    with pytest.raises(rundir.RunDirError, match=f"^writing {tmp_path / 'config.toml.tmp'} refused"):
        rundir.write_text(tmp_path / "config.toml", "x = 1\n")
    assert victim.read_text() == PRECIOUS and not (tmp_path / "config.toml").exists()


# ---------------------------------------------------------------- a kernel build killed mid-way

HOLD = """import sys, time
from pathlib import Path
from fnmoe.kernels import gemm
build = Path(sys.argv[1])
with gemm.build_lock(build):
    (build / gemm.TORCH_LOCK).touch()  # what cpp_extension.load holds while it builds
    print("building", flush=True)
    time.sleep(600)
"""

LOAD = """import logging, sys
from pathlib import Path
from fnmoe.kernels import gemm
logging.basicConfig(level=logging.INFO, format="%(message)s")
gemm.build_dir = lambda: Path(sys.argv[1])
print(gemm.available())
"""


def test_a_kernel_build_killed_mid_way_blocks_no_later_one(tmp_path):
    """A builder killed with kill -9 while it holds torch's lock file: the next load removes that
    file with a line and loads (it waited on it forever). While the builder lives, its flock is held:
    a later one waits for it rather than taking its lock file. The build directory starts as a copy
    of the checkout's build, where there is one, so that no second 17 s build runs."""
    build = tmp_path / "build"
    built = gemm.build_dir()
    if (built / f"{gemm.NAME}.so").exists():
        shutil.copytree(built, build, ignore=shutil.ignore_patterns(gemm.LOCK, gemm.TORCH_LOCK))
    else:
        build.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(build)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "building\n"
        fd = os.open(build / gemm.LOCK, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=30)
    assert (build / gemm.TORCH_LOCK).exists()
    out = subprocess.run([sys.executable, "-c", LOAD, str(build)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout == "True\n", out.stdout + out.stderr
    assert (f"removed {build / gemm.TORCH_LOCK}, left by a process killed while it built or loaded fnmoe's C++ CPU "
            "kernels") in out.stderr
    assert not (build / gemm.TORCH_LOCK).exists()
