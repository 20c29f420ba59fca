"""The processes that save and load a checkpoint together: rank, gather to rank 0, broadcast
from it, and one verdict for all (a simulation of ranks is one process)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fnmoe.parallel import dist as fdist


def rank_in_job() -> tuple[int, int]:
    """(this process's rank, the number of processes) that save and load a checkpoint together; a
    simulation of ranks is one process."""
    return fdist.rank(), 1 if fdist.simulated() else fdist.world()


def gather_to_lead(obj: Any) -> list | None:
    """Every process's obj in rank order on rank 0, None on the others."""
    rank, world = rank_in_job()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def from_lead(obj: Any) -> Any:
    """Rank 0's obj, on every process."""
    if rank_in_job()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_error(error: str | None) -> str | None:
    """The first of every process's error (None for none): every process gets the same verdict."""
    world = rank_in_job()[1]
    if world == 1:
        return error
    errors = [None] * world
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)
