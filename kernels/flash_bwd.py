"""Descriptor-driven FlashAttention backward kernel in the CuTe DSL (nvidia-cutlass-dsl 4.8).

Three steps (``flash_bwd`` runs them in order):

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
     of fallback regions (the predicates of ``flash_fwd.Fallback``).

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
* ``arch=90`` (:class:`FlashBwdSm90`, the default on sm_90; ``KernelOptions(bwd_arch=80)``
  picks the other): all five GEMMs on wgmma (SASS ``HGMMA``), warp-specialized. A producer warpgroup
  loads K and V once and Q, dO per q tile with TMA into a 2-stage mbarrier pipeline, and its
  second warp issues the dQ reduce-adds; two wgmma warpgroups compute, with one barrier between
  them per q tile. The score tile is computed transposed (S^T = K Q^T) so P^T and dS^T feed
  dV/dK as register A operands; S and dP are issued back to back and dV, dQ, dK overlap the
  pointwise math (the FlashAttention 3 schedule). The variants it replaced (cp.async loads,
  waiting for every GEMM, scalar dS stores, dQ adds issued by the compute warpgroups) are
  measured in ``bench/results/backward_variants_2026-11-29.md``: HSTU 32K backward on the H200
  81.7 ms (atomics) -> 58.7 (bulk) -> 43.8-47.7 (this kernel) -> 41.5 (with the CuTe
  pre/postprocess of ``bwd_aux``).

The mma.sync kernel holds 2 stages of Q/dO (cp.async) so the next q tile loads during the
current one's math.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.utils import LayoutEnum

from compilemask.cache import CompileCache
from compilemask.descriptor import bitmap_shape, bitmap_words, is_partial
from compilemask.options import (  # noqa: F401  (BITMAP_SMEM_WORDS, bitmap_fits_smem: re-exported)
    BITMAP_SMEM_WORDS,
    KernelOptions,
    bitmap_fits_smem,
    default_options,
    device_arch,
)

from .block_info import next_tile, tile_state
from .bwd_aux import AuxConfig, compile_aux
from .common import (
    SeqlenInfo,
    _acc_mn,
    _layout_acc_frgA,
    _transpose_view,
    bulk_reduce_add_f32,
    compile_cache_key,
    compile_kernel,
    cp_async_4B,
    fake_descriptor_args,
    fake_tensor,
    fallback_predicates,
    init_kernel,
    load_rows,
    select_modes,
    tiled_copy_g2s_16B,
    tma_partition,
    tma_pipeline,
    wgmma_issue,
)
from .flash_fwd import Fallback
from .mask import SharedRows
from .named_barrier import NamedBarrierBwd

log = logging.getLogger("compilemask")

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
LOG2E = math.log2(math.e)


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlashBwdConfig:
    """Everything that is compile-time for one backward kernel build (the compile-cache key)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    tile_m: int  # q rows per tile   (desc.bwd_tiles.tile_m)
    tile_n: int  # kv rows per tile  (desc.bwd_tiles.tile_n)
    num_intervals: int  # K
    has_fallback: bool = False
    fallback_hash: str = ""
    fallback_regions: tuple = ()
    num_params: int = 0
    num_row_params: int = 0
    arch: int = 80  # 80: mma.sync (runs on sm80..sm90a); 90: wgmma (sm90a)
    num_threads: int = 256
    # dQ accumulation: "atomic" (one float32 atomic per element), "red2" (red.global.add.v2.f32
    # on the two adjacent columns an accumulator fragment holds; sm_90 PTX): the mma.sync
    # kernel; "bulk" (fragment-ordered tile halves through shared memory, one bulk reduce-add
    # each): the sm90 kernel, which needs it
    dq_reduce: str = ""  # "": the kernel's own (bulk for arch 90, atomic for arch 80)
    # arch 90: the kv tiles add to each dQ tile in a fixed order (run-to-run identical
    # dQ) through per-tile semaphores (flash_bwd(deterministic=True))
    deterministic: bool = False
    # arch 90: the next q tile's row metadata goes global -> shared by per-thread cp.async
    # (finished in place before the item's barrier) instead of through registers held across
    # the whole item (KernelOptions.bwd_meta: "async", the default for K > 2, or "regs")
    meta_async: bool = False
    # arch 90: the CTA's bitmap row is copied to shared memory once (up to BITMAP_SMEM_WORDS
    # words: q tiles <= 16 x that), so that the per-item scans of the consumers, the producer
    # and the dQ writer read shared memory instead of rebuilding the row's global address from
    # kernel parameters at every item (flash_bwd sets it False for longer rows;
    # KernelOptions(bwd_bitmap="global") forces the global reads)
    bitmap_smem: bool = True

    def __post_init__(self):
        if not self.dq_reduce:
            object.__setattr__(self, "dq_reduce", "bulk" if self.arch >= 90 else "atomic")

    @property
    def cutlass_dtype(self):
        return _DTYPES[self.dtype]


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
        if cfg.dtype not in _DTYPES or cfg.dq_reduce not in ("atomic", "red2"):
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
        mIntervals: cute.Tensor,  # (B, Sq, 2K) int32
        mBitmap: cute.Tensor,  # (B, n_n, W) int32  backward bitmap
        mRowRegion: cute.Tensor,  # (B, Sq) int32
        mParams: cute.Tensor,  # (B, max(P,1)) int32
        mRowParams: cute.Tensor,  # (B, Sq, max(R,1)) int32
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
            mIntervals,
            mBitmap,
            mRowRegion,
            mParams,
            mRowParams,
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
        mIntervals: cute.Tensor,
        mBitmap: cute.Tensor,
        mRowRegion: cute.Tensor,
        mParams: cute.Tensor,
        mRowParams: cute.Tensor,
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
        ) = self._cta_coords(mQ, mK, mBitmap, softmax_scale)

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
            rP[p] = mParams[batch_idx, p]
        # raw row metadata of the prefetched q tile (thread tidx < tm owns row tidx)
        rMf = cute.make_rmem_tensor((2,), Float32)  # lse, dPsum
        rMi = cute.make_rmem_tensor((2 * K + 1 + Rs,), Int32)  # (start, len) * K, region, params

        # ---- work list: (query head g of the group, non-empty q tile m_block) ---------------
        # Masks are per sequence, so every query head walks the same q tiles.
        loads = (gmem_tiled_copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, rMf, rMi, mLSE, mdPsum,
                 mIntervals, mRowRegion, mRowParams)
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
                self.mask.apply(acc_S_mn, tScS_mn, rows, m_start, n_start, mRowParams,
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
        copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, rMf, rMi, mLSE, mdPsum, mIntervals, mRowRegion,
        mRowParams). With ``store_meta`` (the prologue) the metadata also goes to shared memory
        ``sMeta`` at once; otherwise the caller stores it after the current tile's compute."""
        (gmem_tiled_copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, rMf, rMi, mLSE, mdPsum, mIntervals,
         mRowRegion, mRowParams) = loads
        tm = self.tile_m
        if pred:
            self._load_q_do(
                gmem_tiled_copy, mQ, mdO, tQsQ, tdOsdO, tQcQ, batch_idx,
                head0 if const_expr(g is None) else head0 + g, m_block, 1 - cur_stage, seqlen_q,
            )
        cute.arch.cp_async_commit_group()
        if pred:
            self._load_meta(
                rMf, rMi, mLSE, mdPsum, mIntervals, mRowRegion, mRowParams, batch_idx,
                head0 if const_expr(g is None) else head0 + g, m_block * tm + tidx, seqlen_q,
                tidx,
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
    def _load_meta(
        self, rMf, rMi, mLSE, mdPsum, mIntervals, mRowRegion, mRowParams, batch_idx, head,
        q_idx, seqlen_q, tidx,
    ):
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
                rMi[k] = mIntervals[batch_idx, q_idx, k]
            if const_expr(self.cfg.has_fallback):
                rMi[2 * K] = mRowRegion[batch_idx, q_idx]
                for a in cutlass.range_constexpr(R):
                    rMi[2 * K + 1 + a] = mRowParams[batch_idx, q_idx, a]

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
    def _copy_meta(self, sMeta, stage, mLSE, mdPsum, mIntervals, mRowRegion, mRowParams,
                   batch_idx, head, q_idx, seqlen_q, tidx):
        """meta_async: thread ``tidx < tile_m`` starts 4-byte cp.async copies of row ``q_idx``'s
        raw metadata into shared memory ``stage`` (LSE, dPsum, the (start, len) slots, region,
        row params); :meth:`_finish_meta` completes them. No registers are held meanwhile."""
        K = self.K
        R = self.cfg.num_row_params
        sLSE, sdPsum, sInt, sFb, sRowP = sMeta
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


# ----------------------------------------------------------------------------------------------
# Hopper variant: the same schedule with wgmma (SASS HGMMA)
# ----------------------------------------------------------------------------------------------
class FlashBwdSm90(FlashBwd):
    """``FlashBwd`` with every GEMM on wgmma, warp-specialized (a TMA producer warpgroup with a
    dQ writer warp, two wgmma warpgroups).

    The score tile is computed transposed, ``S^T = K Q^T`` (kv rows on the warpgroups' M, q
    columns on N), so P^T and dS^T stay in registers as the A operand of ``dV += P^T dO`` and
    ``dK += dS^T Q`` (RS wgmma, dO / Q read MN-major from shared memory); dS^T is also stored to
    shared memory as dS for ``dQ = dS K`` (SS wgmma, K read MN-major). The mask and the LSE /
    dPsum are applied per column (q row)."""

    @staticmethod
    def can_implement(cfg: FlashBwdConfig) -> bool:
        if cfg.dtype not in _DTYPES or cfg.head_dim not in (64, 128):
            return False
        if not 1 <= cfg.num_intervals <= 16:
            return False
        if cfg.num_threads != 256 or cfg.tile_n != 128:  # two warpgroups x 64 kv rows
            return False
        if cfg.tile_m != 64:  # one warpgroup row of q; dQ splits the head dim over the two
            return False
        if cfg.dq_reduce != "bulk":  # the dQ writer warp issues bulk reduce-adds
            return False
        dq_bytes = cfg.tile_m * cfg.head_dim * 4
        ds_bytes = cfg.tile_m * cfg.tile_n * 2  # the second dS buffer
        bitmap_bytes = 4 * BITMAP_SMEM_WORDS if cfg.bitmap_smem else 0
        if (FlashBwd.smem_bytes(replace(cfg, dq_reduce="atomic")) + dq_bytes + ds_bytes
                + bitmap_bytes > 227 * 1024):
            return False
        return True

    def __init__(self, cfg: FlashBwdConfig, predicates: tuple = ()):
        init_kernel(self, cfg, predicates, "FlashBwdSm90")
        self.num_threads = cfg.num_threads
        self.num_stages = 2

    @cute.jit
    def __call__(
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
        mIntervals: cute.Tensor,
        mBitmap: cute.Tensor,
        mRowRegion: cute.Tensor,
        mParams: cute.Tensor,
        mRowParams: cute.Tensor,
        mdQsem: Optional[cute.Tensor],  # deterministic: (B, H, q tiles, 2) int32, zeros
        mRank: Optional[cute.Tensor],  # deterministic: (B, kv tiles, q tiles) int32
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
        S = self.num_stages
        n_bitmap_words = BITMAP_SMEM_WORDS if const_expr(self.cfg.bitmap_smem) else 1

        # ---- shared memory: wgmma-compatible swizzled layouts ------------------------------
        atom_d = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, D), dtype
        )
        atom_n = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, tn), dtype
        )
        sQ_layout = cute.tile_to_shape(atom_d, (tm, D, S), order=(0, 1, 2))
        sKV_layout = cute.tile_to_shape(atom_d, (tn, D), order=(0, 1))
        # one dS buffer per Q/dO stage: the item needs no barrier at its end
        sdS_layout = cute.tile_to_shape(atom_n, (tm, tn, S), order=(0, 1, 2))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * S], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, tm * S], 128]
            sInt: cute.struct.Align[cute.struct.MemRange[Int32, tm * 2 * K * S], 128]
            sFb: cute.struct.Align[cute.struct.MemRange[Int32, tm * S], 128]
            sRowP: cute.struct.Align[cute.struct.MemRange[Int32, tm * R * S], 128]
            # the dQ tile in accumulator-fragment order, one contiguous half per warpgroup
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, tm * D], 1024]
            # (full, empty) mbarriers of K/V (1 stage) and Q/dO (S stages)
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2 * S]
            sBitmap: cute.struct.Align[cute.struct.MemRange[Int32, n_bitmap_words], 128]

        Kmaj = cute.nvgpu.OperandMajorMode.K
        MNmaj = cute.nvgpu.OperandMajorMode.MN
        # S^T = K Q^T, dP^T = V dO^T: (tn, tm), warpgroup w owns kv rows [64w, 64w + 64)
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, Kmaj, Kmaj, Float32, atom_layout_mnk=(2, 1, 1), tiler_mn=(64, tm)
        )
        # dV += P^T dO, dK += dS^T Q: (tn, D), A from registers
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
            dtype,
            dtype,
            Kmaj,
            MNmaj,
            Float32,
            atom_layout_mnk=(2, 1, 1),
            tiler_mn=(64, D),
            a_source=warpgroup.OperandSource.RMEM,
        )
        # dQ = dS K: (tm, D), warpgroup w owns head-dim columns [w D/2, (w+1) D/2)
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, Kmaj, MNmaj, Float32, atom_layout_mnk=(1, 2, 1), tiler_mn=(64, D // 2),
        )

        grid = (
            cute.ceil_div(mK.shape[1], tn),
            cute.size(mK.shape[0]) * cute.size(mK.shape[2]),
            1,
        )
        # (B, S, H, D) -> (S, D, H, B): TMA boxes of (tile rows, D); rows past the sequence
        # are zero-filled by the TMA unit (as the cp.async path zero-fills them)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sQ_one = cute.select(sQ_layout, mode=[0, 1])
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            g2s, select_modes(mQ, [1, 3, 2, 0]), sQ_one, (tm, D))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            g2s, select_modes(mdO, [1, 3, 2, 0]), sQ_one, (tm, D))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            g2s, select_modes(mK, [1, 3, 2, 0]), sKV_layout, (tn, D))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            g2s, select_modes(mV, [1, 3, 2, 0]), sKV_layout, (tn, D))
        self.tx_qdo = 2 * cute.size_in_bytes(dtype, sQ_one)
        self.tx_kv = 2 * cute.size_in_bytes(dtype, sKV_layout)
        self.kernel(
            mQ, mK, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, mIntervals, mBitmap, mRowRegion,
            mParams, mRowParams, mdQsem, mRank, softmax_scale, tma_atom_Q, tma_Q,
            tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ_layout,
            sKV_layout, sdS_layout, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
            SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads + 128, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mIntervals: cute.Tensor,
        mBitmap: cute.Tensor,
        mRowRegion: cute.Tensor,
        mParams: cute.Tensor,
        mRowParams: cute.Tensor,
        mdQsem: Optional[cute.Tensor],
        mRank: Optional[cute.Tensor],
        softmax_scale: Float32,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        tma_dO: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        """Warpgroup 0 is the producer: its warp 0 issues the TMA loads (K and V once, then Q
        and dO of every work item into a 2-stage pipeline), its warp 1 is the dQ writer
        (``_dq_writer``). Warpgroups 1 and 2 compute (``_consumer``) and sync with each other
        through named barriers only; their threads < tile_m prefetch the next item's row
        metadata (LSE, dPsum, intervals) into registers."""
        D = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        S = self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        (
            n_block, batch_idx, head_kv, group, seqlen_q, seqlen_k, m_blocks, n_start, scale_log2,
            kv_ragged, mBitmapRow,
        ) = self._cta_coords(mQ, mK, mBitmap, softmax_scale)
        head0 = head_kv * group
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)

        # ---- shared memory, pipelines ---------------------------------------------------
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        if const_expr(self.cfg.bitmap_smem):
            # the bitmap row -> shared memory, visible after pipeline_init_wait's CTA barrier:
            # every scan below reads it there
            sBitmapRow = storage.sBitmap.get_tensor(cute.make_layout((BITMAP_SMEM_WORDS,)))
            for w in cutlass.range(tidx, bitmap_words(m_blocks), self.num_threads + 128,
                                   unroll=1):
                sBitmapRow[w] = mBitmapRow[w]
            mBitmapRow = sBitmapRow
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_threads // 32)
        pipe_kv = tma_pipeline(storage.mbar_kv, 1, producer, consumers, self.tx_kv)
        pipe_qdo = tma_pipeline(storage.mbar_qdo, S, producer, consumers, self.tx_qdo)
        pipeline.pipeline_init_arrive()
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (tm, D, stage)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        # (tm, tn, stage)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sLSE, sdPsum, sInt, sFb, sRowP = self._meta_smem(storage)
        sdQ = storage.sdQ.get_tensor(cute.make_layout((tm * D // 2, 2)))
        pipeline.pipeline_init_wait()

        first_m = next_tile(mBitmapRow, Int32(0), m_blocks)
        has_work = first_m < m_blocks
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            # ================================ producer ==================================
            cute.arch.setmaxregister_decrease(24)
            if warp_idx == 0:
                gK = cute.local_tile(tma_K[None, None, head_kv, batch_idx], (tn, D), (n_block, 0))
                gV = cute.local_tile(tma_V[None, None, head_kv, batch_idx], (tn, D), (n_block, 0))
                tKsK, tKgK = tma_partition(tma_atom_K, sK, gK)
                tVsV, tVgV = tma_partition(tma_atom_V, sV, gV)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                pipe_kv.producer_acquire(kv_state)
                cute.copy(tma_atom_K, tKgK, tKsK,
                          tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
                cute.copy(tma_atom_V, tVgV, tVsV,
                          tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S)
                g = Int32(0)
                m_block = first_m
                work = has_work
                while work:
                    head = head0 + g
                    gQ = cute.local_tile(tma_Q[None, None, head, batch_idx], (tm, D), (m_block, 0))
                    gdO = cute.local_tile(
                        tma_dO[None, None, head, batch_idx], (tm, D), (m_block, 0)
                    )
                    tQsQ, tQgQ = tma_partition(tma_atom_Q, sQ, gQ)
                    tdOsdO, tdOgdO = tma_partition(tma_atom_dO, sdO, gdO)
                    pipe_qdo.producer_acquire(q_state)
                    bar = pipe_qdo.producer_get_barrier(q_state)
                    cute.copy(tma_atom_Q, tQgQ, tQsQ[None, q_state.index], tma_bar_ptr=bar)
                    cute.copy(tma_atom_dO, tdOgdO, tdOsdO[None, q_state.index], tma_bar_ptr=bar)
                    q_state.advance()
                    m_block, g, work = self._next_work(
                        mBitmapRow, m_block, g, first_m, m_blocks, group
                    )
            if warp_idx == 1:
                self._dq_writer(has_work, first_m, mBitmapRow, m_blocks, group, head0,
                                batch_idx, n_block, sdQ, mdQaccum, mdQsem, mRank)
        else:
            # ================================ consumers =================================
            cute.arch.setmaxregister_increase(240)
            mma_tidx = tidx - 128
            cwg = wg_idx - 1
            f = self._mma_setup(sQ, sdO, sK, sV, sdS, sdQ, tiled_mma_sdp, tiled_mma_dkv,
                                tiled_mma_dq, cwg, mma_tidx)
            self._consumer(
                f, pipe_kv, pipe_qdo, has_work, first_m, mBitmapRow, m_blocks, group, head0,
                batch_idx, n_start, seqlen_q, kv_ragged, scale_log2, mParams, mLSE, mdPsum,
                mIntervals, mRowRegion, mRowParams, (sLSE, sdPsum, sInt, sFb, sRowP), cwg,
                mma_tidx,
            )
            self._store_dkv(
                f.acc_dK, f.acc_dV, mdK, mdV, f.thr_dkv, softmax_scale, batch_idx, head_kv,
                n_block, n_start, seqlen_k,
            )

    @cute.jit
    def _consumer(
        self, f, pipe_kv, pipe_qdo, has_work, first_m, mBitmapRow, m_blocks, group, head0,
        batch_idx, n_start, seqlen_q, kv_ragged, scale_log2, mParams, mLSE, mdPsum, mIntervals,
        mRowRegion, mRowParams, sMeta, cwg, tidx,
    ):
        """The two wgmma warpgroups, one barrier per work item: S and dP are issued back to
        back; dV runs while dS is computed; after the one barrier of the two warpgroups (dS
        complete in shared memory) dQ, then dK are issued; dQ goes to this warpgroup's half of
        sdQ for the dQ writer warp (``_dq_writer``), which issues the reduce-add. dS has one
        buffer per Q/dO stage, and the next item's row metadata is stored before the barrier,
        so nothing is rewritten that the other warpgroup may still read and the item needs no
        second barrier."""
        K = self.K
        P = self.cfg.num_params
        Rs = max(self.cfg.num_row_params, 1)
        tm = self.tile_m
        sLSE, sdPsum, sInt, sFb, sRowP = sMeta
        rP = cute.make_rmem_tensor((max(P, 1),), Int32)
        for p in cutlass.range_constexpr(P):
            rP[p] = mParams[batch_idx, p]
        rMf = cute.make_rmem_tensor((2,), Float32)
        rMi = cute.make_rmem_tensor((2 * K + 1 + Rs,), Int32)
        async_meta = self.cfg.meta_async
        regs_meta = not async_meta
        if has_work:  # the first item's row metadata -> stage 0 (threads < tile_m, one row each)
            if const_expr(async_meta):
                self._copy_meta(sMeta, 0, mLSE, mdPsum, mIntervals, mRowRegion, mRowParams,
                                batch_idx, head0, first_m * tm + tidx, seqlen_q, tidx)
                self._finish_meta(sMeta, 0, first_m * tm + tidx, seqlen_q, tidx)
            if const_expr(regs_meta):
                self._load_meta(rMf, rMi, mLSE, mdPsum, mIntervals, mRowRegion, mRowParams,
                                batch_idx, head0, first_m * tm + tidx, seqlen_q, tidx)
                self._store_meta(rMf, rMi, sLSE, sdPsum, sInt, sFb, sRowP, 0, tidx)
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Mma), number_of_threads=self.num_threads)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        g = Int32(0)
        m_block = first_m
        work = has_work
        while work:
            m_start = m_block * tm
            stage = q_state.index
            m_next, g_next, has_next = self._next_work(
                mBitmapRow, m_block, g, first_m, m_blocks, group
            )
            if has_next:  # registers (or cp.async) now, shared memory before the item's barrier
                if const_expr(async_meta):  # the previous item's barrier freed stage 1 - stage
                    self._copy_meta(sMeta, 1 - stage, mLSE, mdPsum, mIntervals, mRowRegion,
                                    mRowParams, batch_idx, head0 + g_next, m_next * tm + tidx,
                                    seqlen_q, tidx)
                if const_expr(regs_meta):
                    self._load_meta(rMf, rMi, mLSE, mdPsum, mIntervals, mRowRegion,
                                    mRowParams, batch_idx, head0 + g_next, m_next * tm + tidx,
                                    seqlen_q, tidx)
            state = tile_state(mBitmapRow, m_block)
            need_mask = is_partial(state) | kv_ragged
            pipe_qdo.consumer_wait(q_state)

            self._item(f, stage, need_mask, has_next, sMeta, rP, rMf, rMi, m_start, n_start,
                       mRowParams, batch_idx, seqlen_q, scale_log2, cwg, tidx, m_next * tm + tidx)
            pipe_qdo.consumer_release(q_state)  # every read of Q and dO has completed
            q_state.advance()
            g = g_next
            m_block = m_next
            work = has_next

    @cute.jit
    def _item(self, f, stage, need_mask, has_next, sMeta, rP, rMf, rMi, m_start,
              n_start, mRowParams, batch_idx, seqlen_q, scale_log2, cwg, tidx, q_next):
        """One work item of ``_consumer``: from the S and dP GEMMs to the dK GEMM's
        completion (Q/dO stage ``stage`` read through)."""
        sLSE, sdPsum, sInt, sFb, sRowP = sMeta
        n_cols = cute.size(f.tScS_mn, mode=[1])  # q rows of the thread
        # -- S^T = K Q^T and dP^T = V dO^T back to back; P^T = exp(S^T - LSE) -------------
        acc_S = cute.make_rmem_tensor(f.acc_shape_S, Float32)
        acc_dP = cute.make_rmem_tensor(f.acc_shape_S, Float32)
        wgmma_issue(f.tiled_mma_sdp, acc_S, f.tSrK, f.tSrQ[None, None, None, stage], True)
        wgmma_issue(f.tiled_mma_sdp, acc_dP, f.tdPrV, f.tdPrdO[None, None, None, stage],
                    True)
        warpgroup.wait_group(1)
        acc_S_mn = _acc_mn(acc_S)
        if need_mask:
            rows = SharedRows(sInt[None, None, stage], sFb[None, stage],
                              sRowP[None, None, stage], rP, self.K, self.cfg.num_params,
                              self.cfg.num_row_params)
            # S^T: kv along the rows, q along the columns
            self.mask.apply(acc_S_mn, f.tScS_mn, rows, m_start, n_start, mRowParams,
                            batch_idx, seqlen_q - 1, transposed=True)
        for c in cutlass.range_constexpr(n_cols):
            lse_l2 = sLSE[f.tScS_mn[0, c][1], stage]
            acc_S_mn[None, c] = cute.math.exp2(
                acc_S_mn[None, c].load() * scale_log2 - lse_l2, fastmath=True
            )
        rP16 = cute.make_fragment_like(acc_S, self.dtype)
        rP16.store(acc_S.load().to(self.dtype))
        tdVrP = cute.make_tensor(rP16.iterator, _layout_acc_frgA(rP16.layout))

        # -- dS^T = P^T (dP^T - dPsum) -> sdS[stage] (as dS); dV += P^T dO in flight ------
        warpgroup.wait_group(0)
        acc_dP_mn = _acc_mn(acc_dP)
        for c in cutlass.range_constexpr(n_cols):
            dps = sdPsum[f.tScS_mn[0, c][1], stage]
            acc_dP_mn[None, c] = acc_S_mn[None, c].load() * (acc_dP_mn[None, c].load() - dps)
        rdS16 = cute.make_fragment_like(acc_dP, self.dtype)
        rdS16.store(acc_dP.load().to(self.dtype))
        cute.copy(f.r2s, f.r2s.retile(rdS16), f.tdSsdSt[None, None, None, stage])
        wgmma_issue(f.tiled_mma_dkv, f.acc_dV, tdVrP, f.tdVrdOt[None, None, None, stage],
                    False)
        if has_next:  # every read of the other metadata stage was before the last barrier
            if const_expr(self.cfg.meta_async):
                self._finish_meta(sMeta, 1 - stage, q_next, seqlen_q, tidx)
            else:
                self._store_meta(rMf, rMi, sLSE, sdPsum, sInt, sFb, sRowP, 1 - stage, tidx)
        cute.arch.fence_view_async_shared()  # dS (generic proxy) -> the dQ wgmma's reads
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.Mma), number_of_threads=self.num_threads)

        # -- dQ = dS K (both warpgroups' dS), then dK += dS^T Q ---------------------------
        acc_dQ = cute.make_rmem_tensor(f.acc_shape_dQ, Float32)
        wgmma_issue(f.tiled_mma_dq, acc_dQ, f.tdQrdS[None, None, None, stage], f.tdQrKt,
                    True)
        warpgroup.wait_group(1)  # dV
        tdKrdS = cute.make_tensor(rdS16.iterator, _layout_acc_frgA(rdS16.layout))
        wgmma_issue(f.tiled_mma_dkv, f.acc_dK, tdKrdS, f.tdKrQt[None, None, None, stage],
                    False)
        warpgroup.wait_group(1)  # dQ
        # this warpgroup's dQ half -> sdQ once the writer has issued the last one's reduce
        cute.arch.barrier(barrier_id=int(NamedBarrierBwd.DqEmpty) + cwg, number_of_threads=128 + 32)
        cute.autovec_copy(
            cute.make_tensor(acc_dQ.iterator, cute.make_layout(f.tdQsdQ.shape)), f.tdQsdQ
        )
        cute.arch.fence_view_async_shared()  # generic-proxy writes -> the TMA unit's reads
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.DqFull) + cwg,
                                 number_of_threads=128 + 32)
        warpgroup.wait_group(0)  # dK

    @cute.jit
    def _dq_writer(self, has_work, first_m, mBitmapRow, m_blocks, group, head0, batch_idx,
                   n_block, sdQ, mdQaccum, mdQsem, mRank):
        """The dQ writer warp (warp 1): per work item
        and dQ half w, it frees sdQ half w once the previous reduce-add has read it (named
        barrier 6 + w), waits until warpgroup w has written it (4 + w), and issues one bulk
        reduce-add of the half into dq_accum. deterministic: before adding, lane 0 waits until
        the half's semaphore equals this CTA's rank among the column's non-empty kv tiles,
        and after the adds have completed it counts them (release). Waits only go to lower
        n_block, which were launched earlier (the grid's fastest index), so they end."""
        half = self.tile_m * self.head_dim // 2
        lane = cute.arch.lane_idx()
        g = Int32(0)
        m_block = first_m
        work = has_work
        while work:
            head = head0 + g
            for w in cutlass.range_constexpr(2):
                if const_expr(not self.cfg.deterministic):
                    if lane == 0:
                        cute.arch.cp_async_bulk_wait_group(1 - w, read=True)
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrierBwd.DqEmpty) + w,
                                         number_of_threads=128 + 32)
            for w in cutlass.range_constexpr(2):
                cute.arch.barrier(barrier_id=int(NamedBarrierBwd.DqFull) + w,
                                  number_of_threads=128 + 32)
                if lane == 0:
                    gdQ = cute.local_tile(mdQaccum[batch_idx, head, m_block, None], (half,), (w,))
                    if const_expr(self.cfg.deterministic):
                        sem = mdQsem.iterator + cute.crd2idx((batch_idx, head, m_block, w),
                                                             mdQsem.layout)
                        rank = mRank[batch_idx, n_block, m_block]
                        done = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
                        while done != rank:
                            done = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
                    bulk_reduce_add_f32(sdQ[None, w].iterator, gdQ.iterator, half * 4)
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.cfg.deterministic):
                if lane == 0:  # the adds are complete (not only read): count them
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    for w in cutlass.range_constexpr(2):
                        sem = mdQsem.iterator + cute.crd2idx((batch_idx, head, m_block, w),
                                                             mdQsem.layout)
                        cute.arch.red(sem, Int32(1), op="add", dtype="s32", sem="release",
                                      scope="gpu")
            m_block, g, work = self._next_work(mBitmapRow, m_block, g, first_m, m_blocks, group)
        if lane == 0:  # sdQ stays until the last reduce-add has read it
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _mma_setup(self, sQ, sdO, sK, sV, sdS, sdQ, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
                   wg_idx, tidx):
        """The wgmma operand descriptors of warpgroup ``wg_idx`` and the partitions of thread
        ``tidx`` (both counted among the wgmma warpgroups), the zeroed dK/dV accumulators, the
        dS and dQ shared-memory stores: a namespace for ``_item``."""
        D = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        f = SimpleNamespace()
        f.sQ, f.sdO, f.sdQ = sQ, sdO, sdQ
        sQt = _transpose_view(sQ)  # (D, tm, stage)
        sdOt = _transpose_view(sdO)  # (D, tm, stage)
        sKt = _transpose_view(sK)  # (D, tn)
        sdSt = _transpose_view(sdS)  # (tn, tm)
        f.tiled_mma_sdp, f.tiled_mma_dkv = tiled_mma_sdp, tiled_mma_dkv
        f.tiled_mma_dq = tiled_mma_dq
        wg_sdp = tiled_mma_sdp.get_slice(wg_idx * 128)
        wg_dkv = tiled_mma_dkv.get_slice(wg_idx * 128)
        wg_dq = tiled_mma_dq.get_slice(wg_idx * 128)
        f.tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        f.tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))  # (..., stage)
        f.tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        f.tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))  # (..., stage)
        f.tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(sdOt))  # (..., stage)
        f.tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt))  # (..., stage)
        f.tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        f.tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))

        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        f.thr_dkv = tiled_mma_dkv.get_slice(tidx)
        f.thr_dq = tiled_mma_dq.get_slice(tidx)
        f.acc_dK = cute.make_rmem_tensor(f.thr_dkv.partition_shape_C((tn, D)), Float32)
        f.acc_dV = cute.make_rmem_tensor(f.thr_dkv.partition_shape_C((tn, D)), Float32)
        f.acc_dK.fill(0.0)
        f.acc_dV.fill(0.0)
        f.acc_shape_S = thr_sdp.partition_shape_C((tn, tm))
        f.acc_shape_dQ = f.thr_dq.partition_shape_C((tm, D))
        # each thread holds dS^T at (kv row, q col pair); stmatrix.trans writes the 8x8 blocks
        # transposed, so sdS rows (q) get 16-byte runs along kv
        r2s_atom = cute.make_copy_atom(
            warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype
        )
        f.r2s = cute.make_tiled_copy_C(r2s_atom, tiled_mma_sdp).get_slice(tidx)
        f.tdSsdSt = f.r2s.partition_D(sdSt)

        f.tScS_mn = _acc_mn(thr_sdp.partition_C(cute.make_identity_tensor((tn, tm))))
        # thread t of warpgroup w writes fragment elements 4k..4k+3 to half w at 512k + 4t
        r2s_dq = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout((128, 2)),
            cute.make_layout(4),
        )
        f.tdQsdQ = r2s_dq.get_slice(tidx).partition_D(sdQ)
        return f


# ----------------------------------------------------------------------------------------------
# Compile cache + launch
# ----------------------------------------------------------------------------------------------
_COMPILE_CACHE = CompileCache("flash_bwd")


def make_fake_args(cfg: FlashBwdConfig):
    """Fake (shape-symbolic) tensors matching the launch ABI, for compilation without a GPU."""
    dt = cfg.cutlass_dtype
    div = 128 // dt.width
    sym = cute.sym_int
    B, Sq, Sk, H, Hkv = sym(), sym(), sym(), sym(), sym()
    D = cfg.head_dim
    t = fake_tensor
    q = t(dt, (B, Sq, H, D), div)
    k = t(dt, (B, Sk, Hkv, D), div)
    v = t(dt, (B, Sk, Hkv, D), div)
    do = t(dt, (B, Sq, H, D), div)
    lse = t(Float32, (B, H, Sq), 1, 4)
    dpsum = t(Float32, (B, H, Sq), 1, 4)
    if cfg.dq_reduce == "bulk":  # (B, H, q tiles, tile in fragment order)
        dq_accum = t(Float32, (B, H, sym(), cfg.tile_m * D), 4, 16)
    else:
        dq_accum = t(Float32, (B, Sq, H, D), 4, 16)
    dk = t(dt, (B, Sk, Hkv, D), div)
    dv = t(dt, (B, Sk, Hkv, D), div)
    args = (q, k, v, do, lse, dpsum, dq_accum, dk, dv) + fake_descriptor_args(
        B, Sq, cfg.num_intervals
    )
    if cfg.arch >= 90:  # the dQ semaphores and kv-tile ranks of the deterministic kernel
        det = cfg.deterministic
        args += (t(Int32, (B, H, sym(), 2), 1, 4) if det else None,
                 t(Int32, (B, sym(), sym()), 1, 4) if det else None)
    return args


def compile_flash_bwd(
    cfg: FlashBwdConfig,
    fallback: Optional[Fallback] = None,
    gpu_arch: Optional[str] = None,
    use_cache: bool = True,
    extra_options: str = "",
    options: Optional[KernelOptions] = None,
):
    """Compile (or fetch from the cache) the backward kernel for ``cfg``; shapes stay symbolic.

    ``gpu_arch`` (e.g. "sm_90a") compiles for that target without a GPU. ``options``: the
    caller's ``KernelOptions`` that ``cfg`` was made from (part of the cache key)."""

    def build():
        preds = fallback_predicates(cfg, fallback, "flash_bwd")
        kernel = (FlashBwdSm90 if cfg.arch >= 90 else FlashBwd)(cfg, preds)
        return compile_kernel(kernel, make_fake_args(cfg), gpu_arch, extra_options)

    return _COMPILE_CACHE.get(compile_cache_key(cfg, gpu_arch, options), build, use_cache)


@functools.lru_cache(maxsize=None)
def _dq_fragment_order(tile_m: int, head_dim: int, device):
    """For the ``bulk`` dQ: ``order[row * D + col]`` = where a dq_accum tile keeps (row, col).

    Warpgroup w owns columns [w D/2, (w+1) D/2) of the (tile_m, D) tile and writes its wgmma
    accumulator fragments (CUTLASS's sm90 C layout: thread t, element e = 4k + v sits at row
    16 (t // 32) + (t % 32) // 4 + 8 (v // 2), column 8k + 2 (t % 4) + v % 2) as 16-byte
    vectors: position w tile_m D/2 + 512k + 4t + v."""
    import torch

    half = tile_m * head_dim // 2
    p = torch.arange(tile_m * head_dim)
    w, r = p // half, p % half
    k, t, v = r // 512, (r % 512) // 4, r % 4
    row = 16 * (t // 32) + (t % 32) // 4 + 8 * (v // 2)
    col = w * (head_dim // 2) + 8 * k + 2 * (t % 4) + v % 2
    order = torch.empty_like(p)
    order[row * head_dim + col] = p
    return order.to(device)


def flash_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    intervals,
    bwd_bitmap,
    row_region=None,
    params=None,
    row_params=None,
    *,
    tile_m: int,
    tile_n: int,
    softmax_scale: Optional[float] = None,
    fallback: Optional[Fallback] = None,
    dlse=None,
    deterministic: bool = False,
    options: Optional[KernelOptions] = None,
):
    """Masked attention backward. Returns ``(dq, dk, dv)`` shaped like ``q, k, v``.

    ``lse`` float32 [B, H, Sq] from the forward (natural log, -inf for rows that see nothing);
    ``intervals`` int32 [B, Sq, K, 2]; ``bwd_bitmap`` int32 [B, ceil(Sk/tile_n), ceil(n_m/16)]
    for this (tile_m, tile_n) (``desc.bwd_tiles``); ``dlse`` (optional, [B, H, Sq]) is the
    gradient flowing into the LSE output. ``deterministic``: run-to-run identical dQ (the kv
    tiles add to each dQ tile in increasing order; sm90 kernel only, NotImplementedError
    elsewhere). ``options``: the kernel variants (``bwd_arch``, ``bwd_dq``, ``bwd_meta``,
    ``bwd_bitmap``; None: ``default_options`` for this device, K and length)."""
    import torch

    from compilemask.tiles import unpack_bitmap

    B, Sq, H, D = q.shape
    _, Sk, Hkv, _ = k.shape
    if D not in (64, 128):
        raise NotImplementedError(f"flash_bwd: head dim {D} not supported (64, 128)")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(f"flash_bwd: dtype {q.dtype}")
    if H % Hkv != 0:
        raise ValueError("num heads must be a multiple of num kv heads")
    Kslots = intervals.shape[2]
    n_m = -(-Sq // tile_m)
    n_n = -(-Sk // tile_n)
    assert intervals.shape[1:] == (Sq, Kslots, 2), intervals.shape
    assert bwd_bitmap.shape[1:] == bitmap_shape(1, n_n, n_m)[1:], (bwd_bitmap.shape, n_n, n_m)
    assert intervals.shape[0] in (1, B) and bwd_bitmap.shape[0] in (1, B)
    cfg = FlashBwdConfig(
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
        arch=80,
    )
    opts = (options or KernelOptions()).resolve(device_arch(q.device), Kslots, n_m)
    if opts.bwd_arch >= 90:
        if FlashBwdSm90.can_implement(replace(cfg, arch=90, dq_reduce="bulk")):
            cfg = replace(cfg, arch=90, dq_reduce="bulk")
        else:  # say so: the mma.sync kernel is slower
            log.warning("compilemask: the sm90 backward kernel cannot implement %s; using the "
                        "mma.sync kernel", cfg)
    if cfg.arch < 90:
        cfg = replace(cfg, dq_reduce=opts.bwd_dq)
        if deterministic:
            raise NotImplementedError(
                f"flash_bwd(deterministic=True) needs the sm90 backward kernel (this "
                f"configuration: {cfg})")
    sm90 = cfg.arch >= 90
    cfg = replace(
        cfg, deterministic=deterministic,
        meta_async=sm90 and opts.bwd_meta == "async",
        # a row longer than the shared-memory copy is read from global memory whatever asked
        bitmap_smem=sm90 and bitmap_fits_smem(n_m) and opts.bwd_bitmap == "smem",
    )
    if cfg.arch < 90 and not FlashBwd.can_implement(cfg):
        raise NotImplementedError(f"flash_bwd: unsupported configuration {cfg}")
    fn = compile_flash_bwd(cfg, fallback, options=options)
    dev = q.device
    q, k, v, dout = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, dout))
    # preprocess: dPsum = rowsum(dO * O) in float32, [B, H, Sq] (one pass over O and dO)
    out = out if out.stride(-1) == 1 else out.contiguous()
    dpsum = torch.empty(B, H, Sq, dtype=torch.float32, device=dev)
    compile_aux(AuxConfig("dpsum", cfg.dtype, D))(out, dout, dpsum)
    if dlse is not None:  # a gradient flowing into the LSE output: dS += P * dLSE
        dpsum = dpsum - torch.nan_to_num(dlse.float(), nan=0.0, posinf=0.0, neginf=0.0)
    dpsum = dpsum.contiguous()
    lse = lse.to(torch.float32).contiguous()
    if cfg.dq_reduce == "bulk":  # per q tile, in the order of the wgmma fragments
        dq_accum = torch.zeros(B, H, n_m, tile_m * D, dtype=torch.float32, device=dev)
    else:
        dq_accum = torch.zeros(B, Sq, H, D, dtype=torch.float32, device=dev)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    # a descriptor made for batch 1 (masks without per-sequence metadata) is broadcast
    iv = intervals.to(torch.int32).contiguous().view(-1, Sq, 2 * Kslots).expand(B, -1, -1)
    bm = bwd_bitmap.to(torch.int32).contiguous().expand(B, -1, -1)
    if row_region is None:
        row_region = torch.full((B, Sq), -1, dtype=torch.int32, device=dev)
    rr = row_region.to(torch.int32).contiguous().expand(B, -1)
    if params is None or params.numel() == 0:
        params = torch.zeros(B, 1, dtype=torch.int32, device=dev)
    if row_params is None or row_params.numel() == 0:
        row_params = torch.zeros(B, Sq, 1, dtype=torch.int32, device=dev)
    pr = params.to(torch.int32).contiguous().expand(B, -1)
    rp = row_params.to(torch.int32).contiguous().expand(B, -1, -1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    det_args = ()
    if cfg.arch >= 90:
        det_args = (None, None)
        if deterministic:  # per dQ tile half: adds done; per (kv tile, q tile): adds before it
            nonempty = (unpack_bitmap(bm, n_m) & 1).to(torch.int32)  # [B, n_n, n_m]
            rank = (torch.cumsum(nonempty, dim=1, dtype=torch.int32) - nonempty).contiguous()
            det_args = (torch.zeros(B, H, n_m, 2, dtype=torch.int32, device=dev), rank)
    fn(q, k, v, dout, lse, dpsum, dq_accum, dk, dv, iv, bm, rr, pr, rp, *det_args, float(scale))
    # postprocess: dQ = scale * dq_accum, in the input dtype (bulk: gathered from the fragment
    # order in the same pass)
    if cfg.dq_reduce == "bulk":
        dq = torch.empty(B, Sq, H, D, dtype=q.dtype, device=dev)
        compile_aux(AuxConfig("dq", cfg.dtype, D, tile_m))(dq_accum, dq, float(scale))
    else:
        dq = (dq_accum * scale).to(q.dtype)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Quick timing (GPU): python -m compilemask.kernels.flash_bwd --mask hstu -S 8192 -B 2
# ----------------------------------------------------------------------------------------------
