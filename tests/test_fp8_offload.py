"""fp8 block inputs on the host (--memory.offload-dtype float8_e4m3fn): each offloaded block input kept
as e4m3 with a float32 scale a 1x128 tile, the recompute starting from its dequantised values; the
pool's bytes and the planner's host bytes count the fp8 bytes; bad configs refused in one line."""
import dataclasses
from pathlib import Path

import pytest
import torch

from fnmoe.config import MemoryConfig, load_config, validate
from fnmoe.kernels import fp8_gemm
from fnmoe.memory import host_pool
from fnmoe.memory import policies as memory
from fnmoe.models.params import init_params
from fnmoe.plan.activations import activation_plan
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict
from conftest import rel

ROOT = Path(__file__).resolve().parent.parent
RUN = load_config(ROOT / "configs" / "tiny.toml")
TOKENS = torch.randint(0, RUN.model.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
FULL = MemoryConfig(recompute="full", offload=True)
FP8 = dataclasses.replace(FULL, offload_dtype="float8_e4m3fn")


def _grads(mem: MemoryConfig, runner_cls=memory.Runner):
    """(loss, gradients, runner) of one forward and backward of the tiny preset under mem."""
    params = init_params(RUN.model, 0)
    leaves = [v.requires_grad_(True) for k, v in flatten_dict(params).items() if not k.startswith("buffers.")]
    runner = runner_cls(mem, RUN.model.n_layers, host_pool.HostPool(64 << 20))
    loss, _ = loss_fn(params, TOKENS[:, :-1], TOKENS[:, 1:], RUN.model, TOKENS[:, 1:].numel(), 1, runner)
    return loss, torch.autograd.grad(loss, leaves), runner


class _Unpacked(memory.Runner):
    """The runner, noting what each block's first unpacked saved tensor (its input) came back as."""

    def __init__(self, *args):
        super().__init__(*args)
        self.inputs, self.back = {}, {}

    def __call__(self, i, fn, p, x_BLD, *rest):
        self.inputs[i] = x_BLD.detach().clone()

        def block(p, x, *rest):
            self.back.setdefault(i, x.detach().clone())  # the forward's, then the recompute's
            self.back[i] = x.detach().clone()
            return fn(p, x, *rest)
        return super().__call__(i, block, p, x_BLD, *rest)


def test_the_recompute_starts_from_the_dequantised_input_and_the_pool_holds_the_fp8_bytes():
    """Each offloaded block's recompute sees exactly its input's 1x128-tile round trip (the last
    block, not offloaded, its input itself); the loss is the forward's, unchanged; each block input
    takes T·D e4m3 bytes and 4 a tile in the pool in place of T·D·4, as the planner counts."""
    loss, grads, runner = _grads(FP8, _Unpacked)
    ref_loss, ref_grads, ref_runner = _grads(FULL)
    assert torch.equal(loss, ref_loss)
    last = RUN.model.n_layers - 1
    for i, x_BLD in runner.inputs.items():
        D = x_BLD.shape[-1]
        want = x_BLD if i == last else fp8_gemm.dequantise_rows(*fp8_gemm.quantise_rows(x_BLD.reshape(-1, D)))
        assert torch.equal(runner.back[i], want.view_as(x_BLD)), i
        assert i == last or not torch.equal(runner.back[i], x_BLD), i
    T, D = TOKENS[:, 1:].numel(), RUN.model.dim
    saved = T * D * 4 - (T * D + T * -(-D // 128) * 4)
    for i, stats in ref_runner.stats.items():
        assert stats["offloaded"] - runner.stats[i]["offloaded"] == saved, i
    run = dataclasses.replace(RUN, memory=FP8, train=dataclasses.replace(RUN.train, batch_size=4),
                              data=dataclasses.replace(RUN.data, seq_len=64))
    full = activation_plan(dataclasses.replace(run, memory=FULL))["host"]
    assert full - activation_plan(run)["host"] == saved * last
    # gradients from inputs within e4m3's rounding (2^-4 of a tile's largest element) of the forward's
    for g, want in zip(grads, ref_grads):
        assert rel(g, want) < 0.1
    assert max(rel(g, want) for g, want in zip(grads, ref_grads)) > 1e-4  # the fp8 inputs took effect


@pytest.mark.parametrize("mem,why", [(MemoryConfig(offload_dtype="float8_e4m3fn"), "offload=False"),
                                     (MemoryConfig(offload=True, offload_dtype="float8_e4m3fn"), "recompute='none'")])
def test_fp8_block_inputs_without_offloaded_recompute_are_refused_in_one_line(mem, why):
    with pytest.raises(ValueError) as e:
        validate(dataclasses.replace(RUN, memory=mem))
    line = [m for m in str(e.value).splitlines() if "offload_dtype" in m]
    assert len(line) == 1 and why in line[0] and "memory.offload=true" in line[0], str(e.value)


def test_a_block_input_saved_twice_is_stored_once_and_unpacked_twice():
    """The hooks store a tensor saved twice (the same storage, view and version) once: an fp8 block
    input too, whose two unpacks give the same dequantised values, each from a device copy the pool
    holds until the last of them (then let go)."""
    pool, stats, handles = host_pool.HostPool(1 << 20), {"kept": 0, "offloaded": 0}, []
    x_TD = torch.randn(64, 200, generator=torch.Generator().manual_seed(0))
    pack, unpack = memory._offload_hooks(pool, set(), 0, stats, handles, lambda: None,
                                         frozenset({memory._torch.storage_key(x_TD)}))
    first, second = pack(x_TD), pack(x_TD)
    assert first is second and len(handles) == 2  # its e4m3 rows and their scales, once
    assert stats["offloaded"] == 64 * 200 + 64 * 2 * 4
    want = fp8_gemm.dequantise_rows(*fp8_gemm.quantise_rows(x_TD))
    assert torch.equal(unpack(first), want)
    assert all(h.back is not None for h in handles)  # one unpack still to come
    assert torch.equal(unpack(second), want)
    assert all(h.back is None for h in handles)


def test_the_planner_charges_the_fp8_inputs_quantise_and_dequantise_passes():
    """Every offloaded block input (all blocks but the last) quantised in the forward (read 2 bytes in
    bf16, write 1) and dequantised for its recompute (read 1, an fp32 product written and read, the
    bf16 input written: 11 bytes), at the profile's HBM rate; nothing without fp8 inputs."""
    from fnmoe.config.hardware import hardware
    from fnmoe.plan.activations import tokens_per_rank
    from fnmoe.plan.overheads import overheads_s
    k2 = load_config(ROOT / "configs" / "kimi_k2_1t.toml")
    run = dataclasses.replace(k2, memory=dataclasses.replace(k2.memory, offload_dtype="float8_e4m3fn"))
    elems = tokens_per_rank(run) * run.model.dim * (run.model.n_layers - 1)
    hbm = hardware(run.plan).hbm_tbps * 1e12
    terms = overheads_s(run)
    assert terms["fp8 block inputs quantise"] == ("forward", pytest.approx(elems * 3 / hbm, rel=1e-12))
    assert terms["fp8 block inputs dequantise"] == ("backward", pytest.approx(elems * 11 / hbm, rel=1e-12))
    assert overheads_s(k2)["fp8 block inputs quantise"][1] == 0.0
