"""Generation: the KV-cache path equals full-forward decoding, for GQA and MLA; sampling rules."""
import dataclasses
from pathlib import Path

import pytest
import torch

from fnmoe.checkpoint import load_params
from fnmoe.config import load_config
from fnmoe.data.loader import EOS_ID, ByteTokenizer
from fnmoe.sampling.generate import generate, init_cache, sample, step_logits
from fnmoe.models.transformer import forward
from fnmoe.models.params import init_params
from conftest import tiny_flags

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("preset", ["tiny", "tiny_mla", "tiny_qwen3"])
def test_kv_cache_greedy_equals_full_forward_greedy(preset):
    cfg = load_config(ROOT / "configs" / f"{preset}.toml").model
    params = init_params(cfg, seed=1)
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    cached = generate(params, prompt, cfg, max_new_tokens=12)
    seq = prompt
    for _ in range(12):  # the reference: recompute the whole sequence for every token
        logits, _ = forward(params, seq, cfg)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, seq)


def test_cached_logits_match_full_forward_logits():
    cfg = load_config(ROOT / "configs" / "tiny_mla.toml").model
    params = init_params(cfg, seed=2)
    tokens = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    full, _ = forward(params, tokens, cfg)
    cache = init_cache(cfg, 1, 10)
    parts = [step_logits(params, tokens[:, :6], cache, cfg)] + [
        step_logits(params, tokens[:, t:t + 1], cache, cfg) for t in range(6, 10)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-4 * full.abs().max()


def test_top_p_keeps_the_nucleus_and_temperature_zero_is_argmax():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, 1.0, 0.7, gen).item() for _ in range(300)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are outside the nucleus
    assert sample(logits, 0.0, 0.7, gen).item() == 0
    assert {sample(logits, 1.0, 1.0, gen).item() for _ in range(500)} == {0, 1, 2, 3}


def test_sampling_settings_are_checked_and_extremes_stay_finite():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    for temperature, top_p, message in ((float("nan"), 1.0, "temperature"), (-1.0, 1.0, "temperature"),
                                        (1.0, 0.0, "top_p"), (1.0, float("nan"), "top_p")):
        with pytest.raises(ValueError, match=message):
            sample(logits, temperature, top_p, gen)
    assert sample(logits, 1e-45, 1.0, gen).item() == 0  # logits / T overflowed to inf and nan before
    assert {sample(logits, 1.0, 1e-9, gen).item() for _ in range(50)} == {0}  # the top token always stays


def test_generation_limits_are_named():
    cfg = dataclasses.replace(load_config(ROOT / "configs" / "tiny.toml").model, max_seq_len=16)
    params = init_params(cfg, seed=0)
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=16"):
        generate(params, torch.zeros(1, 10, dtype=torch.long), cfg, max_new_tokens=10)
    with pytest.raises(ValueError, match="token id 999"):
        generate(params, torch.tensor([[999]]), cfg, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        generate(params, torch.zeros(1, 2, dtype=torch.long), cfg, max_new_tokens=-1)


def test_generate_command_from_a_run_directory(tmp_path, capsys, monkeypatch):
    from fnmoe.sampling import generate as generate_module
    from fnmoe.cli import main

    assert main(["train", "--train.steps", "2", "--train.run-dir", str(tmp_path), *tiny_flags(1)]) == 0
    capsys.readouterr()
    # greedy (the default): the continuation of an independent decode loop over the run's last
    # checkpoint, each token the argmax of a full forward of the sequence so far, up to EOS; token
    # ids compared too (the text shows every byte that is not UTF-8 as the same U+FFFD)
    made = []
    monkeypatch.setattr(generate_module, "generate", lambda *a, **k: made.append(generate(*a, **k)) or made[-1])
    assert main(["generate", "--from", str(tmp_path), "--prompt", "Hello", "--max-new-tokens", "12"]) == 0
    run, params = load_params(tmp_path / "checkpoints" / "step_2")
    tok = ByteTokenizer()
    seq_BL = torch.tensor([tok.encode("Hello")])
    for _ in range(12):
        logits_BLV, _ = forward(params, seq_BL, run.model)
        seq_BL = torch.cat([seq_BL, logits_BLV[:, -1].argmax(-1, keepdim=True)], dim=1)
        if seq_BL[0, -1] == EOS_ID:
            break
    assert torch.equal(made[0], seq_BL)
    assert capsys.readouterr().out == "Hello" + tok.decode(seq_BL[0, 5:].tolist()) + "\n"
    # sampled: the same --seed draws the same text
    sampled = ["generate", "--from", str(tmp_path), "--prompt", "Hello", "--max-new-tokens", "8",
               "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"]
    outs = [main(sampled) == 0 and capsys.readouterr().out for _ in range(2)]
    assert outs[0] == outs[1] and outs[0].startswith("Hello")
    assert main(["generate", "--from", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
