"""The Execution Descriptor: the contract between preprocess and the attention kernels.

One ``preprocess`` call per batch writes every tensor below; the forward and the backward kernels
read the same descriptor (the user writes one MaskSpec, never a second one for the backward).

Shapes and dtypes (``B`` batch, ``Sq``/``Sk`` query/key lengths, ``K`` interval slots)

``intervals``  int32 ``[B, Sq, K, 2]``
    Interval Table. Row ``q_idx`` of sequence ``b`` sees key ``kv_idx`` iff for some slot ``k``
    ``uint32(kv_idx - start) < uint32(len)`` with ``(start, len) = intervals[b, q_idx, k]``.
    Intervals are clipped to ``[0, Sk)``; an empty slot is ``(0, 0)``. One row's K pairs are
    contiguous (8·K bytes: one 16-byte vector load for K = 2), and consecutive rows are
    consecutive, so the threads that own the rows of a q-tile read one contiguous span.
    Slot order is the compiled order (canonicalized at compile time); slots may overlap at run
    time where the compiler could not prove otherwise: the union is what counts.
``row_region``  int32 ``[B, Sq]``
    Index of the Region whose guard holds for the row (first in declaration order), -1 if none
    (such rows see nothing: all slots empty). Kernels need it only for fallback regions.
``fwd_bitmap``  int32 ``[B, n_m_blocks, ceil(n_n_blocks / 16)]`` for the forward tiling
``bwd_bitmap``  int32 ``[B, n_n_blocks, ceil(n_m_blocks / 16)]`` for the backward tiling
    Tile-State Bitmaps, 2 bits per tile. The forward one is indexed ``[b, m_block, word]`` with
    ``n_block`` packed along the row (the forward kernel scans the kv-tiles of one q-tile in one
    contiguous row); the backward one is ``[b, n_block, word]`` with ``m_block`` packed (the
    backward kernel scans the q-tiles of one kv-tile). Tile ``t`` of a row lives in word
    ``t // 16`` at bits ``2 * (t % 16)`` (``TILE_VISIBLE``: some element visible) and
    ``2 * (t % 16) + 1`` (``TILE_MASKED``: some element masked). So ``00`` empty (skip, do not
    load K/V), ``01`` full (no masking code), ``11`` partial (interval test), ``10`` never
    occurs. Rows past ``Sq`` and columns past ``Sk`` of edge tiles are ignored (neither visible
    nor masked). Only exact slots cover a tile: a fallback region's over-approximating slots
    add visibility, never a full tile.
``params``  int32 ``[B, P]``: per-sequence scalar metadata, in ``CompiledMask.scalar_params`` order.
``segments``  ``(cu_seqlens int32 [n + 1], max_seqlen)`` or None
    Only for masks proven causal within segments (``compiler.native``): the segments of all
    sequences of the batch, flattened to ``B * Sq`` rows, for FA4's varlen path; None when the
    batch's segment starts are not a segmentation (then the block-sparse engine runs it).

Block-sparse lists (``block_sparse(kind)``), derived from the bitmaps by a generated TileLang
kernel on the GPU (the torch reference elsewhere), in flash-attn-4's format: per row of tiles the
counts ``[B, 1, R]`` and ascending indices ``[B, 1, R, C]`` of its partial and of its full tiles.
``"fwd"``: q tiles x kv tiles of the forward tiling; ``"bwd64"``: kv tiles x q tiles of the
backward tiling (64x128, FA4's head-dim-128 backward); ``"bwd128"``: kv tiles x q tiles of the
forward tiling (128x128, FA4's head-dim-64 backward).
``row_params``  int32 ``[B, Sq, R]``: per-row metadata arrays, in ``CompiledMask.array_params``
    order (``R`` may be 0; the declared arrays, then the run bounds derived for ``ids[i] ==
    ids[j]`` comparisons, see ``compilemask.compiler.segments``). With ``params`` and ``row_region``
    this is what a kernel needs to evaluate the fallback predicate of a region whose rule did
    not compile to intervals; for such rows the interval slots are a sound over-approximation,
    and an element is visible iff it is inside an interval AND the region's predicate holds.
    A mask with a table param (``CompiledMask.table_params``: ``[B, Sq, M]`` entries read as
    ``t[i, column]``) has the table's entries after the arrays, ``TABLE_ENTRIES_PER_WORD`` to a
    word: entry ``c`` of row ``q_idx`` is bit ``c % 32`` of column ``R_arrays + c // 32``
    (``pack_table``); entries past ``M`` are 0, as are columns outside the table.

``positions`` int32 ``[B, Sq]`` and ``key_params`` int32 ``[B, Sk, R]`` (both or neither)
    Only on a descriptor of chosen rows (rows that are not positions 0.. of their sequence:
    a served request's last rows, a context-parallel shard) of a mask with fallback regions:
    each row's position in its sequence (clamped into ``[0, Sk)``; padding rows see nothing
    anyway) and the sequence's ``row_params`` indexed by position. A fallback predicate there
    reads ``i`` as ``positions[b, q_idx]`` and every array (and table) through ``key_params``
    at that position or at the key, with ``max_row = Sk - 1``; ``row_params`` still holds the
    arrays at the rows. Absent (None), row ``q_idx`` is position ``q_idx``.

``row_start`` (an int)
    Every sequence's position of its local row 0 where the rows are consecutive positions,
    the same in every sequence, but ``q_offset`` is -1 (a padded batch: its keys clipped to
    its real tokens; 0 for a square one). A score_mod reads ``q_idx`` there as
    ``row_start + q_idx``. -1: ``q_offset`` says where the rows are, or the descriptor does
    not know (``positions``, ``seqused_k``).

The encoding constants and helpers below (``TILE_*``, ``bitmap_words``, ``state_in_word``,
``in_interval``) are the only place the layout is spelled out; ``make_descriptor`` is the one
constructor, ``with_fields`` the one way to set the fields a producer adds after the tables
(``POST_FIELDS``), and ``DescriptorArgs`` is the descriptor as the ``compilemask::attention_*``
custom ops carry it (tensors, then static ints).
This module is the contract's one home and a leaf: it imports nothing of the project. What
is computed *from* a descriptor (its dense mask, its picture, lists on demand) belongs to the
modules that do that work; the descriptor's methods for them ask its mask, which owns them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

__all__ = ["TileConfig", "DEFAULT_FWD_TILES", "DEFAULT_BWD_TILES", "ExecutionDescriptor",
           "DescriptorArgs", "BlockSparseLists", "PackedLists", "make_descriptor", "with_fields",
           "POST_FIELDS", "descriptor_shapes", "LIST_KINDS", "TILE_EMPTY", "TILE_VISIBLE",
           "TILE_MASKED",
           "TILE_FULL", "TILE_PARTIAL", "TILE_BITS", "TILE_STATE_MASK", "TILES_PER_WORD",
           "TILE_WORD_SHIFT", "bitmap_words", "bitmap_shape", "tile_word", "tile_shift",
           "state_in_word", "is_partial", "in_interval", "pack_bitmap", "unpack_bitmap",
           "TABLE_ENTRIES_PER_WORD", "pack_table", "unpack_table"]

# ----------------------------------------------------------------------------------------------
# Layout: tile states, bitmap words and the interval test. Every producer and reader (torch,
# TileLang sources, CuTe kernels) takes the encoding from here; the helpers use shifts and masks
# only, so they run on Python ints, torch tensors and CuTe DSL Int32 alike.
# ----------------------------------------------------------------------------------------------
TILE_EMPTY = 0
TILE_VISIBLE = 1  # bit 0: some element visible
TILE_MASKED = 2  # bit 1: some element masked
TILE_FULL = TILE_VISIBLE  # 01: no masking code
TILE_PARTIAL = TILE_VISIBLE | TILE_MASKED  # 11: the interval test
TILE_BITS = 2
TILE_STATE_MASK = (1 << TILE_BITS) - 1
TILES_PER_WORD = 32 // TILE_BITS  # int32 words
TILE_WORD_SHIFT = TILES_PER_WORD.bit_length() - 1  # t >> TILE_WORD_SHIFT == t // TILES_PER_WORD


def bitmap_words(num_tiles):
    """Words of a bitmap row of ``num_tiles >= 0`` tiles (ceil division by a shift: on a signed
    DSL Int32, ``//`` costs a floor-division sequence)."""
    return (num_tiles + TILES_PER_WORD - 1) >> TILE_WORD_SHIFT


def bitmap_shape(batch: int, rows: int, packed_tiles: int) -> tuple[int, int, int]:
    """``[B, rows, words]`` of a bitmap with ``packed_tiles`` tiles packed along each row."""
    return batch, rows, bitmap_words(packed_tiles)


def tile_word(t):
    """The word of a row that holds tile ``t >= 0``."""
    return t >> TILE_WORD_SHIFT


def tile_shift(t):
    """The bit offset of tile ``t``'s state in its word (``TILE_BITS == 2``: a shift by one)."""
    return (t & (TILES_PER_WORD - 1)) << 1


def state_in_word(word, t):
    """The 2-bit state of tile ``t`` from its word."""
    return (word >> tile_shift(t)) & TILE_STATE_MASK


def is_partial(state):
    """Whether a (non-empty) state needs the interval test: its masked bit."""
    return (state & TILE_MASKED) != 0


def in_interval(j, start, length):
    """Key ``j`` in the slot ``(start, length)``: ``uint32(j - start) < uint32(length)`` for
    ``0 <= start, length < 2^31``, as two signed compares."""
    return (j >= start) & (j < start + length)


# block_sparse(kind) -> (backward, over the forward tiling)
LIST_KINDS = {"fwd": (False, False), "bwd64": (True, False), "bwd128": (True, True)}


def pack_bitmap(states: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, R, T]`` states -> int32 ``bitmap_shape(B, R, T)`` words, 2 bits per tile."""
    B, R, T = states.shape
    W = bitmap_words(T)
    shifts = TILE_BITS * torch.arange(TILES_PER_WORD, device=states.device, dtype=torch.int64)
    # in pieces of rows: the int64 temporaries stay ~32 MB at any length (a 2**20-token
    # backward grid is 8x that as int64)
    rows = max(1, (1 << 22) // max(1, B * W * TILES_PER_WORD))
    out = torch.empty(B, R, W, dtype=torch.int32, device=states.device)
    for r0 in range(0, R, rows):
        part = states[:, r0:r0 + rows]
        padded = torch.nn.functional.pad(part.to(torch.int64), (0, W * TILES_PER_WORD - T))
        words = (padded.view(B, part.shape[1], W, TILES_PER_WORD) << shifts).sum(dim=-1)
        out[:, r0:r0 + rows] = torch.where(words >= 2**31, words - 2**32, words)
    return out


def unpack_bitmap(words: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitmap`: uint8 ``[B, R, num_tiles]``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = TILE_BITS * torch.arange(TILES_PER_WORD, device=words.device, dtype=torch.int64)
    st = (w.unsqueeze(-1) >> shifts) & TILE_STATE_MASK
    return st.flatten(-2)[..., :num_tiles].to(torch.uint8)


TABLE_ENTRIES_PER_WORD = 32  # a table's entries: one bit each, in int32 words


def pack_table(entries: torch.Tensor) -> torch.Tensor:
    """``[B, Sq, M]`` table entries (nonzero: set) -> int32 ``[B, Sq, ceil(M / 32)]`` words,
    entry ``c`` at bit ``c % 32`` of word ``c // 32``."""
    B, S, M = entries.shape
    W = -(-M // TABLE_ENTRIES_PER_WORD)
    bits = torch.nn.functional.pad((entries != 0).to(torch.int64),
                                   (0, W * TABLE_ENTRIES_PER_WORD - M))
    shifts = torch.arange(TABLE_ENTRIES_PER_WORD, device=entries.device, dtype=torch.int64)
    words = (bits.view(B, S, W, TABLE_ENTRIES_PER_WORD) << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_table(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_table`: int64 0/1 ``[B, Sq, 32 * W]`` (the padding entries 0)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(TABLE_ENTRIES_PER_WORD, device=words.device, dtype=torch.int64)
    return ((w.unsqueeze(-1) >> shifts) & 1).flatten(-2)


@dataclass(frozen=True)
class TileConfig:
    """A tiling of the [Sq, Sk] score matrix: ``tile_m`` query rows by ``tile_n`` key columns."""

    tile_m: int
    tile_n: int

    def num_blocks(self, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        return -(-seqlen_q // self.tile_m), -(-seqlen_k // self.tile_n)


# The default tilings, and the ones flash-attn-4's sm90 kernels read lists for: forward 128x128,
# backward 64x128 (head dim 128; head dim 64 runs its backward on the forward's tiles)
DEFAULT_FWD_TILES = TileConfig(128, 128)
DEFAULT_BWD_TILES = TileConfig(64, 128)


class BlockSparseLists(NamedTuple):
    """Per row of tiles, the partial (``mask_*``) and full (``full_*``) column tiles, in
    flash-attn-4's format. ``*_cnt`` int32 ``[B, 1, R]``; ``*_idx`` int32 ``[B, 1, R, C]``, the
    first ``cnt`` entries of a row ascending, the rest unspecified (0 from the torch
    reference). The head dimension is 1: one mask for every head (FA4 broadcasts it)."""

    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor
    full_cnt: torch.Tensor
    full_idx: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.mask_idx.shape[2]

    @property
    def num_cols(self) -> int:
        return self.mask_idx.shape[3]


class PackedLists(NamedTuple):
    """Several kinds' lists in one flat int32 buffer, as one launch writes them: per kind,
    ``mask_cnt``, ``mask_idx``, ``full_cnt``, ``full_idx`` back to back. ``layout``: kind ->
    (offsets per sequence of the four outputs, rows, cols). ``view(kind)`` makes the four
    tensors (views, no copy)."""

    buffer: torch.Tensor
    batch_size: int
    layout: dict

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.layout)

    def view(self, kind: str) -> BlockSparseLists:
        offs, R, C = self.layout[kind]
        B, buf = self.batch_size, self.buffer
        shapes = ((B, 1, R), (B, 1, R, C), (B, 1, R), (B, 1, R, C))
        return BlockSparseLists(*(buf[B * o:B * o + B * R * (C if j % 2 else 1)].view(shape)
                                  for j, (o, shape) in enumerate(zip(offs, shapes))))

    def to(self, device) -> PackedLists:
        return PackedLists(self.buffer.to(device), self.batch_size, self.layout)


@dataclass(frozen=True, eq=False)
class ExecutionDescriptor:
    """Per-batch output of ``CompiledMask.preprocess`` (see the module docstring for layouts).

    ``mask`` is the ``CompiledMask`` it was made for (typed loosely: the contract imports
    nothing of the project). ``lists``: FA4's tile lists of every kind, written with the
    descriptor on CUDA (``PackedLists``), else None (``block_sparse`` computes them)."""

    mask: Any
    seqlen_q: int
    seqlen_k: int
    intervals: torch.Tensor
    row_region: torch.Tensor
    fwd_tiles: TileConfig
    fwd_bitmap: torch.Tensor
    bwd_tiles: TileConfig
    bwd_bitmap: torch.Tensor
    params: torch.Tensor
    row_params: torch.Tensor
    segments: tuple | None = None
    lists: PackedLists | None = None
    # > 0: the rows are the positions q_offset.. of a seqlen_k-token sequence (queries at the
    # end of the keys: q_offset == seqlen_k - seqlen_q; ``compilemask.api.serving``); -1: each
    # sequence's rows start at its own position (a batch of requests, context-parallel rows) or
    # its keys are clipped to its real tokens (a padded batch): the table alone (with fallback
    # predicates) is the mask, so no native path
    q_offset: int = 0
    # > 0: the metadata given on the host reach past the longest sequence, up to this power of
    # two; the kernels' int32 arithmetic is checked against it (0: metadata up to the length,
    # the bound assumed of values on the GPU, which are not read)
    meta_max: int = 0
    # int32 [B]: the keys each request holds in a shared KV buffer (``serving.query_descriptor
    # (..., seqused_k=)``), which a paged KV cache's kernel stops at; None: all seqlen_k
    seqused_k: torch.Tensor | None = None
    # int32 [B]: the queries each request has in a packed (varlen) batch, its last positions
    # (``query_descriptor(..., seqused_q=)``; rows past it are padding); None: all seqlen_q
    seqused_q: torch.Tensor | None = None
    # int32 [B, Sk, slots, 2]: per key, the query rows that see it as merged (start, len) runs
    # (``compilemask.compiler.columns``; slot 0 ``(0, -1)``: more runs than slots), written when the
    # pipeline is asked for it (``PipelineConfig(column_view=True)``); FA4's backward reads it
    columns: torch.Tensor | None = None
    # A descriptor of chosen rows (``compilemask.pipeline.rows``) of a mask with fallback
    # regions, whose predicates read ``i`` as a position and arrays at any key: int32 [B, Sq],
    # each row's position in its sequence (clamped into [0, seqlen_k)), and int32 [B, Sk, R]
    # the sequence's ``row_params`` by position (the keys' side). None elsewhere: there row
    # ``r`` is position ``r`` and ``row_params`` is indexed by position
    positions: torch.Tensor | None = None
    key_params: torch.Tensor | None = None
    # every sequence's position of local row 0 where the rows are consecutive but q_offset is
    # -1 (a padded batch); what a score_mod's q_idx is read from. -1 elsewhere
    row_start: int = -1

    @property
    def batch_size(self) -> int:
        return self.intervals.shape[0]

    @property
    def num_intervals(self) -> int:
        return self.intervals.shape[2]

    @property
    def has_fallback(self) -> bool:
        return self.mask.has_fallback

    @property
    def device(self) -> torch.device:
        return self.intervals.device

    @property
    def native(self):
        """The native pattern the compiler proved for the mask (``compilemask.compiler.native``)."""
        return self.mask.native_pattern

    def native_applies(self) -> bool:
        """Whether the native pattern's proof covers this shape: square attention, a
        bottom-right proof, or queries at the end of the keys (FA4's causal and windows align
        bottom-right, as those rows of the square mask do)."""
        pat = self.native
        if pat is None or self.q_offset < 0:
            return False
        if (self.q_offset and self.q_offset == self.seqlen_k - self.seqlen_q
                and pat.kind != "segments"):
            return True
        return pat.applies(self.seqlen_q, self.seqlen_k)

    def block_sparse(self, kind: str = "fwd") -> BlockSparseLists:
        """flash-attn-4 tile lists (see the module docstring): views of ``lists`` when the
        producer wrote them, else computed now (``CompiledMask.block_sparse``)."""
        if kind not in LIST_KINDS:
            raise ValueError(f"kind must be one of {sorted(LIST_KINDS)}, got {kind!r}")
        if self.lists is not None and kind in self.lists.layout:
            return self.lists.view(kind)
        return self.mask.block_sparse(self, kind)

    def tile_states(self, backward: bool = False) -> torch.Tensor:
        """Unpacked 2-bit states, uint8 ``[B, n_m, n_n]`` (forward) or ``[B, n_n, n_m]``."""
        if backward:
            n_m, _ = self.bwd_tiles.num_blocks(self.seqlen_q, self.seqlen_k)
            return unpack_bitmap(self.bwd_bitmap, n_m)
        _, n_n = self.fwd_tiles.num_blocks(self.seqlen_q, self.seqlen_k)
        return unpack_bitmap(self.fwd_bitmap, n_n)

    def dense_mask(self) -> torch.Tensor:
        """bool ``[B, Sq, Sk]``: the mask this descriptor encodes (for tests and pictures)."""
        return self.mask.dense_mask(self)

    def to_string(self, batch: int = 0, backward: bool = False, **kw) -> str:
        """One character per tile ('#' full, '~' partial, '.' empty), counts, FLOPs skipped;
        the header line ends with that legend (``legend=False``: without it)."""
        return self.mask.descriptor_string(self, batch=batch, backward=backward, **kw)

    def to(self, device: Any) -> ExecutionDescriptor:
        """The descriptor on ``device`` (its lists too, when it has them)."""
        moved = {k: getattr(self, k).to(device) for k in DescriptorArgs.tensor_fields()}
        segments = self.segments
        if segments is not None:
            segments = (segments[0].to(device), segments[1])
        lists = None if self.lists is None else self.lists.to(device)
        used = {f: None if getattr(self, f) is None else getattr(self, f).to(device)
                for f in OPTIONAL_TENSORS}
        return replace(self, **moved, segments=segments, lists=lists, **used)


def make_descriptor(mask: Any, seqlen_q: int, seqlen_k: int, fwd_tiles: TileConfig,
                    bwd_tiles: TileConfig, *, intervals: torch.Tensor, row_region: torch.Tensor,
                    fwd_bitmap: torch.Tensor, bwd_bitmap: torch.Tensor, params: torch.Tensor,
                    row_params: torch.Tensor, segments: tuple | None = None,
                    lists: PackedLists | None = None, q_offset: int = 0,
                    meta_max: int = 0, seqused_k: torch.Tensor | None = None,
                    seqused_q: torch.Tensor | None = None,
                    columns: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None,
                    key_params: torch.Tensor | None = None,
                    row_start: int = -1) -> ExecutionDescriptor:
    """The one constructor of an :class:`ExecutionDescriptor` (producers and op readers)."""
    return ExecutionDescriptor(
        mask=mask, seqlen_q=seqlen_q, seqlen_k=seqlen_k, intervals=intervals,
        row_region=row_region, fwd_tiles=fwd_tiles, fwd_bitmap=fwd_bitmap, bwd_tiles=bwd_tiles,
        bwd_bitmap=bwd_bitmap, params=params, row_params=row_params, segments=segments,
        lists=lists, q_offset=q_offset, meta_max=meta_max, seqused_k=seqused_k,
        seqused_q=seqused_q, columns=columns, positions=positions, key_params=key_params,
        row_start=row_start)


# what a producer may set after the tables and bitmaps: the rest is written with them
POST_FIELDS = ("segments", "lists", "q_offset", "meta_max", "seqused_k", "seqused_q", "columns",
               "positions", "key_params", "row_start")
# the optional tensors, None or on the descriptor's device
OPTIONAL_TENSORS = ("seqused_k", "seqused_q", "columns", "positions", "key_params")


def with_fields(desc: ExecutionDescriptor, **fields) -> ExecutionDescriptor:
    """``desc`` with some of its :data:`POST_FIELDS` set, through :func:`make_descriptor` (a
    new descriptor; the tensors are shared). The tables, bitmaps and metadata are the
    producer's: a new batch is a new descriptor."""
    bad = sorted(set(fields) - set(POST_FIELDS))
    if bad:
        raise TypeError(f"with_fields: {bad} are not fields set after construction; those are "
                        f"{list(POST_FIELDS)} (make the descriptor anew for the others)")
    if not fields:
        return desc
    kept = {f: getattr(desc, f) for f in POST_FIELDS}
    return make_descriptor(
        desc.mask, desc.seqlen_q, desc.seqlen_k, desc.fwd_tiles, desc.bwd_tiles,
        intervals=desc.intervals, row_region=desc.row_region, fwd_bitmap=desc.fwd_bitmap,
        bwd_bitmap=desc.bwd_bitmap, params=desc.params, row_params=desc.row_params,
        **{**kept, **fields})


def descriptor_shapes(batch: int, seqlen_q: int, seqlen_k: int, num_intervals: int,
                      num_params: int, num_row_params: int, fwd_tiles: TileConfig,
                      bwd_tiles: TileConfig) -> dict:
    """Tensor field -> shape, in :class:`DescriptorArgs` order (for producers that allocate)."""
    nm_f, nn_f = fwd_tiles.num_blocks(seqlen_q, seqlen_k)
    nm_b, nn_b = bwd_tiles.num_blocks(seqlen_q, seqlen_k)
    return {"intervals": (batch, seqlen_q, num_intervals, 2), "row_region": (batch, seqlen_q),
            "fwd_bitmap": bitmap_shape(batch, nm_f, nn_f),
            "bwd_bitmap": bitmap_shape(batch, nn_b, nm_b), "params": (batch, num_params),
            "row_params": (batch, seqlen_q, num_row_params)}


def _kind(annotation) -> str:
    """A field's schema type from its annotation (a string, or a ForwardRef to one)."""
    text = getattr(annotation, "__forward_arg__", annotation)
    return {"torch.Tensor": "Tensor", "int": "SymInt"}[text]


class DescriptorArgs(NamedTuple):
    """The descriptor as the ``compilemask::attention_*`` custom ops carry it: its tensors, then
    its static ints (custom ops take tensors and scalars only). The op schemas are generated
    from these fields, so a field added here reaches both ops and every reader."""

    intervals: torch.Tensor
    row_region: torch.Tensor
    fwd_bitmap: torch.Tensor
    bwd_bitmap: torch.Tensor
    params: torch.Tensor
    row_params: torch.Tensor
    seqlen_q: int
    seqlen_k: int
    fwd_tile_m: int
    fwd_tile_n: int
    bwd_tile_m: int
    bwd_tile_n: int
    q_offset: int
    meta_max: int

    @classmethod
    def of(cls, desc: ExecutionDescriptor) -> DescriptorArgs:
        return cls(desc.intervals, desc.row_region, desc.fwd_bitmap, desc.bwd_bitmap,
                   desc.params, desc.row_params, int(desc.seqlen_q), int(desc.seqlen_k),
                   int(desc.fwd_tiles.tile_m), int(desc.fwd_tiles.tile_n),
                   int(desc.bwd_tiles.tile_m), int(desc.bwd_tiles.tile_n), int(desc.q_offset),
                   int(desc.meta_max))

    def to_op_args(self) -> tuple:
        """The op's arguments for these fields, in schema order."""
        return tuple(self)

    @classmethod
    def from_op_args(cls, args) -> DescriptorArgs:
        """The fields from the start of ``args`` (an op's arguments past the ones before them);
        further arguments are ignored."""
        return cls(*args[:len(cls._fields)])

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        return tuple(f for f in cls._fields if _kind(cls.__annotations__[f]) == "Tensor")

    def tensors(self) -> tuple:
        return self[:len(self.tensor_fields())]

    def scalars(self) -> tuple:
        return self[len(self.tensor_fields()):]

    @classmethod
    def schema(cls) -> str:
        """These fields as a ``torch.library`` schema fragment."""
        return ", ".join(f"{_kind(cls.__annotations__[f])} {f}" for f in cls._fields)

    def descriptor(self, mask: Any, segments: tuple | None = None,
                   **optional) -> ExecutionDescriptor:
        """The descriptor of these fields; ``optional``: its optional tensors by name
        (``columns``, ``seqused_k``, ``seqused_q``, ``positions``, ``key_params``)."""
        return make_descriptor(
            mask, self.seqlen_q, self.seqlen_k, TileConfig(self.fwd_tile_m, self.fwd_tile_n),
            TileConfig(self.bwd_tile_m, self.bwd_tile_n), intervals=self.intervals,
            row_region=self.row_region, fwd_bitmap=self.fwd_bitmap, bwd_bitmap=self.bwd_bitmap,
            params=self.params, row_params=self.row_params, segments=segments,
            q_offset=self.q_offset, meta_max=self.meta_max, **optional)
