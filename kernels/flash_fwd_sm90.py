"""Hopper (sm_90a) warp-specialized forward kernel: TMA producer warp + wgmma consumer warpgroups.

Same contract, masking and softmax as :class:`kernels.flash_fwd.FlashFwd` (whose helpers it
reuses); the differences are the data movement and the thread roles:

* warpgroup 0 is the producer: one warp walks the Tile-State Bitmap row of the q tile and, for
  every non-empty kv tile only, issues TMA bulk-tensor loads of K and V into a
  ``num_stages``-deep ring of shared-memory buffers, each completing on an mbarrier
  (``PipelineTmaAsync``); it loads Q once the same way. Its registers are given back
  (``setmaxnreg.dec``).
* warpgroups 1..n are consumers (64 q rows each, ``setmaxnreg.inc``): they wait for K, run
  S = Q K^T (wgmma, both operands in shared memory), release K, mask + online softmax in
  registers, wait for V, run O += P V (wgmma, P from registers), release V.
* TMA zero-fills rows past the sequence end, so ragged tails need no predication.
* Consumers software-pipeline their loop (``intra_wg_overlap``): S(i) = Q K(i)^T and
  O += P(i-1) V(i-1) are issued back to back, the softmax of tile i runs while the PV GEMM is
  still in flight, and O is rescaled once it lands. With two consumer warpgroups (``pingpong``)
  the warpgroups take turns issuing their GEMMs (named barriers), so one warpgroup's softmax
  hides behind the other's GEMMs.
* Epilogue per consumer warpgroup: O through shared memory (the Q buffer, own rows only) to
  global with 16-byte stores; LSE straight from registers.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from .block_info import next_tile, next_tile_state, next_tile_state_cached
from .common import (
    SeqlenInfo,
    _acc_mn,
    _layout_acc_frgA,
    _transpose_view,
    select_modes,
    tiled_copy_store_16B,
    tma_partition,
    tma_pipeline,
    wgmma,
    wgmma_issue,
)
from .config import FlashFwdConfig
from .descriptor_tensors import DescriptorTensors
from .flash_fwd import FlashFwd, make_sm90_tiled_mmas
from .named_barrier import NamedBarrierFwd

__all__ = ["FlashFwdSm90"]


class FlashFwdSm90(FlashFwd):
    """Warp-specialized TMA + wgmma forward kernel (see module docstring)."""

    num_producer_regs = 24
    num_consumer_regs = 240

    def __init__(self, cfg: FlashFwdConfig, predicates: tuple = ()):
        super().__init__(cfg, predicates)
        assert cfg.arch >= 90
        self.num_wg = cfg.tile_m // 64
        self.num_mma_threads = 128 * self.num_wg
        self.num_threads = 128 * (self.num_wg + 1)
        self.num_stages = 2
        if self.num_wg == 1:
            self.num_consumer_regs, self.num_producer_regs = 256, 56
        elif self.num_wg == 3:
            self.num_consumer_regs, self.num_producer_regs = 160, 32

    @staticmethod
    def can_implement(cfg: FlashFwdConfig) -> bool:
        return FlashFwd.can_implement(cfg) and cfg.arch >= 90

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, H, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        desc: DescriptorTensors,  # bitmap: the forward one, (B, n_m, W)
        softmax_scale_log2: Float32,
        stream,
    ):
        if const_expr(mQ.element_type != self.dtype):
            raise TypeError("q dtype does not match the kernel config")
        dtype = self.dtype
        D = self.head_dim
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, D), dtype
        )
        sQ_layout = cute.tile_to_shape(atom, (self.tile_m, D), order=(0, 1))
        sKV_layout = cute.tile_to_shape(atom, (self.tile_n, D, self.num_stages), order=(0, 1, 2))

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]

        # (B, S, H, D) -> (S, D, H, B) for TMA boxes of (tile rows, D)
        mQt = select_modes(mQ, [1, 3, 2, 0])
        mKt = select_modes(mK, [1, 3, 2, 0])
        mVt = select_modes(mV, [1, 3, 2, 0])
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQt, sQ_layout, (self.tile_m, D))
        sKV_one = cute.select(sKV_layout, mode=[0, 1])
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mKt, sKV_one, (self.tile_n, D), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mVt, sKV_one, (self.tile_n, D), 1)
        self.tx_Q = cute.size_in_bytes(dtype, sQ_layout)
        self.tx_KV = cute.size_in_bytes(dtype, sKV_one)

        tiled_mma_qk, tiled_mma_pv = make_sm90_tiled_mmas(dtype, D, self.tile_n, self.num_wg)
        # O store: 16-byte vectors, one consumer warpgroup covers its 64 rows
        gmem_tiled_copy_O = tiled_copy_store_16B(dtype, 128)
        grid = (
            cute.ceil_div(mQ.shape[1], self.tile_m),
            cute.size(mQ.shape[0]) * cute.size(mQ.shape[2]),
            1,
        )
        self.kernel_ws(
            tma_Q,
            tma_K,
            tma_V,
            tma_atom_Q,
            tma_atom_K,
            tma_atom_V,
            mO,
            mLSE,
            desc,
            softmax_scale_log2,
            sQ_layout,
            sKV_layout,
            gmem_tiled_copy_O,
            tiled_mma_qk,
            tiled_mma_pv,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.jit
    def _overlap_step(self, c, state, n_block, kv_state, v_state):
        """One kv tile of the overlapped loop: S(i) = Q K(i)^T and O += P(i-1) V(i-1) issued
        back to back, the softmax of S(i) while P V runs, then the O rescale and P(i)."""
        pipe_k, pipe_v, kv, v = c.pipe_k, c.pipe_v, kv_state, v_state
        pipe_k.consumer_wait(kv)
        if const_expr(c.pingpong):  # wait for this warpgroup's turn
            cute.arch.barrier(barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1) + c.cwg,
                              number_of_threads=256)
        acc_S = cute.make_rmem_tensor(c.acc_shape_S, Float32)
        wgmma_issue(c.tiled_mma_qk, acc_S, c.tSrQ, c.tSrK[None, None, None, kv.index], True)
        pipe_v.consumer_wait(v)
        wgmma_issue(c.tiled_mma_pv, c.acc_O, c.tOrP, c.tOrVt[None, None, None, v.index], False)
        if const_expr(c.pingpong):  # hand the tensor cores to the other one
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1) + 1 - c.cwg,
                                     number_of_threads=256)
        warpgroup.wait_group(1)  # S(i) ready; P(i-1) V(i-1) may still run
        pipe_k.consumer_release(kv)
        acc_S_mn = self._mask_tile(
            acc_S, state, n_block, c.tScS_mn, c.row_data, c.m_start, c.seqlen_q, c.seqlen_k,
            c.mRowParams, c.batch_idx,
        )
        self._softmax_rows(acc_S_mn, c.row_max, c.row_sum, c.row_scale, c.softmax_scale_log2)
        warpgroup.wait_group(0)  # O += P(i-1) V(i-1) done
        pipe_v.consumer_release(v)
        self._rescale_O(c.acc_O, c.row_scale)
        c.rPt.store(acc_S.load().to(self.dtype))

    @cute.jit
    def _qk_wait(self, pipe_k, kv_state, tiled_mma_qk, tSrQ, tSrK, acc_shape_S):
        """S = Q K^T on the K stage of ``kv_state`` (waits for its TMA load, releases it)."""
        pipe_k.consumer_wait(kv_state)
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True)
        pipe_k.consumer_release(kv_state)
        return acc_S

    @cute.kernel
    def kernel_ws(
        self,
        mQ: cute.Tensor,  # TMA view (Sq, D, H, B)
        mK: cute.Tensor,  # TMA view (Sk, D, Hkv, B)
        mV: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        mO: cute.Tensor,  # (B, Sq, H, D)
        mLSE: cute.Tensor,
        desc: DescriptorTensors,
        softmax_scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        gmem_tiled_copy_O: cute.TiledCopy,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        D = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        m_block, bh, _ = cute.arch.block_idx()
        num_heads = mO.shape[2]
        batch_idx = bh // num_heads
        head_idx = bh - batch_idx * num_heads
        head_kv = head_idx // (num_heads // mK.shape[2])
        seq = SeqlenInfo(batch_idx, mO.shape[1], mK.shape[0])  # mK is the (S, D, H, B) view
        seqlen_q = seq.seqlen_q
        seqlen_k = seq.seqlen_k
        n_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        m_start = m_block * self.tile_m
        mBitmapRow = desc.bitmap[batch_idx, m_block, None]

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_q = tma_pipeline(storage.mbar_Q, 1, producer, consumers, self.tx_Q)
        pipe_k = tma_pipeline(storage.mbar_K, self.num_stages, producer, consumers, self.tx_KV)
        pipe_v = tma_pipeline(storage.mbar_V, self.num_stages, producer, consumers, self.tx_KV)
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sVt = _transpose_view(sV)

        pipeline.pipeline_init_wait()

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            # ================================ producer ==================================
            cute.arch.setmaxregister_decrease(self.num_producer_regs)
            if warp_idx == 0:
                gQ = cute.local_tile(
                    mQ[None, None, head_idx, batch_idx], (self.tile_m, D), (m_block, 0)
                )
                gK = cute.local_tile(
                    mK[None, None, head_kv, batch_idx], (self.tile_n, D), (None, 0)
                )
                gV = cute.local_tile(
                    mV[None, None, head_kv, batch_idx], (self.tile_n, D), (None, 0)
                )
                tQsQ, tQgQ = tma_partition(tma_atom_Q, sQ, gQ)
                tKsK, tKgK = tma_partition(tma_atom_K, sK, gK)
                tVsV, tVgV = tma_partition(tma_atom_V, sV, gV)
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                pipe_q.producer_acquire(q_state)
                cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                kv_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.num_stages
                )
                n_block = next_tile(mBitmapRow, Int32(0), n_blocks)
                while n_block < n_blocks:
                    pipe_k.producer_acquire(kv_state)
                    cute.copy(
                        tma_atom_K,
                        tKgK[None, n_block],
                        tKsK[None, kv_state.index],
                        tma_bar_ptr=pipe_k.producer_get_barrier(kv_state),
                    )
                    pipe_v.producer_acquire(kv_state)
                    cute.copy(
                        tma_atom_V,
                        tVgV[None, n_block],
                        tVsV[None, kv_state.index],
                        tma_bar_ptr=pipe_v.producer_get_barrier(kv_state),
                    )
                    kv_state.advance()
                    n_block = next_tile(mBitmapRow, n_block + 1, n_blocks)
        else:
            # ================================ consumers =================================
            cute.arch.setmaxregister_increase(self.num_consumer_regs)
            mma_tidx = tidx - 128
            cwg = wg_idx - 1
            thr_mma_qk = tiled_mma_qk.get_slice(mma_tidx)
            thr_mma_pv = tiled_mma_pv.get_slice(mma_tidx)
            wg_mma_qk = tiled_mma_qk.get_slice(cwg * 128)
            wg_mma_pv = tiled_mma_pv.get_slice(cwg * 128)
            tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
            tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
            tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
            acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((self.tile_m, D)), Float32)
            acc_O.fill(0.0)
            acc_shape_S = thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
            tScS_mn = _acc_mn(
                thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            )
            tOcO_mn = _acc_mn(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, D))))
            n_rows = cute.size(tScS_mn, mode=[0])
            row_data = self._load_row_data(desc, tScS_mn, batch_idx, m_start, seqlen_q)
            row_max = cute.make_rmem_tensor((n_rows,), Float32)
            row_sum = cute.make_rmem_tensor((n_rows,), Float32)
            row_max.fill(-Float32.inf)
            row_sum.fill(0.0)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_q.consumer_wait(q_state)
            kv_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_stages
            )
            # each tile's state comes with it from the scan (one bitmap read per tile)
            n_block, state = next_tile_state(mBitmapRow, Int32(0), n_blocks)
            if const_expr(not self.cfg.intra_wg_overlap):
                while n_block < n_blocks:
                    n_next, state_next = next_tile_state(mBitmapRow, n_block + 1, n_blocks)
                    acc_S = self._qk_wait(pipe_k, kv_state, tiled_mma_qk, tSrQ, tSrK, acc_shape_S)
                    acc_S_mn = self._mask_tile(
                        acc_S, state, n_block, tScS_mn, row_data, m_start, seqlen_q, seqlen_k,
                        desc.row_params, batch_idx,
                    )
                    self._online_softmax(acc_S_mn, acc_O, row_max, row_sum, softmax_scale_log2)
                    tOrP = self._p_operand(acc_S)
                    # O += P V
                    pipe_v.consumer_wait(kv_state)
                    wgmma(
                        tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index], False
                    )
                    pipe_v.consumer_release(kv_state)
                    kv_state.advance()
                    n_block = n_next
                    state = state_next
            else:
                # software pipeline (FA3 "intra-warpgroup overlap"): while the softmax of tile
                # i runs on the CUDA cores, the tensor cores finish P(i-1) V(i-1)
                v_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Consumer, self.num_stages
                )
                pingpong = const_expr(self.cfg.pingpong and self.num_wg == 2)
                if const_expr(pingpong):
                    if cwg == 0:  # the first consumer warpgroup takes the first turn
                        cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1),
                                                 number_of_threads=256)
                row_scale = cute.make_rmem_tensor((n_rows,), Float32)
                rPt = cute.make_rmem_tensor(acc_shape_S, self.dtype)
                tOrP = cute.make_tensor(rPt.iterator, _layout_acc_frgA(rPt.layout))
                if n_block < n_blocks:
                    acc_S = self._qk_wait(pipe_k, kv_state, tiled_mma_qk, tSrQ, tSrK, acc_shape_S)
                    acc_S_mn = self._mask_tile(
                        acc_S, state, n_block, tScS_mn, row_data, m_start, seqlen_q, seqlen_k,
                        desc.row_params, batch_idx,
                    )
                    self._softmax_rows(acc_S_mn, row_max, row_sum, row_scale, softmax_scale_log2)
                    rPt.store(acc_S.load().to(self.dtype))
                    kv_state.advance()
                    word_idx = Int32(-1)  # the bitmap word the scan holds (none yet)
                    word = Int32(0)
                    n_block, state, word, word_idx = next_tile_state_cached(
                        mBitmapRow, n_block + 1, n_blocks, word, word_idx
                    )
                    ctx = SimpleNamespace(
                        pipe_k=pipe_k, pipe_v=pipe_v, tiled_mma_qk=tiled_mma_qk,
                        tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tOrP=tOrP,
                        rPt=rPt, acc_O=acc_O, acc_shape_S=acc_shape_S, pingpong=pingpong,
                        cwg=cwg, tScS_mn=tScS_mn, row_data=row_data, m_start=m_start,
                        seqlen_q=seqlen_q, seqlen_k=seqlen_k, mRowParams=desc.row_params,
                        batch_idx=batch_idx, row_max=row_max, row_sum=row_sum,
                        row_scale=row_scale, softmax_scale_log2=softmax_scale_log2,
                    )
                    while n_block < n_blocks:
                        n_next, state_next, word, word_idx = next_tile_state_cached(
                            mBitmapRow, n_block + 1, n_blocks, word, word_idx
                        )
                        self._overlap_step(ctx, state, n_block, kv_state, v_state)
                        v_state.advance()
                        kv_state.advance()
                        n_block = n_next
                        state = state_next
                    pipe_v.consumer_wait(v_state)
                    wgmma(
                        tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False
                    )
                    pipe_v.consumer_release(v_state)

            # ---- epilogue ---------------------------------------------------------------
            rO = self._finalize(
                acc_O, row_max, row_sum, softmax_scale_log2, tOcO_mn, mLSE, batch_idx, head_idx,
                m_start, seqlen_q,
            )
            # the warpgroup's own 64 rows of sQ are no longer read by its wgmma: reuse as sO
            sO = sQ
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma_pv
            ).get_slice(mma_tidx)
            cute.copy(r2s, r2s.retile(rO), r2s.partition_D(sO))
            cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue) + cwg, number_of_threads=128)
            wg_tidx = mma_tidx - cwg * 128
            sO_wg = cute.local_tile(sO, (64, D), (cwg, 0))
            mO_bh = mO[batch_idx, None, head_idx, None]
            gO_wg = cute.local_tile(mO_bh, (64, D), (m_block * self.num_wg + cwg, 0))
            cO_wg = cute.local_tile(
                cute.make_identity_tensor((mO.shape[1], D)),
                (64, D),
                (m_block * self.num_wg + cwg, 0),
            )
            thr_copy_O = gmem_tiled_copy_O.get_slice(wg_tidx)
            tOsO = thr_copy_O.partition_S(sO_wg)
            tOgO = thr_copy_O.partition_D(gO_wg)
            tOcO = thr_copy_O.partition_D(cO_wg)
            tOrO = cute.make_fragment_like(tOgO, self.dtype)
            cute.copy(gmem_tiled_copy_O, tOsO, tOrO)
            for r in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
                if tOcO[0, r, 0][0] < seqlen_q:
                    cute.copy(gmem_tiled_copy_O, tOrO[None, r, None], tOgO[None, r, None])
