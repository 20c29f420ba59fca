"""Shared test setup: one inductor cache per test run, so only the first compile of a graph is cold."""
import logging
import os
import socket
import tempfile

import pytest

# OpenMP's busy-waiting threads starve each other when test processes (torchrun ranks, CLI
# subprocesses) share 2 cores; passive waiting costs nothing when a core is free.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores (pyproject's -n 2): one thread each, as spawned ranks have
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# fnmoe.plan.overlap's recordings of proxy steps: one directory a test run, like the inductor cache
os.environ.setdefault("FNMOE_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"fnmoe-test-cache-{os.getuid()}"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"fnmoe-test-inductor-{os.getuid()}"))


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same global RNG state: inputs drawn without an explicit generator
    are the same on every run and in any test order, so a failure can be reproduced."""
    import torch  # here, not at the top: the cache directory above is set before torch loads

    torch.manual_seed(0)


def whole(t):
    """A whole plain tensor out of a DTensor (gathered) or a simulated per-rank value (equal on every
    rank: reconciled into one)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.reconcile() if hasattr(t, "reconcile") else t


def rel(a, b) -> float:
    """max |a - b| relative to the largest |b|: the tests' one measure of closeness."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# The tiny model and batch the tests that train through the CLI use (`fnmoe train ... *tiny_flags()`),
# defined once here; each test adds its own --train.steps, --train.run-dir and the like.
TINY_FLAGS = ("--model.dim", "32", "--model.ffn-hidden", "64", "--model.moe.expert-hidden", "32",
              "--train.batch-size", "4", "--data.seq-len", "32")


def tiny_flags(eval_batches: int = 1, *more: str) -> list[str]:
    """TINY_FLAGS, --train.eval-batches eval_batches, then more."""
    return [*TINY_FLAGS, "--train.eval-batches", str(eval_batches), *more]


def step_on_2x2(cfg, mem, tokens_BL):
    """(loss, grads), whole, of one step of loss_fn on a simulated 2x2 mesh (fsdp 2 x ep 2) with
    resharding under memory policy mem, each rank taking its quarter of tokens_BL's rows (inputs and
    shifted labels); a host pool where mem offloads."""
    from fnmoe.config import MeshConfig
    from fnmoe.memory import policies
    from fnmoe.memory.host_pool import HostPool
    from fnmoe.parallel import dist as fdist
    from fnmoe.parallel import sharding
    from fnmoe.parallel.fsdp import GATHER
    from fnmoe.parallel.sharding import init_params
    from fnmoe.training.step import loss_fn
    from fnmoe.tree import flatten_dict, value_and_grad

    rows = tokens_BL.shape[0] // 4
    with fdist.simulate(4):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        part = fdist.rank_map(lambda r: tokens_BL[r * rows:(r + 1) * rows].clone())
        pool = HostPool(16 << 20) if mem.offload else None
        runner = policies.block_runner(mem, cfg.n_layers, pool, reshard=True)
        (loss, _), grads = value_and_grad(loss_fn, has_aux=True)(init_params(cfg, 0, mesh=mesh), part[:, :-1],
                                                                 part[:, 1:], cfg, tokens_BL[:, 1:].numel(),
                                                                 runner=runner, source=GATHER)
        return whole(sharding.all_sum(loss)), {k: whole(g) for k, g in flatten_dict(grads).items()}


def pin_routing(monkeypatch) -> None:
    """Routing from a fixed per-token table (gaps of 10 over scores in [0, 1], passed where the
    score-correction bias goes): token t picks the largest (5t + 3e) mod E, so no rounding (a chunk's
    GEMM, bf16, a recompute) can flip an expert choice, while the weights stay the router's
    differentiable scores. A rank's token t of 16 is global token 16r + t, and 5 x 16 is a multiple of
    the tests' expert counts: every rank routes as one process does."""
    import torch
    from fnmoe.models import moe

    route = moe.route

    def pinned(x_TD, w_router_DE, cfg, bias_E=None, router=None, **given):
        T, E = x_TD.shape[0], w_router_DE.shape[1]
        pin_TE = (torch.arange(T, device=x_TD.device)[:, None] * 5 + torch.arange(E, device=x_TD.device) * 3) % E
        return route(x_TD, w_router_DE, cfg, pin_TE.float() * 10, router, **given)
    monkeypatch.setattr(moe, "route", pinned)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous endpoint a test launches against)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def warnings_text():
    """The fnmoe logger's warnings so far, from a handler on that logger itself (the CLI's
    logging.basicConfig(force=True) replaces the root handlers that caplog relies on)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("fnmoe").addHandler(handler)
    yield lambda: "\n".join(records)
    logging.getLogger("fnmoe").removeHandler(handler)
