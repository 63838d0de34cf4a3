"""Tile-State Bitmaps from the Interval Table (vectorized torch; never per element).

A tile is *visible* if some row's interval overlaps its column range and *masked* if some row's
intervals do not cover it. Coverage of a column range by a row's (possibly overlapping) intervals
is decided by a reach iteration: start at the tile's first column and jump to the end of any
interval that contains the current position; after K rounds the range is covered iff the reach
passed its last column. The TileLang preprocess computes the same thing the same way.

Coverage makes a tile *full*: the kernels run it with no interval test and no predicate, so only
slots whose every key is visible may add it. Those are the exact slots; the over-approximating
slots of a fallback region (``Interval.exact`` False: its predicate decides within them) add
visibility only (``visibility_only_slots``).
"""

from __future__ import annotations

import torch

from compilemask.descriptor import (
    TILE_MASKED,
    TILE_VISIBLE,
    TileConfig,
    pack_bitmap,
    unpack_bitmap,
)

__all__ = ["tile_states", "pack_bitmap", "unpack_bitmap", "bitmaps", "visibility_only_slots"]


def visibility_only_slots(mask, region: torch.Tensor) -> torch.Tensor:
    """bool ``[B, Sq, K]``: the slots of each row that add visibility but no coverage (the
    over-approximating slots of the row's region), from the row's region (int ``[B, Sq]``, -1:
    none); the ``always_masked`` argument of ``tile_states`` and ``bitmaps``."""
    R, K = len(mask.regions), mask.num_intervals
    table = torch.zeros(R + 1, K, dtype=torch.bool)  # row R: rows under no guard (empty slots)
    for r in mask.regions:
        for k, iv in enumerate(r.intervals):
            table[r.index, k] = not iv.exact
    idx = torch.where(region < 0, R, region).to(torch.int64)
    return table.to(region.device)[idx]


def tile_states(starts, lens, always_masked, tiles: TileConfig, seqlen_q: int, seqlen_k: int):
    """uint8 ``[B, n_m, n_n]`` of ``TILE_VISIBLE | TILE_MASKED`` bits.

    starts, lens: int64 ``[B, Sq, K]`` (clipped to [0, Sk)); always_masked: bool ``[B, Sq, K]``,
    the slots that add no coverage (``visibility_only_slots``), or bool ``[B, Sq]``, rows none of
    whose slots add coverage."""
    B, Sq, K = starts.shape
    n_m, n_n = tiles.num_blocks(seqlen_q, seqlen_k)
    dev = starts.device
    col0 = torch.arange(n_n, device=dev, dtype=torch.int64) * tiles.tile_n  # [n_n]
    col1 = torch.clamp(col0 + tiles.tile_n, max=seqlen_k)
    s = starts.unsqueeze(-1)  # [B, Sq, K, 1]
    e = (starts + lens).unsqueeze(-1)
    nonempty = (lens > 0).unsqueeze(-1)
    overlap = (nonempty & (s < col1) & (e > col0)).any(dim=2)  # [B, Sq, n_n]
    per_slot = always_masked.dim() == 3
    reach = col0.expand(B, Sq, n_n).clone()
    for _ in range(K):
        for k in range(K):
            sk, ek = s[:, :, k], e[:, :, k]
            jump = (sk <= reach) & (reach < ek)
            if per_slot:
                jump &= ~always_masked[:, :, k : k + 1]
            reach = torch.where(jump, ek.expand_as(reach), reach)
    covered = reach >= col1
    masked = ~covered if per_slot else ~covered | always_masked.unsqueeze(-1)
    pad = n_m * tiles.tile_m - Sq
    row_ok = torch.ones(B, Sq, 1, dtype=torch.bool, device=dev)
    if pad:
        overlap = torch.nn.functional.pad(overlap, (0, 0, 0, pad))
        masked = torch.nn.functional.pad(masked, (0, 0, 0, pad))
        row_ok = torch.nn.functional.pad(row_ok, (0, 0, 0, pad))
    masked = masked & row_ok
    vis = overlap.view(B, n_m, tiles.tile_m, n_n).any(dim=2)
    msk = masked.view(B, n_m, tiles.tile_m, n_n).any(dim=2) & vis  # '10' never occurs
    return vis.to(torch.uint8) * TILE_VISIBLE + msk.to(torch.uint8) * TILE_MASKED


def bitmaps(starts, lens, always_masked, fwd: TileConfig, bwd: TileConfig, seqlen_q, seqlen_k):
    """Both bitmaps: forward ``[B, n_m, W]`` (n_block packed), backward ``[B, n_n, W]``."""
    f = tile_states(starts, lens, always_masked, fwd, seqlen_q, seqlen_k)
    b = tile_states(starts, lens, always_masked, bwd, seqlen_q, seqlen_k)
    return pack_bitmap(f), pack_bitmap(b.transpose(1, 2).contiguous())
