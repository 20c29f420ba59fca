"""Issue 45's own round of planted bugs: the survivors' tests, each against an independent computation.

- A resume with another batch size (fnmoe.checkpoint.resume): smaller is refused as larger is.
- A ring's share of a NIC (fnmoe.plan.network): the node holding the fewest of its members binds
  (otherwise seen only through the layout `plan --search` picks and docs/memory_plan.md's tables,
  minutes of tests; here directly, in a millisecond).

Legend: no tensors here.
"""
import dataclasses

import pytest

from fnmoe.checkpoint.format import CheckpointError
from fnmoe.checkpoint.resume import check_resume_config
from fnmoe.config import MeshConfig, PlanConfig, RunConfig, TrainConfig
from fnmoe.plan import network


def test_a_resume_with_a_smaller_batch_size_is_refused_too(tmp_path):
    """The samples of a step follow from the step and the batch size: a smaller size skips or repeats
    the epoch's rest as a larger one does, and is refused alike (the gradient accumulation may change)."""
    saved = RunConfig(name="tiny", train=TrainConfig(batch_size=8))
    for size in (4, 16):
        with pytest.raises(CheckpointError, match=rf"with --train.batch-size {size}: it was saved at step 3 with "
                                                  r"batch size 8"):
            check_resume_config(saved, dataclasses.replace(saved, train=TrainConfig(batch_size=size)), tmp_path, 3)
    check_resume_config(saved, dataclasses.replace(saved, train=TrainConfig(batch_size=8, grad_accum=2)), tmp_path, 3)


def _mesh(fsdp: int, ep: int, gpus_per_node: int) -> RunConfig:
    return RunConfig(name="tiny", mesh=MeshConfig(fsdp=fsdp, ep=ep), plan=PlanConfig(gpus_per_node=gpus_per_node))


def test_a_rings_nic_share_is_bound_by_the_node_with_the_fewest_of_its_members():
    """A ring with m members on a node crosses the network from each of their NICs in turn: a NIC
    carries 1/m of a member's bytes, and the node with the fewest members binds."""
    # dense leaves over 12 ranks, 8 GPUs a node: 8 members on node 0, 4 on node 1
    assert network.dense_ring_nic_share(_mesh(12, 1, 8)) == 1 / 4
    # expert groups {e, e+4, e+8} of ep 4 x fsdp 3 on nodes of 8: {0, 4} and {8} (node 1 holds one)
    assert network.expert_ring_nic_share(_mesh(3, 4, 8)) == 1.0
    # evenly spread: 2 nodes of 4 members each
    assert network.dense_ring_nic_share(_mesh(8, 1, 4)) == 1 / 4
    assert network.dense_ring_nic_share(_mesh(4, 1, 4)) == 0.0  # inside one node
