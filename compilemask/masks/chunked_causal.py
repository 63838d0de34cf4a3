"""Causal within fixed-size chunks (Llama 4's local layers): row i sees keys j <= i of its own
chunk, ``j // chunk == i // chunk`` (K = 1). The compiler proves it native: FA4 varlen over
chunk-sized segments.

    python -m compilemask.masks.chunked_causal
"""

from __future__ import annotations

import functools

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["chunked_causal", "random_meta", "flex_mask_mod", "bench_meta", "main"]


def chunked_causal(chunk: int = 8192) -> MaskSpec:
    """Causal within fixed-size chunks (Llama 4's local layers)."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunked_causal: chunk must be a positive int, got {chunk!r}")
    spec = MaskSpec(f"chunked_causal_{chunk}", params=[], regions=[
        Region("all", when=lambda i: True,
               visible=lambda i, j: j // chunk == i // chunk and j <= i),
    ])
    return register(spec, Recipes(__name__, random_meta,
                                  functools.partial(flex_mask_mod, chunk=chunk), bench_meta))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """No metadata: the chunk size is a compile-time constant."""
    return {}


def bench_meta(batch: int, seqlen: int, seed: int = 0) -> dict:
    """No metadata."""
    return {}


def flex_mask_mod(meta: dict, seqlen: int | None = None, chunk: int = 8192):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    def chunked_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx // chunk == kv_idx // chunk)
    return chunked_causal


def main(seqlen: int = 256, batch: int = 1, seed: int = 0, chunk: int = 96):
    return show(chunked_causal(chunk), seqlen, batch, seed)


if __name__ == "__main__":
    main()
