"""Sliding-window causal attention: row i sees keys (i - window, i] (K = 1).

    python -m compilemask.masks.sliding_window
"""

from __future__ import annotations

import functools

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["sliding_window", "random_meta", "flex_mask_mod", "main"]


def sliding_window(window: int = 256) -> MaskSpec:
    """Causal within a window: row i sees keys (i - window, i]."""
    spec = MaskSpec(f"sliding_window_{window}", params=[], regions=[
        Region("all", when=lambda i: True, visible=lambda i, j: i - window < j <= i),
    ])
    return register(spec, Recipes(__name__, random_meta,
                                  functools.partial(flex_mask_mod, window=window)))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """No metadata: the window is a compile-time constant."""
    return {}


def flex_mask_mod(meta: dict, seqlen: int | None = None, window: int = 256):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    def sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    return sliding_window


def main(seqlen: int = 256, batch: int = 1, seed: int = 0, window: int = 96):
    return show(sliding_window(window), seqlen, batch, seed)


if __name__ == "__main__":
    main()
