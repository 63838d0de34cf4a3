"""Partial tiles of FA4's sm90 backward masked by the column view: the ``"columns"`` variant.

FA4's sm90 backward computes the score tile transposed (``SdP_swapAB``, head dims 64 and 128):
a thread holds 2 keys x 16 query rows (32 at head dim 64). Its per-score mask_mod reads, for
each of those rows, the row's K Interval Table slots (64 loads per thread and tile for K = 2
at head dim 128). With the column view (``compilemask.compiler.columns``,
``ExecutionDescriptor.columns``) each of the thread's 2 keys reads its few merged row runs
once, and a score is one subtraction, an unsigned compare and a select against them. A key
flagged as overflowing (more runs than the table's slots) takes the Interval Table test for its
rows instead, so the mask stays exact for every input.

The class is ``flash_bwd_sm90.AttentionMask`` during this package's calls into FA4
(``PATCHES``, applied by ``fa4_lib.patched``). It takes a call
only for a mask_mod carrying ``COLUMNS_ATTR``, on the transposed tile, without causal / local
or PackGQA; everything else (FA4's own masks, a non-transposed tile) runs FA4's code with the
same mask_mod, which is the exact per-score interval test (without FA4's index wrap:
``fa4_unwrap.UnwrappedMask``, the base class).
``tests/test_fa4_colmask.py`` pins the FA4 internals relied on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32, const_expr
from quack import layout_utils

from compilemask.codegen.cute_mask_mod import COLUMNS_ATTR
from compilemask.kernels import fa4_lib
from compilemask.kernels.fa4_unwrap import UnwrappedMask

__all__ = ["ColumnIntervalMask", "PATCHES"]

utils = fa4_lib.module("utils")
AuxData = utils.AuxData

# COLUMNS_ATTR on a generated mask_mod: (K, slots, whether a key can overflow them);
# aux_tensors[0] is the Interval Table, int32 [B, Sq, 2K], aux_tensors[1] the column table,
# int32 [B, Sk, 2 * slots]


@dataclass(frozen=True)
class ColumnIntervalMask(UnwrappedMask):
    # False only in bench/sass_colmask.py, to count the common path's code alone (overflowing
    # keys are then wrong)
    OVERFLOW_PATH: ClassVar[bool] = True
    KEYS_ONLY_SEQLEN: ClassVar[bool] = True  # the backward: see UnwrappedMask

    def takes(self, mask_mod, mask_causal: bool, mask_local: bool) -> bool:
        return (getattr(mask_mod, COLUMNS_ATTR, None) is not None and not mask_causal
                and not mask_local and self.swap_AB and self.qhead_per_kvhead_packgqa == 1)

    @cute.jit
    def apply_own(self, acc_S: cute.Tensor, batch_idx: cutlass.Int32, head_idx: cutlass.Int32,
                  m_block: cutlass.Int32, n_block: cutlass.Int32, thr_mma: cute.TiledMma,
                  mask_seqlen: cutlass.Constexpr[bool], mask_mod: cutlass.Constexpr,
                  aux_data: AuxData) -> None:
        K, slots, can_overflow = getattr(mask_mod, COLUMNS_ATTR)
        intervals, columns = aux_data.tensors[0], aux_data.tensors[1]
        # the tile is (tile_n, tile_m): coordinate 0 is the key, 1 the query row
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=True)
        cS = cute.make_identity_tensor((self.tile_n, self.tile_m))
        tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS), transpose=True)
        t0ScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cS),
                                                  transpose=True)
        # a thread's rows are its first row plus thread 0's row offsets (compile-time), as
        # FA4's masks take its columns
        row_base = _plain(m_block * self.tile_m + tScS_mn[0, 0][1])
        for c in cutlass.range_constexpr(cute.size(tScS_mn.shape[1])):
            col_g = _plain(tScS_mn[0, c][0] + n_block * self.tile_n)
            col = cutlass.min(col_g, self.seqlen_k - 1)  # padded keys read the last key
            los, lens = [], []
            for s in cutlass.range_constexpr(slots):
                # runs lie in [0, seqlen_q): rows past it fail the test by themselves
                los.append(columns[batch_idx, col, 2 * s] - row_base)
                ln = columns[batch_idx, col, 2 * s + 1]
                if const_expr(mask_seqlen):
                    ln = ln if col_g < self.seqlen_k else Int32(0)
                lens.append(ln)
            if const_expr(not (can_overflow and self.OVERFLOW_PATH)):
                self._test_runs(acc_S_mn, t0ScS_mn, c, los, lens, slots)
            elif lens[0] >= 0:
                self._test_runs(acc_S_mn, t0ScS_mn, c, los, lens, slots)
            else:  # more runs than slots (metadata in an unusual order): the rows' slots
                self._test_rows(acc_S_mn, t0ScS_mn, c, row_base, col_g, batch_idx, mask_seqlen,
                                K, intervals)

    @cute.jit
    def _test_rows(self, acc_S_mn: cute.Tensor, t0ScS_mn: cute.Tensor,
                   c: cutlass.Constexpr[int], row_base: cutlass.Int32, col_g: cutlass.Int32,
                   batch_idx: cutlass.Int32, mask_seqlen: cutlass.Constexpr[bool],
                   K: cutlass.Constexpr[int], intervals: cute.Tensor) -> None:
        # per score: the key against each of its rows' Interval Table slots
        for r in cutlass.range_constexpr(cute.size(t0ScS_mn.shape[0])):
            row_g = row_base + t0ScS_mn[r, 0][1]
            row = cutlass.min(row_g, self.seqlen_q - 1)
            vis = Uint32(col_g - intervals[batch_idx, row, 0]) < Uint32(
                intervals[batch_idx, row, 1])
            for m in cutlass.range_constexpr(1, K):
                vis = vis | (Uint32(col_g - intervals[batch_idx, row, 2 * m])
                             < Uint32(intervals[batch_idx, row, 2 * m + 1]))
            if const_expr(mask_seqlen):
                vis = vis & (row_g < self.seqlen_q)
            acc_S_mn[r, c] = acc_S_mn[r, c] if vis else -cutlass.Float32.inf

    @cute.jit
    def _test_runs(self, acc_S_mn: cute.Tensor, t0ScS_mn: cute.Tensor,
                   c: cutlass.Constexpr[int], los, lens, slots: cutlass.Constexpr[int]) -> None:
        # per score: the row against the key's runs, rows relative to the thread's first
        for r in cutlass.range_constexpr(cute.size(t0ScS_mn.shape[0])):
            row = t0ScS_mn[r, 0][1]
            vis = Uint32(row - los[0]) < Uint32(lens[0])
            for s in cutlass.range_constexpr(1, slots):
                vis = vis | (Uint32(row - los[s]) < Uint32(lens[s]))
            acc_S_mn[r, c] = acc_S_mn[r, c] if vis else -cutlass.Float32.inf


def _plain(v):
    """``v`` as a plain Int32. A value derived from a layout coordinate is CuTe's IntValue,
    which stays signed under ``Uint32(...)``: the unsigned interval test would compile to a
    signed compare and see every row before a run's start (wrong gradients on the H200).
    FA4 converts its mask_mod's indices the same way."""
    return utils.ssa_to_scalar(utils.scalar_to_ssa(v, Int32))


# the backward kernel builds its masks with ColumnIntervalMask during this package's calls
# (``fa4_lib.patched``: FA4 module, global, FA4's own value, ours)
PATCHES = (("flash_bwd_sm90", "AttentionMask", ("mask", "AttentionMask"), ColumnIntervalMask),)
