"""Hopper (sm_90a) backward kernel :class:`FlashBwdSm90`: the schedule, loads, mask and
epilogue of :class:`kernels.flash_bwd.FlashBwd` with all five GEMMs on wgmma (SASS ``HGMMA``),
warp-specialized; the default on sm_90 (``KernelOptions(bwd_arch=80)`` picks the mma.sync one).

A producer warpgroup loads K and V once and Q, dO per q tile with TMA into a 2-stage mbarrier
pipeline, and its second warp issues the dQ reduce-adds; two wgmma warpgroups compute, with one
barrier between them per q tile. The score tile is computed transposed (S^T = K Q^T) so P^T and
dS^T feed dV/dK as register A operands; S and dP are issued back to back and dV, dQ, dK overlap
the pointwise math (the FlashAttention 3 schedule). It replaced cp.async loads, waiting for
every GEMM, scalar dS stores and dQ adds issued by the compute warpgroups, each measured slower
on the H200.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.utils import LayoutEnum

from compilemask.contract.descriptor import bitmap_words, is_partial
from compilemask.contract.options import BITMAP_SMEM_WORDS

from .block_info import next_tile, tile_state
from .common import (
    _acc_mn,
    _layout_acc_frgA,
    _transpose_view,
    bulk_reduce_add_f32,
    init_kernel,
    select_modes,
    tma_partition,
    tma_pipeline,
    wgmma_issue,
)
from .config import DTYPES, FlashBwdConfig
from .descriptor_tensors import DescriptorTensors
from .flash_bwd import FlashBwd
from .mask import SharedRows
from .named_barrier import NamedBarrierBwd

__all__ = ["FlashBwdSm90"]


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
        if cfg.dtype not in DTYPES or cfg.head_dim not in (64, 128):
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
        desc: DescriptorTensors,  # bitmap: the backward one, (B, n_n, W)
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
            mQ, mK, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, desc, mdQsem, mRank, softmax_scale,
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            sQ_layout, sKV_layout, sdS_layout, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
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
        desc: DescriptorTensors,
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
        ) = self._cta_coords(mQ, mK, desc.bitmap, softmax_scale)
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
                batch_idx, n_start, seqlen_q, kv_ragged, scale_log2, desc, mLSE, mdPsum,
                (sLSE, sdPsum, sInt, sFb, sRowP), cwg, mma_tidx,
            )
            self._store_dkv(
                f.acc_dK, f.acc_dV, mdK, mdV, f.thr_dkv, softmax_scale, batch_idx, head_kv,
                n_block, n_start, seqlen_k,
            )

    @cute.jit
    def _consumer(
        self, f, pipe_kv, pipe_qdo, has_work, first_m, mBitmapRow, m_blocks, group, head0,
        batch_idx, n_start, seqlen_q, kv_ragged, scale_log2, desc, mLSE, mdPsum, sMeta, cwg, tidx,
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
            rP[p] = desc.params[batch_idx, p]
        rMf = cute.make_rmem_tensor((2,), Float32)
        rMi = cute.make_rmem_tensor((2 * K + 1 + Rs,), Int32)
        async_meta = self.cfg.meta_async
        regs_meta = not async_meta
        if has_work:  # the first item's row metadata -> stage 0 (threads < tile_m, one row each)
            if const_expr(async_meta):
                self._copy_meta(sMeta, 0, mLSE, mdPsum, desc, batch_idx, head0,
                                first_m * tm + tidx, seqlen_q, tidx)
                self._finish_meta(sMeta, 0, first_m * tm + tidx, seqlen_q, tidx)
            if const_expr(regs_meta):
                self._load_meta(rMf, rMi, mLSE, mdPsum, desc, batch_idx, head0,
                                first_m * tm + tidx, seqlen_q, tidx)
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
                    self._copy_meta(sMeta, 1 - stage, mLSE, mdPsum, desc, batch_idx,
                                    head0 + g_next, m_next * tm + tidx, seqlen_q, tidx)
                if const_expr(regs_meta):
                    self._load_meta(rMf, rMi, mLSE, mdPsum, desc, batch_idx, head0 + g_next,
                                    m_next * tm + tidx, seqlen_q, tidx)
            state = tile_state(mBitmapRow, m_block)
            need_mask = is_partial(state) | kv_ragged
            pipe_qdo.consumer_wait(q_state)

            self._item(f, stage, need_mask, has_next, sMeta, rP, rMf, rMi, m_start, n_start,
                       desc.row_params, batch_idx, seqlen_q, scale_log2, cwg, tidx,
                       m_next * tm + tidx)
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
