"""HSTU (generative recommendation), as in the paper's Listing 1: context rows see the context
and the history, history rows are causal, and target rows see the context and history plus their
own group of ``group_size`` targets causally (K = 2 for the target region).

    python -m compilemask.masks.hstu
"""

from __future__ import annotations

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._cuts import jitter, sorted_cuts
from compilemask.masks._registry import Recipes, register, show

__all__ = ["hstu", "random_meta", "flex_mask_mod", "bench_meta", "main"]


def hstu() -> MaskSpec:
    """Generative recommendation (HSTU): context, causal history, and grouped targets that see
    the context and history plus their own group causally."""

    def when_context(i):
        return i < ctx_end  # noqa: F821

    def context_sees(i, j):
        return j < hist_end  # noqa: F821

    def when_history(i):
        return ctx_end <= i < hist_end  # noqa: F821

    def history_sees(i, j):
        return j <= i

    def when_target(i):
        return hist_end <= i < seq_end  # noqa: F821

    def target_sees(i, j):
        group_start = hist_end + (i - hist_end) // group_size * group_size  # noqa: F821
        return j < hist_end or group_start <= j <= i  # noqa: F821

    spec = MaskSpec("hstu", params=["ctx_end", "hist_end", "seq_end", "group_size"], regions=[
        Region("context", when=when_context, visible=context_sees),
        Region("history", when=when_history, visible=history_sees),
        Region("target", when=when_target, visible=target_sees),
    ])
    return register(spec, Recipes(__name__, random_meta, flex_mask_mod, bench_meta))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """Segment ends with degenerate cases: empty segments, ends past the end of the sequence."""
    gen = gen or torch.Generator().manual_seed(0)
    B, S = batch_size, seqlen
    c = sorted_cuts(gen, B, 3, S + S // 4 + 1)
    return {"ctx_end": c[:, 0], "hist_end": c[:, 1], "seq_end": c[:, 2],
            "group_size": torch.randint(1, max(2, S // 4), (B,), generator=gen)}


def bench_meta(batch: int, seqlen: int, seed: int = 0) -> dict:
    """At scale: 5% context, history to 70%, targets to the end in groups of 64, jittered."""
    g = torch.Generator().manual_seed(seed)
    ctx = jitter(g, batch, seqlen, 0.05, 0.02)
    hist = torch.maximum(jitter(g, batch, seqlen, 0.7), ctx)
    meta = {"ctx_end": ctx, "hist_end": hist, "seq_end": torch.full((batch,), seqlen),
            "group_size": torch.full((batch,), 64)}
    return {k: v.to(torch.int32) for k, v in meta.items()}


def flex_mask_mod(meta: dict, seqlen: int | None = None):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    ctx, hist, seq, gs = (meta[k] for k in ("ctx_end", "hist_end", "seq_end", "group_size"))

    def hstu(b, h, q_idx, kv_idx):
        c, hi, s, g = ctx[b], hist[b], seq[b], gs[b]
        context = (q_idx < c) & (kv_idx < hi)
        history = (q_idx >= c) & (q_idx < hi) & (kv_idx <= q_idx)
        group_start = hi + (q_idx - hi) // g * g
        target = (q_idx >= hi) & (q_idx < s) & (
            (kv_idx < hi) | ((kv_idx >= group_start) & (kv_idx <= q_idx)))
        return context | history | target
    return hstu


def main(seqlen: int = 256, batch: int = 1, seed: int = 0):
    return show(hstu(), seqlen, batch, seed)


if __name__ == "__main__":
    main()
