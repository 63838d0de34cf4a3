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

``compile_flash_fwd`` picks the kernel class: on sm90 with ``warp_specialized=True`` (the
default) :class:`kernels.flash_fwd_sm90.FlashFwdSm90` (TMA producer warp + wgmma consumer
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

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.utils import LayoutEnum

from compilemask.cache import CompileCache
from compilemask.descriptor import bitmap_shape, is_partial
from compilemask.env import cute_dsl_arch
from compilemask.options import KernelOptions

from .block_info import next_tile, tile_state
from .common import (  # noqa: F401  (SeqlenInfo and the layout helpers: re-exported)
    SeqlenInfo,
    _acc_mn,
    _layout_acc_frgA,
    _layout_acc_mn,
    _quad_allreduce,
    _transpose_view,
    compile_cache_key,
    compile_kernel,
    fake_descriptor_args,
    fake_tensor,
    fallback_predicates,
    init_kernel,
    tiled_copy_g2s_16B,
    tiled_copy_store_16B,
    wgmma,
)
from .mask import RegisterRows, column_pattern

log = logging.getLogger("compilemask")

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlashFwdConfig:
    """Everything that is compile-time for one kernel build (the compile-cache key)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    tile_m: int
    tile_n: int
    num_intervals: int  # K: interval slots per row
    has_fallback: bool = False
    fallback_hash: str = ""  # hash of the generated predicate source ("" without fallback)
    fallback_regions: tuple = ()  # region ids whose rows evaluate the fallback predicate
    num_params: int = 0  # P (scalar params the predicate takes, in order)
    num_row_params: int = 0  # R (per-row arrays the predicate takes, in order)
    arch: int = 90  # 80: mma.sync path (sm80-sm89); 90: wgmma path (sm90a)
    warp_specialized: bool = True  # sm90: TMA producer warp + wgmma consumers (flash_fwd_sm90)
    intra_wg_overlap: bool = True  # sm90 warp-specialized: softmax(i) overlaps P(i-1) V and QK(i)
    pingpong: bool = True  # sm90 warp-specialized, 2 consumer warpgroups: alternate their GEMMs
    # partial tiles: the interval test once per row, as a word of the thread's column bits, then
    # one bit test per element (KernelOptions.fwd_mask: "bits", the default on sm90, or "compare")
    mask_bits: bool = False

    @property
    def cutlass_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def num_threads(self) -> int:
        if self.arch < 90:
            return 128
        return (self.tile_m // 64 + (1 if self.warp_specialized else 0)) * 128


def default_tiles(head_dim: int, arch: int) -> tuple[int, int]:
    if arch >= 90:
        return (128, 128) if head_dim <= 128 else (64, 64)
    return (128, 64) if head_dim >= 128 else (128, 128)


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
        if cfg.dtype not in _DTYPES:
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
        mIntervals: cute.Tensor,  # (B, Sq, 2K) int32
        mBitmap: cute.Tensor,  # (B, n_m, W) int32
        mRowRegion: cute.Tensor,  # (B, Sq) int32
        mParams: cute.Tensor,  # (B, max(P,1)) int32
        mRowParams: cute.Tensor,  # (B, Sq, max(R,1)) int32
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
            mIntervals,
            mBitmap,
            mRowRegion,
            mParams,
            mRowParams,
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
        mIntervals: cute.Tensor,
        mBitmap: cute.Tensor,
        mRowRegion: cute.Tensor,
        mParams: cute.Tensor,
        mRowParams: cute.Tensor,
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
        mBitmapRow = mBitmap[batch_idx, m_block, None]

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
        row_data = self._load_row_data(
            mIntervals, mRowRegion, mParams, mRowParams, tScS_mn, batch_idx, m_start, seqlen_q
        )

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
                mRowParams, batch_idx,
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
    def _load_row_data(
        self, mIntervals, mRowRegion, mParams, mRowParams, tScS_mn, batch_idx, m_start, seqlen_q
    ):
        """The q tile's interval rows (as start/end), fallback slots and params, in registers."""
        K = self.K
        n_rows = cute.size(tScS_mn, mode=[0])
        rInt = cute.make_rmem_tensor((n_rows, 2 * K), Int32)
        rFb = cute.make_rmem_tensor((n_rows,), Int32)  # fallback slot of the row, -1 if none
        R = self.cfg.num_row_params
        P = self.cfg.num_params
        rRowP = cute.make_rmem_tensor((n_rows, max(R, 1)), Int32)
        rP = cute.make_rmem_tensor((max(P, 1),), Int32)
        for p in cutlass.range_constexpr(P):
            rP[p] = mParams[batch_idx, p]
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
                    st = mIntervals[batch_idx, q_idx, 2 * k]
                    rInt[r, 2 * k] = st
                    rInt[r, 2 * k + 1] = st + mIntervals[batch_idx, q_idx, 2 * k + 1]
                if const_expr(self.cfg.has_fallback):
                    region = mRowRegion[batch_idx, q_idx]
                    for slot in cutlass.range_constexpr(len(self.cfg.fallback_regions)):
                        if region == self.cfg.fallback_regions[slot]:
                            rFb[r] = slot
                    for k in cutlass.range_constexpr(R):
                        rRowP[r, k] = mRowParams[batch_idx, q_idx, k]

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


# ----------------------------------------------------------------------------------------------
# Compile cache + launch
# ----------------------------------------------------------------------------------------------
_COMPILE_CACHE = CompileCache("flash_fwd")


@dataclass
class Fallback:
    """Fallback predicates for the kernel: one generated source per fallback region.

    Rows whose ``row_region`` equals ``regions[s]`` AND the interval test with predicate ``s``
    (in partial tiles; their tiles are never full). Every predicate takes all ``num_params``
    scalar params and all ``num_row_params`` per-row arrays of the descriptor, in order.
    """

    sources: tuple
    regions: tuple
    num_params: int
    num_row_params: int
    name: str = "fallback_predicate"
    _fns: Optional[tuple] = field(default=None, repr=False)

    @property
    def hash(self) -> str:
        h = hashlib.sha256()
        for src, reg in zip(self.sources, self.regions):
            h.update(f"{reg}:".encode() + src.encode())
        return h.hexdigest()[:16]

    def functions(self) -> tuple:
        if self._fns is None:
            compile_predicate = _codegen().compile_predicate
            self._fns = tuple(compile_predicate(src, self.name) for src in self.sources)
        return self._fns

    @staticmethod
    def from_expr(expr, scalar_params=(), array_params=(), regions=(0,)) -> "Fallback":
        """One predicate shared by all ``regions``."""
        src = _codegen().predicate_source(expr, scalar_params, array_params)
        regions = tuple(int(r) for r in regions)
        return Fallback(
            sources=(src,) * len(regions),
            regions=regions,
            num_params=len(tuple(scalar_params)),
            num_row_params=len(tuple(array_params)),
        )

    @staticmethod
    def from_mask(mask) -> Optional["Fallback"]:
        """From a ``CompiledMask``: the rule of each fallback region; None without fallback."""
        regs = [r for r in mask.regions if r.fallback]
        if not regs:
            return None
        ps = _codegen().predicate_source
        return Fallback(
            sources=tuple(ps(r.rule, mask.scalar_params, mask.array_params) for r in regs),
            regions=tuple(int(r.index) for r in regs),
            num_params=len(mask.scalar_params),
            num_row_params=len(mask.array_params),
        )


def _codegen():
    try:
        from ..codegen import cute_predicate  # as compilemask.kernels
    except (ImportError, ValueError):
        from codegen import cute_predicate  # from the repository root
    return cute_predicate


def _arch_from_env_or_device() -> int:
    env = cute_dsl_arch()
    if env.startswith("sm_"):
        return int(env[3:5])
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor
    except Exception:
        pass
    return 90


def make_fake_args(cfg: FlashFwdConfig):
    """Fake (shape-symbolic) tensors matching the launch ABI, for compilation without a GPU."""
    dt = cfg.cutlass_dtype
    div = 128 // dt.width
    sym = cute.sym_int
    B, Sq, Sk, H, Hkv = sym(), sym(), sym(), sym(), sym()
    t = fake_tensor
    q = t(dt, (B, Sq, H, cfg.head_dim), div)
    k = t(dt, (B, Sk, Hkv, cfg.head_dim), div)
    v = t(dt, (B, Sk, Hkv, cfg.head_dim), div)
    o = t(dt, (B, Sq, H, cfg.head_dim), div)
    lse = t(Float32, (B, H, Sq), 1, 4)
    return (q, k, v, o, lse) + fake_descriptor_args(B, Sq, cfg.num_intervals)


def compile_flash_fwd(
    cfg: FlashFwdConfig,
    fallback: Optional[Fallback] = None,
    gpu_arch: Optional[str] = None,
    use_cache: bool = True,
    extra_options: str = "",
    options: Optional[KernelOptions] = None,
):
    """Compile (or fetch from the cache) the kernel for ``cfg``; shapes stay symbolic.

    ``gpu_arch`` (e.g. "sm_90a") compiles for that target without a GPU; by default the DSL's
    ``CUTE_DSL_ARCH`` or the detected device is used. ``options``: the caller's
    ``KernelOptions`` that ``cfg`` was made from (part of the cache key).
    """

    def build():
        preds = fallback_predicates(cfg, fallback, "flash_fwd", with_arch=True)
        if cfg.arch >= 90 and cfg.warp_specialized:
            from .flash_fwd_sm90 import FlashFwdSm90

            kernel = FlashFwdSm90(cfg, preds)
        else:
            kernel = FlashFwd(cfg, preds)
        return compile_kernel(kernel, make_fake_args(cfg), gpu_arch, extra_options)

    return _COMPILE_CACHE.get(compile_cache_key(cfg, gpu_arch, options), build, use_cache)


def _aligned(x):
    """The kernels assume a unit-stride head dim, 16-byte aligned rows and base (TMA / cp.async)."""
    el = x.element_size()
    ok = (
        x.stride(-1) == 1
        and all(s > 0 and (s * el) % 16 == 0 for s in x.stride()[:-1])
        and x.data_ptr() % 16 == 0
    )
    return x if ok else x.contiguous()


def flash_fwd(
    q,
    k,
    v,
    intervals,
    fwd_bitmap,
    row_region=None,
    params=None,
    row_params=None,
    *,
    tile_m: int,
    tile_n: int,
    softmax_scale: Optional[float] = None,
    fallback: Optional[Fallback] = None,
    arch: Optional[int] = None,
    warp_specialized: bool = True,
    intra_wg_overlap: bool = True,
    pingpong: bool = True,
    out=None,
    lse=None,
    options: Optional[KernelOptions] = None,
):
    """Masked attention forward. Returns ``(out [B,Sq,H,D], lse float32 [B,H,Sq])``.

    ``intervals`` int32 [B, Sq, K, 2]; ``fwd_bitmap`` int32 [B, ceil(Sq/tile_m), ceil(n_n/16)]
    computed for this (tile_m, tile_n); ``row_region`` int32 [B, Sq], ``params`` int32 [B, P],
    ``row_params`` int32 [B, Sq, R] are needed only with a ``fallback``. ``options``: the
    kernel variants (``fwd_mask``; None: ``default_options`` for the kernel's arch).
    """
    import torch

    B, Sq, H, D = q.shape
    _, Sk, Hkv, _ = k.shape
    if D not in (64, 128):
        raise NotImplementedError(f"head dim {D} not supported (64, 128)")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(f"dtype {q.dtype}")
    if H % Hkv != 0:
        raise ValueError("num heads must be a multiple of num kv heads")
    if k.shape != v.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("k/v shape or dtype mismatch")
    Kslots = intervals.shape[2]
    assert intervals.shape[:2] == (B, Sq) and intervals.shape[3] == 2
    n_m = -(-Sq // tile_m)
    n_n = -(-Sk // tile_n)
    assert fwd_bitmap.shape == bitmap_shape(B, n_m, n_n), (fwd_bitmap.shape, (B, n_m, n_n))
    if arch is None:
        arch = 90 if _arch_from_env_or_device() >= 90 else 80
    fwd_mask = (options or KernelOptions()).resolve(arch, Kslots).fwd_mask
    cfg = FlashFwdConfig(
        dtype="bf16" if q.dtype == torch.bfloat16 else "fp16",
        head_dim=D,
        tile_m=tile_m,
        tile_n=tile_n,
        num_intervals=Kslots,
        has_fallback=fallback is not None,
        fallback_hash=fallback.hash if fallback is not None else "",
        fallback_regions=fallback.regions if fallback is not None else (),
        num_params=fallback.num_params if fallback is not None else 0,
        num_row_params=fallback.num_row_params if fallback is not None else 0,
        arch=arch,
        warp_specialized=warp_specialized and arch >= 90,
        intra_wg_overlap=intra_wg_overlap,
        pingpong=pingpong and intra_wg_overlap,
        mask_bits=fwd_mask == "bits",
    )
    if not FlashFwd.can_implement(cfg):
        raise NotImplementedError(f"flash_fwd: unsupported configuration {cfg}")
    fn = compile_flash_fwd(cfg, fallback, options=options)
    dev = q.device
    q, k, v = (_aligned(x) for x in (q, k, v))
    if out is None:
        out = torch.empty_like(q)
    elif _aligned(out) is not out:
        raise ValueError("out must have a unit-stride head dim and 16-byte aligned strides")
    if lse is None:
        lse = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)
    iv = intervals.to(torch.int32).contiguous().view(B, Sq, 2 * Kslots)
    bm = fwd_bitmap.to(torch.int32).contiguous()
    if row_region is None:
        row_region = torch.full((B, Sq), -1, dtype=torch.int32, device=dev)
    rr = row_region.to(torch.int32).contiguous()
    if params is None or params.numel() == 0:
        params = torch.zeros(B, 1, dtype=torch.int32, device=dev)
    if row_params is None or row_params.numel() == 0:
        row_params = torch.zeros(B, Sq, 1, dtype=torch.int32, device=dev)
    pr = params.to(torch.int32).contiguous()
    rp = row_params.to(torch.int32).contiguous()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    fn(q, k, v, out, lse, iv, bm, rr, pr, rp, float(scale * math.log2(math.e)))
    return out, lse
