"""Packed variable-length data: sequences of heavy-tailed lengths packed into a fixed token
capacity, each with its mask metadata.

``PackedSequences`` stands in for recommendation traces such as KuaiRand-1K's user-day
sequences (one user's interactions in a day, a few to thousands of events): a generator, not
the data. Sequence lengths are lognormal, ``exp(N(mu, sigma))`` rounded, clipped to
``[min_len, max_len]`` (defaults mu = 6.0, sigma = 1.0, min_len = 16, max_len = the row's
capacity: median ~403 tokens, mean ~665 before clipping, 5 % over ~2090). Each sequence is an
HSTU sequence: ``ctx_len`` context tokens (user features; fewer if the sequence is shorter),
a history, and targets (the last ``target_frac`` of it, at least one token) scored in groups of
``group_size``. Sequences are packed in arrival order, first fit, into rows of ``seq_len``
tokens (+1 for the shifted labels); a row's tail that no sequence fills is one padding
sequence (positions from 0, labels ignored). Tokens are random ids below ``vocab_size``.

A batch (the ``input_dict`` TorchTitan passes to ``post_dataloading_process``):
``input`` and ``positions`` ``[B, S]`` (positions restart at 0 at each sequence), and per
sequence of each row, ``[B, N]`` (N = ``max_seqs``, entries past a row's sequences repeat its
last): ``ctx_end``, ``hist_end``, ``group_size`` (offsets from the sequence's start), which
``masks.resolve_mask("hstu")`` reads. The descriptor is built for this packed batch.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import IterableDataset

__all__ = ["PackedSequences", "pack_sequences", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def _lengths(gen: torch.Generator, n: int, mu: float, sigma: float, lo: int, hi: int):
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    return torch.exp(mu + sigma * z).round().clamp(lo, hi).to(torch.int64)


def pack_sequences(lengths, capacity: int, max_seqs: int):
    """First-fit packing in arrival order of ``lengths`` (a Python list, consumed from the
    front) into one row of ``capacity`` tokens: the lengths taken, at most ``max_seqs - 1``
    (one slot is kept for the padding tail)."""
    row, used = [], 0
    while lengths and used + lengths[0] <= capacity and len(row) < max_seqs - 1:
        n = lengths.pop(0)
        row.append(n)
        used += n
    if not row and lengths:  # longer than a row: cut to the row (clipping makes this rare)
        row.append(min(lengths.pop(0), capacity))
    return row


class PackedSequences(IterableDataset):
    """Packed HSTU sequences (see the module docstring); infinite, deterministic per
    (seed, dp_rank)."""

    def __init__(self, seq_len: int, *, vocab_size: int = 2048, mu: float = 6.0,
                 sigma: float = 1.0, min_len: int = 16, max_len: int | None = None,
                 ctx_len: int = 8, target_frac: float = 0.2, group_size: int = 64,
                 seed: int = 0, dp_rank: int = 0, dp_world_size: int = 1):
        if seq_len < 2 or min_len < 1:
            raise ValueError(f"PackedSequences: seq_len >= 2 and min_len >= 1, got {seq_len}, "
                             f"{min_len}")
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.mu, self.sigma = mu, sigma
        self.min_len = min_len
        self.max_len = min(max_len or seq_len, seq_len)
        self.ctx_len, self.target_frac, self.group_size = ctx_len, target_frac, group_size
        self.max_seqs = math.ceil((seq_len + 1) / min_len) + 1
        self.gen = torch.Generator().manual_seed(seed * 100003 + dp_rank)
        self._pending: list[int] = []

    def _row(self):
        cap = self.seq_len + 1
        while sum(self._pending) < cap:
            self._pending += _lengths(self.gen, 64, self.mu, self.sigma, self.min_len,
                                      self.max_len).tolist()
        lens = pack_sequences(self._pending, cap, self.max_seqs)
        pad = cap - sum(lens)
        n = len(lens)
        tokens = torch.randint(0, self.vocab_size, (cap,), generator=self.gen)
        positions = torch.cat([torch.arange(x) for x in lens + ([pad] if pad else [])])
        lens_t = torch.tensor(lens, dtype=torch.int64)
        targets = (lens_t.to(torch.float64) * self.target_frac).round().to(torch.int64)
        hist = lens_t - targets.clamp(min=1).minimum(lens_t)
        ctx = torch.minimum(torch.full_like(hist, self.ctx_len), hist)
        group = torch.full_like(hist, self.group_size)
        if pad:  # the padding tail: all history (causal), labels ignored
            hist = torch.cat([hist, torch.tensor([pad])])
            ctx = torch.cat([ctx, torch.tensor([0])])
            group = torch.cat([group, torch.tensor([self.group_size])])
        labels = tokens[1:].clone()
        # a sequence's last token predicts nothing; the padding predicts nothing
        ends = torch.cumsum(lens_t, 0) - 1
        labels[ends[ends < self.seq_len]] = IGNORE_INDEX
        if pad:
            labels[sum(lens):] = IGNORE_INDEX

        def fill(t):  # [n or n + 1] -> [max_seqs], repeating the last
            return torch.cat([t, t[-1:].expand(self.max_seqs - t.shape[0])])
        return ({"input": tokens[:-1], "positions": positions[:-1], "ctx_end": fill(ctx),
                 "hist_end": fill(hist), "group_size": fill(group)}, labels, n)

    def __iter__(self):
        while True:
            d, labels, _ = self._row()
            yield d, labels

    def state_dict(self):
        return {"rng": self.gen.get_state(), "pending": list(self._pending)}

    def load_state_dict(self, state):
        self.gen.set_state(state["rng"])
        self._pending = list(state["pending"])
