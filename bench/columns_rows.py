"""The column mask with every key through its Interval Table branch (a row's own test), for
``bench/columns_bisect.py rows``: a real module file, since the CuTe DSL reads a jit function's
source."""

import cutlass
import cutlass.cute as cute
from cutlass import Uint32, const_expr
from quack import layout_utils


@cute.jit
def all_rows(self, acc_S, batch_idx, m_block, n_block, thr_mma, mask_seqlen, K, slots,
              can_overflow, intervals, columns):
    acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=True)
    cS = cute.make_identity_tensor((self.tile_n, self.tile_m))
    tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS), transpose=True)
    t0ScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cS),
                                              transpose=True)
    row_base = m_block * self.tile_m + tScS_mn[0, 0][1]
    nrow = cute.size(tScS_mn.shape[0])
    for c in cutlass.range_constexpr(cute.size(tScS_mn.shape[1])):
        col_g = tScS_mn[0, c][0] + n_block * self.tile_n
        for r in cutlass.range_constexpr(nrow):
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
