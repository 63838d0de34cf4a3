"""Packed prefix-LM documents: several documents in one sequence, each with a bidirectional
prefix (every row of the document sees the whole prefix) and causal after it.

``doc_start[i]`` is the first row of row i's document, ``prefix_end[i]`` the end (exclusive) of
that document's prefix, both per row (``[B, Sq]``): row i sees ``doc_start[i] <= j`` and
(``j <= i`` or ``j < prefix_end[i]``).

    python -m compilemask.masks.packed_prefix_lm
"""

from __future__ import annotations

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["packed_prefix_lm", "random_meta", "flex_mask_mod", "bench_meta", "main"]


def packed_prefix_lm() -> MaskSpec:
    """Packed documents, each a prefix-LM: ``doc_start[i]`` and ``prefix_end[i]`` per row."""
    spec = MaskSpec("packed_prefix_lm", params=["doc_start", "prefix_end"], regions=[
        Region("doc", when=lambda i: True,
               visible=lambda i, j: doc_start[i] <= j and (j <= i or j < prefix_end[i])),  # noqa: F821
    ])
    return register(spec, Recipes(__name__, random_meta, flex_mask_mod, bench_meta))


def _documents(batch, seqlen, lengths):
    """Per-row ``doc_start`` and ``prefix_end`` from a draw ``lengths(room) -> (n, prefix)``."""
    ds = torch.zeros(batch, seqlen, dtype=torch.int64)
    pe = torch.zeros(batch, seqlen, dtype=torch.int64)
    for b in range(batch):
        pos = 0
        while pos < seqlen:
            n, prefix = lengths(seqlen - pos)
            ds[b, pos:pos + n] = pos
            pe[b, pos:pos + n] = pos + prefix
            pos += n
    return {"doc_start": ds, "prefix_end": pe}


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """Documents of 1 to seqlen rows with prefixes of 0 to the whole document."""
    gen = gen or torch.Generator().manual_seed(0)

    def lengths(room):
        n = int(torch.randint(1, room + 1, (1,), generator=gen))
        return n, int(torch.randint(0, n + 1, (1,), generator=gen))
    return _documents(batch_size, seqlen, lengths)


def bench_meta(batch: int, seqlen: int, seed: int = 0) -> dict:
    """Documents of 256 to 4096 tokens, each with a prefix of up to half of it."""
    gen = torch.Generator().manual_seed(seed)

    def lengths(room):
        n = min(room, int(torch.randint(256, 4097, (1,), generator=gen)))
        return n, int(torch.randint(0, n // 2 + 1, (1,), generator=gen))
    return _documents(batch, seqlen, lengths)


def flex_mask_mod(meta: dict, seqlen: int | None = None):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    doc_start, prefix_end = meta["doc_start"], meta["prefix_end"]

    def packed_prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx >= doc_start[b, q_idx]) & (
            (kv_idx <= q_idx) | (kv_idx < prefix_end[b, q_idx]))
    return packed_prefix_lm


def main(seqlen: int = 256, batch: int = 1, seed: int = 0):
    return show(packed_prefix_lm(), seqlen, batch, seed)


if __name__ == "__main__":
    main()
