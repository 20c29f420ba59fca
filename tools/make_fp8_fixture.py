"""Write a tiny block-FP8 DeepSeek-V3 checkpoint laid out like the published one.

    python tools/make_fp8_fixture.py OUT_DIR [--seed N]

A random `DeepseekV3ForCausalLM` (transformers) with odd sizes, so blocks do not tile the
matrices evenly, is saved and then rewritten: every linear weight except the embedding, the
output head and the routers becomes float8_e4m3fn in BLOCK x BLOCK blocks, each with its fp32
`<key>_scale_inv` (dequantized weight = fp8 value * scale_inv of its block); config.json gains
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK}; and a
multi-token-prediction layer (index num_hidden_layers) is added, as in DeepSeek-V3's files, for
loaders to skip. Tests call `make_fixture` into a temporary directory; no binary is committed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = (16, 16)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
NOT_QUANTIZED = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale_inv per block) with scale_inv = block amax / 448."""
    rows, cols = w.shape
    nb0, nb1 = -(-rows // block[0]), -(-cols // block[1])
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(nb0, nb1)
    for i in range(nb0):
        for j in range(nb1):
            rs, cs = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            s = w[rs, cs].abs().max().clamp_min(1e-12) / FP8_MAX
            q[rs, cs] = (w[rs, cs] / s).to(torch.float8_e4m3fn)
            scale_inv[i, j] = s
    return q, scale_inv


def tiny_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(vocab_size=72, hidden_size=40, intermediate_size=56, moe_intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=3, num_key_value_heads=3, n_shared_experts=1, n_routed_experts=6, n_group=2,
              topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=20, kv_lora_rank=18,
              qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=128,
              initializer_range=0.1)
    return DeepseekV3Config(**(kw | overrides))


def make_fixture(out_dir: str | Path, seed: int = 0, block: tuple[int, int] = BLOCK) -> Path:
    """Write the FP8 fixture to out_dir and return it."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    cfg = tiny_config()
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # decisive routing, a non-zero score-correction bias
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0, 2 / cfg.hidden_size ** 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    n = cfg.num_hidden_layers
    mtp = {f"model.layers.{n}.enorm.weight": torch.ones(cfg.hidden_size),
           f"model.layers.{n}.hnorm.weight": torch.ones(cfg.hidden_size),
           f"model.layers.{n}.eh_proj.weight": torch.randn(cfg.hidden_size, 2 * cfg.hidden_size) * 0.1,
           f"model.layers.{n}.shared_head.norm.weight": torch.ones(cfg.hidden_size)}
    out = {}
    for key, t in (tensors | mtp).items():
        if t.ndim == 2 and not key.endswith(NOT_QUANTIZED):
            out[key], out[key + "_scale_inv"] = quantize_block_fp8(t, block)
        else:
            out[key] = t
    save_file(out, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    config["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {make_fixture(args.out_dir, args.seed)}")
