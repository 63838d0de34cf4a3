"""Tile-State Bitmaps from the Interval Table (vectorized torch; never per element).

A tile is *visible* if some row's interval overlaps its column range and *masked* if some row's
intervals do not cover it. Coverage of a column range by a row's (possibly overlapping) intervals
is decided by a reach iteration: start at the tile's first column and jump to the end of any
interval that contains the current position; after K rounds the range is covered iff the reach
passed its last column. The TileLang preprocess computes the same thing the same way.
"""

from __future__ import annotations

import torch

from compilemask.descriptor import (
    TILE_BITS,
    TILE_MASKED,
    TILE_STATE_MASK,
    TILE_VISIBLE,
    TILES_PER_WORD,
    TileConfig,
    bitmap_words,
)

__all__ = ["tile_states", "pack_bitmap", "unpack_bitmap", "bitmaps"]


def tile_states(starts, lens, always_masked, tiles: TileConfig, seqlen_q: int, seqlen_k: int):
    """uint8 ``[B, n_m, n_n]`` of ``TILE_VISIBLE | TILE_MASKED`` bits.

    starts, lens: int64 ``[B, Sq, K]`` (clipped to [0, Sk)); always_masked: bool ``[B, Sq]``
    (rows of fallback regions, whose tiles are never full)."""
    B, Sq, K = starts.shape
    n_m, n_n = tiles.num_blocks(seqlen_q, seqlen_k)
    dev = starts.device
    col0 = torch.arange(n_n, device=dev, dtype=torch.int64) * tiles.tile_n  # [n_n]
    col1 = torch.clamp(col0 + tiles.tile_n, max=seqlen_k)
    s = starts.unsqueeze(-1)  # [B, Sq, K, 1]
    e = (starts + lens).unsqueeze(-1)
    nonempty = (lens > 0).unsqueeze(-1)
    overlap = (nonempty & (s < col1) & (e > col0)).any(dim=2)  # [B, Sq, n_n]
    reach = col0.expand(B, Sq, n_n).clone()
    for _ in range(K):
        for k in range(K):
            sk, ek = s[:, :, k], e[:, :, k]
            reach = torch.where((sk <= reach) & (reach < ek), ek.expand_as(reach), reach)
    covered = reach >= col1
    masked = ~covered | always_masked.unsqueeze(-1)
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


def pack_bitmap(states: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, R, T]`` states -> int32 ``bitmap_shape(B, R, T)`` words, 2 bits per tile."""
    B, R, T = states.shape
    W = bitmap_words(T)
    padded = torch.nn.functional.pad(states.to(torch.int64), (0, W * TILES_PER_WORD - T))
    shifts = TILE_BITS * torch.arange(TILES_PER_WORD, device=states.device, dtype=torch.int64)
    words = (padded.view(B, R, W, TILES_PER_WORD) << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_bitmap(words: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """Inverse of ``pack_bitmap``: uint8 ``[B, R, num_tiles]``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = TILE_BITS * torch.arange(TILES_PER_WORD, device=words.device, dtype=torch.int64)
    st = (w.unsqueeze(-1) >> shifts) & TILE_STATE_MASK
    return st.flatten(-2)[..., :num_tiles].to(torch.uint8)


def bitmaps(starts, lens, always_masked, fwd: TileConfig, bwd: TileConfig, seqlen_q, seqlen_k):
    """Both bitmaps: forward ``[B, n_m, W]`` (n_block packed), backward ``[B, n_n, W]``."""
    f = tile_states(starts, lens, always_masked, fwd, seqlen_q, seqlen_k)
    b = tile_states(starts, lens, always_masked, bwd, seqlen_q, seqlen_k)
    return pack_bitmap(f), pack_bitmap(b.transpose(1, 2).contiguous())
