"""Data mixtures (data.mix): each global batch drawn from several prepared corpora in proportion to
their weights, as a pure function of the step like `fnmoe.data.loader.Loader`.

Shape suffixes: B batch (sequences, or rows of the global batch), L sequence length, M sources.

Rows to sources. Global row g = step * batch_size + j (j laid out micro-batch-major, as Loader)
goes to a source by nested rounding, a deterministic low-discrepancy rule rather than sampling:
source 0 takes the rows where round(g * q_0) steps up, q_0 = p_0 its share; the rows it leaves are
renumbered 0, 1, 2, ... and source 1 takes those where round(r * q_1) steps up, q_1 = p_1 / (1 - p_0)
its share of what is left; and so on, the last source taking the rest. The k-th row a source takes
is that source's sample k, so a source's count among the first G rows is round(G q_0) for source 0
(and within a row or two of G p_i for the others) at every G: every batch, and any run of steps,
holds each source in its proportion up to a row per source. Any rank computes the rows of any
step in O(sources) without the steps before it, so resume needs only the step.

Within a source, sample k is window perm_e[k % n] of its training stream (n windows, epoch
e = k // n, one permutation per (seed, source name, epoch)): a source that runs out starts a new
epoch of itself, with a warning naming it. Each source keeps its own validation split, evaluated
on its own (val_loss/<name>); val_loss is their weighted mean.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fnmoe import caches
from fnmoe.config import DataConfig, RunConfig
from fnmoe.data.loader import (Loader, TokenData, keyed_permutation, load_data, load_prepared, read_prepared_index,
                               val_batches, windows)

log = logging.getLogger("fnmoe")


@dataclass(frozen=True, eq=False)
class Mixture:
    names: tuple[str, ...]
    weights: tuple[float, ...]
    """normalised: they sum to one"""
    sources: tuple[TokenData, ...]
    fingerprint: str
    """short sha256 of the names, weights and the sources' fingerprints; identifies the data"""


def load_mixture(dcfg: DataConfig, vocab_size: int) -> Mixture:
    """The prepared directories of data.mix, checked to share one tokenizer (the first mismatch is
    an error naming both sources)."""
    names = tuple(s.label for s in dcfg.mix)
    indexes = []
    for name, s in zip(names, dcfg.mix):
        try:
            indexes.append(read_prepared_index(s.corpus))
        except (OSError, ValueError) as e:
            raise type(e)(f"data.mix source {name!r}: {e}") from None
    def said(i: int) -> str:
        return (f"{names[i]!r} ({dcfg.mix[i].corpus}: tokenizer {indexes[i].get('tokenizer')}, "
                f"eos {indexes[i].get('eos_id')})")

    for i, index in enumerate(indexes[1:], start=1):
        if (index.get("tokenizer"), index.get("eos_id")) != (indexes[0].get("tokenizer"), indexes[0].get("eos_id")):
            raise ValueError(f"data.mix sources {said(0)} and {said(i)} were prepared with different tokenizers; "
                             "prepare them with the same --tokenizer")
    sources = tuple(load_prepared(Path(s.corpus), vocab_size) for s in dcfg.mix)
    total = sum(s.weight for s in dcfg.mix)
    weights = tuple(s.weight / total for s in dcfg.mix)
    h = hashlib.sha256()
    for name, w, data in zip(names, weights, sources):
        h.update(f"{name}:{w!r}:{data.fingerprint};".encode())
    return Mixture(names, weights, sources, h.hexdigest()[:16])


# ---------------------------------------------------------------- rows to sources

def _shares(weights: tuple[float, ...]) -> list[float]:
    """q_i = p_i / (p_i + ... + p_last): each source's share of the rows the ones before it leave."""
    out, left = [], 1.0
    for w in weights[:-1]:
        out.append(min(1.0, w / left) if left > 0 else 1.0)
        left -= w
    return out


def assign_rows(g_B: torch.Tensor, weights: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(source_B, k_B) int64: the source of each global row index g_B and which of that source's
    samples it is (its count of earlier rows): the nested rounding of the module docstring."""
    r_B = g_B.to(torch.int64).clone()
    source_B = torch.full_like(r_B, len(weights) - 1)
    k_B = torch.empty_like(r_B)
    open_B = torch.ones_like(r_B, dtype=torch.bool)
    for i, q in enumerate(_shares(weights)):
        before_B = _taken(r_B, q)
        hit_B = open_B & (_taken(r_B + 1, q) > before_B)
        source_B[hit_B], k_B[hit_B] = i, before_B[hit_B]
        open_B &= ~hit_B
        r_B = torch.where(open_B, r_B - before_B, r_B)  # renumbered among the rows left
    k_B[open_B] = r_B[open_B]
    return source_B, k_B


def _taken(r_B: torch.Tensor, q: float) -> torch.Tensor:
    """round(r * q): how many of the first r rows a source of share q takes (float64: exact far past
    any run's row count; the same on every rank)."""
    return torch.floor(r_B.to(torch.float64) * q + 0.5).to(torch.int64)


def source_counts(G: int, weights: tuple[float, ...]) -> list[int]:
    """How many of the first G global rows each source takes."""
    out, r = [], G
    for q in _shares(weights):
        n = int(_taken(torch.tensor([r]), q)[0])
        out.append(n)
        r -= n
    return out + [r]


@caches.register
@functools.lru_cache(maxsize=16)   # consecutive steps almost always share each source's epoch
def _source_permutation(seed: int, name: str, epoch: int, n: int) -> torch.Tensor:
    return keyed_permutation(f"fnmoe.mix:{seed}:{name}:{epoch}", n)


# ---------------------------------------------------------------- batches

@dataclass(frozen=True, eq=False)
class MixtureLoader:
    """`fnmoe.data.loader.Loader` over a Mixture: the same layout of the global batch over micro-batches
    and ranks, each row from the source assign_rows gives it."""

    data: Mixture
    seq_len: int
    batch_size: int
    grad_accum: int
    seed: int
    doc_mask: bool = False
    _warned: set = field(default_factory=set, repr=False)
    """(source, epoch) pairs already warned about in this process"""

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """windows of seq_len+1 tokens in each source's training stream"""
        sizes = tuple((len(d.train_T) - 1) // self.seq_len for d in self.data.sources)
        for name, d, n in zip(self.data.names, self.data.sources, sizes):
            if n < 1:
                raise ValueError(f"data.mix source {name!r}: its training stream has {len(d.train_T)} tokens, "
                                 f"fewer than one sample of seq_len+1={self.seq_len + 1}")
        return sizes

    @property
    def n_samples(self) -> int:
        """all sources' windows together (a checkpoint's data position counts epochs of this)"""
        return sum(self.sizes)

    position = Loader.position

    def rows(self, step: int, dp_rank: int, dp_size: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(source_B, window_B) of one rank's micro-batch."""
        if not (0 <= dp_rank < dp_size and 0 <= micro < self.grad_accum and step >= 0) or \
                self.batch_size % (dp_size * self.grad_accum):
            raise ValueError(f"need 0 <= dp_rank={dp_rank} < dp_size={dp_size}, 0 <= micro={micro} < "
                             f"grad_accum={self.grad_accum}, step={step} >= 0, and batch_size={self.batch_size} "
                             f"a multiple of dp_size x grad_accum")
        B = self.batch_size // (dp_size * self.grad_accum)
        g_B = step * self.batch_size + (micro * dp_size + dp_rank) * B + torch.arange(B)
        source_B, k_B = assign_rows(g_B, self.data.weights)
        window_B = torch.empty_like(k_B)
        for i in source_B.unique().tolist():
            n, name = self.sizes[i], self.data.names[i]
            mine_B = source_B == i
            epoch_B, pos_B = k_B[mine_B] // n, k_B[mine_B] % n
            out_B = torch.empty_like(pos_B)
            for epoch in epoch_B.unique().tolist():
                in_epoch_B = epoch_B == epoch
                out_B[in_epoch_B] = _source_permutation(self.seed, name, epoch, n)[pos_B[in_epoch_B]]
            window_B[mine_B] = out_B
        if dp_rank == 0 and micro == 0:
            self._warn_new_epochs(step)
        return source_B, window_B

    def batch_at(self, step: int, dp_rank: int, dp_size: int, micro: int) -> tuple[torch.Tensor, ...]:
        """(inputs_BL, labels_BL[, positions_BL]) as Loader.batch_at, rows from their sources."""
        source_B, window_B = self.rows(step, dp_rank, dp_size, micro)
        idx_BL = window_B[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        parts = [(source_B == i, windows(d, "train", idx_BL[source_B == i], self.doc_mask))
                 for i, d in enumerate(self.data.sources) if (source_B == i).any()]
        out = [torch.empty((len(window_B), self.seq_len), dtype=torch.long) for _ in parts[0][1]]
        for mine_B, tensors in parts:
            for o, t in zip(out, tensors):
                o[mine_B] = t
        return tuple(out)

    def _warn_new_epochs(self, step: int) -> None:
        """Say so when a source's rows of this step's global batch start a second or later epoch of it."""
        before = source_counts(step * self.batch_size, self.data.weights)
        after = source_counts((step + 1) * self.batch_size, self.data.weights)
        for name, n, k0, k1 in zip(self.data.names, self.sizes, before, after):
            epoch = -(-k0 // n)  # the first epoch that starts at or after sample k0
            if epoch >= 1 and epoch * n < k1 and (name, epoch) not in self._warned:
                self._warned.add((name, epoch))
                log.warning("data.mix source %r ran out of data after %d samples: step %d starts its epoch %d "
                            "(it repeats)", name, epoch * n, step + 1, epoch + 1)


def mixture_val_batches(mix: Mixture, seq_len: int, batch: int, n_batches: int,
                        doc_mask: bool = False) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    """Each source's own validation batches (fnmoe.data.loader.val_batches of its val split)."""
    return {name: val_batches(d, seq_len, batch, n_batches, doc_mask) for name, d in zip(mix.names, mix.sources)}


def training_data(run: RunConfig) -> tuple[Loader | MixtureLoader, dict[str, list], dict[str, float]]:
    """(loader, {source: validation batches}, {source: weight}) of a run: one source named "" for
    data.corpus, the prepared directories of data.mix otherwise."""
    t, d, L = run.train, run.data, run.data.seq_len
    if not d.mix:
        data = load_data(d, run.model.vocab_size)
        return (Loader(data, L, t.batch_size, t.grad_accum, t.seed, d.doc_mask),
                {"": val_batches(data, L, t.batch_size // t.grad_accum, t.eval_batches, d.doc_mask)}, {"": 1.0})
    mix = load_mixture(d, run.model.vocab_size)
    weights = dict(zip(mix.names, mix.weights))
    log.info("data.mix: %s", ", ".join(f"{n} {w:.3g} ({s.corpus})" for (n, w), s in zip(weights.items(), d.mix)))
    return (MixtureLoader(mix, L, t.batch_size, t.grad_accum, t.seed, d.doc_mask),
            mixture_val_batches(mix, L, t.batch_size // t.grad_accum, t.eval_batches, d.doc_mask), weights)
