"""Process groups: start one from torchrun's environment, warm it, and simulate ranks in one process.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address; `init_from_env` starts the
default group from them (gloo on CPU, NCCL on GPU) with --dist.timeout-s and warms it with a
barrier, because a lazily created communicator can deadlock at the first collective that only
some ranks reach. `simulate(world)` runs `world` ranks in this process (LocalTensorMode over the
fake process group): every tensor holds one value per rank and collectives are computed exactly,
which is how the tests check the mesh matrix without starting processes.

The private torch APIs used for that (torch.distributed._local_tensor, the fake process group)
are imported here only.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from fnmoe.config import DistConfig

try:  # private torch APIs, imported here only
    from torch.distributed._local_tensor import LocalTensorMode, enabled_local_tensor_mode
    from torch.distributed._local_tensor import rank_map as _rank_map
    from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode
    from torch.distributed._local_tensor import tensor_map as _tensor_map
    from torch.testing._internal.distributed.fake_pg import FakeStore
except ImportError as e:  # pragma: no cover - a torch without them
    raise ImportError(f"fnmoe.dist needs torch.distributed._local_tensor and the fake process group "
                      f"(private torch APIs, torch >= 2.10): {e}") from e


def launched() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def backend_for(dcfg: DistConfig) -> str:
    if dcfg.backend != "auto":
        return dcfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(dcfg: DistConfig) -> None:
    """Start the default process group from torchrun's environment and warm it with a barrier."""
    if dist.is_initialized():
        return
    backend = backend_for(dcfg)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=dcfg.timeout_s))
    dist.barrier()


def group_options(dcfg: DistConfig):
    """(backend, options) that give a new process group --dist.timeout-s: subgroups otherwise take
    torch's default timeout (30 min on gloo), not the default group's."""
    backend = backend_for(dcfg)
    opts = dist.ProcessGroupGloo._Options() if backend == "gloo" else dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=dcfg.timeout_s)
    return backend, opts


def rank() -> int:
    """This process's global rank (0 without a process group, and in a simulation)."""
    return dist.get_rank() if dist.is_initialized() and not simulated() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def simulated() -> bool:
    return enabled_local_tensor_mode() is not None


def rank_map(fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """fn(rank) as this rank's tensor; in a simulation, one value per simulated rank."""
    return _rank_map(fn)


def tensor_map(t: torch.Tensor, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(rank, this rank's t): local work that differs by rank (in a simulation, run once per rank)."""
    return _tensor_map(t, fn)


def rank_ints(fn: Callable[[int], list[int]]) -> list:
    """fn(rank): ints that differ by rank, such as a collective's split sizes; in a simulation each
    is a SymInt holding every simulated rank's value. Computed on the host: no device sync."""
    return rank_map(lambda r: torch.tensor(fn(r), dtype=torch.int64, device="cpu")).tolist()


def ranks_here() -> list[int]:
    """The ranks this process runs: its own, or every simulated one."""
    mode = enabled_local_tensor_mode()
    return sorted(mode.ranks) if mode is not None else [rank()]


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """{rank: t's value there} for each of ranks_here(), as plain tensors."""
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    return dict.fromkeys(ranks_here(), t)


def unsimulated() -> contextlib.AbstractContextManager:
    """Ops on plain tensors in the body stay plain (a simulation's mode is off there): for host work
    such as file IO on values taken out of a simulation with rank_values."""
    return maybe_disable_local_tensor_mode()


@contextlib.contextmanager
def simulate(n_ranks: int) -> Iterator[None]:
    """Run the body as n_ranks ranks in this process (fake process group + LocalTensorMode)."""
    if dist.is_initialized():
        raise RuntimeError("fnmoe.dist.simulate: a process group is already running in this process")
    dist.init_process_group("fake", world_size=n_ranks, rank=0, store=FakeStore())
    try:
        with LocalTensorMode(n_ranks):
            yield
    finally:
        dist.destroy_process_group()
