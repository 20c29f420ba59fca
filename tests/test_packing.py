"""Packing with document masks and SFT prompt masking: a packed row equals its documents run alone."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fnmoe import load_config
from fnmoe.models.attention import doc_mask, sdpa
from fnmoe.cli import main
from fnmoe.config import DataConfig
from fnmoe.data.loader import EOS_ID, IGNORE, Loader, load_data, val_batches
from fnmoe.models.transformer import forward
from fnmoe.models.params import init_params
from fnmoe.training.step import loss_fn
from fnmoe.tree import flatten_dict, tree_map, value_and_grad

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["tiny.toml", "tiny_mla.toml"]


def fp32(name):
    cfg = load_config(ROOT / "configs" / name).model
    return dataclasses.replace(cfg, compute_dtype="float32", compile=False)


def two_docs(cfg, lens=(21, 35)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg.vocab_size, (1, n), generator=g) for n in lens]


def packed(docs):
    tokens_BL = torch.cat(docs, dim=1)
    positions_BL = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    return tokens_BL, positions_BL


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_row_gives_the_logits_of_its_documents_run_separately(name):
    cfg = fp32(name)
    params = init_params(cfg, 0)
    docs = two_docs(cfg)
    tokens_BL, positions_BL = packed(docs)
    logits_BLV, _ = forward(params, tokens_BL, cfg, positions_BL)
    alone = [forward(params, d, cfg)[0] for d in docs]
    ref_BLV = torch.cat(alone, dim=1)
    assert (logits_BLV - ref_BLV).abs().max() <= 1e-5 * ref_BLV.abs().max()
    # without the mask the second document would see the first: the test can fail
    assert (forward(params, tokens_BL, cfg)[0] - ref_BLV).abs().max() > 1e-3


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_row_gradients_equal_the_sum_over_its_documents(name):
    cfg = fp32(name)
    # the router's balance losses are batch statistics, not sums over documents: compare the CE
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss_coeff=0.0, seq_aux_loss_coeff=0.0,
                                                           z_loss_coeff=0.0))
    params = init_params(cfg, 0)
    docs = two_docs(cfg)
    tokens_BL, positions_BL = packed(docs)
    # a packed row's labels: the next token, none for a document's first token (the Loader's rule)
    labels_BL = tokens_BL.roll(-1, 1)
    labels_BL[:, -1] = IGNORE
    labels_BL[:, docs[0].shape[1] - 1] = IGNORE
    n = int((labels_BL != IGNORE).sum())
    grad_fn = value_and_grad(loss_fn, has_aux=True)
    (loss, _), grads = grad_fn(params, tokens_BL, labels_BL, cfg, n, positions_BL=positions_BL)
    total, ref = 0.0, None
    for d in docs:
        y = d.roll(-1, 1)
        y[:, -1] = IGNORE
        (part, _), g = grad_fn(params, d, y, cfg, n)
        total, ref = total + part, g if ref is None else tree_map(torch.add, ref, g)
    assert abs(float(loss) - float(total)) <= 1e-5 * abs(float(total))
    ref_flat = flatten_dict(ref)
    for path, a in flatten_dict(grads).items():
        b = ref_flat[path]
        assert (a - b).abs().max() <= 1e-5 * max(float(b.abs().max()), 1e-12), path


def test_block_sparse_mask_matches_the_dense_one():
    """The flex_attention path (CUDA in compiled regions) on CPU, forward only (no CPU backward)."""
    B, H, G, L, A = 2, 4, 2, 256, 16
    positions_BL = torch.cat([torch.arange(100), torch.arange(90), torch.arange(66)])[None].repeat(B, 1)
    positions_BL[1, :130] = torch.arange(130) + 5  # a row may start inside a document
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, L, A, generator=g) for h in (H, G, G))
    dense = sdpa(q, k, v, doc_mask(positions_BL))
    with torch.no_grad():
        sparse = torch.compile(sdpa)(q, k, v, doc_mask(positions_BL, block_sparse=True))
    assert (sparse - dense).abs().max() <= 1e-5


def test_loader_positions_restart_and_first_labels_are_ignored(tmp_path):
    corpus = tmp_path / "short_docs.txt"
    corpus.write_text("\n\f\n".join(f"doc {i} " + "ab" * (i % 23) for i in range(400)))
    data = load_data(DataConfig(corpus=str(corpus)), 257)
    L = 64
    loader = Loader(data, L, 8, 1, 0, doc_mask=True)
    plain = Loader(data, L, 8, 1, 0)
    stream = data.train_T.tolist()
    for step in range(8):
        x, y, pos = loader.batch_at(step, 0, 1, 0)
        x0, y0 = plain.batch_at(step, 0, 1, 0)
        assert torch.equal(x, x0)
        for b, window in enumerate(plain.sample_ids(step, 0, 1, 0) % loader.n_samples):
            start = int(window) * L
            for j in range(L + 1):  # the reference: walk back to the previous EOS
                i = start + j
                p = 0
                while i - p - 1 >= 0 and stream[i - p - 1] != EOS_ID:
                    p += 1
                if j < L:
                    assert pos[b, j] == p
                if j > 0:
                    assert y[b, j - 1] == (IGNORE if p == 0 else y0[b, j - 1])
    assert (pos == 0).sum() > 8
    vx, vy, vpos = val_batches(data, L, 4, 2, doc_mask=True)[0]
    assert vpos.shape == vx.shape and (vy[:, :-1][vpos[:, 1:] == 0] == IGNORE).all()


def sft_rows(n=60):
    return [{"prompt": f"Q{i}: what is {i}+{i}?", "answer": f" {2 * i}."} for i in range(n)]


def test_sft_prompt_tokens_get_no_loss_in_memory_and_prepared(tmp_path):
    rows = sft_rows()
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dcfg = DataConfig(corpus=str(src), text_field="answer", prompt_field="prompt", val_fraction=0.1)
    mem = load_data(dcfg, 257)
    # the reference: prompt bytes are not targets, the answer and its EOS are
    n_train = len(rows) - round(len(rows) * 0.1)
    ids, mask = [], []
    for r in rows[:n_train]:
        p, a = r["prompt"].encode(), r["answer"].encode()
        ids += list(p) + list(a) + [EOS_ID]
        mask += [0] * len(p) + [1] * (len(a) + 1)
    assert mem.train_T.tolist() == ids and mem.train_loss_T.tolist() == mask
    x, y = Loader(mem, 32, 4, 1, 0).batch_at(0, 0, 1, 0)
    assert (y == IGNORE).any() and (y != IGNORE).any()

    assert main(["prepare", "--input", str(src), "--text-field", "answer", "--prompt-field", "prompt",
                 "--val-fraction", "0.1", "--out", str(tmp_path / "out")]) == 0
    prep = load_data(DataConfig(corpus=str(tmp_path / "out")), 257)
    for split in ("train", "val"):
        (a, ma), (b, mb) = mem.stream(split), prep.stream(split)
        assert a.tolist() == b.long().tolist() and ma.tolist() == mb.tolist()
    x2, y2 = Loader(prep, 32, 4, 1, 0).batch_at(0, 0, 1, 0)
    assert torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize("doc_mask", [False, True])
def test_sft_labels_train_the_first_answer_token_and_no_prompt_token(tmp_path, doc_mask):
    """Every label of every window, against the token stream itself: prompts are written in capitals
    and answers in lower case, so a target token says by its value whether it is trained on. The
    last prompt token predicts the first answer token (a target); an off-by-one mask drops it."""
    letters = "abcdefghij"
    rows = [{"prompt": "".join(letters[int(c)].upper() for c in str(7 * i)) + "?",
             "answer": "".join(letters[int(c)] for c in str(14 * i)) + "."} for i in range(40)]
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_data(DataConfig(corpus=str(src), text_field="answer", prompt_field="prompt", val_fraction=0.1), 257)
    answer_ids = set((letters + ".").encode()) | {EOS_ID}
    L = 16
    loader = Loader(data, L, 4, 1, 0, doc_mask=doc_mask)
    first_answers = 0
    for step in range(-(-loader.n_samples // 4)):  # one epoch: every window
        x_BL, y_BL, *_ = loader.batch_at(step, 0, 1, 0)
        window_B = loader.sample_ids(step, 0, 1, 0) % loader.n_samples
        next_BL = data.train_T[window_B[:, None] * L + torch.arange(1, L + 1)].long()  # the token each predicts
        for b in range(x_BL.shape[0]):
            for j in range(L):
                token = next_BL[b, j].item()
                assert y_BL[b, j] == (token if token in answer_ids else IGNORE), (step, b, j, token)
                first_answers += chr(x_BL[b, j]) == "?" and token in answer_ids
    assert first_answers > 20


def test_sft_field_errors_name_the_line_and_field(tmp_path):
    src = tmp_path / "sft.jsonl"
    src.write_text(json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(ValueError, match='line 1: expected an object with a string "text"'):
        load_data(DataConfig(corpus=str(src), prompt_field="prompt"), 257)
    txt = tmp_path / "plain.txt"
    txt.write_text("hello")
    with pytest.raises(ValueError, match="needs a JSONL, Parquet or datasets corpus"):
        load_data(DataConfig(corpus=str(txt), prompt_field="prompt"), 257)
