"""Block-sparse tile lists (flash-attn-4 / FlexAttention format) from the Tile-State Bitmaps.

flash-attn-4's block-sparse interface takes, per row of tiles, the column tiles to visit as
compacted lists instead of a bitmap: the *partial* tiles (state ``11``: the kernel applies the
mask) and the *full* tiles (state ``01``: no masking code); empty tiles (``00``) are in neither.

``mask_cnt``  int32 ``[B, 1, R]``: number of partial tiles of row ``r``
``mask_idx``  int32 ``[B, 1, R, C]``: their column-tile indices, ascending, packed left
``full_cnt`` / ``full_idx``: the same for the full tiles

The head dimension is 1 (one mask for every head: flash-attn-4 broadcasts it). Entries of a row
past its count are never read by the kernels; the torch reference writes 0 there.

Which rows and columns:

- forward: rows are q tiles (m blocks), columns kv tiles, read from ``fwd_bitmap`` as it is;
- backward: rows are kv tiles (n blocks), columns q tiles, read from ``bwd_bitmap`` as it is;
- backward over the forward tiling (``transpose=True`` on ``fwd_bitmap``): rows are the kv tiles
  of the forward tiling and columns its q tiles, read by columns of the forward bitmap (for a
  backward that runs on the forward's 128x128 tiles, such as head dim 64).

This module is the vectorized torch reference (no loop over rows or tiles, no dense
``[Sq, Sk]`` mask); ``compilemask.codegen.blocksparse`` writes the same lists in one TileLang
launch on the bitmap's device.
"""

from __future__ import annotations

import torch

from compilemask.contract.descriptor import (
    LIST_KINDS,
    TILE_FULL,
    TILE_PARTIAL,
    BlockSparseLists,
    PackedLists,
    bitmap_words,
    pack_bitmap,
    unpack_bitmap,
)

__all__ = ["BlockSparseLists", "PackedLists", "lists_from_bitmap", "lists_from_states",
           "to_dense_states", "list_pass", "descriptor_lists", "pack_bitmap", "unpack_bitmap",
           "TILE_FULL", "TILE_PARTIAL"]


def _compact(sel: torch.Tensor):
    """bool ``[B, R, C]`` -> (count int32 ``[B, R]``, indices int32 ``[B, R, C]``): the columns
    where ``sel`` holds, ascending and packed left, 0 past the count."""
    B, R, C = sel.shape
    cnt = sel.sum(dim=-1, dtype=torch.int64)
    # each selected column goes to its rank among the selected ones; the others to a spare slot
    pos = torch.where(sel, torch.cumsum(sel, dim=-1, dtype=torch.int64) - 1, C)
    cols = torch.arange(C, device=sel.device, dtype=torch.int64).expand(B, R, C)
    out = torch.zeros(B, R, C + 1, dtype=torch.int64, device=sel.device)
    out.scatter_(-1, pos, cols)
    return cnt.to(torch.int32), out[..., :C].to(torch.int32)


def lists_from_states(states: torch.Tensor) -> BlockSparseLists:
    """Lists from unpacked tile states, uint8 ``[B, R, C]`` (rows of the result along dim 1)."""
    if states.dim() != 3:
        raise ValueError(f"states must be [B, R, C], got shape {tuple(states.shape)}")
    st = states.to(torch.uint8)
    mc, mi = _compact(st == TILE_PARTIAL)
    fc, fi = _compact(st == TILE_FULL)
    return BlockSparseLists(mc.unsqueeze(1), mi.unsqueeze(1), fc.unsqueeze(1), fi.unsqueeze(1))


def _unpack(bitmap: torch.Tensor, packed_tiles: int) -> torch.Tensor:
    if bitmap.dim() != 3 or bitmap.dtype != torch.int32:
        raise ValueError(f"bitmap must be int32 [B, rows, words], got {bitmap.dtype} "
                         f"{tuple(bitmap.shape)}")
    words = bitmap_words(packed_tiles)
    if packed_tiles < 1 or bitmap.shape[2] != words:
        raise ValueError(f"packed_tiles={packed_tiles} needs {max(words, 1)} words per row, the "
                         f"bitmap has {bitmap.shape[2]}")
    if bitmap.shape[1] < 1:
        raise ValueError("bitmap has no rows")
    return unpack_bitmap(bitmap, packed_tiles)


def lists_from_bitmap(bitmap: torch.Tensor, packed_tiles: int, *,
                      transpose: bool = False) -> BlockSparseLists:
    """Block-sparse lists from a Tile-State Bitmap (torch reference).

    bitmap: int32 ``[B, N, ceil(packed_tiles / 16)]``, 2 bits per tile (``fwd_bitmap`` or
    ``bwd_bitmap`` of an ``ExecutionDescriptor``). packed_tiles: the number of tiles packed along
    each of its rows (the forward bitmap's n-tiles, the backward bitmap's m-tiles): it tells the
    tiles from the padding of the last word.

    ``transpose=False``: one list row per bitmap row, ``R = N``, ``C = packed_tiles``.
    ``transpose=True``: one list row per packed tile (a column of the bitmap), ``R =
    packed_tiles``, ``C = N``; on ``fwd_bitmap`` these are the backward lists over the forward
    tiling."""
    st = _unpack(bitmap, packed_tiles)
    if transpose:
        st = st.transpose(1, 2)
    return lists_from_states(st)


def to_dense_states(lists: BlockSparseLists) -> torch.Tensor:
    """Inverse of ``lists_from_states``: uint8 ``[B, R, C]`` tile states (``01`` full, ``11``
    partial, ``00`` elsewhere). Entries past a row's count are not read."""
    B, _, R, C = lists.mask_idx.shape
    dev = lists.mask_idx.device
    out = torch.zeros(B, R, C + 1, dtype=torch.uint8, device=dev)
    slot = torch.arange(C, device=dev, dtype=torch.int64)
    for cnt, idx, state in ((lists.full_cnt, lists.full_idx, TILE_FULL),
                            (lists.mask_cnt, lists.mask_idx, TILE_PARTIAL)):
        live = slot < cnt[:, 0].to(torch.int64).unsqueeze(-1)  # [B, R, C]
        # entries past the count go to the spare column C, dropped below
        col = torch.where(live, idx[:, 0].to(torch.int64).clamp(0, C), C)
        val = torch.full_like(col, state, dtype=torch.uint8)
        out.scatter_add_(-1, col, val)
    dense = out[..., :C]
    if bool(((dense != 0) & (dense != TILE_FULL) & (dense != TILE_PARTIAL)).any()):
        raise ValueError("a column tile is listed twice in a row (or as both full and partial)")
    return dense


def list_pass(kind: str, fwd_tiles, bwd_tiles, seqlen_q: int, seqlen_k: int
              ) -> tuple[str, int, int, bool]:
    """Which bitmap (``"fwd"`` | ``"bwd"``) the lists of ``kind`` read, their rows and columns,
    and whether the bitmap is read by columns."""
    if kind not in LIST_KINDS:
        raise ValueError(f"kind must be one of {sorted(LIST_KINDS)}, got {kind!r}")
    backward, forward_tiling = LIST_KINDS[kind]
    fwd_m, fwd_n = fwd_tiles.num_blocks(seqlen_q, seqlen_k)
    if not backward:
        return "fwd", fwd_m, fwd_n, False
    if forward_tiling:
        return "fwd", fwd_n, fwd_m, True
    if kind == "bwd64" and (bwd_tiles.tile_m, bwd_tiles.tile_n) != (64, 128):
        raise ValueError(f"bwd64 lists need 64x128 backward tiles, got {bwd_tiles}")
    bwd_m, bwd_n = bwd_tiles.num_blocks(seqlen_q, seqlen_k)
    return "bwd", bwd_n, bwd_m, False


def descriptor_lists(desc, kind: str = "fwd") -> BlockSparseLists:
    """The lists of one kind of an ``ExecutionDescriptor`` (torch reference, on its device):
    ``"fwd"`` rows the q tiles of ``desc.fwd_tiles``; ``"bwd64"`` rows the kv tiles of
    ``desc.bwd_tiles``, columns its q tiles; ``"bwd128"`` the same over ``desc.fwd_tiles`` (the
    forward bitmap by columns)."""
    which, rows, cols, transpose = list_pass(kind, desc.fwd_tiles, desc.bwd_tiles,
                                             desc.seqlen_q, desc.seqlen_k)
    bitmap = desc.fwd_bitmap if which == "fwd" else desc.bwd_bitmap
    return lists_from_bitmap(bitmap, rows if transpose else cols, transpose=transpose)
