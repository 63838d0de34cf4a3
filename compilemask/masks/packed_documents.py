"""Packed documents: several documents in one sequence, causal within each.

``doc_start`` is a per-row array (``[B, Sq]``): the first row of the document that row i is in.
Subscripting a param by ``i`` keeps the rule an interval rule (K = 1).

    python -m compilemask.masks.packed_documents
"""

from __future__ import annotations

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["packed_documents", "random_meta", "flex_mask_mod", "main"]


def packed_documents() -> MaskSpec:
    """Documents packed in one sequence, causal within each: ``doc_start[i]`` per row."""
    spec = MaskSpec("packed_documents", params=["doc_start"], regions=[
        Region("doc", when=lambda i: True,
               visible=lambda i, j: doc_start[i] <= j <= i),  # noqa: F821
    ])
    return register(spec, Recipes(__name__, random_meta, flex_mask_mod))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """Up to five documents per sequence, from four random cuts (repeated cuts allowed)."""
    gen = gen or torch.Generator().manual_seed(0)
    ds = torch.zeros(batch_size, seqlen, dtype=torch.int64)
    for b in range(batch_size):
        bounds = sorted(torch.randint(0, seqlen, (4,), generator=gen).tolist())
        for x in bounds:
            ds[b, x:] = x
    return {"doc_start": ds}


def flex_mask_mod(meta: dict, seqlen: int | None = None):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    doc_start = meta["doc_start"]

    def packed_documents(b, h, q_idx, kv_idx):
        return (kv_idx >= doc_start[b, q_idx]) & (kv_idx <= q_idx)
    return packed_documents


def main(seqlen: int = 256, batch: int = 1, seed: int = 0):
    return show(packed_documents(), seqlen, batch, seed)


if __name__ == "__main__":
    main()
