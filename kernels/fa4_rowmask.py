"""Partial tiles of FA4's sm90 forward masked a row at a time: the ``"rows"`` mask_mod variant.

FA4 calls a ``mask_mod`` once per score of a partial tile; for the interval test that is, per
score and slot, a subtraction, a compare and an or. Here the forward's mask is a subclass of
FA4's ``AttentionMask`` that, for a mask_mod carrying ``ROWS_ATTR``, reads each of the
thread's rows' K ``(start, len)`` slots once, turns them into one 32-bit keep mask per chunk of
the thread's columns (FA4's own R2P helpers, as its causal and window masks do) and selects with
it: per row K * a few operations instead of per score. The mask_mod itself stays the interval
test (the same function, so any call this class does not take keeps the exact per-score path:
the transposed backward, PackGQA, causal / local).

The class is ``flash_fwd_sm90.AttentionMask`` during this package's calls into FA4
(``PATCHES``, applied by ``fa4_lib.patched``); every mask_mod without the attribute runs FA4's
own code (a generated one without FA4's index wrap: ``fa4_unwrap.UnwrappedMask``, the base
class). ``tests/test_fa4_rowmask.py`` pins the
FA4 internals relied on (the module global, ``apply_mask``'s parameters, the R2P helpers).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from quack import layout_utils

from compilemask.codegen.cute_mask_mod import ROWS_ATTR
from compilemask.kernels import fa4_lib
from compilemask.kernels.fa4_unwrap import UnwrappedMask

__all__ = ["RowIntervalMask", "PATCHES"]

_mask = fa4_lib.module("mask")
AuxData = fa4_lib.module("utils").AuxData
mask_r2p_lambda, r2p_bitmask_above, r2p_bitmask_below, sm90_col_to_r2p_idx = (
    _mask.mask_r2p_lambda, _mask.r2p_bitmask_above, _mask.r2p_bitmask_below,
    _mask.sm90_col_to_r2p_idx)

# ROWS_ATTR on a generated mask_mod: (K, heads), the Interval Table's slots per row and the
# heads folded into its batch (row b * heads + h); aux_tensors[0] is the table, int32
# [B * heads, Sq, 2K]


@dataclass(frozen=True)
class RowIntervalMask(UnwrappedMask):
    def takes(self, mask_mod, mask_causal: bool, mask_local: bool) -> bool:
        return (getattr(mask_mod, ROWS_ATTR, None) is not None and not mask_causal
                and not mask_local and not self.swap_AB and self.qhead_per_kvhead_packgqa == 1)

    @cute.jit
    def apply_own(self, acc_S: cute.Tensor, batch_idx: cutlass.Int32, head_idx: cutlass.Int32,
                  m_block: cutlass.Int32, n_block: cutlass.Int32, thr_mma: cute.TiledMma,
                  mask_seqlen: cutlass.Constexpr[bool], mask_mod: cutlass.Constexpr,
                  aux_data: AuxData) -> None:
        K, heads = getattr(mask_mod, ROWS_ATTR)
        intervals = aux_data.tensors[0]
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS))
        # limits relative to the thread's first column: thread 0's column pattern (0, 1, 8, 9,
        # ...) is what the R2P element index assumes
        col_base = n_block * self.tile_n + tScS_mn[0][1]
        seqlenk_col_limit = self.seqlen_k - col_base
        b = batch_idx
        if const_expr(heads != 1):
            b = batch_idx * heads + head_idx
        max_row = self.seqlen_q - 1
        for r in cutlass.range_constexpr(cute.size(tScS_mn.shape[0])):
            # padded rows past seqlen_q read the last row (their results are discarded)
            row = cutlass.min(tScS_mn[r, 0][0] + m_block * self.tile_m, max_row)
            los, his = [], []
            for m in cutlass.range_constexpr(K):
                lo = intervals[b, row, 2 * m] - col_base
                hi = lo + intervals[b, row, 2 * m + 1]
                if const_expr(mask_seqlen):
                    hi = cutlass.min(hi, seqlenk_col_limit)
                # within [0, tile_n]: the element index of a column limit is then exact
                lo = cutlass.min(cutlass.max(lo, Int32(0)), Int32(self.tile_n))
                hi = cutlass.min(cutlass.max(hi, Int32(0)), Int32(self.tile_n))
                los.append(sm90_col_to_r2p_idx(lo))
                his.append(sm90_col_to_r2p_idx(hi))

            def keep(s: int, los=los, his=his):
                bits = r2p_bitmask_below(his[0], s) & r2p_bitmask_above(los[0], s)
                for m in cutlass.range_constexpr(1, K):
                    bits = bits | (r2p_bitmask_below(his[m], s) & r2p_bitmask_above(los[m], s))
                return bits

            mask_r2p_lambda(acc_S_mn[r, None], keep, rank1=True)


# the forward kernel builds its masks with RowIntervalMask during this package's calls
# (``fa4_lib.patched``: FA4 module, global, FA4's own value, ours)
PATCHES = (("flash_fwd_sm90", "AttentionMask", ("mask", "AttentionMask"), RowIntervalMask),)
