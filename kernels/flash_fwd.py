"""Descriptor-driven FlashAttention forward kernel in the CuTe DSL (nvidia-cutlass-dsl 4.8).

One CTA computes one q tile (``tile_m`` rows) of one (batch, head); the grid is
``(n_m_blocks, B * H)``. The kernel walks the kv tiles of its q tile in the order of the forward
Tile-State Bitmap row ``fwd_bitmap[b, m_block, :]`` (see ``compilemask/descriptor.py``):

* ``00`` empty: skipped, K/V never loaded;
* ``01`` full: no masking code runs (except on the ragged last kv tile, whose out-of-range
  columns the Interval Table excludes because intervals are clipped to ``[0, Sk)``);
* ``11`` partial: every score is tested against the row's interval slots,
  ``OR_k uint32(kv_idx - start_k) < uint32(len_k)`` (K a compile-time constant, fully unrolled;
  evaluated as ``start_k <= kv_idx < end_k`` with ``end_k = start_k + len_k`` formed once per
  row when the q tile's interval rows are loaded),
  AND-ed with the fallback predicate for rows whose ``row_region`` is a fallback region.

The interval rows (and for fallback kernels the row region / per-row params) of the q tile are
loaded into registers once per CTA, before the kv loop.

``interface.compile_flash_fwd`` picks the kernel class: on sm90 with ``warp_specialized=True``
(the default) :class:`kernels.flash_fwd_sm90.FlashFwdSm90` (TMA producer warp + wgmma consumer
warpgroups, software-pipelined, pingpong); otherwise this module's :class:`FlashFwd`, whose
two MMA paths share the loads, the mask and the online softmax:

* ``arch=80`` (portable sm80-sm89 path): 4 warps, ``mma.sync.m16n8k16`` fed by ``ldmatrix``.
* ``arch=90`` (Hopper): ``tile_m // 64`` consumer warpgroups, ``wgmma`` (SASS ``HGMMA``):
  S = Q K^T with both operands from swizzled shared memory, O += P V with P from registers (RS).

K/V tiles are double buffered in shared memory and filled with ``cp.async`` (the load of the next
non-empty kv tile overlaps the compute of the current one).

Rows that see nothing get O = 0 and LSE = -inf. LSE is the natural-log log-sum-exp of the
*scaled* scores, float32 ``[B, H, Sq]``.
"""

from __future__ import annotations

import logging
import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.utils import LayoutEnum

from compilemask.contract.descriptor import is_partial

from .block_info import next_tile, tile_state
from .common import (
    SeqlenInfo,
    _acc_mn,
    _layout_acc_frgA,
    _quad_allreduce,
    _transpose_view,
    init_kernel,
    tiled_copy_g2s_16B,
    tiled_copy_store_16B,
    wgmma,
)
from .config import DTYPES, FlashFwdConfig
from .descriptor_tensors import DescriptorTensors
from .mask import RegisterRows, column_pattern

__all__ = ["FlashFwd", "make_sm90_tiled_mmas"]

log = logging.getLogger("compilemask")


def make_sm90_tiled_mmas(dtype, head_dim: int, tile_n: int, num_wg: int):
    """wgmma tiled MMAs of the forward: S = Q K^T (both operands from shared memory) and
    O += P V (P from registers), ``num_wg`` warpgroups of 64 q rows each."""
    tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        cute.nvgpu.OperandMajorMode.K,
        cute.nvgpu.OperandMajorMode.K,
        Float32,
        atom_layout_mnk=(num_wg, 1, 1),
        tiler_mn=(64, tile_n),
    )
    tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        cute.nvgpu.OperandMajorMode.K,
        cute.nvgpu.OperandMajorMode.MN,
        Float32,
        atom_layout_mnk=(num_wg, 1, 1),
        tiler_mn=(64, head_dim),
        a_source=warpgroup.OperandSource.RMEM,
    )
    return tiled_mma_qk, tiled_mma_pv


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
class FlashFwd:
    """FlashAttention forward over an Execution Descriptor (see module docstring)."""

    def __init__(self, cfg: FlashFwdConfig, predicates: tuple = ()):
        init_kernel(self, cfg, predicates, "FlashFwd")
        self.num_threads = (cfg.tile_m // 64) * 128 if cfg.arch >= 90 else 128
        self.is_sm90 = cfg.arch >= 90
        self.num_stages = 2

    # -- static checks ------------------------------------------------------------------------
    @staticmethod
    def smem_bytes(cfg: FlashFwdConfig) -> int:
        elt = 2
        return elt * cfg.head_dim * (cfg.tile_m + 2 * 2 * cfg.tile_n) + 3 * 1024

    @staticmethod
    def can_implement(cfg: FlashFwdConfig) -> bool:
        if cfg.dtype not in DTYPES:
            return False
        if cfg.head_dim not in (64, 128):
            return False  # 256 and others: NotImplementedError at the call site
        if cfg.num_intervals < 1 or cfg.num_intervals > 16:
            return False
        if cfg.arch >= 90:
            if cfg.tile_m % 64 != 0 or cfg.tile_m // 64 not in (1, 2, 3):
                return False
            if cfg.tile_n % 16 != 0 or cfg.tile_n > 256:
                return False
        else:
            if cfg.tile_m % 64 != 0 or cfg.tile_n % 16 != 0:
                return False
        threads = cfg.num_threads if not (cfg.arch >= 90 and cfg.warp_specialized) else 128
        rows_per_pass = threads // (64 // 8)
        if cfg.tile_m % rows_per_pass or cfg.tile_n % rows_per_pass:
            return False
        if FlashFwd.smem_bytes(cfg) > 227 * 1024:
            return False
        return True

    # -- host side ----------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, H, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, D)
        mO: cute.Tensor,  # (B, Sq, H, D)
        mLSE: cute.Tensor,  # (B, H, Sq) float32
        desc: DescriptorTensors,  # bitmap: the forward one, (B, n_m, W)
        softmax_scale_log2: Float32,
        stream,
    ):
        if const_expr(mQ.element_type != self.dtype):
            raise TypeError("q dtype does not match the kernel config")
        dtype = self.dtype
        D = self.head_dim
        # ---- shared memory layouts --------------------------------------------------------
        if const_expr(self.is_sm90):
            atom_q = warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, D), dtype
            )
            sQ_layout = cute.tile_to_shape(atom_q, (self.tile_m, D), order=(0, 1))
            sKV_layout = cute.tile_to_shape(
                atom_q, (self.tile_n, D, self.num_stages), order=(0, 1, 2)
            )
        else:
            smem_k_block = 64 if D % 64 == 0 else 32
            swz = 3 if smem_k_block == 64 else 2
            atom = cute.make_composed_layout(
                cute.make_swizzle(swz, 3, 3),
                0,
                cute.make_layout((8, smem_k_block), stride=(smem_k_block, 1)),
            )
            sQ_layout = cute.tile_to_shape(atom, (self.tile_m, D), (0, 1))
            sKV_layout = cute.tile_to_shape(atom, (self.tile_n, D, self.num_stages), (0, 1, 2))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]

        # ---- global <-> shared copies (16-byte cp.async; 8 threads cover 64 elements) ------
        gmem_tiled_copy_QKV = tiled_copy_g2s_16B(dtype, self.num_threads)
        gmem_tiled_copy_O = tiled_copy_store_16B(dtype, self.num_threads)

        # ---- MMAs -------------------------------------------------------------------------
        if const_expr(self.is_sm90):
            tiled_mma_qk, tiled_mma_pv = make_sm90_tiled_mmas(
                dtype, D, self.tile_n, self.tile_m // 64
            )
        else:
            nw = self.num_threads // 32
            tiled_mma_qk = cute.make_tiled_mma(
                warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)),
                (nw, 1, 1),
                permutation_mnk=(nw * 16, 16, 16),
            )
            tiled_mma_pv = tiled_mma_qk

        grid = (
            cute.ceil_div(mQ.shape[1], self.tile_m),
            cute.size(mQ.shape[0]) * cute.size(mQ.shape[2]),
            1,
        )
        self.kernel(
            mQ,
            mK,
            mV,
            mO,
            mLSE,
            desc,
            softmax_scale_log2,
            sQ_layout,
            sKV_layout,
            gmem_tiled_copy_QKV,
            gmem_tiled_copy_O,
            tiled_mma_qk,
            tiled_mma_pv,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # -- device side --------------------------------------------------------------------------
    @cute.jit
    def _load_kv(
        self,
        gmem_tiled_copy,
        tXgX: cute.Tensor,  # (CPY, CPY_N, CPY_K, n_block)
        tXsX: cute.Tensor,  # (CPY, CPY_N, CPY_K, stage)
        tXcX: cute.Tensor,  # identity (CPY, CPY_N, CPY_K)
        n_block: Int32,
        stage: Int32,
        seqlen_k: Int32,
    ):
        limit = seqlen_k - n_block * self.tile_n
        for r in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
            if tXcX[0, r, 0][0] < limit:
                cute.copy(gmem_tiled_copy, tXgX[None, r, None, n_block], tXsX[None, r, None, stage])
            else:
                tXsX[None, r, None, stage].fill(0)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        desc: DescriptorTensors,
        softmax_scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        gmem_tiled_copy_QKV: cute.TiledCopy,
        gmem_tiled_copy_O: cute.TiledCopy,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        D = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, bh, _ = cute.arch.block_idx()
        num_heads = mQ.shape[2]
        batch_idx = bh // num_heads
        head_idx = bh - batch_idx * num_heads
        head_kv = head_idx // (num_heads // mK.shape[2])
        seq = SeqlenInfo.create(batch_idx, mQ, mK)
        seqlen_q = seq.seqlen_q
        seqlen_k = seq.seqlen_k
        n_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        m_start = m_block * self.tile_m

        # ---- global tiles -------------------------------------------------------------------
        gQ = cute.local_tile(mQ[batch_idx, None, head_idx, None], (self.tile_m, D), (m_block, 0))
        gK = cute.local_tile(mK[batch_idx, None, head_kv, None], (self.tile_n, D), (None, 0))
        gV = cute.local_tile(mV[batch_idx, None, head_kv, None], (self.tile_n, D), (None, 0))
        mBitmapRow = desc.bitmap[batch_idx, m_block, None]

        # ---- shared memory ------------------------------------------------------------------
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        if const_expr(self.is_sm90):
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
            sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        else:
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sKV_layout)
            sV = storage.sV.get_tensor(sKV_layout)
        sVt = _transpose_view(sV)  # (D, tile_n, stage)

        gmem_thr_copy = gmem_tiled_copy_QKV.get_slice(tidx)
        tQgQ = gmem_thr_copy.partition_S(gQ)
        tQsQ = gmem_thr_copy.partition_D(sQ)
        tKgK = gmem_thr_copy.partition_S(gK)
        tKsK = gmem_thr_copy.partition_D(sK)
        tVgV = gmem_thr_copy.partition_S(gV)
        tVsV = gmem_thr_copy.partition_D(sV)
        tQcQ = gmem_thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, D)))
        tKVcKV = gmem_thr_copy.partition_S(cute.make_identity_tensor((self.tile_n, D)))

        # ---- MMA partitions -----------------------------------------------------------------
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((self.tile_m, D)), Float32)
        acc_O.fill(0.0)
        acc_shape_S = thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        tScS_mn = _acc_mn(tScS)
        tOcO_mn = _acc_mn(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, D))))
        n_rows = cute.size(tScS_mn, mode=[0])

        if const_expr(self.is_sm90):
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * 128)
            wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * 128)
            tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
            tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
            tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
            smem_copy = None
        else:
            tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
            tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK[None, None, 0]))
            tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt[None, None, 0]))
            atom_ld = cute.make_copy_atom(
                warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
            )
            atom_ldt = cute.make_copy_atom(
                warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
            )
            s2r_Q = cute.make_tiled_copy_A(atom_ld, tiled_mma_qk).get_slice(tidx)
            s2r_K = cute.make_tiled_copy_B(atom_ld, tiled_mma_qk).get_slice(tidx)
            s2r_V = cute.make_tiled_copy_B(atom_ldt, tiled_mma_pv).get_slice(tidx)
            smem_copy = (
                s2r_Q,
                s2r_Q.partition_S(sQ),
                s2r_Q.retile(tSrQ),
                s2r_K,
                s2r_K.partition_S(sK),
                s2r_K.retile(tSrK),
                s2r_V,
                s2r_V.partition_S(sVt),
                s2r_V.retile(tOrVt),
            )

        # ---- per-row descriptor data, loaded once per q tile ------------------------------
        row_data = self._load_row_data(desc, tScS_mn, batch_idx, m_start, seqlen_q)

        # ---- softmax state ------------------------------------------------------------------
        row_max = cute.make_rmem_tensor((n_rows,), Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        # ---- prologue: Q + first non-empty kv tile ------------------------------------------
        for r in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if tQcQ[0, r, 0][0] < seqlen_q - m_start:
                cute.copy(gmem_tiled_copy_QKV, tQgQ[None, r, None], tQsQ[None, r, None])
            else:
                tQsQ[None, r, None].fill(0)
        n_block = next_tile(mBitmapRow, Int32(0), n_blocks)
        if n_block < n_blocks:
            self._load_kv(gmem_tiled_copy_QKV, tKgK, tKsK, tKVcKV, n_block, Int32(0), seqlen_k)
            self._load_kv(gmem_tiled_copy_QKV, tVgV, tVsV, tKVcKV, n_block, Int32(0), seqlen_k)
        cute.arch.cp_async_commit_group()

        stage = Int32(0)
        while n_block < n_blocks:
            n_next = next_tile(mBitmapRow, n_block + 1, n_blocks)
            if n_next < n_blocks:
                self._load_kv(gmem_tiled_copy_QKV, tKgK, tKsK, tKVcKV, n_next, 1 - stage, seqlen_k)
                self._load_kv(gmem_tiled_copy_QKV, tVgV, tVsV, tKVcKV, n_next, 1 - stage, seqlen_k)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()

            # ---- S = Q K^T -----------------------------------------------------------------
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            if const_expr(self.is_sm90):
                wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, stage], True)
            else:
                acc_S.fill(0.0)
                self._mma_sync_qk(tiled_mma_qk, acc_S, tSrQ, tSrK, smem_copy, stage)

            # ---- mask ----------------------------------------------------------------------
            state = tile_state(mBitmapRow, n_block)
            acc_S_mn = self._mask_tile(
                acc_S, state, n_block, tScS_mn, row_data, m_start, seqlen_q, seqlen_k,
                desc.row_params, batch_idx,
            )

            # ---- online softmax --------------------------------------------------------------
            self._online_softmax(acc_S_mn, acc_O, row_max, row_sum, softmax_scale_log2)

            # ---- O += P V ------------------------------------------------------------------
            tOrP = self._p_operand(acc_S)
            if const_expr(self.is_sm90):
                wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, stage], False)
            else:
                self._mma_sync_pv(tiled_mma_pv, acc_O, tOrP, tOrVt, smem_copy, stage)

            cute.arch.barrier()  # all reads of this stage done before it is refilled
            n_block = n_next
            stage = 1 - stage

        cute.arch.cp_async_wait_group(0)

        # ---- epilogue: normalize, LSE, store -----------------------------------------------
        rO = self._finalize(
            acc_O, row_max, row_sum, softmax_scale_log2, tOcO_mn, mLSE, batch_idx, head_idx,
            m_start, seqlen_q,
        )
        cute.arch.barrier()  # sQ is reused as sO
        sO = sQ
        r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        r2s = cute.make_tiled_copy_C(r2s_atom, tiled_mma_pv).get_slice(tidx)
        cute.copy(r2s, r2s.retile(rO), r2s.partition_D(sO))
        cute.arch.barrier()
        gO = cute.local_tile(mO[batch_idx, None, head_idx, None], (self.tile_m, D), (m_block, 0))
        gmem_thr_copy_O = gmem_tiled_copy_O.get_slice(tidx)
        tOsO = gmem_thr_copy_O.partition_S(sO)
        tOgO = gmem_thr_copy_O.partition_D(gO)
        tOrO = cute.make_fragment_like(tOgO, self.dtype)
        cute.copy(gmem_tiled_copy_O, tOsO, tOrO)
        for r in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if tQcQ[0, r, 0][0] < seqlen_q - m_start:
                cute.copy(gmem_tiled_copy_O, tOrO[None, r, None], tOgO[None, r, None])

    @cute.jit
    def _load_row_data(self, desc, tScS_mn, batch_idx, m_start, seqlen_q):
        """The q tile's interval rows (as start/end), fallback slots and params, in registers
        (from the descriptor tensors ``desc``)."""
        K = self.K
        n_rows = cute.size(tScS_mn, mode=[0])
        rInt = cute.make_rmem_tensor((n_rows, 2 * K), Int32)
        rFb = cute.make_rmem_tensor((n_rows,), Int32)  # fallback slot of the row, -1 if none
        R = self.cfg.num_row_params
        P = self.cfg.num_params
        rRowP = cute.make_rmem_tensor((n_rows, max(R, 1)), Int32)
        rP = cute.make_rmem_tensor((max(P, 1),), Int32)
        for p in cutlass.range_constexpr(P):
            rP[p] = desc.params[batch_idx, p]
        for r in cutlass.range_constexpr(n_rows):
            q_idx = m_start + tScS_mn[r, 0][0]
            in_range = q_idx < seqlen_q
            for k in cutlass.range_constexpr(2 * K):
                rInt[r, k] = 0
            rFb[r] = -1
            for k in cutlass.range_constexpr(max(R, 1)):
                rRowP[r, k] = 0
            if in_range:
                # kept as (start, end = start + len): the test below is then two signed
                # compares per slot, equivalent to uint32(kv - start) < uint32(len) for
                # 0 <= start, len < 2^31 (the DSL's wrapping-free integer ops do not keep
                # the unsigned trick intact: LLVM turned it into a signed compare)
                for k in cutlass.range_constexpr(K):
                    st = desc.intervals[batch_idx, q_idx, 2 * k]
                    rInt[r, 2 * k] = st
                    rInt[r, 2 * k + 1] = st + desc.intervals[batch_idx, q_idx, 2 * k + 1]
                if const_expr(self.cfg.has_fallback):
                    region = desc.row_region[batch_idx, q_idx]
                    for slot in cutlass.range_constexpr(len(self.cfg.fallback_regions)):
                        if region == self.cfg.fallback_regions[slot]:
                            rFb[r] = slot
                    for k in cutlass.range_constexpr(R):
                        rRowP[r, k] = desc.row_params[batch_idx, q_idx, k]

        return rInt, rFb, rP, rRowP

    @cute.jit
    def _softmax_row(self, acc_S_mn, r: cutlass.Constexpr, row_max, row_sum, softmax_scale_log2):
        """Online softmax step of row ``r``: new running max and sum; returns the rescale factor
        of the row's old O and sum, and the row's probabilities (the caller stores them)."""
        s_row = acc_S_mn[r, None].load()
        mx = s_row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
        mx = _quad_allreduce(mx, cute.arch.fmax)
        m_new = cute.arch.fmax(row_max[r], mx)
        m_use = m_new
        if m_new == -Float32.inf:
            m_use = Float32(0.0)
        m_scaled = m_use * softmax_scale_log2
        scale_old = cute.math.exp2(row_max[r] * softmax_scale_log2 - m_scaled, fastmath=True)
        p_row = cute.math.exp2(s_row * softmax_scale_log2 - m_scaled, fastmath=True)
        row_sum[r] = row_sum[r] * scale_old + p_row.reduce(
            cute.ReductionOp.ADD, Float32.zero, 0
        )
        row_max[r] = m_new
        return scale_old, p_row

    @cute.jit
    def _softmax_rows(self, acc_S_mn, row_max, row_sum, row_scale, softmax_scale_log2):
        """Like ``_online_softmax`` but leaves O alone: the O rescale factors go to row_scale."""
        for r in cutlass.range_constexpr(cute.size(row_max)):
            scale_old, p_row = self._softmax_row(acc_S_mn, r, row_max, row_sum, softmax_scale_log2)
            row_scale[r] = scale_old
            acc_S_mn[r, None] = p_row

    @cute.jit
    def _rescale_O(self, acc_O, row_scale):
        acc_O_mn = _acc_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * row_scale[r]

    @cute.jit
    def _online_softmax(self, acc_S_mn, acc_O, row_max, row_sum, softmax_scale_log2):
        """Scores -> probabilities in place; rescales O and the running row sums."""
        acc_O_mn = _acc_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            scale_old, p_row = self._softmax_row(acc_S_mn, r, row_max, row_sum, softmax_scale_log2)
            acc_S_mn[r, None] = p_row
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * scale_old

    @cute.jit
    def _finalize(
        self,
        acc_O,
        row_max,
        row_sum,
        softmax_scale_log2,
        tOcO_mn,
        mLSE,
        batch_idx,
        head_idx,
        m_start,
        seqlen_q,
    ):
        """O /= row sum (0 for rows that saw nothing) and LSE (-inf for those rows); returns O
        in the output dtype (registers)."""
        acc_O_mn = _acc_mn(acc_O)
        LN2 = math.log(2.0)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            s = _quad_allreduce(row_sum[r], lambda a, b: a + b)
            inv = Float32(0.0)
            lse = -Float32.inf
            if s > 0.0:
                inv = cute.arch.rcp_approx(s)
                lse = (row_max[r] * softmax_scale_log2 + cute.math.log2(s, fastmath=True)) * LN2
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * inv
            q_idx = m_start + tOcO_mn[r, 0][0]
            if tOcO_mn[0, 0][1] == 0:
                if q_idx < seqlen_q:
                    mLSE[batch_idx, head_idx, q_idx] = lse
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        return rO

    @cute.jit
    def _p_operand(self, acc_S):
        """P (the softmaxed scores, in place in acc_S) in the input dtype, as the register A
        operand of O += P V."""
        rPt = cute.make_fragment_like(acc_S, self.dtype)
        rPt.store(acc_S.load().to(self.dtype))
        return cute.make_tensor(rPt.iterator, _layout_acc_frgA(rPt.layout))

    @cute.jit
    def _needs_mask(self, state, n_block, seqlen_k):
        """Partial tiles (``state`` 11) and the ragged last kv tile get the interval test."""
        return is_partial(state) | ((n_block + 1) * self.tile_n > seqlen_k)

    @cute.jit
    def _mask_tile(
        self, acc_S, state, n_block, tScS_mn, row_data, m_start, seqlen_q, seqlen_k, mRowParams,
        batch_idx,
    ):
        """(rows, cols) view of the score tile ``n_block``, masked where needed
        (:meth:`_needs_mask`)."""
        rInt, rFb, rP, rRowP = row_data
        acc_S_mn = _acc_mn(acc_S)
        if self._needs_mask(state, n_block, seqlen_k):
            rows = RegisterRows(rInt, rFb, rP, rRowP, self.cfg.num_params,
                                self.cfg.num_row_params)
            self.mask.apply(acc_S_mn, tScS_mn, rows, m_start, n_block * self.tile_n,
                            mRowParams, batch_idx, seqlen_q - 1,
                            pattern=self._bits_pattern(tScS_mn))
        return acc_S_mn

    def _bits_pattern(self, tScS_mn):
        """Trace time: the column pattern of the score fragment when ``mask_bits`` is on (and
        the fragment has one), else None: the per-element interval test."""
        if not self.cfg.mask_bits:
            return None
        pattern = column_pattern(tScS_mn)
        if pattern is None:
            log.warning("flash_fwd: mask_bits: score fragment columns %s have no bit pattern; "
                        "partial tiles keep the per-element interval test", tScS_mn.layout)
        return pattern

    @cute.jit
    def _mma_sync_qk(self, tiled_mma, acc_S, tSrQ, tSrK, smem_copy, stage):
        s2r_Q, tSsQ, tSrQ_v, s2r_K, tSsK, tSrK_v = smem_copy[:6]
        for k in cutlass.range_constexpr(cute.size(tSsQ.shape[2])):
            cute.copy(s2r_Q, tSsQ[None, None, k], tSrQ_v[None, None, k])
            cute.copy(s2r_K, tSsK[None, None, k, stage], tSrK_v[None, None, k])
        for k in cutlass.range_constexpr(cute.size(tSsQ.shape[2])):
            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

    @cute.jit
    def _mma_sync_pv(self, tiled_mma, acc_O, tOrP, tOrVt, smem_copy, stage):
        s2r_V, tOsVt, tOrVt_v = smem_copy[6:]
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.copy(s2r_V, tOsVt[None, None, k, stage], tOrVt_v[None, None, k])
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)
