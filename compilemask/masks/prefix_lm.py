"""Prefix-LM: a bidirectional prefix of ``prefix_len`` keys, causal after it (K = 1: the union
[0, prefix_len) | [0, i] is proved to be one interval).

    python -m compilemask.masks.prefix_lm
"""

from __future__ import annotations

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["prefix_lm", "random_meta", "flex_mask_mod", "main"]


def prefix_lm() -> MaskSpec:
    """A bidirectional prefix of ``prefix_len`` keys, causal after it."""
    def sees(i, j):
        return j < prefix_len or j <= i  # noqa: F821 (a param)

    spec = MaskSpec("prefix_lm", params=["prefix_len"], regions=[
        Region("all", when=lambda i: True, visible=sees),
    ])
    return register(spec, Recipes(__name__, random_meta, flex_mask_mod))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """Prefixes of any length, empty and past the end of the sequence included."""
    gen = gen or torch.Generator().manual_seed(0)
    over = seqlen + seqlen // 4 + 1
    return {"prefix_len": torch.randint(0, over, (batch_size,), generator=gen)}


def flex_mask_mod(meta: dict, seqlen: int | None = None):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    prefix = meta["prefix_len"]

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (kv_idx <= q_idx)
    return prefix_lm


def main(seqlen: int = 256, batch: int = 1, seed: int = 0):
    return show(prefix_lm(), seqlen, batch, seed)


if __name__ == "__main__":
    main()
