"""Loss curves of the mesh matrix, AdamW and Muon, on real gloo process groups.

Meshes 2x2, 4x1 and 1x4 train in ONE torchrun launch of 4 processes and 2x1, 1x2 in one launch of
2 (fnmoe.parallel.sharding.make_mesh needs world == fsdp * ep, so a world-4 job cannot build the world-2
meshes); the two launches run side by side. Each process runs this file as a script (`_worker`):
one default gloo group with a 10 s timeout, a fresh mesh (new subgroups, 10 s timeouts) per mesh
and run, test_sharding's training loop (its B, L, tokens and contiguous per-rank batch parts) on
the tiny preset's model in float32, eager (configs/tiny.toml with --model.compute-dtype float32
--model.no-compile) for STEPS steps (2 of warm-up, then the cosine) with each optimizer the mesh
runs (RUNS), and each rank writes its losses to rank<r>.json; rank 0 saves the whole initial params
of every mesh to init.pt. The tests compare them with one process (1x1) run here, in the pytest
process: initial params bitwise, first-step loss to 1e-6 and every step's loss to 1e-4 relative.

AdamW runs on every mesh, and on 2x2 once more with --mesh.reduce-dtype bfloat16 (its curve held to
2x2's float32-reduce curve, not to one process); Muon on 2x2 (both axes at once) and the world-2
meshes: its update on 4x1 and 1x4 is checked bitwise against one process on gloo by
test_muon_mesh.py (and its 2x2 curve with MuonClip there too), so the world-4 launch, the slowest
part of this file, skips those two
(on 2 shared AMD EPYC cores the launches took 114 s with 10 steps of both optimizers on every mesh,
62 s as now). (First-step gradients and Muon's first-step params on every mesh, simulated:
test_sharding.py, test_muon_mesh.py.)
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.config import DistConfig, MeshConfig, OptimConfig, load_config
from fnmoe.parallel.sharding import init_params
from fnmoe.tree import flatten_dict

from conftest import whole
from test_sharding import _train  # tests/ is on sys.path: pytest's rootdir import, a script's own dir

ROOT = Path(__file__).resolve().parents[1]
CFG = dataclasses.replace(load_config(ROOT / "configs" / "tiny.toml").model, compute_dtype="float32", compile=False)
STEPS = 6
OPTIMS = {"adamw": OptimConfig(warmup_steps=2),  # test_sharding's AdamW rows
          # test_muon_mesh's, with Newton-Schulz in float32: in bfloat16 a gradient's last-bit difference
          # (another reduction order) flips single entries of the update by a bf16 ulp, and ten steps
          # of that on the tiny preset reach ~1e-3 relative in the loss on every mesh
          "muon": OptimConfig(name="muon", lr=0.02, adamw_lr=3e-3, warmup_steps=2, ns_dtype="float32")}
BOTH = tuple(OPTIMS)
BF16_REDUCE = "adamw bf16-reduce"  # AdamW with --mesh.reduce-dtype bfloat16: compared with 2x2's fp32 reduce
RUNS = {4: {(2, 2): (*BOTH, BF16_REDUCE), (4, 1): ("adamw",), (1, 4): ("adamw",)},  # world: {mesh: runs}
        2: {(2, 1): BOTH, (1, 2): BOTH}}
MESHES = [m for ms in RUNS.values() for m in ms]
CURVES = [(m, opt) for ms in RUNS.values() for m, opts in ms.items() for opt in opts if opt in OPTIMS]
DIST = DistConfig(timeout_s=10)
BF16_REDUCE_TOL = 1e-3
pytestmark = [pytest.mark.timeout(240), pytest.mark.launch, pytest.mark.slow]  # torchrun, ~60 s of setup


def _name(mesh_shape) -> str:
    return "x".join(map(str, mesh_shape))


def _worker(out: Path) -> None:
    """One rank of a launch: every mesh of RUNS[world], each of its optimizers, STEPS steps."""
    fdist.init_from_env(DIST)
    rank, world = dist.get_rank(), dist.get_world_size()
    results, inits = {}, {}
    for shape, opts in RUNS[world].items():
        mesh = sharding.make_mesh(MeshConfig(fsdp=shape[0], ep=shape[1]), DIST)
        inits[_name(shape)] = {k: whole(v) for k, v in flatten_dict(init_params(CFG, 0, mesh=mesh)).items()}
        for opt in opts:
            start = time.perf_counter()
            losses, _ = _train(shape, STEPS, optim_cfg=OPTIMS[opt.split()[0]], cfg=CFG,  # its own mesh (new groups)
                               reduce_dtype="bfloat16" if opt == BF16_REDUCE else "float32")
            results[f"{_name(shape)} {opt}"] = {"losses": losses, "time_s": time.perf_counter() - start}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    if rank == 0:
        torch.save(inits, out / "init.pt")
    dist.barrier()
    dist.destroy_process_group()
    fdist.exit_worker(0)


# ---------------------------------------------------------------- tests (read what the ranks wrote)

@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict:
    """{world: ([rank results], {mesh: initial params})}: both launches, run side by side."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start, jobs = time.monotonic(), {}
    for world in RUNS:
        out = tmp_path_factory.mktemp(f"mesh_curves_world{world}")
        jobs[world] = out, subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
             __file__, str(out)], cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)  # its own process group: a hung launch is killed with its ranks
    got = {}
    try:
        for world, (out, job) in jobs.items():
            log = job.communicate(timeout=150)[0]
            assert job.returncode == 0, f"world-{world} launch:\n{log[-5000:]}"
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
            times = ", ".join(f"{k} {v['time_s']:.1f} s" for k, v in ranks[0].items())
            print(f"\nworld-{world} gloo launch: done by {time.monotonic() - start:.1f} s ({times})")
            got[world] = ranks, torch.load(out / "init.pt")
    finally:
        for _, job in jobs.values():
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    return got


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process: {optimizer: losses of STEPS steps}."""
    return {opt: _train((1, 1), STEPS, optim_cfg=ocfg, cfg=CFG)[0] for opt, ocfg in OPTIMS.items()}


@pytest.mark.parametrize("shape", MESHES, ids=_name)
def test_initial_params_on_every_mesh_equal_one_process(shape, launches):
    _, inits = launches[shape[0] * shape[1]]
    got, want = inits[_name(shape)], flatten_dict(init_params(CFG, 0))
    assert got.keys() == want.keys()
    for path, w in want.items():
        assert torch.equal(got[path], w), (shape, path)


@pytest.mark.parametrize("shape,opt", CURVES, ids=[f"{_name(m)}-{o}" for m, o in CURVES])
def test_loss_curve_on_every_mesh_matches_one_process(shape, opt, launches, reference):
    ranks, _ = launches[shape[0] * shape[1]]
    want = reference[opt]
    curves = [r[f"{_name(shape)} {opt}"]["losses"] for r in ranks]
    assert all(c == curves[0] for c in curves), curves  # every rank reports the all-summed loss
    got = curves[0]
    assert len(got) == len(want) == STEPS
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    print(f"\n{_name(shape)} {opt}: first-step rel diff {rel[0]:.2e}, max over {STEPS} steps {max(rel):.2e}")
    assert rel[0] <= 1e-6, (got, want)
    assert max(rel) <= 1e-4, (got, want)


def test_bf16_reduce_scatter_curve_stays_near_float32s(launches):
    """--mesh.reduce-dtype bfloat16 on 2x2: each rank's gradient is rounded to bf16 (8 significant
    bits, 2^-9 relative) and summed over ranks in bf16 by the collective, then kept and updated in
    float32. AdamW divides each update by its second moment, so these roundings move the loss far
    less than the gradient's own noise: within BF16_REDUCE_TOL relative of the float32 reduce-scatter's
    curve on every step (the first step's loss is the forward of the same params: equal)."""
    ranks, _ = launches[4]
    fp32, bf16 = ([r[f"2x2 {name}"]["losses"] for r in ranks] for name in ("adamw", BF16_REDUCE))
    assert all(c == bf16[0] for c in bf16), bf16
    rel = [abs(a - b) / abs(b) for a, b in zip(bf16[0], fp32[0])]
    print(f"\n2x2 adamw, bf16 vs fp32 reduce-scatter: max rel loss diff over {STEPS} steps {max(rel):.2e}")
    assert len(rel) == STEPS and rel[0] == 0.0, (bf16[0], fp32[0])
    assert max(rel) <= BF16_REDUCE_TOL, (bf16[0], fp32[0])


if __name__ == "__main__":  # a rank of a launch in `launches`
    _worker(Path(sys.argv[1]))
