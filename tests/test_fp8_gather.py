"""fp8 expert-weight gathers (--mesh.expert-gather-dtype float8_e4m3fn, fnmoe.parallel.fp8): the
quantiser's error bound per block, a simulated mesh's forward and backward equal to the same mesh
gathering weights pre-rounded through the quantiser (bitwise), one quantisation a step, the bytes
the planner counts and the meters record, and the field's bad inputs.

Meshes run as simulated ranks (fnmoe.parallel.dist.simulate), as tests/test_sharding.py's do.
Legend: I rows, O columns of a matrix; B batch, L sequence.
"""
import contextlib
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from fnmoe import optim
from fnmoe.cli import main
from fnmoe.kernels import fp8_blocks, fp8_gemm
from fnmoe.config import MeshConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig, load_config, validate
from fnmoe.memory.policies import train_runner
from fnmoe.parallel.sharding import init_params
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import fp8, sharding
from fnmoe.parallel import gather as fgather
from fnmoe.parallel.fsdp import GATHER
from fnmoe.plan.comm import comm_bytes
from fnmoe.plan.meters import CommMeter
from fnmoe.plan.rehearse import compare, rehearse, rehearsed_comm
from fnmoe.training.step import init_state, loss_fn, make_train_step
from fnmoe.tree import flatten_dict, leaf_kind, map_with_path, value_and_grad
from conftest import rel, whole

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]

B, L = 8, 8
TOKENS = torch.randint(0, 64, (B, L + 1), generator=torch.Generator().manual_seed(0))


def _cfg(n_experts: int = 4, expert_hidden: int = 16, dtype: str = "float32") -> ModelConfig:
    return ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=16,
                       compute_dtype=dtype, moe=MoEConfig(n_experts=n_experts, top_k=2, expert_hidden=expert_hidden,
                                                          first_k_dense=1))


# ---------------------------------------------------------------- the quantiser

def _block_view(t: torch.Tensor) -> torch.Tensor:
    """t [..., I, O] zero-padded to whole blocks, as [..., I/128, O/128, 128 * 128]."""
    I, O = t.shape[-2:]
    p = torch.nn.functional.pad(t, (0, fp8.blocks(O) * 128 - O, 0, fp8.blocks(I) * 128 - I))
    return p.unflatten(-2, (-1, 128)).unflatten(-1, (-1, 128)).transpose(-3, -2).flatten(-2)


@pytest.mark.parametrize("shape", [(3, 200, 300), (2, 256, 128), (1, 5, 7)], ids=str)
def test_round_trip_error_is_within_2_to_the_minus_4_of_each_block_amax(shape):
    """Derived in fnmoe/parallel/fp8.py: with y = x / s, |y| <= 448, e4m3's 3 mantissa bits round y
    within 2^-4 |y| (normal) or 2^-10 (subnormal), so each element errs by at most
    max(2^-4 |x|, 2^-10 s) <= 2^-4 amax of its block. Values spread over 12 binades (normal and
    subnormal e4m3 both met), shapes 128 divides and does not. Over a block's worth of values the
    bound is reached within 1% (so the quantiser keeps 3 mantissa bits, no more), the scales are powers of two with
    amax / s in (224, 448], and dequantising in bf16 is exact (the fp32 result, cast)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 0, shape, generator=g).float())
    q, s = fp8.quantise(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    y = fp8.dequantise(q, s, torch.float32)
    err, spread = (x - y).abs(), fp8_blocks._spread(s, x.shape)
    bound = torch.maximum(x.abs() * 2**-4, spread * 2**-10)
    assert (err <= bound).all()
    if x.numel() >= 128 * 128:  # enough values to meet a rounding midpoint; 35 rarely do
        assert (err / bound).max() > 0.99
    amax = _block_view(x).abs().amax(-1)
    assert (_block_view(err).amax(-1) <= amax * 2**-4).all()
    mantissa, _ = torch.frexp(s)
    assert (mantissa == 0.5).all()
    assert ((amax / s > 224) & (amax / s <= 448)).all()
    assert torch.equal(fp8.dequantise(q, s, torch.bfloat16), y.bfloat16())


def test_a_block_of_zeros_and_a_block_with_one_huge_value():
    """Zeros come back zeros; a 1e30 among values near 1 comes back within 2^-4 of itself and takes
    its block's small values to its scale's resolution (2^-10 s: here all of them to 0), while
    the other blocks come back as if quantised alone."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 256, 250, generator=g)
    x[0, :128, :128] = 0
    x[0, 130, 140] = 1e30
    y = fp8.round_trip(x)
    assert torch.equal(y[0, :128, :128], torch.zeros(128, 128))
    assert abs(y[0, 130, 140].item() / 1e30 - 1) <= 2**-4
    _, s = fp8.quantise(x)
    small, small_x = y[0, 128:, 128:].clone(), x[0, 128:, 128:].clone()
    small[2, 12] = small_x[2, 12] = 0
    assert (small == 0).all() and (small_x.abs() <= s[0, 1, 1] * 2**-10).all()
    for rows, cols in ((slice(None, 128), slice(128, None)), (slice(128, None), slice(None, 128))):
        assert torch.equal(y[0, rows, cols], fp8.round_trip(x[:, rows, cols])[0])


@pytest.mark.parametrize("dim,sizes", [(0, (3, 3, 1)), (1, (150, 150, 1)), (1, (101, 100, 0))],
                         ids=["experts", "rows", "rows-uneven-and-an-empty-rank"])
def test_uneven_row_shards_come_back_as_each_rounded_alone(dim, sizes):
    """What three ranks send (fp8.pack: each shard padded to the largest, torch.chunk's rows, moved
    first, as bytes) concatenated as an all-gather does, unpacked: the leaf, each rank's part
    quantised alone (its own blocks), the padding dropped; 201 rows and 250 columns leave short
    blocks at every shard's end."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 201, 250, generator=g) if dim == 0 else torch.randn(2, sum(sizes), 250, generator=g)
    parts = x.split(list(sizes), dim)
    rows = max(sizes)
    packs = [fp8.pack(p, dim, rows) for p in parts]
    q, s = torch.cat([p[0] for p in packs]), torch.cat([p[1] for p in packs])
    assert q.dtype == s.dtype == torch.uint8 and q.numel() == 3 * rows * x.numel() // x.shape[dim]
    got = fp8.unpack(q, s, 3, dim, x.shape[dim], torch.bfloat16)
    want = torch.cat([fp8.round_trip(p, torch.bfloat16) for p in parts if p.shape[dim]], dim)
    assert got.is_contiguous() and torch.equal(got, want)


# ---------------------------------------------------------------- on a mesh

def _rank_part(x_BL: torch.Tensor, n: int) -> torch.Tensor:
    b = x_BL.shape[0] // n
    return fdist.rank_map(lambda r: x_BL[r * b:(r + 1) * b].clone())


def _pre_rounded(params: dict, f: int, e: int) -> dict:
    """params with each expert stack rounded as the fp8 gather delivers it: each rank's shard (its
    slice by sharding's rules) padded to the gather's rows along its split dim, quantised and
    dequantised, the padding dropped."""
    sizes = {"fsdp": f, "ep": e, "dp": f * e}

    def rounded(path: str, w: torch.Tensor) -> torch.Tensor:
        if leaf_kind(path) != "expert":
            return w
        spec = sharding.leaf_spec(path, tuple(w.shape), sizes)
        d = dict(spec.splits)["fsdp"]
        rows = math.ceil((w.shape[0] // e if d == 0 else w.shape[d]) / f)
        out = torch.empty_like(w)
        for r in range(f * e):
            idx = sharding.local_index(spec, tuple(w.shape), sharding.axis_coords(r, f, e), sizes)
            local = w[idx]
            out[idx] = fp8.round_trip(fp8.pad(local, d, rows)).narrow(d, 0, local.shape[d])
        return out
    return map_with_path(rounded, params)


def _loss_and_grads(cfg: ModelConfig, params: dict | None, shape: tuple[int, int], expert_dtype, gemm_dtype=None):
    """(loss, {path: (grad's type, dtype, whole grad)}) of one forward and backward of TOKENS on a
    simulated mesh, params (full, None: init) sharded onto it; gemm_dtype: the expert GEMMs'."""
    f, e = shape
    with fdist.simulate(f * e):
        mesh = sharding.make_mesh(MeshConfig(fsdp=f, ep=e))
        sharded = init_params(cfg, 0, mesh=mesh) if params is None else sharding.shard_params(params, mesh)
        x = _rank_part(TOKENS, f * e)
        with fgather.expert_dtype(expert_dtype), fp8_gemm.expert_gemm_dtype(gemm_dtype):
            (loss, _), g = value_and_grad(loss_fn, has_aux=True)(sharded, x[:, :-1], x[:, 1:], cfg, B * L,
                                                                 source=GATHER)
        return whole(sharding.all_sum(loss)), {k: (type(v).__name__, v.dtype, whole(v))
                                                for k, v in flatten_dict(g).items()}


@pytest.mark.parametrize("shape,n_experts,hidden", [((2, 1), 4, 16), ((2, 2), 2, 16)],
                         ids=["fsdp2-whole-experts", "2x2-rows"])
def test_fp8_gathers_equal_the_mesh_on_pre_rounded_weights_bitwise(shape, n_experts, hidden):
    """Forward and backward with fp8 expert gathers equal, bit for bit, the same mesh gathering
    (in the compute dtype) params whose expert stacks were rounded through the quantiser first:
    the blocks compute on exactly the rounded weights, and the gradient reaches each float32
    master shard as the rounded weights' gradient (straight-through). Two layouts: whole experts
    a rank (the smallest mesh that shards experts), and 2x2 with two experts, where fsdp splits each
    expert's rows (uneven rows: test_uneven_row_shards_come_back_as_each_rounded_alone; a simulation
    cannot pad them on the compute-dtype side). The smallest mesh also equals one process
    on the rounded weights, to the mesh's own tolerance (tests/test_sharding.py: sums over ranks)."""
    cfg = _cfg(n_experts, hidden)
    rounded = _pre_rounded(init_params(cfg, 0), *shape)  # the mesh's init draws the same (test_sharding)
    loss, grads = _loss_and_grads(cfg, None, shape, fp8.E4M3)
    ref_loss, ref_grads = _loss_and_grads(cfg, rounded, shape, None)
    assert torch.equal(loss, ref_loss)
    for path, (kind, dtype, g) in grads.items():
        assert (kind, dtype) == ("DTensor", torch.float32), path
        assert torch.equal(g, ref_grads[path][2]), (path, rel(g, ref_grads[path][2]))
    plain_loss, plain_grads = _loss_and_grads(cfg, None, shape, None)
    assert not torch.equal(plain_grads["layers.1.moe.w_up_EDF"][2], grads["layers.1.moe.w_up_EDF"][2])
    if shape == (2, 1):
        (one_loss, _), one_grads = value_and_grad(loss_fn, has_aux=True)(rounded, TOKENS[:, :-1], TOKENS[:, 1:],
                                                                          cfg, B * L)
        assert abs(loss.item() - one_loss.item()) <= 1e-6 * abs(one_loss.item())
        for path, g in flatten_dict(one_grads).items():
            assert rel(grads[path][2], g) <= 1e-5, path


def test_fp8_gemms_take_the_gathered_packs_and_quantise_no_weight(monkeypatch):
    """fp8 expert GEMMs behind fp8 gathers of whole experts (2x2, bf16) take each stack's blocks from
    the packs it was gathered from: no weight stack is quantised, by the forward's GEMMs or by backward's
    input gradients, and the loss and every gradient equal, bit for bit, the same step quantising the gathered stacks
    again (whose values the packs' are: test_an_fp8_gathered_stack_quantises_back_to_itself_exactly)."""
    cfg = _cfg(dtype="bfloat16")
    calls, quantise = [], fp8_blocks.quantise
    monkeypatch.setattr(fp8_blocks, "quantise", lambda t: calls.append(tuple(t.shape)) or quantise(t))
    loss, grads = _loss_and_grads(cfg, None, (2, 2), fp8.E4M3, fp8.E4M3)
    assert calls == []
    monkeypatch.setattr(fp8, "remember", lambda *a: None)  # the gathers keep no packs: the GEMMs quantise
    again, again_grads = _loss_and_grads(cfg, None, (2, 2), fp8.E4M3, fp8.E4M3)
    assert len(calls) == 3  # the MoE layer's three stacks, each once for its forward and input grad
    assert torch.equal(loss, again)
    for path, (_, _, g) in grads.items():
        assert torch.equal(g, again_grads[path][2]), path


class _GatherBytes(CommMeter):
    """CommMeter without the all-to-alls (in a simulation their split sizes cannot be counted)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _counting_packs():
    """The shapes fp8.pack is called on (each quantisation of a shard) while inside."""
    packs, pack = [], fp8.pack

    def counted(*args):
        packs.append(tuple(args[0].shape))
        return pack(*args)
    fp8.pack = counted
    try:
        yield packs
    finally:
        fp8.pack = pack


def _step_bytes(run: RunConfig, steps: int = 1) -> tuple[dict, list]:
    """({(kind, axis, dtype): bytes} of `steps` train steps on a simulated mesh, fp8.pack's calls)."""
    with _counting_packs() as packs:
        with fdist.simulate(run.mesh.world):
            mesh = sharding.make_mesh(run.mesh)
            tx = optim.from_config(run.optim, steps)
            state = init_state(init_params(run.model, 0, mesh=mesh), tx)
            step = make_train_step(run, tx, train_runner(run))
            x, a = TOKENS, run.train.grad_accum
            with _GatherBytes(sharding.group_axes(mesh)) as meter:
                for _ in range(steps):
                    state, _ = step(state, [(p[:, :-1], p[:, 1:]) for p in
                                            (_rank_part(x[i::a], run.mesh.world) for i in range(a))])
    rows = {(r["kind"], r["axis"], r["dtype"]): r["bytes"] for r in meter.rows()
            if r["kind"] in ("all_gather", "reduce_scatter")}
    return rows, packs


def _run(gather: str, accum: int = 1) -> RunConfig:
    return RunConfig(model=_cfg(dtype="bfloat16"), mesh=MeshConfig(fsdp=2, ep=2, expert_gather_dtype=gather),
                     train=TrainConfig(batch_size=B, grad_accum=accum))


def test_gathered_expert_bytes_halve_against_bf16_plus_the_scales_and_the_planner_counts_them():
    """2x2, bf16 compute, one step (forward gathers and backward's regathers): the expert stacks'
    all-gathers over fsdp send uint8 (e4m3 and the scales' bytes), exactly half of bf16's plus 4
    bytes a 128x128 block of each rank's shard, per gather; dense gathers and every reduce-scatter
    are unchanged. fnmoe.plan.comm.comm_bytes counts the same bytes as the meter for both."""
    measured = {}
    for gather in ("compute", "float8_e4m3fn"):
        run = _run(gather)
        measured[gather], _ = _step_bytes(run)
        planned = comm_bytes(run)
        assert sum(measured[gather].values()) == planned["fsdp"], (gather, measured[gather], planned["fsdp"])
    bf16, f8 = measured.values()
    assert bf16[("all_gather", "fsdp", "bfloat16")] > 0 and ("all_gather", "fsdp", "bfloat16") not in f8
    # a rank's expert shard of each stack: 1 expert of [32, 16] or [16, 32], one block each; 3 stacks,
    # gathered twice (forward, backward's regather), sent to 1 peer
    scales = 2 * 3 * 1 * 4
    assert f8[("all_gather", "fsdp", "uint8")] == bf16[("all_gather", "fsdp", "bfloat16")] // 2 + scales
    assert {k: v for k, v in f8.items() if k[2] != "uint8"} == \
        {k: v for k, v in bf16.items() if k != ("all_gather", "fsdp", "bfloat16")}


def test_the_shard_is_quantised_once_a_step():
    """Two micro-batches, each gathering the expert stacks in forward and again in backward
    (resharding), quantise each stack once a step (3 stacks: 3 packs; in a simulation one call
    serves every rank); a new step's params are quantised again, and so is a shard written in
    place (its version moves), whose next gather then carries the new values."""
    run = _run("float8_e4m3fn", accum=2)
    rows, packs = _step_bytes(run, steps=2)
    assert len(packs) == 2 * 3, packs
    assert rows[("all_gather", "fsdp", "uint8")] == 2 * 2 * 2 * (3 * 512 + 3 * 4)  # steps x micro x (fwd, bwd)
    cfg = _cfg()
    with fdist.simulate(2):
        params = init_params(cfg, 0, mesh=sharding.make_mesh(MeshConfig(fsdp=2)))
        layer = params["layers"]["1"]
        with fgather.expert_dtype(fp8.E4M3), _counting_packs() as packs:
            first = whole(fgather.gather(layer, torch.float32)["moe"]["w_up_EDF"])
            assert torch.equal(whole(fgather.gather(layer, torch.float32)["moe"]["w_up_EDF"]), first)
            assert len(packs) == 3
            with torch.no_grad():
                layer["moe"]["w_up_EDF"].to_local().mul_(2)
            again = whole(fgather.gather(layer, torch.float32)["moe"]["w_up_EDF"])
        assert len(packs) == 4 and torch.equal(again, 2 * first)  # powers-of-two scales: exact


@pytest.mark.launch
def test_a_rehearsal_records_the_fp8_bytes_the_planner_counts():
    """`fnmoe rehearse` (one rank of 2x2 on fake tensors: the packs made and kept there too) records
    the expert gathers as uint8 over fsdp, and its fsdp bytes equal the plan's; memory agrees too."""
    tiny = load_config(ROOT / "configs" / "tiny.toml")
    run = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, compute_dtype="bfloat16"),
                              mesh=MeshConfig(fsdp=2, ep=2, expert_gather_dtype="float8_e4m3fn"),
                              train=dataclasses.replace(tiny.train, batch_size=8))
    report = rehearse(run, "worst")
    assert compare(report)["ok"]
    assert rehearsed_comm(report)["fsdp"] == report["plan"]["comm_bytes_detail"]["fsdp"]
    kinds = {(r["kind"], r["axis"], r["dtype"]) for r in report["collectives"]}
    assert ("all_gather", "fsdp", "uint8") in kinds and ("all_gather", "fsdp", "bfloat16") not in kinds


def test_the_planner_prices_fp8_gathers_on_the_command_line(capsys):
    """`fnmoe plan --mesh.expert-gather-dtype float8_e4m3fn` on the tiny preset, bf16, 2 ranks: each
    of the 9 expert stacks (3 MoE layers) is a rank's 4 experts of [128, 256] or [256, 128], 131072
    elements, 2 blocks an expert: bf16 sends 2 x 131072 bytes a stack a gather, fp8 131072 + 4 x 8,
    in the forward's gathers and backward's regathers alike; everything else is priced as before."""
    parts = {}
    for gather in ("compute", "float8_e4m3fn"):
        assert main(["plan", "--config", str(ROOT / "configs" / "tiny.toml"), "--mesh.fsdp", "2",
                     "--model.compute-dtype", "bfloat16", "--mesh.expert-gather-dtype", gather, "--json"]) == 0
        parts[gather] = {k: sum(v.values()) for k, v in
                         json.loads(capsys.readouterr().out)["comm_bytes_detail"]["parts"].items()}
    bf16, f8 = parts.values()
    saved = 9 * (2 * 131072 - (131072 + 4 * 8))
    for part in ("forward/all_gather/blocks", "backward/all_gather/blocks"):
        assert bf16[part] - f8[part] == saved, part
    assert {k: v for k, v in f8.items() if "all_gather/blocks" not in k} == \
        {k: v for k, v in bf16.items() if "all_gather/blocks" not in k}


def test_bad_fields_are_refused_naming_the_field(monkeypatch):
    """fp8 gathers where nothing is gathered (one rank, fsdp 1: expert stacks stay whole on their ep
    rank) or with a torch that lacks the dtype are refused with one line naming mesh.expert_gather_dtype."""
    tiny = load_config(ROOT / "configs" / "tiny.toml")
    for mesh in (MeshConfig(expert_gather_dtype="float8_e4m3fn"),
                 MeshConfig(ep=2, expert_gather_dtype="float8_e4m3fn")):
        with pytest.raises(ValueError, match=r"^invalid config: mesh.expert_gather_dtype='float8_e4m3fn' quantises "
                                             r"the expert stacks' all-gather over mesh.fsdp, but mesh.fsdp=1"):
            validate(dataclasses.replace(tiny, mesh=mesh))
    run = dataclasses.replace(tiny, mesh=MeshConfig(fsdp=2, expert_gather_dtype="float8_e4m3fn"))
    assert validate(run) is run
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match=r"mesh.expert_gather_dtype='float8_e4m3fn' needs torch.float8_e4m3fn, "
                                         r"which this torch .* lacks"):
        validate(run)
    with pytest.raises(ValueError, match=r"mesh.expert_gather_dtype must be one of \('compute', 'float8_e4m3fn'\), "
                                         r"got 'float8_e5m2'"):
        validate(dataclasses.replace(run, mesh=MeshConfig(fsdp=2, expert_gather_dtype="float8_e5m2")))


def test_a_gathered_stack_keeps_its_packs_only_for_fp8_gemms():
    """An fp8 gather of whole experts keeps the packs as the stack's blocks (1 byte an element more,
    alive with the stack) only where fp8 expert GEMMs will take them; with compute-dtype GEMMs they
    go as soon as the stack is dequantised. Kept, they are the stack's values exactly."""
    cfg = _cfg()
    with fdist.simulate(2):
        layer = init_params(cfg, 0, mesh=sharding.make_mesh(MeshConfig(fsdp=2)))["layers"]["1"]
        with fgather.expert_dtype(fp8.E4M3):
            w = fgather.gather(layer, torch.float32)["moe"]["w_up_EDF"]
            assert fp8_blocks.remembered(w) is None
            with fp8_gemm.expert_gemm_dtype(fp8.E4M3):
                w = fgather.gather(layer, torch.float32)["moe"]["w_up_EDF"]
        q, s = fp8_blocks.remembered(w)
        assert torch.equal(whole(fp8_blocks.dequantise(q, s, torch.float32)), whole(w))
        # backward's recompute takes the stack regathered as a new view of its storage (reshard's
        # as_strided, then detached): the packs still serve it; another layout or a change does not
        again = w.as_strided(w.shape, w.stride(), w.storage_offset()).detach()
        assert fp8_blocks.remembered(again)[0] is q
        assert fp8_blocks.remembered(w[1:]) is None and fp8_blocks.remembered(w.mT) is None
        w.mul_(1)
        assert fp8_blocks.remembered(again) is None
