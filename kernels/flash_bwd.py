"""Descriptor-driven FlashAttention backward kernel in the CuTe DSL (nvidia-cutlass-dsl 4.8).

Three steps (``interface.flash_bwd`` runs them in order):

1. preprocess (``bwd_aux.BwdPreprocess``, one warp per row): ``dPsum[b, h, i] = sum_d
   dO[b, i, h, d] * O[b, i, h, d]`` in float32 (``D`` in the FlashAttention papers); ``dq_accum``
   float32 is zeroed.
2. main kernel (:class:`FlashBwd`): one CTA per (kv tile ``n_block``, batch, kv head). The CTA
   holds its K and V tile in shared memory and, for every query head of its GQA group, streams the
   q tiles that the backward Tile-State Bitmap row ``bwd_bitmap[b, n_block, :]`` marks non-empty
   (see ``compilemask/descriptor.py``):

   * ``00`` empty: skipped, Q/dO never loaded;
   * ``01`` full: no masking code (except on a ragged last kv tile, whose out-of-range columns the
     clipped Interval Table excludes);
   * ``11`` partial: the interval rows of the q tile are loaded into shared memory with the tile
     and every score is tested with ``start_k <= kv_idx < start_k + len_k`` OR-ed over the K slots
     (== ``uint32(kv_idx - start) < uint32(len)``), AND-ed with the fallback predicate for rows
     of fallback regions (the predicates of ``fallback.Fallback``).

   Per q tile: ``S = Q K^T``, mask, ``P = exp2(S * scale * log2e - LSE * log2e)`` (rows whose LSE
   is -inf, i.e. rows that see nothing, and rows past ``Sq`` get P = 0: no NaN),
   ``dP = dO V^T``, ``dS = P * (dP - dPsum)``; ``dV += P^T dO`` and ``dK += dS^T Q`` accumulate
   in registers across the q tiles *and* the query heads of the group (so dK/dV of a kv head are
   the sum over its query heads, written once, no atomics); ``dQ_tile = dS K`` is added to
   ``dq_accum`` in float32. The sm90 kernel (``bulk``) writes each warpgroup's half of the dQ
   tile to shared memory in accumulator-fragment order and a writer warp adds it with one
   ``cp.reduce.async.bulk ... add.f32`` (the TMA unit, asynchronous; dq_accum is
   [B, H, q tiles, tile_m * D] in that order), as FlashAttention 3/4 do. The mma.sync kernel
   (``KernelOptions.bwd_dq``) uses ``red2``, one ``red.global.add.v2.f32`` per pair of adjacent
   columns (sm_90), or ``atomic``, one ``atom.global.add.f32`` per element (before sm_90).
3. postprocess: ``dq = (dq_accum * softmax_scale).to(dtype)`` (``bwd_aux.DqPostprocess``
   gathers the ``bulk`` fragment order back into rows in the same pass; a torch expression for
   the mma.sync kernel's row-major dq_accum).

Two MMA paths share the schedule, the loads, the mask and the epilogue:

* ``arch=80`` (:class:`FlashBwd`, the portable path for sm80..sm89): ``mma.sync.m16n8k16`` fed
  by ``ldmatrix``, 8 warps; S = Q K^T, P and dS go through shared memory for the three GEMMs
  that need them transposed. Runs on sm80..sm90a; validated on the H200 (dQ/dK/dV vs the
  float32 reference).
* ``arch=90`` (:class:`kernels.flash_bwd_sm90.FlashBwdSm90`, the default on sm_90;
  ``KernelOptions(bwd_arch=80)`` picks the other): all five GEMMs on wgmma, warp-specialized
  (see that module).

The mma.sync kernel holds 2 stages of Q/dO (cp.async) so the next q tile loads during the
current one's math.
"""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from compilemask.contract.descriptor import is_partial

from .block_info import next_tile, tile_state
from .common import (
    SeqlenInfo,
    _acc_mn,
    _transpose_view,
    cp_async_4B,
    init_kernel,
    load_rows,
    tiled_copy_g2s_16B,
)
from .config import DTYPES, FlashBwdConfig
from .descriptor_tensors import DescriptorTensors
from .mask import SharedRows

__all__ = ["FlashBwd"]

LOG2E = math.log2(math.e)


def _warp_grid(m: int, n: int, num_warps: int) -> Optional[tuple]:
    """(warps_m, warps_n), ``warps_m * warps_n == num_warps``, tiling an (m, n) accumulator with
    warp tiles that are multiples of 16x16, with the smallest per-warp operand footprint
    ``m / warps_m + n / warps_n``; None if there is none."""
    best = None
    wm = 1
    while wm <= num_warps:
        wn = num_warps // wm
        if wm * wn == num_warps and m % (16 * wm) == 0 and n % (16 * wn) == 0:
            cost = m // wm + n // wn
            if best is None or cost < best[0]:
                best = (cost, wm, wn)
        wm *= 2
    return None if best is None else best[1:]


class FlashBwd:
    """FlashAttention backward over an Execution Descriptor (see the module docstring)."""

    def __init__(self, cfg: FlashBwdConfig, predicates: tuple = ()):
        init_kernel(self, cfg, predicates, "FlashBwd")
        self.num_threads = cfg.num_threads
        self.num_stages = 2  # Q, dO and the row metadata of the next q tile are prefetched
        nw = cfg.num_threads // 32
        self.warps_sdp = _warp_grid(cfg.tile_m, cfg.tile_n, nw)  # S, dP: (tile_m, tile_n)
        self.warps_dkv = _warp_grid(cfg.tile_n, cfg.head_dim, nw)  # dK, dV: (tile_n, D)
        self.warps_dq = _warp_grid(cfg.tile_m, cfg.head_dim, nw)  # dQ: (tile_m, D)

    # -- static checks ------------------------------------------------------------------------
    @staticmethod
    def smem_bytes(cfg: FlashBwdConfig) -> int:
        elt = 2
        return (
            elt * cfg.head_dim * 2 * (2 * cfg.tile_m + cfg.tile_n)
            + elt * 2 * cfg.tile_m * cfg.tile_n
            + 8 * cfg.tile_m * (2 + 2 * cfg.num_intervals + 1 + max(cfg.num_row_params, 1))
            + 8 * 1024
        )

    @staticmethod
    def can_implement(cfg: FlashBwdConfig) -> bool:
        if cfg.dtype not in DTYPES or cfg.dq_reduce not in ("atomic", "red2"):
            return False
        if cfg.deterministic or cfg.meta_async:  # sm90 only
            return False
        if cfg.head_dim not in (64, 128):
            return False
        if not 1 <= cfg.num_intervals <= 16:
            return False
        if cfg.num_threads % 32 or cfg.num_threads > 512:
            return False
        if cfg.tile_m % 64 or cfg.tile_n % 64:
            return False
        if cfg.tile_m > cfg.num_threads:  # one thread per q row loads the row's metadata
            return False
        nw = cfg.num_threads // 32
        if _warp_grid(cfg.tile_m, cfg.tile_n, nw) is None:
            return False
        if _warp_grid(cfg.tile_n, cfg.head_dim, nw) is None:
            return False
        if _warp_grid(cfg.tile_m, cfg.head_dim, nw) is None:
            return False
        rows_per_pass = cfg.num_threads // 8
        if cfg.tile_m % rows_per_pass and rows_per_pass % cfg.tile_m:
            return False
        if FlashBwd.smem_bytes(cfg) > 227 * 1024:
            return False
        return True

    # -- host side ----------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, H, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, D)
        mdO: cute.Tensor,  # (B, Sq, H, D)
        mLSE: cute.Tensor,  # (B, H, Sq) float32
        mdPsum: cute.Tensor,  # (B, H, Sq) float32
        mdQaccum: cute.Tensor,  # (B, Sq, H, D) float32, zeroed
        mdK: cute.Tensor,  # (B, Sk, Hkv, D)
        mdV: cute.Tensor,  # (B, Sk, Hkv, D)
        desc: DescriptorTensors,  # bitmap: the backward one, (B, n_n, W)
        softmax_scale: Float32,
        stream,
    ):
        if const_expr(mQ.element_type != self.dtype):
            raise TypeError("q dtype does not match the kernel config")
        dtype = self.dtype
        D = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        K = self.K
        R = max(self.cfg.num_row_params, 1)

        # ---- shared memory (64-element swizzled rows, ldmatrix friendly) -------------------
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        S = self.num_stages
        sQ_layout = cute.tile_to_shape(atom, (tm, D, S), (0, 1, 2))
        sKV_layout = cute.tile_to_shape(atom, (tn, D), (0, 1))
        sPdS_layout = cute.tile_to_shape(atom, (tm, tn), (0, 1))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sPdS_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sPdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * S], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, tm * S], 128]
            sInt: cute.struct.Align[cute.struct.MemRange[Int32, tm * 2 * K * S], 128]
            sFb: cute.struct.Align[cute.struct.MemRange[Int32, tm * S], 128]
            sRowP: cute.struct.Align[cute.struct.MemRange[Int32, tm * R * S], 128]

        # ---- global -> shared copies (16-byte cp.async, 8 threads per 64 columns) ---------
        gmem_tiled_copy = tiled_copy_g2s_16B(dtype, self.num_threads)

        # ---- MMAs (mma.sync m16n8k16) -----------------------------------------------------
        op = warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16))
        wm, wn = self.warps_sdp
        tiled_mma_sdp = cute.make_tiled_mma(op, (wm, wn, 1), permutation_mnk=(wm * 16, wn * 16, 16))
        wm, wn = self.warps_dkv
        tiled_mma_dkv = cute.make_tiled_mma(op, (wm, wn, 1), permutation_mnk=(wm * 16, wn * 16, 16))
        wm, wn = self.warps_dq
        tiled_mma_dq = cute.make_tiled_mma(op, (wm, wn, 1), permutation_mnk=(wm * 16, wn * 16, 16))

        grid = (
            cute.ceil_div(mK.shape[1], tn),
            cute.size(mK.shape[0]) * cute.size(mK.shape[2]),
            1,
        )
        self.kernel(
            mQ,
            mK,
            mV,
            mdO,
            mLSE,
            mdPsum,
            mdQaccum,
            mdK,
            mdV,
            desc,
            softmax_scale,
            sQ_layout,
            sKV_layout,
            sPdS_layout,
            gmem_tiled_copy,
            tiled_mma_sdp,
            tiled_mma_dkv,
            tiled_mma_dq,
            SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # -- device side --------------------------------------------------------------------------
    @cute.jit
    def _gemm(self, tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, s2r_A, s2r_B):
        """acc += A B with both operands streamed from shared memory via ldmatrix."""
        tCrA_v = s2r_A.retile(tCrA)
        tCrB_v = s2r_B.retile(tCrB)
        nk = cute.size(tCsA.shape[2])
        cute.copy(s2r_A, tCsA[None, None, 0], tCrA_v[None, None, 0])
        cute.copy(s2r_B, tCsB[None, None, 0], tCrB_v[None, None, 0])
        for k in cutlass.range_constexpr(nk):
            if const_expr(k + 1 < nk):  # load slice k+1 while slice k multiplies
                cute.copy(s2r_A, tCsA[None, None, k + 1], tCrA_v[None, None, k + 1])
                cute.copy(s2r_B, tCsB[None, None, k + 1], tCrB_v[None, None, k + 1])
            cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        desc: DescriptorTensors,
        softmax_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        gmem_tiled_copy: cute.TiledCopy,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        D = self.head_dim
        K = self.K
        tm, tn = self.tile_m, self.tile_n
        P = self.cfg.num_params
        R = self.cfg.num_row_params
        Rs = max(R, 1)
        tidx, _, _ = cute.arch.thread_idx()
        (
            n_block, batch_idx, head_kv, group, seqlen_q, seqlen_k, m_blocks, n_start, scale_log2,
            kv_ragged, mBitmapRow,
        ) = self._cta_coords(mQ, mK, desc.bitmap, softmax_scale)

        # ---- shared memory ------------------------------------------------------------------
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sQ = storage.sQ.get_tensor(sQ_layout)  # (tm, D, stage)
        sdO = storage.sdO.get_tensor(sQ_layout)  # (tm, D, stage)
        sP = storage.sP.get_tensor(sPdS_layout)
        sdS = storage.sdS.get_tensor(sPdS_layout)
        sLSE, sdPsum, sInt, sFb, sRowP = self._meta_smem(storage)
        sQt = _transpose_view(sQ)  # (D, tm, stage)
        sdOt = _transpose_view(sdO)  # (D, tm, stage)
        sKt = _transpose_view(sK)  # (D, tn)
        sPt = _transpose_view(sP)  # (tn, tm)
        sdSt = _transpose_view(sdS)  # (tn, tm)

        # ---- K, V tile: loaded once -----------------------------------------------------
        gmem_thr_copy, tQcQ = self._load_kv_tile(
            gmem_tiled_copy, mK, mV, sK, sV, batch_idx, head_kv, n_block, seqlen_k, tidx
        )
        tQsQ = gmem_thr_copy.partition_D(sQ)  # (CPY, CPY_M, CPY_K, stage)
        tdOsdO = gmem_thr_copy.partition_D(sdO)

        # ---- MMA partitions -----------------------------------------------------------------
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        thr_dkv = tiled_mma_dkv.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, D)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, D)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        acc_shape_S = thr_sdp.partition_shape_C((tm, tn))
        acc_shape_dQ = thr_dq.partition_shape_C((tm, D))

        tSrQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ[None, None, 0]))
        tSrK = thr_sdp.make_fragment_B(thr_sdp.partition_B(sK))
        tdPrdO = thr_sdp.make_fragment_A(thr_sdp.partition_A(sdO[None, None, 0]))
        tdPrV = thr_sdp.make_fragment_B(thr_sdp.partition_B(sV))
        tdVrPt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sPt))
        tdVrdOt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt[None, None, 0]))
        tdKrdSt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sdSt))
        tdKrQt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt[None, None, 0]))
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tdQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(sKt))

        ld = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        ldt = cute.make_copy_atom(
            warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
        )
        s2r_sdp_A = cute.make_tiled_copy_A(ld, tiled_mma_sdp).get_slice(tidx)
        s2r_sdp_B = cute.make_tiled_copy_B(ld, tiled_mma_sdp).get_slice(tidx)
        s2r_dkv_A = cute.make_tiled_copy_A(ldt, tiled_mma_dkv).get_slice(tidx)
        s2r_dkv_B = cute.make_tiled_copy_B(ldt, tiled_mma_dkv).get_slice(tidx)
        s2r_dq_A = cute.make_tiled_copy_A(ld, tiled_mma_dq).get_slice(tidx)
        s2r_dq_B = cute.make_tiled_copy_B(ldt, tiled_mma_dq).get_slice(tidx)
        tSsQ = s2r_sdp_A.partition_S(sQ)  # (CPY, M, K, stage)
        tSsK = s2r_sdp_B.partition_S(sK)
        tdPsdO = s2r_sdp_A.partition_S(sdO)  # (CPY, M, K, stage)
        tdPsV = s2r_sdp_B.partition_S(sV)
        tdVsPt = s2r_dkv_A.partition_S(sPt)
        tdVsdOt = s2r_dkv_B.partition_S(sdOt)  # (CPY, N, K, stage)
        tdKsdSt = s2r_dkv_A.partition_S(sdSt)
        tdKsQt = s2r_dkv_B.partition_S(sQt)  # (CPY, N, K, stage)
        tdQsdS = s2r_dq_A.partition_S(sdS)
        tdQsKt = s2r_dq_B.partition_S(sKt)
        r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        r2s = cute.make_tiled_copy_C(r2s_atom, tiled_mma_sdp).get_slice(tidx)
        tPsP = r2s.partition_D(sP)
        tdSsdS = r2s.partition_D(sdS)

        tScS_mn = _acc_mn(thr_sdp.partition_C(cute.make_identity_tensor((tm, tn))))
        n_rows = cute.size(tScS_mn, mode=[0])
        tdQcdQ = thr_dq.partition_C(cute.make_identity_tensor((tm, D)))

        # scalar params of the fallback predicate: once per CTA
        rP = cute.make_rmem_tensor((max(P, 1),), Int32)
        for p in cutlass.range_constexpr(P):
            rP[p] = desc.params[batch_idx, p]
        # raw row metadata of the prefetched q tile (thread tidx < tm owns row tidx)
        rMf = cute.make_rmem_tensor((2,), Float32)  # lse, dPsum
        rMi = cute.make_rmem_tensor((2 * K + 1 + Rs,), Int32)  # (start, len) * K, region, params

        # ---- work list: (query head g of the group, non-empty q tile m_block) ---------------
        # Masks are per sequence, so every query head walks the same q tiles.
        loads = (gmem_tiled_copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, rMf, rMi, mLSE, mdPsum, desc)
        sMeta = (sLSE, sdPsum, sInt, sFb, sRowP)
        has_work, first_m, head0 = self._work_start(
            loads, sMeta, mBitmapRow, m_blocks, batch_idx, head_kv, group, seqlen_q, tidx
        )
        g = Int32(0)
        m_block = first_m
        stage = Int32(0)

        while has_work:
            head = head0 + g
            m_start = m_block * tm
            m_next, g_next, has_next, need_mask = self._work_begin(
                loads, mBitmapRow, m_block, g, first_m, m_blocks, group, stage, kv_ragged,
                batch_idx, head0, seqlen_q, tidx,
            )

            # -- S = Q K^T, mask, P = exp(S - LSE) ----------------------------------------
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            acc_S.fill(0.0)
            self._gemm(
                tiled_mma_sdp, acc_S, tSrQ, tSrK, tSsQ[None, None, None, stage], tSsK,
                s2r_sdp_A, s2r_sdp_B,
            )
            acc_S_mn = _acc_mn(acc_S)
            if need_mask:
                rows = SharedRows(sInt[None, None, stage], sFb[None, stage],
                                  sRowP[None, None, stage], rP, self.K, self.cfg.num_params,
                                  self.cfg.num_row_params)
                self.mask.apply(acc_S_mn, tScS_mn, rows, m_start, n_start, desc.row_params,
                                batch_idx, seqlen_q - 1)
            for r in cutlass.range_constexpr(n_rows):
                lse_l2 = sLSE[tScS_mn[r, 0][0], stage]
                acc_S_mn[r, None] = cute.math.exp2(
                    acc_S_mn[r, None].load() * scale_log2 - lse_l2, fastmath=True
                )

            # -- dP = dO V^T, dS = P (dP - dPsum) -----------------------------------------
            acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
            acc_dP.fill(0.0)
            self._gemm(
                tiled_mma_sdp, acc_dP, tdPrdO, tdPrV, tdPsdO[None, None, None, stage], tdPsV,
                s2r_sdp_A, s2r_sdp_B,
            )
            acc_dP_mn = _acc_mn(acc_dP)
            for r in cutlass.range_constexpr(n_rows):
                dps = sdPsum[tScS_mn[r, 0][0], stage]
                acc_dP_mn[r, None] = acc_S_mn[r, None].load() * (acc_dP_mn[r, None].load() - dps)

            rP16 = cute.make_fragment_like(acc_S, self.dtype)
            rP16.store(acc_S.load().to(self.dtype))
            rdS16 = cute.make_fragment_like(acc_dP, self.dtype)
            rdS16.store(acc_dP.load().to(self.dtype))
            cute.copy(r2s, r2s.retile(rP16), tPsP)
            cute.copy(r2s, r2s.retile(rdS16), tdSsdS)
            cute.arch.barrier()

            # -- dV += P^T dO, dK += dS^T Q -----------------------------------------------
            self._gemm(
                tiled_mma_dkv, acc_dV, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt[None, None, None, stage],
                s2r_dkv_A, s2r_dkv_B,
            )
            self._gemm(
                tiled_mma_dkv, acc_dK, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt[None, None, None, stage],
                s2r_dkv_A, s2r_dkv_B,
            )

            # -- dQ += dS K (float32 atomics into dq_accum) ------------------------------
            acc_dQ = cute.make_rmem_tensor(acc_shape_dQ, Float32)
            acc_dQ.fill(0.0)
            self._gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, tdQsdS, tdQsKt, s2r_dq_A, s2r_dq_B)
            self._atomic_add_dq(
                acc_dQ, mdQaccum, thr_dq, tdQcdQ, batch_idx, head, m_block, m_start, seqlen_q
            )

            self._work_end(has_next, rMf, rMi, sMeta, stage, tidx)  # also sP, sdS are reused
            g = g_next
            m_block = m_next
            stage = 1 - stage
            has_work = has_next

        # ---- epilogue: dK *= scale; store dK, dV (rows < Sk) ------------------------------
        cute.arch.cp_async_wait_group(0)  # a CTA without q tiles still waits for its K/V loads
        self._store_dkv(
            acc_dK, acc_dV, mdK, mdV, thr_dkv, softmax_scale, batch_idx, head_kv, n_block,
            n_start, seqlen_k,
        )

    @cute.jit
    def _cta_coords(self, mQ, mK, mBitmap, softmax_scale):
        """The CTA's kv tile and (batch, kv head), the GQA group size, the sequence lengths, the
        number of q tiles, the kv tile's first row, the softmax scale in log2 units, whether the
        kv tile is ragged, and the CTA's backward bitmap row."""
        tm, tn = self.tile_m, self.tile_n
        n_block, bh, _ = cute.arch.block_idx()
        num_heads = mQ.shape[2]
        num_heads_kv = mK.shape[2]
        group = num_heads // num_heads_kv
        batch_idx = bh // num_heads_kv
        head_kv = bh - batch_idx * num_heads_kv
        seq = SeqlenInfo.create(batch_idx, mQ, mK)
        seqlen_q = seq.seqlen_q
        seqlen_k = seq.seqlen_k
        m_blocks = cute.ceil_div(seqlen_q, tm)
        n_start = n_block * tn
        scale_log2 = softmax_scale * LOG2E
        kv_ragged = n_start + tn > seqlen_k
        mBitmapRow = mBitmap[batch_idx, n_block, None]
        return (
            n_block, batch_idx, head_kv, group, seqlen_q, seqlen_k, m_blocks, n_start, scale_log2,
            kv_ragged, mBitmapRow,
        )

    @cute.jit
    def _meta_smem(self, storage):
        """The per-row metadata buffers of the q tiles, ``num_stages`` deep: LSE (log2 units),
        dPsum, intervals as (start, end), fallback slot, per-row params."""
        tm, K, S = self.tile_m, self.K, self.num_stages
        Rs = max(self.cfg.num_row_params, 1)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((tm, S), stride=(1, tm)))
        sdPsum = storage.sdPsum.get_tensor(cute.make_layout((tm, S), stride=(1, tm)))
        sInt = storage.sInt.get_tensor(
            cute.make_layout((tm, 2 * K, S), stride=(2 * K, 1, tm * 2 * K))
        )
        sFb = storage.sFb.get_tensor(cute.make_layout((tm, S), stride=(1, tm)))
        sRowP = storage.sRowP.get_tensor(cute.make_layout((tm, Rs, S), stride=(Rs, 1, tm * Rs)))
        return sLSE, sdPsum, sInt, sFb, sRowP

    @cute.jit
    def _load_kv_tile(
        self, gmem_tiled_copy, mK, mV, sK, sV, batch_idx, head_kv, n_block, seqlen_k, tidx
    ):
        """cp.async the CTA's K and V tile (rows past Sk zero-filled) and commit; returns the
        thread's copy slice and its identity partition of a (tile_m, D) q tile."""
        D = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        n_start = n_block * tn
        gmem_thr_copy = gmem_tiled_copy.get_slice(tidx)
        gK = cute.local_tile(mK[batch_idx, None, head_kv, None], (tn, D), (n_block, 0))
        gV = cute.local_tile(mV[batch_idx, None, head_kv, None], (tn, D), (n_block, 0))
        tKVcKV = gmem_thr_copy.partition_S(cute.make_identity_tensor((tn, D)))
        tQcQ = gmem_thr_copy.partition_S(cute.make_identity_tensor((tm, D)))
        load_rows(
            gmem_tiled_copy,
            gmem_thr_copy.partition_S(gK),
            gmem_thr_copy.partition_D(sK),
            tKVcKV,
            seqlen_k - n_start,
        )
        load_rows(
            gmem_tiled_copy,
            gmem_thr_copy.partition_S(gV),
            gmem_thr_copy.partition_D(sV),
            tKVcKV,
            seqlen_k - n_start,
        )
        cute.arch.cp_async_commit_group()
        return gmem_thr_copy, tQcQ

    @cute.jit
    def _atomic_add_dq(
        self, acc_dQ, mdQaccum, thr_dq, tdQcdQ, batch_idx, head, m_block, m_start, seqlen_q
    ):
        """dq_accum[rows < Sq of q tile m_block] += acc_dQ (float32 atomics)."""
        gdQ = cute.local_tile(
            mdQaccum[batch_idx, None, head, None], (self.tile_m, self.head_dim), (m_block, 0)
        )
        tdQg = thr_dq.partition_C(gdQ)
        if const_expr(self.cfg.dq_reduce == "red2"):
            # fragment elements 2p, 2p+1 are columns c, c+1 of one row (the accumulator layout's
            # innermost mode); c is even, so the pair is one 8-byte aligned v2.f32 reduction
            pair = cute.make_rmem_tensor((2,), Float32)
            for p in cutlass.range_constexpr(cute.size(acc_dQ) // 2):
                if tdQcdQ[2 * p][0] < seqlen_q - m_start:
                    pair[0] = acc_dQ[2 * p]
                    pair[1] = acc_dQ[2 * p + 1]
                    cute.arch.red(tdQg.iterator + cute.crd2idx(2 * p, tdQg.layout),
                                  pair.load(), op="add", dtype="f32", sem="relaxed", scope="gpu")
        else:
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                if tdQcdQ[i][0] < seqlen_q - m_start:
                    cute.arch.atomic_add(tdQg.iterator + cute.crd2idx(i, tdQg.layout), acc_dQ[i])

    @cute.jit
    def _store_dkv(
        self, acc_dK, acc_dV, mdK, mdV, thr_dkv, softmax_scale, batch_idx, head_kv, n_block,
        n_start, seqlen_k,
    ):
        """dK * scale and dV of kv tile n_block (rows < Sk) to global."""
        D = self.head_dim
        tn = self.tile_n
        gdK = cute.local_tile(mdK[batch_idx, None, head_kv, None], (tn, D), (n_block, 0))
        gdV = cute.local_tile(mdV[batch_idx, None, head_kv, None], (tn, D), (n_block, 0))
        tdKgdK = thr_dkv.partition_C(gdK)
        tdVgdV = thr_dkv.partition_C(gdV)
        tdKcdK = thr_dkv.partition_C(cute.make_identity_tensor((tn, D)))
        rdK = cute.make_fragment_like(acc_dK, self.dtype)
        rdK.store((acc_dK.load() * softmax_scale).to(self.dtype))
        rdV = cute.make_fragment_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        for i in cutlass.range_constexpr(cute.size(rdK)):
            if tdKcdK[i][0] < seqlen_k - n_start:
                tdKgdK[i] = rdK[i]
                tdVgdV[i] = rdV[i]

    @cute.jit
    def _next_work(self, mBitmapRow, m_block, g, first_m, m_blocks, group):
        """The work item after (query head g, q tile m_block): the next non-empty q tile of the
        same head, else the first one of the next head of the group. Returns
        (m_next, g_next, has_next)."""
        m_next = next_tile(mBitmapRow, m_block + 1, m_blocks)
        g_next = g
        if m_next >= m_blocks:
            g_next = g + 1
            m_next = first_m
        has_next = g_next < group
        return m_next, g_next, has_next

    @cute.jit
    def _work_start(
        self, loads, sMeta, mBitmapRow, m_blocks, batch_idx, head_kv, group, seqlen_q, tidx
    ):
        """The first work item (the group's first query head, its first non-empty q tile): its
        loads go to stage 0 and its metadata to shared memory. Returns (has_work, first_m,
        head0), head0 the group's first query head."""
        first_m = next_tile(mBitmapRow, Int32(0), m_blocks)
        has_work = first_m < m_blocks
        head0 = head_kv * group
        self._load_work(
            has_work, loads, sMeta, batch_idx, head0, None, first_m, 1, seqlen_q, tidx, True
        )
        return has_work, first_m, head0

    @cute.jit
    def _work_begin(
        self, loads, mBitmapRow, m_block, g, first_m, m_blocks, group, stage, kv_ragged,
        batch_idx, head0, seqlen_q, tidx,
    ):
        """Start work item (g, m_block): prefetch the next item into the other stage, wait for
        this one's loads. Returns (m_next, g_next, has_next, need_mask)."""
        m_next, g_next, has_next = self._next_work(
            mBitmapRow, m_block, g, first_m, m_blocks, group
        )
        self._load_work(
            has_next, loads, None, batch_idx, head0, g_next, m_next, stage, seqlen_q, tidx, False
        )
        cute.arch.cp_async_wait_group(1)
        cute.arch.barrier()
        state = tile_state(mBitmapRow, m_block)
        need_mask = is_partial(state) | kv_ragged
        return m_next, g_next, has_next, need_mask

    @cute.jit
    def _work_end(self, has_next, rMf, rMi, sMeta, stage, tidx):
        """End a work item: the prefetched item's metadata goes to the other stage, then every
        thread is done with this stage (refilled by the item after next)."""
        if has_next:
            sLSE, sdPsum, sInt, sFb, sRowP = sMeta
            self._store_meta(rMf, rMi, sLSE, sdPsum, sInt, sFb, sRowP, 1 - stage, tidx)
        cute.arch.barrier()

    @cute.jit
    def _load_work(
        self, pred, loads, sMeta, batch_idx, head0, g, m_block, cur_stage, seqlen_q, tidx,
        store_meta: cutlass.Constexpr,
    ):
        """If ``pred``: cp.async Q/dO of work item (query head ``head0 + g``, or ``head0`` when
        ``g`` is None; q tile ``m_block``) into stage ``1 - cur_stage`` and load its row
        metadata into registers (the cp.async group is committed either way). ``loads``: (tiled
        copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, rMf, rMi, mLSE, mdPsum, the descriptor tensors).
        With ``store_meta`` (the prologue) the metadata also goes to shared memory
        ``sMeta`` at once; otherwise the caller stores it after the current tile's compute."""
        gmem_tiled_copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, rMf, rMi, mLSE, mdPsum, desc = loads
        tm = self.tile_m
        if pred:
            self._load_q_do(
                gmem_tiled_copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, batch_idx,
                head0 if const_expr(g is None) else head0 + g, m_block, 1 - cur_stage, seqlen_q,
            )
        cute.arch.cp_async_commit_group()
        if pred:
            self._load_meta(
                rMf, rMi, mLSE, mdPsum, desc, batch_idx,
                head0 if const_expr(g is None) else head0 + g, m_block * tm + tidx, seqlen_q, tidx,
            )
            if const_expr(store_meta):
                sLSE, sdPsum, sInt, sFb, sRowP = sMeta
                self._store_meta(rMf, rMi, sLSE, sdPsum, sInt, sFb, sRowP, 1 - cur_stage, tidx)

    @cute.jit
    def _load_q_do(
        self, gmem_tiled_copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, batch_idx, head, m_block, stage,
        seqlen_q,
    ):
        """cp.async the Q and dO tiles ``m_block`` of query head ``head`` into ``stage``."""
        D = self.head_dim
        tm = self.tile_m
        tidx, _, _ = cute.arch.thread_idx()
        gmem_thr_copy = gmem_tiled_copy.get_slice(tidx)
        gQ = cute.local_tile(mQ[batch_idx, None, head, None], (tm, D), (m_block, 0))
        gdO = cute.local_tile(mdO[batch_idx, None, head, None], (tm, D), (m_block, 0))
        limit = seqlen_q - m_block * tm
        load_rows(
            gmem_tiled_copy, gmem_thr_copy.partition_S(gQ), tQsQ[None, None, None, stage], tQcQ,
            limit,
        )
        load_rows(
            gmem_tiled_copy, gmem_thr_copy.partition_S(gdO), tdOsdO[None, None, None, stage],
            tQcQ, limit,
        )

    @cute.jit
    def _load_meta(self, rMf, rMi, mLSE, mdPsum, desc, batch_idx, head, q_idx, seqlen_q, tidx):
        """Raw loads of row ``q_idx``'s metadata into registers (used only after the next
        tile's compute, so the loads overlap it). Rows past ``Sq`` get lse -inf, intervals
        (0, 0), region -1."""
        K = self.K
        R = self.cfg.num_row_params
        rMf[0] = -Float32.inf
        rMf[1] = Float32(0.0)
        for k in cutlass.range_constexpr(2 * K):
            rMi[k] = 0
        rMi[2 * K] = -1
        for a in cutlass.range_constexpr(R):
            rMi[2 * K + 1 + a] = 0
        if (tidx < self.tile_m) & (q_idx < seqlen_q):
            rMf[0] = mLSE[batch_idx, head, q_idx]
            rMf[1] = mdPsum[batch_idx, head, q_idx]
            for k in cutlass.range_constexpr(2 * K):
                rMi[k] = desc.intervals[batch_idx, q_idx, k]
            if const_expr(self.cfg.has_fallback):
                rMi[2 * K] = desc.row_region[batch_idx, q_idx]
                for a in cutlass.range_constexpr(R):
                    rMi[2 * K + 1 + a] = desc.row_params[batch_idx, q_idx, a]

    @cute.jit
    def _store_meta(self, rMf, rMi, sLSE, sdPsum, sInt, sFb, sRowP, stage, tidx):
        """Row metadata -> shared memory ``stage``: LSE in log2 units with -inf (a row that sees
        nothing, or past Sq) mapped to +inf so that P = exp2(s - inf) = 0; intervals as
        (start, end = start + len); the fallback slot of the row's region (-1 if none)."""
        K = self.K
        R = self.cfg.num_row_params
        if tidx < self.tile_m:
            sLSE[tidx, stage] = self._lse_log2(rMf[0])
            sdPsum[tidx, stage] = rMf[1]
            for k in cutlass.range_constexpr(K):
                st = rMi[2 * k]
                sInt[tidx, 2 * k, stage] = st
                sInt[tidx, 2 * k + 1, stage] = st + rMi[2 * k + 1]
            if const_expr(self.cfg.has_fallback):
                sFb[tidx, stage] = self._fallback_slot(rMi[2 * K])
                for a in cutlass.range_constexpr(R):
                    sRowP[tidx, a, stage] = rMi[2 * K + 1 + a]

    @cute.jit
    def _lse_log2(self, lse):
        """LSE in log2 units; -inf (a row that sees nothing, or past Sq) -> +inf, so that
        P = exp2(s - inf) = 0."""
        lse_l2 = lse * LOG2E
        if lse == -Float32.inf:
            lse_l2 = Float32.inf
        return lse_l2

    @cute.jit
    def _fallback_slot(self, region):
        """The fallback predicate slot of a row's region (-1: the interval test alone)."""
        fb = Int32(-1)
        for slot in cutlass.range_constexpr(len(self.cfg.fallback_regions)):
            if region == self.cfg.fallback_regions[slot]:
                fb = Int32(slot)
        return fb

    @cute.jit
    def _copy_meta(self, sMeta, stage, mLSE, mdPsum, desc, batch_idx, head, q_idx, seqlen_q,
                   tidx):
        """meta_async: thread ``tidx < tile_m`` starts 4-byte cp.async copies of row ``q_idx``'s
        raw metadata into shared memory ``stage`` (LSE, dPsum, the (start, len) slots, region,
        row params); :meth:`_finish_meta` completes them. No registers are held meanwhile."""
        K = self.K
        R = self.cfg.num_row_params
        sLSE, sdPsum, sInt, sFb, sRowP = sMeta
        mIntervals, mRowRegion, mRowParams = desc.intervals, desc.row_region, desc.row_params
        if (tidx < self.tile_m) & (q_idx < seqlen_q):
            cp_async_4B(sLSE.iterator + cute.crd2idx((tidx, stage), sLSE.layout),
                        mLSE.iterator + cute.crd2idx((batch_idx, head, q_idx), mLSE.layout))
            cp_async_4B(sdPsum.iterator + cute.crd2idx((tidx, stage), sdPsum.layout),
                        mdPsum.iterator + cute.crd2idx((batch_idx, head, q_idx), mdPsum.layout))
            for k in cutlass.range_constexpr(2 * K):
                cp_async_4B(
                    sInt.iterator + cute.crd2idx((tidx, k, stage), sInt.layout),
                    mIntervals.iterator + cute.crd2idx((batch_idx, q_idx, k), mIntervals.layout),
                )
            if const_expr(self.cfg.has_fallback):
                cp_async_4B(
                    sFb.iterator + cute.crd2idx((tidx, stage), sFb.layout),
                    mRowRegion.iterator + cute.crd2idx((batch_idx, q_idx), mRowRegion.layout),
                )
                for a in cutlass.range_constexpr(R):
                    cp_async_4B(
                        sRowP.iterator + cute.crd2idx((tidx, a, stage), sRowP.layout),
                        mRowParams.iterator
                        + cute.crd2idx((batch_idx, q_idx, a), mRowParams.layout),
                    )
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _finish_meta(self, sMeta, stage, q_idx, seqlen_q, tidx):
        """meta_async: wait for this thread's copies, then put its row in the form the item
        reads (as :meth:`_store_meta`): LSE in log2 units (-inf -> +inf), slots as (start,
        end), the region's fallback slot; rows past Sq get LSE +inf, empty slots, slot -1."""
        K = self.K
        R = self.cfg.num_row_params
        sLSE, sdPsum, sInt, sFb, sRowP = sMeta
        if tidx < self.tile_m:
            if q_idx < seqlen_q:
                cute.arch.cp_async_wait_group(0)
                sLSE[tidx, stage] = self._lse_log2(sLSE[tidx, stage])
                for k in cutlass.range_constexpr(K):
                    sInt[tidx, 2 * k + 1, stage] = sInt[tidx, 2 * k, stage] + sInt[
                        tidx, 2 * k + 1, stage]
                if const_expr(self.cfg.has_fallback):
                    sFb[tidx, stage] = self._fallback_slot(sFb[tidx, stage])
            else:
                sLSE[tidx, stage] = Float32.inf
                sdPsum[tidx, stage] = Float32(0.0)
                for k in cutlass.range_constexpr(2 * K):
                    sInt[tidx, k, stage] = 0
                if const_expr(self.cfg.has_fallback):
                    sFb[tidx, stage] = -1
                    for a in cutlass.range_constexpr(R):
                        sRowP[tidx, a, stage] = 0
