"""Hugging Face checkpoints <-> fnmoe: `load(dir) -> (ModelConfig, params)`, `save(dir, params, cfg)`.

A Hugging Face checkpoint is a directory with config.json and safetensors weights, one file
(model.safetensors) or several named by model.safetensors.index.json. Files are memory-mapped
(safetensors.safe_open): a tensor is read when its leaf is built.

Architectures (dispatched on config.json's `architectures`, never `model_type`):
  Qwen3MoeForCausalLM     GQA with q/k RMSNorm, softmax router; dense layers from mlp_only_layers
                          and decoder_sparse_step
  DeepseekV3ForCausalLM   MLA, sigmoid router with the score-correction bias and group-limited
                          routing, shared experts, the first first_k_dense_replace layers dense
                          (Kimi-K2 uses this architecture too)
  MixtralForCausalLM      GQA, softmax top-k renormalised, every layer MoE
  Ernie4_5_MoeForCausalLM GQA, softmax top-k renormalised (chosen on the scores plus moe_statics'
                          score-correction bias: the router bias), shared experts, dense layers
                          outside moe_layer_start_index..moe_layer_end_index and moe_layer_interval;
                          its interleaved RoPE is fnmoe's half-split one with each head's query and
                          key rows reordered (keys.rope_rows). `save` writes it for a GQA model
                          without q/k norm that Mixtral cannot hold (the tiny preset: a dense first
                          layer)

Both config dialects are read: transformers-5 `rope_parameters`, and the top-level `rope_theta`
and `rope_scaling` (with `type`) of published hub checkpoints; `save` writes the former.

Weights: HF linear weights are [out, in] and are transposed to fnmoe's [in, out]; per-expert
weights `experts.<j>.*` are stacked by global expert id j into [E, in, out];
`e_score_correction_bias` goes to buffers.layers.<i>.moe.router_bias_E. Block-FP8 weights
(`quantization_config.weight_block_size`, `<key>_scale_inv` per block) are dequantized on load.
DeepSeek's multi-token-prediction layers (num_hidden_layers .. + num_nextn_predict_layers - 1)
are skipped with a logged line. Every leaf is fp32 (the master-param dtype).

Strict: an unknown architecture, a missing or unexpected tensor, a shape mismatch or an
option fnmoe does not implement raises ValueError naming the key; nothing loads partially.

Training-only knobs: `router_aux_loss_coef` (Qwen3, Mixtral) maps to model.moe.aux_loss_coeff and
DeepSeek's `aux_loss_alpha` with `seq_aux` to model.moe.seq_aux_loss_coeff; the others
(z-loss, the router-bias update rate) have no config.json field and load as 0 / are not saved.

  config.py   config.json <-> ModelConfig for each architecture; block-FP8 settings
  keys.py     fnmoe leaf paths <-> HF tensor keys, and the HF shape behind each leaf
  weights.py  HF tensors -> leaves (transpose, expert stacking, FP8 dequantization) and back
  tokenizer.py  the tokenizer files an export carries (fnmoe's byte tokenizer as a byte-level
                tokenizer.json, or a prepared corpus's) and its end-of-text id
  io.py       load and save: the checkpoint directory, its safetensors files and index

Modules import one way, in that order; this file only re-exports.

Legend: no shape-suffixed tensors here; leaves are handled by dotted path, HF tensors by key.
"""
from fnmoe.hf.config import MODEL_TYPES, architecture, config_from_hf, config_to_hf, fp8_block, hf_architecture
from fnmoe.hf.io import INDEX, SINGLE, load, read_json, save
from fnmoe.hf.keys import key_map
from fnmoe.hf.tokenizer import TokenizerFiles, byte_level, of_corpus
from fnmoe.hf.weights import HFReader as HFReader  # tests count the reads a load makes
from fnmoe.hf.weights import dequantize_fp8

__all__ = [
    "load", "save",
    "MODEL_TYPES", "architecture", "config_from_hf", "config_to_hf", "fp8_block", "hf_architecture",
    "key_map", "dequantize_fp8", "INDEX", "SINGLE", "read_json", "TokenizerFiles", "byte_level", "of_corpus",
]
