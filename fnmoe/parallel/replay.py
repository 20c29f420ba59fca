"""A second process group over each expert-parallel group's ranks, for a recompute's replayed
exchanges (memory.keep_exchange off: the recompute sends its rows again).

NCCL runs one communicator's collectives in the order they were issued. Under whole-block chunks
(fnmoe.models.block_chunks) chunk c-1's recompute issues its replayed dispatch before chunk c's backward
sends its gradients, and that backward waits for them at once: on one group, the gradients queue
behind the replay. fnmoe.memory.policies._Replaying sends the replayed rows on the replay group
instead, while autograd sends their gradients on the ep group the forward named (it keeps the group
it was given), so a replay never queues ahead of a wait. The values are the same: the same ranks,
splits and rows.
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fnmoe import caches

_REPLAY: dict[str, str] = {}
"""the ep group's name -> its replay group's"""
caches.register(_REPLAY.clear)


def make_replay_groups(mesh: DeviceMesh, ep_group_name: str, **mesh_kwargs) -> None:
    """A mesh of mesh's shape made again (every rank calls this where it makes the mesh: new groups
    are collective), its ep group registered as the replay group of ep_group_name. Its fsdp groups go
    unused; NCCL creates a communicator at its first collective, so they cost nothing there."""
    if mesh.size(1) == 1:
        return
    again = init_device_mesh(mesh.device_type, tuple(mesh.shape), mesh_dim_names=mesh.mesh_dim_names,
                             **mesh_kwargs)
    _REPLAY[ep_group_name] = again["ep"].get_group().group_name


def replay_group_name(group_name: str) -> str:
    """The group a replayed exchange on group_name runs on: its replay group where one was made, else
    group_name itself."""
    return _REPLAY.get(group_name, group_name)
