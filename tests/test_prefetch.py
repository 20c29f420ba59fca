"""FSDP gathers overlap compute: the next block's gathers are issued before this block computes and
waited only where that block starts, on 2 gloo ranks (this file run under torchrun records the order
of issue, wait and compute ops on rank 0). The synchronous gathers of before waited at issue:
I W I W ... then compute."""
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fnmoe import sharding
from fnmoe._torch import TorchDispatchMode
from fnmoe.config import MeshConfig, ModelConfig, MoEConfig
from fnmoe.model import hidden_states
from fnmoe.params import init_params

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1))


class _Order(TorchDispatchMode):
    """I for an all-gather issued, W for a wait on a collective, c for a matmul."""

    def __init__(self):
        super().__init__()
        self.seq = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        kind = ("I" if "all_gather" in name else "W" if "wait_tensor" in name
                else "c" if re.match(r"aten\.b?mm\.", name) else "")
        self.seq.append(kind)
        return func(*args, **(kwargs or {}))


def _record() -> str:
    dist.init_process_group("gloo")
    try:
        params = init_params(CFG, 0, mesh=sharding.make_mesh(MeshConfig(fsdp=2, ep=1)))
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        with _Order() as order:
            hidden_states(params, tokens, CFG)
        return "".join(order.seq)
    finally:
        dist.destroy_process_group()


def test_the_next_blocks_gathers_are_waited_after_this_block_computes():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          __file__], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seq = re.search(r"ORDER ([IWc]+)", out.stdout).group(1)
    # blocks: compute runs in three stretches; before each, the waits of that block's gathers
    stretches = re.findall(r"W+c+", seq)
    assert len(stretches) == CFG.n_layers, seq
    # block 1's gathers were issued before block 0 computed: more issues than one block's before
    # the first compute, and after block 0's compute, block 1 starts by waiting without issuing
    first_compute = seq.index("c")
    issued_first = seq[:first_compute].count("I")
    waited_first = seq[:first_compute].count("W")
    assert issued_first > waited_first + 1, seq
    after_block0 = seq[first_compute:].lstrip("c")
    assert after_block0.startswith("I") and "W" in after_block0, seq  # block 2 issued, then block 1 waited
    assert "IW" * 4 not in seq, seq  # no gather waited at issue


if __name__ == "__main__":
    order = _record()
    if int(os.environ.get("RANK", "0")) == 0:
        print("ORDER", order)
