"""A recompute's replayed exchanges on their own process group (fnmoe.parallel.replay), and the overlap
meter's rule that a group runs its collectives in issue order (fnmoe.plan.meters.OrderMeter).

Legend: B batch, L sequence.
"""
import torch

from fnmoe.config import MemoryConfig, MeshConfig, ModelConfig, MoEConfig
from fnmoe.memory import policies
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import replay, sharding
from fnmoe.parallel.fsdp import GATHER
from fnmoe.parallel.sharding import init_params
from fnmoe.plan.meters import OrderMeter
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict, value_and_grad
from conftest import whole

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=8,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1))
B, L, CHUNKS = 8, 8, 2
MEM = MemoryConfig(recompute="full", block_chunks=CHUNKS, keep_exchange=False)


def _step():
    """(loss, grads, the step's float all-to-alls as (phase, group: "ep" or "replay")) on a simulated
    2x2 mesh, each rank's 2 sequences in 2 block chunks, the exchange replayed in backward."""
    tokens = torch.randint(0, CFG.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(3))
    with fdist.simulate(4):
        mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
        ep = sharding.submesh(mesh, "ep").get_group().group_name
        part = fdist.rank_map(lambda r: tokens[r * 2:(r + 1) * 2].clone())
        runner = policies.block_runner(MEM, CFG.n_layers, None, reshard=True)
        with OrderMeter() as order:
            (loss, _), grads = value_and_grad(loss_fn, has_aux=True)(
                init_params(CFG, 0, mesh=mesh), part[:, :-1], part[:, 1:], CFG, tokens[:, 1:].numel(),
                runner=runner, source=GATHER)
        names = {replay.replay_group_name(ep): "replay", ep: "ep"}  # without a replay group: one name
        a2a = [(phase, names.get(group, group)) for phase, kind, group in order.log if kind == "all_to_all"]
        return whole(sharding.all_sum(loss)), {k: whole(g) for k, g in flatten_dict(grads).items()}, a2a


def test_replayed_exchanges_run_on_their_own_group_and_change_no_value(monkeypatch):
    """One MoE layer, 2 chunks: the forward sends each chunk's dispatch and combine on the ep group;
    backward's recompute sends them again on the replay group, and the gradients autograd sends back
    go on the ep group, so none queues behind a replay. Loss and every gradient are those of one ep
    group for everything (today's before), to the bit."""
    loss, grads, a2a = _step()
    assert [g for ph, g in a2a if ph == "forward"] == ["ep"] * 2 * CHUNKS
    backward = [g for ph, g in a2a if ph == "backward"]
    assert backward.count("replay") == 2 * CHUNKS and backward.count("ep") == 2 * CHUNKS
    monkeypatch.setattr(replay, "make_replay_groups", lambda *args, **kwargs: None)
    replay._REPLAY.clear()
    loss_one, grads_one, a2a_one = _step()
    assert {g for _, g in a2a_one} == {"ep"}
    assert torch.equal(loss, loss_one)
    for path, g in grads_one.items():
        assert torch.equal(grads[path], g), path


def test_a_wait_ends_every_collective_issued_before_it_on_its_group():
    """Two all-reduces issued back to back on one group, the second waited for at once: the first
    ended there too, with nothing computed since its issue, so it is not hidden even though a matmul
    runs before its own wait. On two groups it is hidden."""
    from fnmoe._torch import funcol

    def first_hidden(two_groups: bool) -> int:
        with fdist.simulate(4):
            mesh = sharding.make_mesh(MeshConfig(fsdp=2, ep=2))
            ep = sharding.submesh(mesh, "ep").get_group()
            other = sharding.replay_group(ep.group_name) if two_groups else ep
            x = fdist.rank_map(lambda r: torch.full((4, 4), float(r)))
            with OrderMeter() as order:
                a = funcol.all_reduce(x, "sum", ep)
                b = funcol.all_reduce(x, "sum", other)
                funcol.wait_tensor(b)
                x @ x
                funcol.wait_tensor(a)
            return order.overlapped[("forward", "all_reduce")]
    assert first_hidden(two_groups=False) == 0
    assert first_hidden(two_groups=True) == 1
