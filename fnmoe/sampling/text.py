"""Text in and out of a model during and after training: the tokenizer a run's data was made
with (`run_codec`) and a short greedy sample for the log (`--train.sample-every N`).

Legend: B batch (one row here), L tokens of the prompt and the sample.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from fnmoe import caches
from fnmoe.config import DataConfig, RunConfig
from fnmoe.data.loader import EOS_ID, ByteTokenizer, corpus_codec
from fnmoe.sampling.generate import generate
from fnmoe.parallel.sharding import full_params
from fnmoe.tree import Tree, flatten_dict

log = logging.getLogger("fnmoe")

Codec = tuple[Callable[[str], list[int]], Callable[[list[int]], str], int]
"""(encode, decode, end-of-text id)"""


def prepared_corpus(data: DataConfig) -> Path | None:
    """The prepared directory whose tokenizer the data use (a mixture's sources share one), or
    None for text read with the byte tokenizer."""
    corpus = Path(data.mix[0].corpus if data.mix else data.corpus)
    return corpus if (corpus / "index.json").is_file() else None


@caches.register
@functools.lru_cache(maxsize=4)
def run_codec(data: DataConfig) -> Codec:
    """(encode, decode, eos id) of the tokenizer the data were tokenised with."""
    corpus = prepared_corpus(data)
    if corpus is not None:
        return corpus_codec(corpus)
    tok = ByteTokenizer()
    return tok.encode, tok.decode, EOS_ID


def sample_text(params: Tree, run: RunConfig, codec: Codec) -> str:
    """train.sample_prompt and up to train.sample_tokens greedy tokens after it (fewer at an
    end-of-text or at model.max_seq_len), decoded. params: whole tensors (one process)."""
    encode, decode, eos = codec
    t = run.train
    ids = encode(t.sample_prompt) or [eos]  # an empty prompt starts a new document
    device = flatten_dict(params)["embed.w_VD"].device
    new = max(0, min(t.sample_tokens, run.model.max_seq_len - len(ids)))
    eager = dataclasses.replace(run.model, compile=False)  # a decode step's shapes would compile anew
    out_BL = generate(params, torch.tensor([ids], device=device), eager, new, stop_id=eos)
    return t.sample_prompt + decode(out_BL[0, len(ids):].tolist())


def log_sample(step: int, params: Tree, run: RunConfig, rank: int) -> None:
    """--train.sample-every: every rank takes part in gathering sharded params; rank 0 samples and logs."""
    if any(isinstance(x, DTensor) for x in flatten_dict(params).values()):
        params = full_params(params)
    if rank == 0:
        try:
            log.info("sample at step %d: %r", step, sample_text(params, run, run_codec(run.data)))
        except ValueError as e:  # non-finite weights (a skipped step's neighbours): the run goes on
            log.warning("sample at step %d: none (%s)", step, e)
