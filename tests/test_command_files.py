"""Every command's file errors are one line naming the path and the OS's reason and leave no
temporary file (issue 35): `prepare` on a full disk, and stopped by SIGTERM (its workers end, a
rerun resumes) or killed (its workers end too); `convert` past a file-size limit; `plot` on a full
disk or an undecodable metrics.jsonl; `generate` when its checkpoint vanishes mid-read, and when
the run's tokenizer is missing. A full disk is /dev/full behind the temporary name a file is
written to, so the real write fails."""
import json
import multiprocessing
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fnmoe import checkpoint
from fnmoe.cli import main
from fnmoe.data.prepare import PART_DOCS, prepare, scan
from fnmoe.run.faults import PART_DELAY_ENV

from test_checkpoint import args, fnmoe_cmd, one_thread, spawn_env, train_here  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
FULL = "/dev/full"


def _jsonl(path: Path, n_docs: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "words " * (i % 9 + 3)}) + "\n"
                            for i in range(n_docs)))
    return path


def _one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err), err
    return err[-1]


def _temp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name)


@pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full")
def test_prepare_on_a_full_disk_names_the_file_and_leaves_no_temporary_file(tmp_path, capsys):
    """A part's write (numpy said "N requested and M written", naming neither file nor reason) and the
    final train.bin's each fail as one line; the temporary file is gone, the pool's workers have
    ended, and the same command then resumes and finishes."""
    src = _jsonl(tmp_path / "in.jsonl", 3 * PART_DOCS)
    out = tmp_path / "out"
    (out / "parts").mkdir(parents=True)
    (out / "parts" / "key.txt").write_text(scan([str(src)], "byte").key)  # this input's parts: not wiped
    os.symlink(FULL, out / "parts" / "000001.tmp.npy")
    cmd = ["prepare", "--input", str(src), "--out", str(out)]
    assert _one_line(capsys, cmd) == (f"fnmoe prepare: error: writing {out / 'parts' / '000001.npy'} failed: "
                                      "No space left on device (disk full or over a file-size limit)")
    assert _temp_files(out) == [] and multiprocessing.active_children() == []

    os.symlink(FULL, out / "train.tmp")  # where train.bin is written before its rename
    assert _one_line(capsys, cmd) == (f"fnmoe prepare: error: writing {out / 'train.bin'} failed: "
                                      "No space left on device (disk full or over a file-size limit)")
    assert _temp_files(out) == [] and not (out / "train.bin").exists() and (out / "parts" / "000002.npy").is_file()

    assert main(cmd) == 0
    assert json.loads((out / "index.json").read_text())["splits"]["train"]["docs"] == 3 * PART_DOCS - 77
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "train.bin", "val.bin"]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def _parts_done(out: Path) -> int:
    return len(list((out / "parts").glob("0*[0-9].npy")))


def _start_prepare(src: Path, out: Path) -> tuple[subprocess.Popen, list[int]]:
    """fnmoe prepare with 2 workers slowed to 0.3 s a part, once it has written a part; its workers."""
    before = _parts_done(out) if (out / "parts").is_dir() else 0
    proc = subprocess.Popen(fnmoe_cmd("prepare", "--input", str(src), "--out", str(out), "--workers", "2"),
                            env=spawn_env(PYTHONPATH=str(ROOT), **{PART_DELAY_ENV: "0.3"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and (
            not (out / "parts").is_dir() or _parts_done(out) <= before):
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    return proc, _children(proc.pid)


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_prepare_stops_its_workers_on_sigterm_or_its_death_and_a_rerun_resumes(tmp_path):
    """SIGKILL to prepare: its workers end within seconds (they watch it); SIGTERM: it stops as Ctrl-C
    does, its workers end with it, exit 130 with one line, no temporary file; the same command then
    resumes from the finished parts and writes what one uninterrupted run writes. (Before, SIGTERM
    ended prepare at once and left its tokenizer workers running.)"""
    src = _jsonl(tmp_path / "in.jsonl", 12 * PART_DOCS)
    out = tmp_path / "out"
    proc, workers = _start_prepare(src, out)
    assert len(workers) == 2
    proc.kill()
    proc.communicate(timeout=30)
    assert _gone(workers, 5), workers
    killed = set(_temp_files(out))  # a write SIGKILL cut short (overwritten when its part is done again)

    proc, workers = _start_prepare(src, out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == (f"fnmoe prepare: SIGTERM: stopped; finished parts stay in {out / 'parts'}: "
                                            "the same command resumes from them"), err
    assert "Traceback" not in err and _gone(workers, 5) and set(_temp_files(out)) <= killed
    assert 0 < _parts_done(out) < 13

    index = prepare([str(src)], "byte", out)
    assert index == prepare([str(src)], "byte", tmp_path / "whole")


@pytest.mark.launch
@pytest.mark.timeout(90)
def test_convert_past_a_file_size_limit_is_one_line_and_leaves_no_temporary_directory(tmp_path):
    """safetensors' own error (no file named, not an OSError: a traceback before) is one line naming
    the file as --out would hold it and the OS's reason; the temporary directory is removed."""
    run_dir = tmp_path / "run"
    train_here(*args(run_dir, 1))
    limit = 100_000  # the model's weights are ~0.3 MB

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    dst = tmp_path / "hf"
    r = subprocess.run(fnmoe_cmd("convert", "--to-hf", str(run_dir), "--out", str(dst)), cwd=tmp_path,
                       env=spawn_env(PYTHONPATH=str(ROOT)), preexec_fn=small_files, capture_output=True, text=True,
                       timeout=80)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"fnmoe convert: error: writing {dst / 'model.safetensors'} failed: "
                                                 "File too large (disk full or over a file-size limit)"), r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # neither hf nor a .hf.* temporary directory


@pytest.mark.launch
def test_plot_on_a_full_disk_or_of_undecodable_metrics_is_one_line(tmp_path, capsys):
    """matplotlib's OSError names no file; the chart is written to a temporary name, removed on
    failure, so no partial PNG is left; a metrics.jsonl that is not UTF-8 is named too. The full disk
    is a file-size limit here: a run's files are never written through a link (issue 56), so
    /dev/full behind the temporary name is refused before a write."""
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 100.0} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plots = tmp_path / "plots"
    plots.mkdir()

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # a chart is ~20 kB
    r = subprocess.run(fnmoe_cmd("plot", str(tmp_path)), cwd=tmp_path, env=spawn_env(PYTHONPATH=str(ROOT)),
                       preexec_fn=small_files, capture_output=True, text=True, timeout=80)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"fnmoe plot: error: writing {plots / 'loss.png'} failed: File too large (disk full or over a file-size "
        "limit)")
    assert list(plots.iterdir()) == []
    assert main(["plot", str(tmp_path)]) == 0 and (plots / "loss.png").is_file() and _temp_files(plots) == []
    capsys.readouterr()

    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 5.0}\n\xff\xfe\n')
    assert _one_line(capsys, ["plot", str(tmp_path)]) == (
        f"fnmoe plot: error: {tmp_path / 'metrics.jsonl'}: not UTF-8 text (byte 25: invalid start byte)")


def test_generate_chooses_again_when_its_checkpoint_vanishes_and_warns_when_the_tokenizer_is_gone(
        tmp_path, capsys, monkeypatch):
    """A run's newest checkpoint removed while generate reads it (as a training run's keep-last does)
    is said on stderr and the next newest read instead (an error before); a run trained on a prepared
    corpus that is gone generates with bytes and says so (silently before)."""
    run_dir = tmp_path / "run"
    train_here(*args(run_dir, 2, "--checkpoint.every", "1"))
    load_params = checkpoint.load_params

    def vanishing(ckpt):
        if Path(ckpt).name == "step_2":
            shutil.rmtree(ckpt)
        return load_params(ckpt)
    monkeypatch.setattr(checkpoint, "load_params", vanishing)
    capsys.readouterr()
    assert main(["generate", "--from", str(run_dir), "--prompt", "a", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    root = run_dir / "checkpoints"
    assert (f"fnmoe: {root / 'step_2'} vanished while it was read (a training run's --checkpoint.keep-last removes "
            "older checkpoints); choosing the newest complete one again") in err
    assert f"using {root / 'step_1'} (step 1)" in err and out.startswith("a")
    monkeypatch.undo()

    corpus = tmp_path / "corpus"
    prepare([str(_jsonl(tmp_path / "in.jsonl", 1000))], "byte", corpus)
    train_here(*args(tmp_path / "run2", 1, "--data.corpus", str(corpus)))
    shutil.rmtree(corpus)
    capsys.readouterr()
    assert main(["generate", "--from", str(tmp_path / "run2"), "--prompt", "a", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert (f"warning: {corpus}, the corpus {tmp_path / 'run2' / 'checkpoints' / 'step_1'} trained on, is missing, "
            "and with it the tokenizer it was prepared with; generating with bytes (ids 0-255), which garbles the "
            "text unless that tokenizer was 'byte'") in err, err
    assert out.startswith("a")
