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
    nor masked). Tiles of fallback rows are never full.
``params``  int32 ``[B, P]``: per-sequence scalar metadata, in ``CompiledMask.scalar_params`` order.
``segments``  ``(cu_seqlens int32 [n + 1], max_seqlen)`` or None
    Only for masks proven causal within segments (``compilemask.native``): the segments of all
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
    ids[j]`` comparisons, see ``compilemask.segments``). With ``params`` and ``row_region``
    this is what a kernel needs to evaluate the fallback predicate of a region whose rule did
    not compile to intervals; for such rows the interval slots are a sound over-approximation,
    and an element is visible iff it is inside an interval AND the region's predicate holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from compilemask.compiled import CompiledMask

__all__ = ["TileConfig", "ExecutionDescriptor", "TILE_VISIBLE", "TILE_MASKED", "TILES_PER_WORD"]

TILE_VISIBLE = 1
TILE_MASKED = 2
TILES_PER_WORD = 16
# block_sparse(kind) -> (backward, over the forward tiling)
_LIST_KINDS = {"fwd": (False, False), "bwd64": (True, False), "bwd128": (True, True)}


@dataclass(frozen=True)
class TileConfig:
    """A tiling of the [Sq, Sk] score matrix: ``tile_m`` query rows by ``tile_n`` key columns."""

    tile_m: int
    tile_n: int

    def num_blocks(self, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        return -(-seqlen_q // self.tile_m), -(-seqlen_k // self.tile_n)


@dataclass(frozen=True, eq=False)
class ExecutionDescriptor:
    """Per-batch output of ``CompiledMask.preprocess`` (see the module docstring for layouts)."""

    mask: CompiledMask
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
    # kind -> BlockSparseLists, or the PackedLists that holds it (viewed on first use): filled
    # by the producer on CUDA in one launch (a compiled model then runs no kernel for it), else
    # computed on first use
    block_lists: dict = field(default_factory=dict, compare=False, repr=False)

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
        """The native pattern the compiler proved for the mask (``compilemask.native``)."""
        return self.mask.native_pattern

    def block_sparse(self, kind: str = "fwd"):
        """flash-attn-4 tile lists (see the module docstring), computed once per descriptor."""
        cache = self.block_lists
        got = cache.get(kind)
        if got is not None and not isinstance(got, tuple):  # PackedLists: view it
            got = got.view(kind)
            if not torch.compiler.is_compiling():  # no side effects while dynamo traces
                cache[kind] = got
            return got
        if kind not in cache:
            from compilemask.blocksparse import descriptor_lists

            if kind not in _LIST_KINDS:
                raise ValueError(f"kind must be one of {sorted(_LIST_KINDS)}, got {kind!r}")
            backward, forward_tiling = _LIST_KINDS[kind]
            if kind == "bwd64" and (self.bwd_tiles.tile_m, self.bwd_tiles.tile_n) != (64, 128):
                raise ValueError(f"bwd64 lists need 64x128 backward tiles, got {self.bwd_tiles}")
            backend = "tilelang" if self.device.type == "cuda" else "torch"
            cache[kind] = descriptor_lists(self, backward, forward_tiling=forward_tiling,
                                           backend=backend)
        return cache[kind]

    def tile_states(self, backward: bool = False) -> torch.Tensor:
        """Unpacked 2-bit states, uint8 ``[B, n_m, n_n]`` (forward) or ``[B, n_n, n_m]``."""
        from compilemask.tiles import unpack_bitmap

        if backward:
            n_m, n_n = self.bwd_tiles.num_blocks(self.seqlen_q, self.seqlen_k)
            return unpack_bitmap(self.bwd_bitmap, n_m)
        n_m, n_n = self.fwd_tiles.num_blocks(self.seqlen_q, self.seqlen_k)
        return unpack_bitmap(self.fwd_bitmap, n_n)

    def dense_mask(self) -> torch.Tensor:
        """bool ``[B, Sq, Sk]``: the mask this descriptor encodes (for tests and pictures)."""
        from compilemask.reference import descriptor_dense_mask

        return descriptor_dense_mask(self)

    def to_string(self, batch: int = 0, backward: bool = False, **kw) -> str:
        """One character per tile ('#' full, '~' partial, '.' empty), counts, FLOPs skipped;
        the header line ends with that legend (``legend=False``: without it)."""
        from compilemask.render import descriptor_to_string

        return descriptor_to_string(self, batch=batch, backward=backward, **kw)

    def to(self, device: Any) -> ExecutionDescriptor:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k, v in fields.items():
            if isinstance(v, torch.Tensor):
                fields[k] = v.to(device)
        if self.segments is not None:
            fields["segments"] = (self.segments[0].to(device), self.segments[1])
        packed = {id(v): v.to(device) for v in self.block_lists.values()
                  if not isinstance(v, tuple)}  # a PackedLists serves several kinds
        fields["block_lists"] = {k: packed[id(v)] if id(v) in packed
                                 else type(v)(*(t.to(device) for t in v))
                                 for k, v in self.block_lists.items()}
        return ExecutionDescriptor(**fields)
