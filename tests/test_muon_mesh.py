"""Muon on the FSDP x EP mesh: Newton-Schulz on whole matrices, what it communicates, the Muon rows
of the mesh matrix, and non-finite steps skipped on every rank.

Meshes run as simulated ranks (fnmoe.parallel.dist.simulate); one torchrun launch of 4 gloo processes runs
this file as its worker script (`_worker`) for what needs real process groups: NaN on one rank
(a simulation cannot read a NaN metric back) and `fnmoe train --optim.name muon` on 2x2.
Legend: B batch, L sequence.
"""
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import fnmoe.optim.muon_update as fmuon
from fnmoe.parallel import dist as fdist
from fnmoe import optim
from fnmoe.training import loop
from fnmoe.parallel import sharding
from fnmoe.training import step as ftrain
from fnmoe.config import DataConfig, DistConfig, MeshConfig, OptimConfig, RunConfig, TrainConfig
from fnmoe.parallel.sharding import init_params
from fnmoe.training.step import init_state, make_train_step
from fnmoe.memory.policies import train_runner
from fnmoe.tree import flatten_dict, map_with_path, tree_flatten, unflatten_dict
from conftest import rel, whole

from test_sharding import B, CFG, MESHES, TOKENS, assert_same_metrics  # tests/ is on sys.path: pytest's rootdir import

ROOT = Path(__file__).resolve().parents[1]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def layouts() -> dict:
    """Muon leaves in every layout these meshes give: dense matrices split on rows over dp evenly,
    unevenly and with fewer rows than ranks; expert stacks split on E (4 experts) and, where
    fsdp*ep does not divide 2 experts, on rows over fsdp."""
    shapes = {"layers.0.attn.w_q_DN": (32, 48), "layers.0.attn.w_o_ND": (48, 32),
              "layers.0.attn.w_k_DM": (30, 20), "layers.0.attn.w_v_DM": (3, 40),
              "layers.1.moe.w_up_EDF": (4, 16, 8), "layers.1.moe.w_down_EFD": (2, 8, 16)}
    return {path: _randn(*shape, seed=i) for i, (path, shape) in enumerate(shapes.items())}


class CollectiveBytes(TorchDispatchMode):
    """Bytes that functional collectives take in, summed over every (simulated) rank of this process."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name != "wait_tensor" and not name.startswith("_"):
            t = args[0]
            parts = t._local_tensors.values() if hasattr(t, "_local_tensors") else [t]
            self.bytes += sum(p.numel() * p.element_size() for p in parts)
        return func(*args, **(kwargs or {}))


def _grads(flat: dict, steps: int = 2) -> list[dict]:
    """Gradients for `steps` updates; drawn outside simulations, where random ops differ by rank."""
    return [{p: x * 0.5 + _randn(*x.shape, seed=100 + s) for p, x in flat.items()} for s in range(steps)]


def _sharded_updates(flat: dict, grads: list[dict], mesh):
    """(updates, momentum) of Muon updates of the tree `flat` by `grads` on mesh (None: one process),
    with (CommDebugMode, CollectiveBytes) of the last update."""
    params, grads = unflatten_dict(flat), [unflatten_dict(g) for g in grads]  # shard_params reads the paths
    if mesh is not None:
        params = sharding.shard_params(params, mesh)
        grads = [sharding.shard_params(g, mesh) for g in grads]
    tx = fmuon.muon(0.02, weight_decay=0.1)
    state = tx.init(params)
    for g in grads:
        with CommDebugMode() as comm, CollectiveBytes() as moved:
            updates, state = tx.update(g, state, params)
    return flatten_dict(updates), flatten_dict(state["muon"][0].mu), comm, moved


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_update_on_every_mesh_equals_one_process_bitwise(mesh_shape):
    flat, grads = layouts(), _grads(layouts())
    ref_updates, ref_mu, _, _ = _sharded_updates(flat, grads, None)
    f, e = mesh_shape
    with fdist.simulate(f * e):
        updates, mu, _, _ = _sharded_updates(flat, grads, sharding.make_mesh(MeshConfig(fsdp=f, ep=e)))
        for path, want in ref_updates.items():
            assert torch.equal(whole(updates[path]), want), path
            assert torch.equal(whole(mu[path]), ref_mu[path]), path


@pytest.mark.parametrize("paths, all_to_alls", [
    (["layers.1.moe.w_up_EDF"], 0),  # split on E: no communication
    (["layers.0.attn.w_q_DN", "layers.0.attn.w_o_ND", "layers.0.attn.w_k_DM", "layers.0.attn.w_v_DM"], 2),
    (["layers.1.moe.w_down_EFD"], 2),  # rows over fsdp
])
def test_communication_is_one_gather_to_owners_and_one_scatter(paths, all_to_alls):
    """Per splitting group and step one all-to-all to the owners and one back, each moving every
    matrix once in bf16: 2 x 2 bytes an element, the matrix's fp32 bytes (the limit is twice that)."""
    flat = {p: x for p, x in layouts().items() if p in paths}
    grads = _grads(flat)
    with fdist.simulate(4):
        _, _, comm, moved = _sharded_updates(flat, grads, sharding.make_mesh(MeshConfig(fsdp=2, ep=2)))
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == ({"c10d_functional.all_to_all_single": all_to_alls} if all_to_alls else {}), counts
    fp32_bytes = sum(x.numel() * 4 for x in flat.values())
    assert moved.bytes == (fp32_bytes if all_to_alls else 0) <= 2 * fp32_bytes


def test_qk_clip_on_a_mesh_equals_one_process():
    params = init_params(CFG, 0)
    max_logits_NH = torch.tensor([[3.0, 9.0], [12.0, 1.0]])
    want = flatten_dict(optim.qk_clip(params, max_logits_NH, CFG, 4.0))
    with fdist.simulate(4):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        got = flatten_dict(optim.qk_clip(sharding.shard_params(params, mesh), max_logits_NH, CFG, 4.0))
        for path, w in want.items():
            assert torch.equal(whole(got[path]), w), path


# ---------------------------------------------------------------- training: the Muon rows of the mesh matrix

def _rank_part(x_BL: torch.Tensor, n: int) -> torch.Tensor:
    """Each simulated rank's contiguous part of the global batch (as Loader lays it out)."""
    b = x_BL.shape[0] // n
    return fdist.rank_map(lambda r: x_BL[r * b:(r + 1) * b].clone())


def _train(mesh_shape, steps: int):
    """Losses of `steps` Muon steps and the params after the first, whole."""
    f, e = mesh_shape
    n = f * e
    run = RunConfig(model=CFG, mesh=MeshConfig(fsdp=f, ep=e), train=TrainConfig(batch_size=B, steps=steps),
                    # fp32 Newton-Schulz: the meshes' gradients differ from one process's in the
                    # reduction order (~1e-8), which in bf16 can flip a rounding (2^-8) of a leaf
                    # whose iteration sits on a tie (seen on an AVX512-BF16 CPU: w_down_FD, 3.5e-3)
                    optim=OptimConfig(name="muon", lr=0.02, adamw_lr=3e-3, warmup_steps=2, ns_dtype="float32"))
    tx = optim.from_config(run.optim, steps)
    state = init_state(init_params(CFG, 0, mesh=sharding.make_mesh(run.mesh) if n > 1 else None), tx)
    train_step = make_train_step(run, tx, train_runner(run))
    losses, first = [], None
    for s in range(steps):
        x_BL = _rank_part(TOKENS[s], n) if n > 1 else TOKENS[s]
        state, metrics = train_step(state, [(x_BL[:, :-1], x_BL[:, 1:])])
        losses.append(metrics["loss"])
        if s == 0:
            first = {k: whole(v) for k, v in flatten_dict(state.params).items()}
    return losses, first


def test_muon_rows_of_the_mesh_matrix():
    """As test_sharding's AdamW rows: after the first Muon step the params on every mesh are the
    one-process params up to the gradients' reduction order (the update itself is bitwise equal for
    equal gradients: test_update_on_every_mesh_equals_one_process_bitwise). The 10-step loss curves
    of every mesh run on gloo in test_mesh_curves.py."""
    ref, ref_first = _train((1, 1), 1)
    for f, e in MESHES:
        with fdist.simulate(f * e):
            losses, first = _train((f, e), 1)
        assert abs(losses[0] - ref[0]) <= 1e-6 * abs(ref[0]), ((f, e), losses, ref)
        for path, want in ref_first.items():
            assert rel(first[path], want) <= 1e-5, ((f, e), path, rel(first[path], want))


# ---------------------------------------------------------------- real processes

def _poison_one_rank(value_and_grad, rank: int):
    """value_and_grad whose gradient of one dense leaf is NaN in `rank`'s shard alone."""
    def make(fn, **kw):
        grad_fn = value_and_grad(fn, **kw)

        def poisoned(*args, **kwargs):
            out, grads = grad_fn(*args, **kwargs)

            def leaf(path: str, g: torch.Tensor) -> torch.Tensor:
                if path != "layers.0.attn.w_q_DN":
                    return g
                local = fdist.tensor_map(g.to_local(), lambda r, x: x * float("nan") if r == rank else x)
                return DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())
            return out, map_with_path(leaf, grads)
        return poisoned
    return make


def _skips_everywhere(name: str) -> bool:
    """One 2x2 step with NaN in rank 1's gradient shard: skipped, params and state bitwise unchanged."""
    run = RunConfig(model=CFG, mesh=MeshConfig(fsdp=2, ep=2), train=TrainConfig(batch_size=B, steps=1),
                    optim=OptimConfig(name=name, warmup_steps=0), dist=DistConfig(timeout_s=10))
    tx = optim.from_config(run.optim, 1)
    state = init_state(init_params(CFG, 0, mesh=sharding.make_mesh(run.mesh, run.dist)), tx)
    real = ftrain.value_and_grad
    ftrain.value_and_grad = _poison_one_rank(real, rank=1)
    try:
        b = B // 4
        x_BL = TOKENS[0][dist.get_rank() * b:(dist.get_rank() + 1) * b]
        new, metrics = make_train_step(run, tx, train_runner(run))(state, [(x_BL[:, :-1], x_BL[:, 1:])])
    finally:
        ftrain.value_and_grad = real
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    same = all(torch.equal(local(a), local(b)) for a, b in zip(tree_flatten((new.params, new.opt_state))[0],
                                                               tree_flatten((state.params, state.opt_state))[0]))
    return metrics["skipped"] == 1 and same


def _worker(out: Path) -> None:
    """Run by each of 4 torchrun processes; rank 0 writes what the test checks to out/worker.json."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank, report = dist.get_rank(), {}
    flat, grads = layouts(), _grads(layouts())
    ref_updates, _, _, _ = _sharded_updates(flat, grads, None)
    for f, e in [(2, 2), (4, 1), (1, 4)]:
        mesh = sharding.make_mesh(MeshConfig(fsdp=f, ep=e), DistConfig(timeout_s=10))
        updates, _, comm, moved = _sharded_updates(flat, grads, mesh)
        equal = torch.tensor(all(torch.equal(whole(updates[p]), w) for p, w in ref_updates.items()))
        stats = torch.tensor([moved.bytes, sum(comm.get_comm_counts().values())])
        dist.all_reduce(stats)  # bytes: all ranks; counts: every rank makes the same calls
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        report[f"{f}x{e}"] = {"equal": bool(equal), "bytes": int(stats[0]), "collectives": int(stats[1]) // 4}
    skipped = torch.tensor([_skips_everywhere("adamw"), _skips_everywhere("muon")])
    dist.all_reduce(skipped, op=dist.ReduceOp.MIN)
    report["nan_on_rank_1_skipped"] = {"adamw": bool(skipped[0]), "muon": bool(skipped[1])}
    if rank == 0:
        (out / "worker.json").write_text(json.dumps(report))
    loop.train(_cli_run(2, 2, out / "four"))  # ends the process group
    fdist.exit_worker(0)


def _cli_run(f: int, e: int, run_dir: Path) -> RunConfig:
    """What `fnmoe train --optim.name muon --optim.qk-clip --optim.ns-dtype float32 --mesh.fsdp F --mesh.ep E`
    runs, made small; tau below the max logits at init (~0.2), so MuonClip rescales heads from the first
    step. Newton-Schulz in float32: in bfloat16 its matmuls took 10 of the one-process run's 13 s of CPU
    here (no native bf16 GEMM); the bf16 iteration on these meshes is checked bitwise in `_worker`."""
    return RunConfig(mesh=MeshConfig(fsdp=f, ep=e), data=DataConfig(seq_len=32), dist=DistConfig(timeout_s=10),
                     train=TrainConfig(steps=3, batch_size=8, eval_batches=1, log_every=1, run_dir=str(run_dir)),
                     optim=OptimConfig(name="muon", warmup_steps=0, qk_clip=True, qk_clip_tau=0.15,
                                       ns_dtype="float32"))


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_torchrun_4_ranks_muon_and_non_finite_skip(tmp_path):
    """Four gloo processes: the update on 2x2, 4x1 and 1x4 equals one process bitwise with its
    collectives and bytes as simulated; NaN in one rank's gradient skips the step on every rank for
    AdamW and Muon; Muon with MuonClip trains 2x2 along the one-process curve."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          __file__, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    report = json.loads((tmp_path / "worker.json").read_text())
    matrix_bytes = sum(x.numel() * 4 for p, x in layouts().items() if p != "layers.1.moe.w_up_EDF")
    for mesh in ("2x2", "4x1", "1x4"):
        assert report[mesh]["equal"], (mesh, report)
    # dense leaves over dp; on 2x2 and 4x1 two experts split on rows over fsdp too
    assert report["2x2"] == report["4x1"] == {"equal": True, "bytes": matrix_bytes, "collectives": 4}
    assert report["1x4"]["collectives"] == 2
    assert report["nan_on_rank_1_skipped"] == {"adamw": True, "muon": True}

    loop.train(_cli_run(1, 1, tmp_path / "one"))
    assert_same_metrics(tmp_path / "one", tmp_path / "four")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
