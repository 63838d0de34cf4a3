"""Dilated causal attention: causal, every ``stride``-th key only. ``(i - j) % stride == 0`` is
not an interval in j, so the region keeps a predicate: the interval [0, i] over-approximates it
for tile classification (no tile is ever full) and partial tiles evaluate the residual predicate
element by element. ``explain()`` says so (FALLBACK ... because ...).

    python -m compilemask.masks.dilated_causal
"""

from __future__ import annotations

import functools

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["dilated_causal", "random_meta", "flex_mask_mod", "main"]


def dilated_causal(stride: int = 2) -> MaskSpec:
    """Causal, every ``stride``-th key only: not an interval rule, so it keeps a predicate."""
    spec = MaskSpec(f"dilated_causal_{stride}", params=[], regions=[
        Region("all", when=lambda i: True,
               visible=lambda i, j: j <= i and (i - j) % stride == 0),
    ])
    return register(spec, Recipes(__name__, random_meta,
                                  functools.partial(flex_mask_mod, stride=stride)))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """No metadata: the stride is a compile-time constant."""
    return {}


def flex_mask_mod(meta: dict, seqlen: int | None = None, stride: int = 2):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    def dilated_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) % stride == 0)
    return dilated_causal


def main(seqlen: int = 256, batch: int = 1, seed: int = 0, stride: int = 2):
    return show(dilated_causal(stride), seqlen, batch, seed)


if __name__ == "__main__":
    main()
