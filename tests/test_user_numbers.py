"""Numbers and files a user reads (issue 45, item 6): each checked against an independent
computation written here, not against fnmoe's own helpers. The progress line's MFU follows its
window's speed; the HF export's guard on routing functions matches what each target class supports;
the byte-level tokenizer's byte-to-character map is GPT-2's for all 256 bytes; bits-per-byte counts
the bytes of word-boundary and multi-byte pieces; the warmup clamp's boundary (warmup == steps is
clamped, steps - 1 is not)."""
import dataclasses
import json
import re

import pytest

from fnmoe.config import ModelConfig, MoEConfig, OptimConfig
from fnmoe.training.evaluate import tokenizer_json_bytes
from fnmoe.hf import config as hf_config
from fnmoe.hf import tokenizer as hf_tokenizer
from fnmoe.optim import schedules
from fnmoe.run.progress import progress_line, window_means


# ---------------------------------------------------------------- 1. the progress line's MFU

FLOPS_PER_TOKEN = 6e6
PEAK_TFLOPS = 1e-3
TOKENS_PER_STEP = 100


def _rows(first_step: int, speeds: list[float], start_s: float) -> list[dict]:
    """Metrics rows as the loop writes them: each step's mfu is its own tokens/s times the FLOPs a
    token over the peak."""
    rows, t = [], start_s
    for i, tps in enumerate(speeds):
        t += TOKENS_PER_STEP / tps
        rows.append({"step": first_step + i, "loss": 3.0, "lr": 1e-3, "grad_norm": 0.5,
                     "tokens": TOKENS_PER_STEP * (first_step + i), "tokens_per_s": tps,
                     "mfu": FLOPS_PER_TOKEN * tps / (PEAK_TFLOPS * 1e12),
                     "expert_load_max_over_mean": 1.2, "skipped": 0, "time_s": t})
    return rows


@pytest.mark.parametrize("speeds", [[100.0, 300.0, 200.0], [50.0, 40.0, 20.0]], ids=["fast", "slow"])
def test_the_progress_lines_mfu_follows_its_windows_speed(speeds):
    """MFU = FLOPs a token x the window's tokens/s (its tokens over its steps' time) / peak, for two
    windows of different speed: not the first step's, nor the last step's, nor the rows' mean."""
    rows = _rows(11, speeds, 10.0)
    seconds = sum(TOKENS_PER_STEP / tps for tps in speeds)
    window_tps = len(speeds) * TOKENS_PER_STEP / seconds
    want = FLOPS_PER_TOKEN * window_tps / (PEAK_TFLOPS * 1e12)
    for wrong in (rows[0]["mfu"], rows[-1]["mfu"], sum(r["mfu"] for r in rows) / len(rows)):
        assert f"{100 * wrong:.1f}" != f"{100 * want:.1f}"  # the windows tell the right figure from these
    got = window_means(rows)
    assert got["tokens_per_s"] == pytest.approx(window_tps, rel=1e-12)
    assert got["mfu"] == pytest.approx(want, rel=1e-12)
    line = progress_line(rows, 100, before_s=10.0)
    assert f"| mfu {100 * want:.1f}% |" in line, line


def test_the_progress_line_says_n_a_for_mfu_without_a_peak():
    rows = [dict(r, mfu=None) for r in _rows(1, [100.0, 200.0], 0.0)]
    assert window_means(rows)["mfu"] is None and "| mfu n/a |" in progress_line(rows, 10)


# ---------------------------------------------------------------- 2. the HF export's routing guard

# What each HF class's router computes (transformers' modeling files):
#   DeepseekV3ForCausalLM: sigmoid scores; the top k chosen on scores + e_score_correction_bias
#     (always present: topk_method noaux_tc); group-limited (n_group, topk_group) routing.
#   Qwen3MoeForCausalLM: softmax top k over all experts; no bias, no groups.
#   MixtralForCausalLM: softmax top k, renormalised; no bias, no groups; every layer sparse.
#   Ernie4_5_MoeForCausalLM: softmax top k, renormalised, chosen on scores + moe_statics' bias
#     (optional: an all-zero one is no bias); no groups.
SUPPORTS = {  # class: (score_func, router bias: True required / False refused / None either, groups allowed)
    "DeepseekV3ForCausalLM": ("sigmoid", True, True),
    "Qwen3MoeForCausalLM": ("softmax", False, False),
    "MixtralForCausalLM": ("softmax", False, False),
    "Ernie4_5_MoeForCausalLM": ("softmax", None, False),
}


def _supported(arch: str, score: str, bias: bool, groups: bool) -> bool:
    want_score, want_bias, groups_ok = SUPPORTS[arch]
    return score == want_score and (want_bias is None or bias == want_bias) and (groups_ok or not groups)


def _base(family: str, every_layer_moe: bool) -> ModelConfig:
    moe = MoEConfig(n_experts=8, top_k=2, expert_hidden=16, first_k_dense=0 if every_layer_moe else 1)
    common = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_hidden=48, max_seq_len=16, moe=moe)
    if family == "mla":
        return ModelConfig(**common, n_kv_heads=4, attention="mla", q_lora_rank=16, kv_lora_rank=16,
                           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_interleave=True)
    return ModelConfig(**common, n_kv_heads=2, qk_norm=family == "qk_norm")


def _cases():
    """(family, every layer MoE, score_func, router bias, groups) for every routing combination."""
    for family, every in [("mla", False), ("qk_norm", True), ("gqa", True), ("gqa", False)]:
        for score in ("softmax", "sigmoid"):
            for bias in (False, True):
                for groups in (False, True):
                    yield family, every, score, bias, groups


def _expected(family: str, every: bool, score: str, bias: bool, groups: bool) -> tuple[str, bool]:
    """(the class the model is saved as, whether it is accepted), from SUPPORTS alone: MLA is
    DeepSeek-V3, q/k norm Qwen3-MoE, plain GQA Mixtral where it fits (every layer MoE) else Ernie."""
    if family == "mla":
        return "DeepseekV3ForCausalLM", _supported("DeepseekV3ForCausalLM", score, bias, groups)
    if family == "qk_norm":
        return "Qwen3MoeForCausalLM", _supported("Qwen3MoeForCausalLM", score, bias, groups)
    if every and _supported("MixtralForCausalLM", score, bias, groups):
        return "MixtralForCausalLM", True
    return "Ernie4_5_MoeForCausalLM", _supported("Ernie4_5_MoeForCausalLM", score, bias, groups)


def _reasons(arch: str, score: str, bias: bool, groups: bool) -> list[str]:
    """What the refusal must name: each routing feature the class lacks."""
    want_score, want_bias, groups_ok = SUPPORTS[arch]
    out = []
    if score != want_score:
        out.append(f"model.moe.score_func must be '{want_score}'")
    if want_bias is True and not bias:
        out.append("model.moe.router_bias must be true")
    if (want_bias is False and bias) or (groups and not groups_ok):
        out.append("group-limited routing")
    return out


@pytest.mark.parametrize("family,every,score,bias,groups", list(_cases()))
def test_the_hf_export_guards_the_routing_each_class_supports(family, every, score, bias, groups):
    base = _base(family, every)
    moe = dataclasses.replace(base.moe, score_func=score, router_bias=bias,
                              n_group=2 if groups else 1, topk_group=1)
    cfg = dataclasses.replace(base, moe=moe)
    arch, ok = _expected(family, every, score, bias, groups)
    if ok:
        assert hf_config.hf_architecture(cfg) == arch
        return
    with pytest.raises(ValueError) as e:
        hf_config.hf_architecture(cfg)
    msg = str(e.value)
    assert msg.startswith(f"hf.save: this model is saved as {arch}"), msg
    for reason in _reasons(arch, score, bias, groups):
        assert reason in msg, (reason, msg)


def test_every_class_of_the_export_table_is_checked():
    """The guard's classes are the ones SUPPORTS describes; each is accepted and refused above (a
    model Mixtral cannot hold falls through to Ernie 4.5, so Mixtral's refusals are Ernie's cases)."""
    assert set(hf_config.MODEL_TYPES) == set(SUPPORTS)
    outcomes, mixtral_misfits = {}, 0
    for case in _cases():
        arch, ok = _expected(*case)
        outcomes.setdefault(arch, set()).add(ok)
        family, every, score, bias, groups = case
        mixtral_misfits += family == "gqa" and every and not _supported("MixtralForCausalLM", score, bias, groups)
    assert outcomes == {arch: {True} if arch == "MixtralForCausalLM" else {True, False} for arch in SUPPORTS}
    assert mixtral_misfits == 7


# ---------------------------------------------------------------- 3. the byte-to-character map

def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's encoder.py bytes_to_unicode, as published."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2 ** 8):
        if b not in bs:
            bs.append(b)
            cs.append(2 ** 8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def test_the_byte_level_map_is_gpt2s_for_every_byte():
    want, got = _gpt2_bytes_to_unicode(), hf_tokenizer.byte_to_unicode()
    assert sorted(got) == list(range(256))
    wrong = [(b, got[b], want[b]) for b in range(256) if got[b] != want[b]]
    assert not wrong, wrong[:5]
    assert got[ord(" ")] == "Ġ" and got[ord("\n")] == "Ċ" and got[0] == "Ā" and got[0xAD] == "Ń"


def test_the_exported_vocabulary_maps_each_byte_to_its_value(tmp_path):
    """tokenizer.json's vocabulary: GPT-2's character of byte b -> b, for all 256 bytes."""
    files = dict(hf_tokenizer.byte_level(64).files)
    vocab = json.loads(files["tokenizer.json"])["model"]["vocab"]
    want = _gpt2_bytes_to_unicode()
    assert all(vocab[want[b]] == b for b in range(256))


# ---------------------------------------------------------------- 4. bits per byte's byte count

TEXTS = [" the", " ", "\n", "hello", " café", "é", "日本", " 日", "\t\t", "€", "🙂", " 🙂x"]


def _byte_level_piece(text: str) -> str:
    b2u = _gpt2_bytes_to_unicode()
    return "".join(b2u[b] for b in text.encode("utf-8"))


def test_bits_per_byte_counts_the_bytes_of_byte_level_pieces(tmp_path):
    """Byte-level BPE pieces, word-boundary ones ('Ġthe': the space is one byte) and multi-byte
    characters among them: each counts the UTF-8 bytes of the text it decodes to; a special token none."""
    vocab = {_byte_level_piece(t): i for i, t in enumerate(TEXTS)}
    assert "Ġthe" in vocab and "ĠcafÃ©" in vocab
    tok = {"model": {"type": "BPE", "vocab": vocab, "merges": []},
           "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False},
           "added_tokens": [{"id": len(TEXTS), "content": "<|endoftext|>", "special": True}]}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tok, ensure_ascii=False))
    got = tokenizer_json_bytes(path, len(TEXTS) + 2).tolist()
    assert got == [len(t.encode("utf-8")) for t in TEXTS] + [0, 0]


def test_bits_per_byte_counts_sentencepiece_word_boundaries_as_one_byte(tmp_path):
    """SentencePiece: '▁' (three UTF-8 bytes itself) stands for one space, <0xHH> for one byte."""
    texts = [" the", " ", "日本", " café"]
    vocab = [[t.replace(" ", "▁"), 0.0] for t in texts] + [["<0xE6>", 0.0]]
    tok = {"model": {"type": "Unigram", "vocab": vocab}, "decoder": {"type": "Metaspace"}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tok, ensure_ascii=False))
    assert tokenizer_json_bytes(path, len(vocab)).tolist() == [len(t.encode("utf-8")) for t in texts] + [1]


# ---------------------------------------------------------------- 5. the warmup clamp's boundary

@pytest.mark.parametrize("steps", [30, 100, 7])
def test_the_warmup_clamp_starts_at_a_warmup_as_long_as_the_run(steps):
    """warmup_steps == train.steps is clamped to a tenth (rounded down), with its note; one step
    shorter is kept as given, without one."""
    tenth = steps // 10
    warmup, note = schedules.warmup_of(OptimConfig(warmup_steps=steps), steps)
    assert warmup == tenth and note is not None
    assert f"optim.warmup_steps={steps} " in note and f"train.steps={steps})" in note
    assert re.search(rf"clamped to {tenth} steps?,", note), note
    assert schedules.warmup_of(OptimConfig(warmup_steps=steps - 1), steps) == (steps - 1, None)
    assert schedules.warmup_of(OptimConfig(warmup_steps=steps + 1), steps)[0] == tenth
