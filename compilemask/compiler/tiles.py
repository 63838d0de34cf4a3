"""Tile-State Bitmaps from the Interval Table (vectorized torch; never per element).

A tile is *visible* if some row's interval overlaps its column range and *masked* if some row's
intervals do not cover it. Coverage of a column range by a row's (possibly overlapping) intervals
is the union's measure within the tile (slots sorted by start, each adding what the earlier ones
did not reach) equal to the tile's width; the TileLang preprocess decides the same by a reach
iteration (jump to the end of any interval containing the current position, K rounds).

Coverage makes a tile *full*: the kernels run it with no interval test and no predicate, so only
slots whose every key is visible may add it. Those are the exact slots; the over-approximating
slots of a fallback region (``Interval.exact`` False: its predicate decides within them) add
visibility only (``visibility_only_slots``).
"""

from __future__ import annotations

import torch

from compilemask.contract.descriptor import (
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


_COVER_CHUNK = 1 << 24  # elements of one [rows, K, n_n] step: a 32K-row CPU table in pieces


def _covered(starts, ends, col0, col1):
    """bool ``[B, Sq, n_n]``: whether the union of each row's intervals ``[starts, ends)``
    (``[B, Sq, K]``) covers each column range ``[col0, col1)``. Sorted by start and clipped to
    the range, slot k adds ``ends_k - max(starts_k, max of the earlier ends)`` where positive;
    covered iff the sum is the range's width. A constant number of launches for any K (a decode
    step's descriptor is launch-bound)."""
    B, Sq, K = starts.shape
    if K == 1:
        return (starts <= col0) & (ends >= col1)
    order = starts.argsort(dim=-1)
    s_sorted, e_sorted = starts.gather(-1, order), ends.gather(-1, order)
    c0, c1 = col0.view(1, 1, 1, -1), col1.view(1, 1, 1, -1)
    width = col1 - col0
    rows = max(1, _COVER_CHUNK // max(1, B * K * col0.numel()))
    out = []
    for r0 in range(0, Sq, rows):
        a = torch.minimum(torch.maximum(s_sorted[:, r0:r0 + rows].unsqueeze(-1), c0), c1)
        b = torch.minimum(torch.maximum(e_sorted[:, r0:r0 + rows].unsqueeze(-1), a), c1)
        before = torch.nn.functional.pad(b.cummax(dim=2).values[:, :, :-1], (0, 0, 1, 0))
        added = (b - torch.maximum(a, before)).clamp(min=0).sum(dim=2)
        out.append(added == width)
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def tile_states(starts, lens, always_masked, tiles: TileConfig, seqlen_q: int, seqlen_k: int):
    """uint8 ``[B, n_m, n_n]`` of ``TILE_VISIBLE | TILE_MASKED`` bits.

    starts, lens: int64 ``[B, Sq, K]`` (clipped to [0, Sk)); always_masked: bool ``[B, Sq, K]``,
    the slots that add no coverage (``visibility_only_slots``), or bool ``[B, Sq]``, rows none of
    whose slots add coverage."""
    rows = _row_states(starts, lens, always_masked, tiles.tile_n, seqlen_k)
    return _tile_states(*rows, tiles.tile_m)


def _row_states(starts, lens, always_masked, tile_n: int, seqlen_k: int):
    """Per row and column range of ``tile_n`` keys: (some key visible, some key masked), bool
    ``[B, Sq, n_n]`` each; the tilings' row heights only group them."""
    n_n = -(-seqlen_k // tile_n)
    dev = starts.device
    col0 = torch.arange(n_n, device=dev, dtype=torch.int64) * tile_n  # [n_n]
    col1 = torch.clamp(col0 + tile_n, max=seqlen_k)
    s = starts.unsqueeze(-1)  # [B, Sq, K, 1]
    e = (starts + lens).unsqueeze(-1)
    nonempty = (lens > 0).unsqueeze(-1)
    overlap = (nonempty & (s < col1) & (e > col0)).any(dim=2)  # [B, Sq, n_n]
    per_slot = always_masked.dim() == 3
    counts = lens > 0
    if per_slot:
        counts = counts & ~always_masked
    covered = _covered(starts, torch.where(counts, starts + lens, starts), col0, col1)
    masked = ~covered if per_slot else ~covered | always_masked.unsqueeze(-1)
    return overlap, masked


def _tile_states(overlap, masked, tile_m: int):
    """Row states grouped into tiles of ``tile_m`` rows (rows past Sq: neither)."""
    B, Sq, n_n = overlap.shape
    n_m = -(-Sq // tile_m)
    if n_m == 1:  # one row of tiles (a decode step's few rows): no padding to the tile
        vis = overlap.any(dim=1, keepdim=True)
        msk = masked.any(dim=1, keepdim=True) & vis
        return vis.to(torch.uint8) * TILE_VISIBLE + msk.to(torch.uint8) * TILE_MASKED
    pad = n_m * tile_m - Sq
    if pad:  # padding rows are neither visible nor masked
        overlap = torch.nn.functional.pad(overlap, (0, 0, 0, pad))
        masked = torch.nn.functional.pad(masked, (0, 0, 0, pad))
    vis = overlap.view(B, n_m, tile_m, n_n).any(dim=2)
    msk = masked.view(B, n_m, tile_m, n_n).any(dim=2) & vis  # '10' never occurs
    return vis.to(torch.uint8) * TILE_VISIBLE + msk.to(torch.uint8) * TILE_MASKED


# elements of one chunk's [b, rows, K, n_n] row states: 2**22 (int64 temporaries of ~32 MB), so
# the working set grows with the descriptor (Sq x K and the tile grid), never with Sq x n_n
_STATE_CHUNK = 1 << 22


def bitmaps(starts, lens, always_masked, fwd: TileConfig, bwd: TileConfig, seqlen_q, seqlen_k):
    """Both bitmaps: forward ``[B, n_m, W]`` (n_block packed), backward ``[B, n_n, W]``. The
    row states are computed once where the tilings' columns agree (FA4's: 128 keys both), in
    chunks of whole row tiles of both tilings (and of sequences), each reduced to its tiles
    before the next."""
    B, Sq, K = starts.shape
    step = max(fwd.tile_m, bwd.tile_m)  # powers of two: a multiple of both
    n_n = -(-seqlen_k // min(fwd.tile_n, bwd.tile_n))
    per_row = K * n_n
    rows = max(step, _STATE_CHUNK // max(1, B * per_row) // step * step)
    seqs = max(1, min(B, _STATE_CHUNK // max(1, rows * per_row)))
    # written in place: a chunk leaves nothing behind (small results kept between the chunks'
    # temporaries would fragment the heap, which then grows with every chunk)
    f = torch.empty(B, -(-Sq // fwd.tile_m), -(-seqlen_k // fwd.tile_n), dtype=torch.uint8,
                    device=starts.device)
    b = torch.empty(B, -(-Sq // bwd.tile_m), -(-seqlen_k // bwd.tile_n), dtype=torch.uint8,
                    device=starts.device)
    for b0 in range(0, B, seqs):
        for r0 in range(0, Sq, rows):
            part = (starts[b0:b0 + seqs, r0:r0 + rows], lens[b0:b0 + seqs, r0:r0 + rows],
                    always_masked[b0:b0 + seqs, r0:r0 + rows])
            states = _row_states(*part, fwd.tile_n, seqlen_k)
            f_part = _tile_states(*states, fwd.tile_m)
            f[b0:b0 + seqs, r0 // fwd.tile_m:r0 // fwd.tile_m + f_part.shape[1]] = f_part
            if bwd.tile_n != fwd.tile_n:
                states = _row_states(*part, bwd.tile_n, seqlen_k)
            b_part = _tile_states(*states, bwd.tile_m)
            b[b0:b0 + seqs, r0 // bwd.tile_m:r0 // bwd.tile_m + b_part.shape[1]] = b_part
            del states, f_part, b_part
    return pack_bitmap(f), pack_bitmap(b.transpose(1, 2).contiguous())
