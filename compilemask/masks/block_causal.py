"""Block-causal: row i sees every key of its own block and of the blocks before it (frame- or
image-level causality) (K = 1).

    python -m compilemask.masks.block_causal
"""

from __future__ import annotations

import functools

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["block_causal", "random_meta", "flex_mask_mod", "bench_meta", "main"]


def block_causal(block: int = 32) -> MaskSpec:
    """Block-causal."""
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block_causal: block must be a positive int, got {block!r}")
    spec = MaskSpec(f"block_causal_{block}", params=[], regions=[
        Region("all", when=lambda i: True, visible=lambda i, j: j // block <= i // block),
    ])
    return register(spec, Recipes(__name__, random_meta,
                                  functools.partial(flex_mask_mod, block=block), bench_meta))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """No metadata: the block size is a compile-time constant."""
    return {}


def bench_meta(batch: int, seqlen: int, seed: int = 0) -> dict:
    """No metadata."""
    return {}


def flex_mask_mod(meta: dict, seqlen: int | None = None, block: int = 32):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    def block_causal(b, h, q_idx, kv_idx):
        return kv_idx // block <= q_idx // block
    return block_causal


def main(seqlen: int = 256, batch: int = 1, seed: int = 0, block: int = 16):
    return show(block_causal(block), seqlen, batch, seed)


if __name__ == "__main__":
    main()
