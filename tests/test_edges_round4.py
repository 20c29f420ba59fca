"""Edges of round 4 (issue 55): validators at their exact limit, the optimizer against torch's in
every dimension at once, and fp8 quantisation at its boundaries.

- The donated update's alias check (fnmoe.optim.in_place.check_no_aliases): leaves that share exactly
  one element (the last of one, the first of the other; the last of a strided leaf), or two
  one-element views of one element, are refused; leaves that are adjacent in one storage are not.
- The checkpoint index's bound of an entry's values by its files' bytes (fnmoe.checkpoint.format's
  _size_problem, through read_index): values of exactly the files' bytes are read, one byte more
  than they hold is refused.
- AdamW against torch.optim.AdamW with a warmup-then-cosine lr that changes every step and weight
  decay 0.1 (decoupled decay takes the same step's lr), pure and in place; an in-place step skipped
  by its finite check (non-finite gradients, or finite ones beside a non-finite loss) leaves the step
  count and the lr in the state as they were, not only the params and moments.
- fnmoe.kernels.fp8_blocks.pow2_scale through quantise (128x128 blocks) and fnmoe.kernels.fp8_gemm's
  quantise_rows (1x128 tiles): a block whose largest |x| is exactly 448 * 2^k gets the scale 2^k
  and a largest |q| of exactly 448; quantising what a dequantise gave back gives it back bitwise.
"""
import json
import math

import pytest
import torch

from test_optim import run_torch_adamw

from fnmoe import optim
from fnmoe.checkpoint import CheckpointError
from fnmoe.checkpoint.format import FORMAT, VERSION, read_index
from fnmoe.kernels import fp8_blocks, fp8_gemm
from fnmoe.optim.in_place import check_no_aliases, update_in_place
from conftest import rel

# ------------------------------------------------------------------ the alias check at its limit


def _refused(tree, first: str, second: str) -> None:
    with pytest.raises(ValueError, match=rf"'{second}' shares its memory with '{first}'"):
        check_no_aliases(tree, "the params")


def test_leaves_sharing_exactly_one_element_are_refused_and_adjacent_ones_are_not():
    """One float32 storage of 16 elements: [0, 8) and [8, 16) are adjacent (accepted); [0, 8) and
    [7, 16) share element 7 alone (refused). The same in bfloat16 (2-byte elements: the end is
    counted in elements, not bytes)."""
    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.zeros(16, dtype=dtype)
        check_no_aliases({"a": buf[:8], "b": buf[8:]}, "the params")
        _refused({"a": buf[:8], "b": buf[7:]}, "a", "b")
        # as rows of a matrix: rows 0-1 and rows 2-3 adjacent; row 1's last element and rows 2-3 not
        m = buf.view(4, 4)
        check_no_aliases({"a": m[:2], "b": m[2:]}, "the params")
        _refused({"a": m[:2], "b": m.view(-1)[7:]}, "a", "b")


def test_two_one_element_views_of_one_element_are_refused():
    """A 0-D view and a [1] view of element 3 (and two [1, 1] views of it): the same bytes written
    twice, refused; the views of elements 3 and 4 are adjacent and accepted."""
    buf = torch.zeros(8)
    _refused({"a": buf[3], "b": buf[3:4]}, "a", "b")
    m = buf.view(2, 4)
    _refused({"a": m[0:1, 3:4], "b": m[0:1, 3:4]}, "a", "b")
    check_no_aliases({"a": buf[3], "b": buf[4:5]}, "the params")


def test_a_strided_leafs_last_element_shared_with_another_is_refused():
    """A column of a 4x4 matrix spans elements 3, 7, 11, 15: a leaf starting at element 15 shares
    its last element (refused); one starting at element 16 of a longer storage does not."""
    buf = torch.zeros(20)
    col = buf[:16].view(4, 4)[:, 3]
    assert col.stride() == (4,)
    _refused({"a": col, "b": buf[15:16]}, "a", "b")
    check_no_aliases({"a": col, "b": buf[16:]}, "the params")


# ------------------------------------------------------------------ the index's bound by its files' bytes

PARAMS = "params-rank00000.safetensors"


def _index(tmp_path, dtype: str, shape: list[int], file_bytes: list[int]):
    """A step_0 checkpoint directory whose index.json lists one tensor entry (dtype, shape, one part)
    and len(file_bytes) files of those sizes (read_index reads no file but the index)."""
    ckpt = tmp_path / f"{dtype}-{'-'.join(map(str, file_bytes))}" / "step_0"
    ckpt.mkdir(parents=True)
    files = {f"params-rank{r:05d}.safetensors": {"writer_rank": r, "bytes": n, "sha256": ""}
             for r, n in enumerate(file_bytes)}
    index = {"format": FORMAT, "version": VERSION, "step": 0, "model": {},
             "tensors": {"w": {"dtype": dtype, "shape": shape,
                               "shards": [{"file": PARAMS, "key": "w", "offset": [0] * len(shape), "shape": shape}]}},
             "opt_state": {}, "rng": {}, "files": files, "mesh": {"fsdp": 1, "ep": 1},
             "train": {"step": 0, "schedule": {}, "data": {"step": 0, "epoch": 0, "samples_seen": 0, "seed": 0,
                                                           "corpus_fingerprint": ""}}}
    (ckpt / "index.json").write_text(json.dumps(index))
    return ckpt


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("bfloat16", 2), ("int64", 8)])
def test_an_entrys_values_may_take_exactly_its_files_bytes_and_not_one_more(tmp_path, dtype, itemsize):
    """A [3, 5] entry: 15 values of itemsize bytes. Its files (one, or two summed) holding exactly
    that many bytes: read; one byte fewer: refused naming the entry, its shape and the files' bytes."""
    need = 15 * itemsize
    for sizes in ([need], [need // 3, need - need // 3]):
        assert read_index(_index(tmp_path, dtype, [3, 5], sizes))["tensors"]["w"]["shape"] == [3, 5]
        short = sizes[:-1] + [sizes[-1] - 1]
        with pytest.raises(CheckpointError, match=rf"tensors\['w'\]\.shape = \[3, 5\] is more {dtype} values than "
                                                  rf"its files' {need - 1} bytes hold$"):
            read_index(_index(tmp_path, dtype, [3, 5], short))


# ------------------------------------------------------------------ AdamW under a schedule with decay

SHAPES = [(24, 16), (17,), (4, 3, 5)]
STEPS, WARMUP, PEAK, WD = 7, 3, 1e-2, 0.1


def _schedule():
    return optim.warmup_cosine(PEAK, WARMUP, STEPS, min_ratio=0.1)


def _torch_adamw(params0, grads, decayed, lr_at):
    """torch.optim.AdamW (foreach off) with the lr set to lr_at(step) before each step; decay WD on
    the decayed params, none on the others (test_optim's reference runner)."""
    return run_torch_adamw(params0, grads, PEAK, WD, decayed, betas=(0.9, 0.95), eps=1e-8, lr_at=lr_at)


def test_adamw_under_a_changing_lr_with_decay_matches_torch_pure_and_in_place():
    """7 steps, warmup over 3 then cosine down to a tenth: the lr differs at every step, so a decay
    by another step's lr (the state's previous one, or the schedule a step ahead) is off by
    |lr_t - lr_t'| * wd * |p| each step, ~100x the tolerance. The leaves without decay (a mask)
    match torch bitwise, the decayed ones within 1e-6 (torch rounds the decay in place first), the
    moments bitwise; the in-place update gives the pure update's values bit for bit and the lr of
    the last step in its state."""
    g = torch.Generator().manual_seed(0)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(STEPS)]
    decayed = [True, False, True]
    sched = _schedule()
    lrs = [sched(torch.tensor(t)).item() for t in range(STEPS)]
    assert len(set(lrs)) == STEPS  # the lr changes at every step
    ref, ref_state = _torch_adamw(params0, grads, decayed, lambda t: lrs[t])
    tx = optim.adamw(sched, 0.9, 0.95, 1e-8, WD, mask={str(i): d for i, d in enumerate(decayed)})
    pure = {str(i): p.clone() for i, p in enumerate(params0)}
    placed = {str(i): p.clone() for i, p in enumerate(params0)}
    pure_state, placed_state = tx.init(pure), tx.init(placed)
    for gs in grads:
        tree = {str(i): x for i, x in enumerate(gs)}
        updates, pure_state = tx.update(tree, pure_state, pure)
        pure = optim.apply_updates(pure, updates)
        assert bool(update_in_place(tx, tree, placed_state, placed, torch.ones((), dtype=torch.bool),
                                    optim.global_norm(tree)))
    for state in (pure_state, placed_state):
        assert state.count.item() == STEPS and state.lr.item() == lrs[-1]
    for i, r in enumerate(ref):
        k = str(i)
        assert torch.equal(pure[k], placed[k]) and torch.equal(pure_state.mu[k], placed_state.mu[k])
        assert torch.equal(pure_state.mu[k], ref_state[i]["exp_avg"])
        assert torch.equal(pure_state.nu[k], ref_state[i]["exp_avg_sq"])
        if decayed[i]:
            assert rel(pure[k], r) <= 1e-6, (k, rel(pure[k], r))
        else:
            assert torch.equal(pure[k], r), k


def test_a_step_skipped_by_ok_leaves_the_step_count_and_lr_in_the_state_as_they_were():
    """3 finite steps of the scheduled AdamW in place, then two skipped ones (ok False, the step's
    finite check): NaN gradients, and finite gradients where something else was not finite (the
    loss, QK-clip's logits: ok gates every write, not the leaves' own finiteness). Each returns False
    and leaves params, moments, the step count and the scheduled lr bitwise as they were (the module
    docstring: a skip decided by ok leaves everything as it was); the next step then equals the pure
    update's fourth (the count resumes at 3, the lr at the schedule's step 3)."""
    g = torch.Generator().manual_seed(1)
    params = {str(i): torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}
    grads = [{k: torch.randn(p.shape, generator=g) for k, p in params.items()} for _ in range(4)]
    tx = optim.adamw(_schedule(), weight_decay=WD)
    pure_p, pure_s = {k: v.clone() for k, v in params.items()}, tx.init(params)
    for gs in grads:
        updates, pure_s = tx.update(gs, pure_s, pure_p)
        pure_p = optim.apply_updates(pure_p, updates)
    state = tx.init(params)
    yes = torch.ones((), dtype=torch.bool)
    for gs in grads[:3]:
        update_in_place(tx, gs, state, params, yes, optim.global_norm(gs))
    before = [_bits(t).clone() for t in optim.tree_flatten_with_paths((params, state))[1]]
    nan = {k: torch.full_like(v, float("nan")) for k, v in grads[3].items()}
    for skipped in (nan, grads[3]):
        assert not bool(update_in_place(tx, skipped, state, params, ~yes, optim.global_norm(skipped)))
        assert state.count.item() == 3 and state.lr.item() == _schedule()(torch.tensor(2)).item()
        after = optim.tree_flatten_with_paths((params, state))[1]
        assert all(torch.equal(b, _bits(a)) for b, a in zip(before, after, strict=True))
    update_in_place(tx, grads[3], state, params, yes, optim.global_norm(grads[3]))
    assert all(torch.equal(params[k], pure_p[k]) for k in params)
    assert state.count.item() == 4 and torch.equal(state.lr, pure_s.lr)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes: an equality of them is bitwise (NaNs and signed zeros included)."""
    return t.reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------ fp8 scales at 448 x 2^k

EXPONENTS = [-126, -60, -7, 0, 1, 9, 100, 118]  # 448 x 2^118 ~ 1.9e38, within float32


def _block_with_amax(amax: float, n_rows: int, n_cols: int, seed: int) -> torch.Tensor:
    """[n_rows, n_cols] float32 values of |x| < amax / 2 and one of -amax (a negative largest |x|)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n_rows, n_cols, generator=g, dtype=torch.float64) - 0.5) * amax * 0.99
    x = x.float()
    x[n_rows // 2, n_cols // 3] = -amax
    return x


@pytest.mark.parametrize("k", EXPONENTS)
def test_a_block_whose_amax_is_448_times_2_to_the_k_gets_scale_2_to_the_k(k):
    """The least power of two s with amax / s <= 448 is 2^k itself when amax is 448 * 2^k (not 2^(k+1),
    which would throw away one bit of e4m3's range), and the block's largest |q| is exactly 448; one
    float32 ulp below it the scale is 2^k too, one ulp above it 2^(k+1) (a log2 that rounds would
    give 2^k there, and q past 448). Three 128x128 blocks side by side (below, at, above), through
    quantise's blocks and quantise_rows' 1x128 tiles (the row holding each block's amax)."""
    at = torch.tensor(math.ldexp(448.0, k), dtype=torch.float32)
    amaxes = [torch.nextafter(at, torch.tensor(0.0)).item(), at.item(),
              torch.nextafter(at, torch.tensor(math.inf)).item()]
    x = torch.cat([_block_with_amax(a, 128, 128, seed=k + 200 + i) for i, a in enumerate(amaxes)], dim=1)
    want = [math.ldexp(1.0, k), math.ldexp(1.0, k), math.ldexp(1.0, k + 1)]
    q, s = fp8_blocks.quantise(x)
    qr, sr = fp8_gemm.quantise_rows(x)
    row = 64  # the row holding each block's -amax
    assert s[0].tolist() == want and sr[row].tolist() == want, (k, s, sr[row])
    for lowest in (q.float().view(128, 3, 128).amin(dim=(0, 2)).tolist(),
                   qr[row].float().view(3, 128).amin(1).tolist()):
        assert lowest[1] == -448.0 and lowest[0] >= -448.0 and -224.0 >= lowest[2] >= -232.0, (k, lowest)


def test_a_block_below_448_times_2_to_the_minus_126_keeps_the_smallest_normal_scale():
    """amax = 224 x 2^-126: its power of two would be 2^-127, a subnormal scale; the scale stays
    2^-126 (fp8_blocks.MIN_SCALE_EXP) and the block's largest |q| is 224, in both quantisers."""
    x = _block_with_amax(math.ldexp(224.0, -126), 4, 128, seed=7)
    for q, s in (fp8_blocks.quantise(x), fp8_gemm.quantise_rows(x[2:3])):
        assert s.max().item() == math.ldexp(1.0, -126) and q.float().abs().max().item() == 224.0


def _edge_blocks() -> torch.Tensor:
    """[256, 384] float32 in six 128x128 blocks, all worth requantising: one of randn; one whose amax
    rounds up to 448 x s (440 x 2^-3: its dequantised amax is exactly 448 x 2^-3); one of exactly
    448 x 2^5; one where most values land on e4m3's subnormals (|x / s| < 2^-6, on steps of 2^-9);
    one of zeros; one spread over 20 binades."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 384, generator=g)
    x[:128, 128:256] = _block_with_amax(440 * 2.0 ** -3, 128, 128, seed=1)
    x[:128, 256:] = _block_with_amax(448 * 2.0 ** 5, 128, 128, seed=2)
    sub = torch.randn(128, 128, generator=g) * 2.0 ** -8  # x / s ~ 2^-8: mostly subnormal q
    sub[0, 0] = 448.0
    x[128:, :128] = sub
    x[128:, 128:256] = 0
    x[128:, 256:] = torch.randn(128, 128, generator=g) * torch.exp2(torch.randint(-20, 0, (128, 128), generator=g))
    return x


def test_quantising_a_dequantised_block_gives_it_back_bitwise():
    """dequantise(quantise(y)) == y for y = dequantise(quantise(x)): y's values are e4m3 values times
    x's scale s, subnormals included, and its amax is the rounded one, in [224 s, 448 s]: its scale is
    s (or s / 2 where the amax rounded down to 224 s, and every q doubles exactly), so nothing rounds
    again. In bfloat16 as in float32. A scale of 2s for an amax of exactly 448 s would halve each q
    and drop the last bit of the odd ones. Checks the blocks are what they say: one amax that
    rounds up to exactly 448 s, subnormal q values."""
    x = _edge_blocks()
    q, s = fp8_blocks.quantise(x)
    assert (q[:128, 128:256].float().abs().max() == 448.0 and s[0, 1].item() == 2.0 ** -3
            and x[:128, 128:256].abs().max() < 448 * 2.0 ** -3)
    small = q[128:, :128].float().abs()
    assert ((small > 0) & (small < 2.0 ** -6)).sum() > 1000
    for dtype in (torch.float32, torch.bfloat16):
        y = fp8_blocks.dequantise(q, s, dtype)
        q2, s2 = fp8_blocks.quantise(y)
        assert ((s2 == s) | (s2 == s / 2)).all()
        assert torch.equal(_bits(fp8_blocks.dequantise(q2, s2, dtype)), _bits(y)), dtype


def test_quantising_a_dequantised_row_tile_gives_it_back_bitwise():
    """The same for fp8_gemm's 1x128 tiles: each row tile of the edge blocks, quantised, dequantised,
    quantised again, comes back bitwise, with the same scale or half of it (some tiles' amax rounds
    down to 224 s here)."""
    x = _edge_blocks()
    q, s = fp8_gemm.quantise_rows(x)
    tiles = q.float().abs().view(256, 3, 128).amax(-1)
    assert (tiles == 448.0).sum() >= 2  # tiles whose amax is 448 exactly (given, or rounded up to it)
    y = fp8_gemm.dequantise_rows(q, s)
    q2, s2 = fp8_gemm.quantise_rows(y)
    assert ((s2 == s) | (s2 == s / 2)).all() and (s2 == s / 2).any()
    assert torch.equal(_bits(fp8_gemm.dequantise_rows(q2, s2)), _bits(y))
