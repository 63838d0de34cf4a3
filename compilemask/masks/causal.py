"""Causal attention: every row sees itself and the keys before it (K = 1).

    python -m compilemask.masks.causal
"""

from __future__ import annotations

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["causal", "random_meta", "flex_mask_mod", "bench_meta", "main"]


def causal() -> MaskSpec:
    """Every row sees itself and the keys before it."""
    spec = MaskSpec("causal", params=[], regions=[
        Region("all", when=lambda i: True, visible=lambda i, j: j <= i),
    ])
    return register(spec, Recipes(__name__, random_meta, flex_mask_mod, bench_meta))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """No metadata."""
    return {}


def bench_meta(batch: int, seqlen: int, seed: int = 0) -> dict:
    """No metadata."""
    return {}


def flex_mask_mod(meta: dict, seqlen: int | None = None):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return causal


def main(seqlen: int = 256, batch: int = 1, seed: int = 0):
    return show(causal(), seqlen, batch, seed)


if __name__ == "__main__":
    main()
