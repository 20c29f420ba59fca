"""The final norm inside each cross-entropy chunk, and QK-clip's max-logit pass gathering only the
attention (issue 43, items 5 and 7).

Final norm: loss_fn runs it inside each CE chunk's checkpoint (fnmoe.training.step.ce_loss_sum), so what is
kept is the last block's output, not the norm's fp32 saves at full T. Its loss and gradients are
checked against the path it replaced (hidden_states' final-norm states, then CE over chunks: written
out here), and the bytes the forward leaves alive against the planner's head term.

QK-clip: on a simulated 2x2 (fsdp x ep) mesh, one train step with and without --optim.qk-clip:
CommMeter's all-gathers over fsdp (where expert stacks are gathered) are equal, those over dp grow
by the attention leaves alone, as fnmoe.plan.comm counts them (gathering the whole layer, as before,
added 12,288 bytes over fsdp here); the max logits equal one process's bitwise.
Legend: B batch, L sequence, T tokens (B·L), D model, V vocab, N layers, H heads.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fnmoe import optim
from fnmoe.models.attention import upcast
from fnmoe.config import DataConfig, MeshConfig, ModelConfig, MoEConfig, OptimConfig, RunConfig, TrainConfig
from fnmoe.dtypes import DTYPE_BYTES
from fnmoe.memory.policies import train_runner
from fnmoe.models.transformer import head_weight, hidden_states
from fnmoe.parallel import dist as fdist
from fnmoe.parallel import sharding
from fnmoe.parallel.fsdp import GATHER
from fnmoe.parallel.sharding import init_params
from fnmoe.plan.activations import head_bytes
from fnmoe.plan.comm import comm_bytes
from fnmoe.plan.memory_report import NewStorages
from fnmoe.plan.meters import CommMeter
from fnmoe.training.step import init_state, loss_fn, make_train_step
from fnmoe.tree import flatten_dict, tree_map

from conftest import pin_routing

pytestmark = pytest.mark.timeout(60)
B, L, V, D = 4, 16, 96, 32
TOKENS_BL = torch.randint(0, V, (B, L + 1), generator=torch.Generator().manual_seed(1))


def _cfg(dtype: str, tied: bool) -> ModelConfig:
    # no router losses: the two paths differ in the cross-entropy only
    return ModelConfig(vocab_size=V, dim=D, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=L,
                       moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1, aux_loss_coeff=0.0),
                       compute_dtype=dtype, compile=False, tie_embeddings=tied)


def _params(cfg: ModelConfig) -> dict:
    return tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), init_params(cfg, 0))


def _replaced_loss(params: dict, cfg: ModelConfig, chunks: int) -> torch.Tensor:
    """The mean CE as loss_fn took it before: the final-norm states of hidden_states at full T, then
    the head and CE over chunks, each chunk's logits recomputed in backward."""
    h_TD = hidden_states(params, TOKENS_BL[:, :-1], cfg)[0].reshape(-1, D)
    labels_T = TOKENS_BL[:, 1:].reshape(-1)
    w_DV = head_weight(params, cfg).to(h_TD.dtype)

    def ce(h, y):
        return F.cross_entropy(upcast(h @ w_DV), y, reduction="sum")
    if chunks == 1:
        return ce(h_TD, labels_T) / labels_T.numel()
    parts = [checkpoint(ce, h, y, use_reentrant=False) for h, y in zip(h_TD.chunk(chunks), labels_T.chunk(chunks))]
    return torch.stack(parts).sum() / labels_T.numel()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
def test_final_norm_per_ce_chunk_matches_the_replaced_path(dtype, tied):
    """Loss and every gradient bitwise equal, but for the final norm's weight with chunks > 1: its
    gradient is now summed chunk by chunk (autograd adds the chunks' in the compute dtype), within
    chunks x 2^-22 of its largest entry in fp32 (measured 1.6e-7) and chunks x 2^-8 in bf16
    (measured one bf16 ulp, 2^-8)."""
    cfg = _cfg(dtype, tied)
    params = _params(cfg)
    leaves = {k: v for k, v in flatten_dict(params).items() if v.requires_grad}
    for chunks in (1, 3):  # 3 does not divide the 64 tokens: uneven chunks
        want = _replaced_loss(params, cfg, chunks)
        got = loss_fn(params, TOKENS_BL[:, :-1], TOKENS_BL[:, 1:], cfg, ce_chunks=chunks)[0]
        assert torch.equal(got, want), (chunks, got, want)
        g_want = dict(zip(leaves, torch.autograd.grad(want, list(leaves.values()), allow_unused=True)))
        g_got = dict(zip(leaves, torch.autograd.grad(got, list(leaves.values()), allow_unused=True)))
        for k, w in g_want.items():
            if w is None:
                assert g_got[k] is None, k
            elif k == "final_norm.w_D" and chunks > 1:
                bound = chunks * 2.0 ** (-22 if dtype == "float32" else -8) * w.abs().max()
                assert (g_got[k] - w).abs().max() <= bound, (k, (g_got[k] - w).abs().max(), bound)
            else:
                assert torch.equal(g_got[k], w), (chunks, k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_bytes_are_the_planners_head(dtype, monkeypatch):
    """What the forward leaves alive beyond the blocks' saves (hidden_states' graph and aux, less its
    output) is the planner's head: with chunks, the last block's output; whole, the final norm's saves
    and the fp32 log-softmax. In bf16 the matmuls also keep the head weight's and the norm weight's
    compute-dtype casts, which the planner counts as gathered weights, not here."""
    # the kernels the planner's formulas price (a GPU's, and a CPU's with native bf16): on a CPU without
    # native bf16, fnmoe's fp32 GEMMs keep their operands' fp32 copies (fnmoe.kernels.bf16)
    monkeypatch.setenv("FNMOE_BF16_GEMMS", "native")
    cfg = _cfg(dtype, tied=False)
    params = _params(cfg)
    s, T = DTYPE_BYTES[dtype], B * L
    casts = (V * D + D) * s if dtype != "float32" else 0
    with NewStorages(set()) as blocks:
        out = hidden_states(params, TOKENS_BL[:, :-1], cfg, final_norm=False)
        kept_blocks = blocks.live_bytes() - T * D * s
        del out
    for chunks in (1, 4):
        with NewStorages(set()) as live:
            out = loss_fn(params, TOKENS_BL[:, :-1], TOKENS_BL[:, 1:], cfg, ce_chunks=chunks)
            kept = live.live_bytes()
            del out
        # beyond the head: the labels made contiguous int64 (T·8, which the plan leaves out) and scalars
        extra = kept - kept_blocks - casts - head_bytes(cfg, T, s, chunks) - T * 8
        assert 0 <= extra <= 64, (chunks, kept, kept_blocks, extra)
    # chunked, the norm's fp32 saves at full T are gone: 4 + 2s bytes an element (+ 4 a row) less the input kept
    assert head_bytes(cfg, T, s, 1) - T * V * 4 - head_bytes(cfg, T, s, 4) == T * D * (4 + s) + 4 * T


# ---------------------------------------------------------------- QK-clip's max-logit pass on a mesh

CLIP_CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=48, max_seq_len=L,
                       moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, first_k_dense=1),
                       compute_dtype="float32", compile=False)
CLIP_B, WORLD = 8, 4
CLIP_TOKENS_BL = torch.randint(0, 64, (CLIP_B, L + 1), generator=torch.Generator().manual_seed(2))


def _clip_run(qk_clip: bool) -> RunConfig:
    return RunConfig(model=CLIP_CFG, mesh=MeshConfig(fsdp=2, ep=2), data=DataConfig(seq_len=L),
                     train=TrainConfig(batch_size=CLIP_B, steps=1),
                     optim=OptimConfig(name="adamw", qk_clip=qk_clip, warmup_steps=0))


def _gathered(rows: list[dict]) -> dict[str, int]:
    """all-gather bytes sent, by mesh axis."""
    out: dict[str, int] = {}
    for r in rows:
        if r["kind"] == "all_gather":
            out[r["axis"]] = out.get(r["axis"], 0) + r["bytes"]
    return out


def _mesh_step(qk_clip: bool) -> tuple[dict, torch.Tensor]:
    """(all-gather bytes by axis of one train step, the max logits of a forward of the step's batch
    on the mesh: every rank's maxed)."""
    run = _clip_run(qk_clip)
    with fdist.simulate(WORLD):
        mesh = sharding.make_mesh(run.mesh)
        tx = optim.from_config(run.optim, 1)
        state = init_state(init_params(CLIP_CFG, 0, mesh=mesh), tx)
        b = CLIP_B // WORLD
        part_BL = fdist.rank_map(lambda r: CLIP_TOKENS_BL[r * b:(r + 1) * b].clone())
        with torch.no_grad():
            max_NH = hidden_states(state.params, part_BL[:, :-1], CLIP_CFG, record_max_logits=True,
                                   source=GATHER)[1]["max_logits_NH"]
        step = make_train_step(run, tx, train_runner(run))
        with CommMeter(sharding.group_axes(mesh)) as meter:
            step(state, [(part_BL[:, :-1], part_BL[:, 1:])])
        return _gathered(meter.rows()), torch.stack([max_NH._local_tensors[r] for r in range(WORLD)]).amax(0)


def test_max_logit_pass_gathers_no_expert_stack(monkeypatch):
    pin_routing(monkeypatch)  # every simulated rank routes alike: the exchange's splits are one value
    without, _ = _mesh_step(False)
    with_clip, max_NH = _mesh_step(True)
    assert without["fsdp"] > 0 and with_clip["fsdp"] == without["fsdp"], (without, with_clip)
    # the extra dense bytes a rank sends are every layer's attention and its norm (a ring all-gather
    # over dp sends (WORLD-1)/WORLD of them), as the planner counts them
    extra = comm_bytes(_clip_run(True))["fsdp"] - comm_bytes(_clip_run(False))["fsdp"]
    attention = sum(t.numel() * 4 for k, t in flatten_dict(init_params(CLIP_CFG, 0)).items()
                    if k.split(".")[0] == "layers" and k.split(".")[2] in ("attn", "attn_norm"))
    assert extra == with_clip["dp"] - without["dp"] == attention * (WORLD - 1) // WORLD, (extra, with_clip, without)
    want = hidden_states(init_params(CLIP_CFG, 0), CLIP_TOKENS_BL[:, :-1], CLIP_CFG,
                         record_max_logits=True)[1]["max_logits_NH"]
    assert max_NH.shape == (CLIP_CFG.n_layers, CLIP_CFG.n_heads)
    assert torch.equal(max_NH, want), (max_NH, want)
