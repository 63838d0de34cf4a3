"""One sequence per row, with the metadata of the mask it trains (the data of masks that are
not packed: shared-prompt reward model, CLEAR, prefix-LM, one HSTU sequence per row, causal,
a factory-built ``MaskSpec`` by import path).

Each row is ``seq_len`` random token ids (+1 for the shifted labels), ``positions`` 0..S-1, and
the mask's fields drawn for that row by ``MaskSource.rows`` (``masks``): the mask module's
at-scale metadata (its ``bench_meta``: for the reward model a prompt of about S/4 and six
responses of about S/8; for CLEAR an image grid over 15/16 of the row; for HSTU 5 % context,
history to 70 %, targets in groups of 64; each jittered per row), else its random metadata;
prefix-LM draws a prefix of S/8 to S/2. Every row draws anew, so each batch's descriptor is
built for new metadata, as in training.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils.data import IterableDataset

from .masks import resolve_mask

__all__ = ["RowSequences"]


class RowSequences(IterableDataset):
    """Rows of one sequence each with ``mask``'s fields; infinite, deterministic per (seed,
    dp_rank)."""

    def __init__(self, seq_len: int, mask: str, mask_options: Mapping | None = None, *,
                 vocab_size: int = 2048, seed: int = 0, dp_rank: int = 0,
                 dp_world_size: int = 1):
        if seq_len < 1:
            raise ValueError(f"RowSequences: seq_len >= 1, got {seq_len}")
        source = resolve_mask(mask, mask_options)
        if source.rows is None:
            raise ValueError(
                f"RowSequences: mask {mask!r} reads {list(source.fields) or 'packed sequences'}"
                " that this dataset cannot draw; use packed data (dataset='packed_hstu_lognormal')"
                " for documents and hstu, or a dataset of your own that yields those fields")
        self.seq_len, self.vocab_size, self.source = seq_len, vocab_size, source
        self.gen = torch.Generator().manual_seed(seed * 100003 + dp_rank)

    def _row(self):
        tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=self.gen)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen))
        # the batch's first dimension dropped: the dataloader stacks rows into [B] or [B, S]
        fields = {k: v[0] for k, v in self.source.rows(self.seq_len, seed).items()}
        d = {"input": tokens[:-1], "positions": torch.arange(self.seq_len), **fields}
        return d, tokens[1:].clone()

    def __iter__(self):
        while True:
            yield self._row()

    def state_dict(self):
        return {"rng": self.gen.get_state()}

    def load_state_dict(self, state):
        self.gen.set_state(state["rng"])
