"""Streaming attention: row i sees the first ``sinks`` tokens (attention sinks) and a causal
window (i - window, i] (K = 2; StreamingLLM, gpt-oss's sliding layers with sink tokens).

    python -m compilemask.masks.sink_window
"""

from __future__ import annotations

import functools

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["sink_window", "random_meta", "flex_mask_mod", "bench_meta", "main"]


def sink_window(window: int = 4096, sinks: int = 4) -> MaskSpec:
    """The first ``sinks`` keys (up to the row itself) and a causal window of ``window`` keys."""
    for name, v in (("window", window), ("sinks", sinks)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"sink_window: {name} must be a positive int, got {v!r}")
    spec = MaskSpec(f"sink_window_{window}_{sinks}", params=[], regions=[
        Region("all", when=lambda i: True,
               visible=lambda i, j: j <= i and (j < sinks or i - window < j)),
    ])
    return register(spec, Recipes(__name__, random_meta,
                                  functools.partial(flex_mask_mod, window=window, sinks=sinks),
                                  bench_meta))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """No metadata: window and sinks are compile-time constants."""
    return {}


def bench_meta(batch: int, seqlen: int, seed: int = 0) -> dict:
    """No metadata."""
    return {}


def flex_mask_mod(meta: dict, seqlen: int | None = None, window: int = 4096, sinks: int = 4):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    def sink_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < sinks) | (q_idx - kv_idx < window))
    return sink_window


def main(seqlen: int = 256, batch: int = 1, seed: int = 0, window: int = 48, sinks: int = 4):
    return show(sink_window(window, sinks), seqlen, batch, seed)


if __name__ == "__main__":
    main()
