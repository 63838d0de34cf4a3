"""Random segment ends shared by the segment masks' metadata recipes."""

from __future__ import annotations

import torch

__all__ = ["sorted_cuts", "jitter"]


def sorted_cuts(gen, B, n, hi):
    """n non-decreasing cut points per sequence in [0, hi], with zero-length segments likely."""
    cuts = torch.randint(0, hi + 1, (B, n), generator=gen)
    same = torch.rand(B, n, generator=gen) < 0.15
    cuts = torch.where(same, torch.zeros_like(cuts), cuts)
    return torch.sort(cuts, dim=1).values


def jitter(gen, batch, seqlen, frac, spread=0.05):
    """``frac * seqlen`` per sequence, moved by up to ``spread * seqlen`` either way, clamped to
    [0, seqlen]: realistic segment ends that differ per sequence (the benchmarks' metadata)."""
    base = torch.full((batch,), frac * seqlen)
    noise = (torch.rand(batch, generator=gen) - 0.5) * 2 * spread * seqlen
    return torch.clamp(base + noise, 0, seqlen).to(torch.int64)
