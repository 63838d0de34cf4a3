"""Tile scans over a Tile-State Bitmap row (CuTe DSL): the reading side of the descriptor's
bitmaps (``compilemask/descriptor.py`` holds the encoding).

A kernel walks the tiles of one bitmap row (the forward: the kv tiles of its q tile; the backward:
the q tiles of its kv tile) and skips empty ones: :func:`tile_state` decodes one tile,
:func:`next_tile_state` / :func:`next_tile` find the next non-empty one, and
:func:`next_tile_state_cached` keeps the current word across calls.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from compilemask.contract.descriptor import state_in_word, tile_word

__all__ = ["tile_state", "next_tile_state", "next_tile_state_cached", "next_tile"]


@cute.jit
def tile_state(mBitmapRow: cute.Tensor, t: Int32) -> Int32:
    """State of tile ``t >= 0`` in a bitmap row (``TILE_EMPTY``, ``TILE_FULL``,
    ``TILE_PARTIAL``; ``TILES_PER_WORD`` per int32). Shifts, not ``//`` and ``%``: Python's
    floor division of a signed Int32 costs several instructions, and this runs in every consumer
    warp once per tile."""
    word = mBitmapRow[tile_word(t)]
    return state_in_word(word, t)


@cute.jit
def next_tile_state(mBitmapRow: cute.Tensor, start: Int32, n_blocks: Int32):
    """First tile ``>= start`` whose state is not empty, and that state: ``(t, state)``;
    ``(n_blocks, 0)`` if none. One bitmap read for both, where a ``next_tile`` + ``tile_state``
    pair reads and decodes the word twice."""
    t = start
    state = Int32(0)
    searching = t < n_blocks
    while searching:
        state = tile_state(mBitmapRow, t)
        if state != 0:
            searching = False
        else:
            t = t + 1
            searching = t < n_blocks
    return t, state


@cute.jit
def next_tile_state_cached(mBitmapRow: cute.Tensor, start: Int32, n_blocks: Int32,
                           word: Int32, word_idx: Int32):
    """``next_tile_state`` with the bitmap word ``word_idx`` (``tile_word`` of its tiles) kept
    by the caller: a global read only when the scan enters another word (once per 16 tiles on
    a dense row). Returns (t, state, word, word_idx)."""
    t = start
    state = Int32(0)
    searching = t < n_blocks
    while searching:
        if tile_word(t) != word_idx:
            word_idx = tile_word(t)
            word = mBitmapRow[word_idx]
        state = state_in_word(word, t)
        if state != 0:
            searching = False
        else:
            t = t + 1
            searching = t < n_blocks
    return t, state, word, word_idx


@cute.jit
def next_tile(mBitmapRow: cute.Tensor, start: Int32, n_blocks: Int32) -> Int32:
    """First tile ``>= start`` whose state is not empty, ``n_blocks`` if none."""
    t, _ = next_tile_state(mBitmapRow, start, n_blocks)
    return t
