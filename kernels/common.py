"""Device-side pieces shared by the forward and backward kernels (CuTe DSL).

The descriptor is read through ``block_info`` (tile scans of a bitmap row) and ``mask`` (the
interval test of a score tile); this module holds the rest:

* per-batch sequence bookkeeping (:class:`SeqlenInfo`);
* accumulator layout views, the 16-byte row copies (:func:`load_rows` and the tiled copies) and
  the wgmma issue helpers;
* host side: the common part of the kernel objects' construction (:func:`init_kernel`), fake
  launch arguments, the compile-cache key, the fallback predicates of a build and the compile
  call.

Moving code between these modules must leave the generated PTX unchanged (the kernels were
validated on a GPU): compare the PTX of every compile configuration before and after
(``--keep-ptx --dump-dir``).
"""

from __future__ import annotations

import logging

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from compilemask.contract.env import cute_dsl_arch
from compilemask.contract.options import KernelOptions

from .mask import IntervalMask

log = logging.getLogger("compilemask")


# ----------------------------------------------------------------------------------------------
# Per-batch sequence bookkeeping (the one place that knows where a sequence lives)
# ----------------------------------------------------------------------------------------------
class SeqlenInfo:
    """Offsets and lengths of sequence ``batch_idx``.

    Today every sequence of the batch has the padded lengths ``Sq``/``Sk`` of the tensors and
    starts at offset 0 of its batch slice. Varlen (``cu_seqlens``) only needs this class to read
    ``offset = cu_seqlens[b]`` / ``seqlen = cu_seqlens[b + 1] - cu_seqlens[b]`` and the kernel to
    slice the packed tensors with ``offset_q``/``offset_k``.
    """

    def __init__(self, batch_idx, seqlen_q, seqlen_k):
        self.batch_idx = batch_idx
        self.offset_q = 0
        self.offset_k = 0
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k

    @staticmethod
    def create(batch_idx, mQ: cute.Tensor, mK: cute.Tensor) -> "SeqlenInfo":
        """From the (B, S, H, D) q/k tensors."""
        return SeqlenInfo(batch_idx, mQ.shape[1], mK.shape[1])


# ----------------------------------------------------------------------------------------------
# Layout helpers (CuTe accumulator layouts -> (rows, cols) views)
# ----------------------------------------------------------------------------------------------
def _layout_acc_mn(acc_layout: cute.Layout) -> cute.Layout:
    """sm80 ((2,2),MMA_M,MMA_N) / sm90 ((2,2,V),MMA_M,MMA_N) -> ((2,MMA_M),(2,[V,]MMA_N))."""
    cm = cute.make_layout(acc_layout.shape)
    shape = (
        (cm.shape[0][1], cm.shape[1]),
        (cm.shape[0][0], *cm.shape[0][2:], cm.shape[2]),
    )
    stride = (
        (cm.stride[0][1], cm.stride[1]),
        (cm.stride[0][0], *cm.stride[0][2:], cm.stride[2]),
    )
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def _acc_mn(acc: cute.Tensor) -> cute.Tensor:
    """Accumulator (or its identity partition) as a (rows, cols) view."""
    return cute.make_tensor(acc.iterator, _layout_acc_mn(acc.layout))


def _layout_acc_frgA(acc_layout: cute.Layout) -> cute.Layout:
    """Accumulator of one GEMM viewed as the register A operand of the next (its N becomes that
    GEMM's K), e.g. S = Q K^T as the A operand of O = P V."""
    if const_expr(cute.rank(acc_layout.shape[0]) == 3):  # sm90 ((2,2,N/8),MMA_M,MMA_N)
        div = 2 if const_expr(acc_layout.shape[0][2] % 2 == 0) else 1
        ld = cute.logical_divide(acc_layout, ((None, None, div), None, None))
        return cute.make_layout(
            (
                (ld.shape[0][0], ld.shape[0][1], ld.shape[0][2][0]),
                ld.shape[1],
                (ld.shape[0][2][1], ld.shape[2]),
            ),
            stride=(
                (ld.stride[0][0], ld.stride[0][1], ld.stride[0][2][0]),
                ld.stride[1],
                (ld.stride[0][2][1], ld.stride[2]),
            ),
        )
    # sm80 (4,MMA_M,MMA_N) -> ((4,2),MMA_M,MMA_N/2)
    ld = cute.logical_divide(acc_layout, (None, None, 2))
    return cute.make_layout(
        ((ld.shape[0], ld.shape[2][0]), ld.shape[1], ld.shape[2][1]),
        stride=((ld.stride[0], ld.stride[2][0]), ld.stride[1], ld.stride[2][1]),
    )


def _transpose_view(a: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes (works on swizzled shared-memory tensors)."""
    shape = (a.shape[1], a.shape[0], *a.shape[2:])
    order = (1, 0, *range(2, cute.rank(a)))
    return cute.composition(a, cute.make_ordered_layout(shape, order=order))


def _quad_allreduce(val, op):
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=2))
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=1))
    return val


# ----------------------------------------------------------------------------------------------
# Global <-> shared / register copies: 16-byte vectors, rows of 64 elements
# ----------------------------------------------------------------------------------------------
def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    """The same memory viewed with its modes reordered (e.g. (B, S, H, D) -> (S, D, H, B) for a
    TMA atom)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def tma_partition(tma_atom, s, g):
    """(smem, gmem) partitions of a TMA copy (one CTA, the tile's first two modes grouped)."""
    return cpasync.tma_partition(
        tma_atom,
        0,
        cute.make_layout(1),
        cute.group_modes(s, 0, 2),
        cute.group_modes(g, 0, 2),
    )


def tiled_copy_16B(atom, dtype, num_threads: int):
    """``num_threads`` threads copying 16-byte vectors, 64 elements per row (8 threads a row for
    16-bit types)."""
    copy_elems = 128 // dtype.width
    thr_cols = 64 // copy_elems
    thr_layout = cute.make_layout((num_threads // thr_cols, thr_cols), stride=(thr_cols, 1))
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, copy_elems)))


def tiled_copy_g2s_16B(dtype, num_threads: int):
    """Global -> shared with 16-byte ``cp.async`` (cache-global)."""
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
        dtype,
        num_bits_per_copy=128,
    )
    return tiled_copy_16B(atom, dtype, num_threads)


def tiled_copy_store_16B(dtype, num_threads: int):
    """Registers -> global with 16-byte stores."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    return tiled_copy_16B(atom, dtype, num_threads)


@cute.jit
def load_rows(gmem_tiled_copy, tXgX, tXsX, tXcX, limit: Int32):
    """cp.async the rows ``< limit`` of a tile, zero-fill the others (``tXcX``: the identity
    partition of the tile, for the row coordinates)."""
    for r in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
        if tXcX[0, r, 0][0] < limit:
            cute.copy(gmem_tiled_copy, tXgX[None, r, None], tXsX[None, r, None])
        else:
            tXsX[None, r, None].fill(0)


# ----------------------------------------------------------------------------------------------
# wgmma
# ----------------------------------------------------------------------------------------------
def tma_pipeline(mbar, num_stages, producer, consumers, tx_count):
    """A TMA-fed ``num_stages``-deep pipeline on the mbarriers ``mbar`` (set up before
    ``pipeline_init_arrive``/``pipeline_init_wait``)."""
    import cutlass.pipeline as pipeline

    return pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar.data_ptr(),
        num_stages=num_stages,
        producer_group=producer,
        consumer_group=consumers,
        tx_count=tx_count,
        defer_sync=True,
    )


@dsl_user_op
def cp_async_4B(smem_ptr, gmem_ptr, *, loc=None, ip=None):
    """``smem[0:4] = gmem[0:4]``, asynchronously: one ``cp.async.ca`` of 4 bytes issued by this
    thread; ``cute.arch.cp_async_commit_group`` / ``cp_async_wait_group`` complete it (its own
    view), a barrier after that shows it to the others."""
    llvm.inline_asm(
        None,
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), gmem_ptr.llvm_ptr],
        "cp.async.ca.shared.global [$0], [$1], 4;",
        "r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_reduce_add_f32(smem_ptr, gmem_ptr, num_bytes: int, *, loc=None, ip=None):
    """``gmem[0:num_bytes] += smem[0:num_bytes]`` (float32, both contiguous) by the TMA unit,
    asynchronously: one ``cp.reduce.async.bulk ... bulk_group.add.f32`` issued by one thread,
    followed by ``cp_async_bulk_commit_group``; ``cp_async_bulk_wait_group(n, read=True)`` says
    when shared memory may be rewritten."""
    llvm.inline_asm(
        None,
        [gmem_ptr.llvm_ptr, smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def wgmma_issue(tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr):
    """acc (+)= A B as a wgmma chain + commit, no wait (the caller waits with
    ``warpgroup.wait_group``)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def wgmma(tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr):
    """acc (+)= A B on wgmma, waited for."""
    wgmma_issue(tiled_mma, acc, tCrA, tCrB, zero_init)
    warpgroup.wait_group(0)


# ----------------------------------------------------------------------------------------------
# Host side: kernel objects, fake (shape-symbolic) launch arguments and the compile call
# ----------------------------------------------------------------------------------------------
def init_kernel(kernel, cfg, predicates, name: str):
    """What every kernel object keeps of its (forward or backward) config, after checking that
    ``kernel.can_implement(cfg)`` and that there is one generated predicate per fallback region;
    ``name`` is the class named in the NotImplementedError."""
    if not kernel.can_implement(cfg):
        raise NotImplementedError(f"{name} cannot implement {cfg}")
    if cfg.has_fallback and len(predicates) != len(cfg.fallback_regions):
        raise ValueError("has_fallback=True needs one generated predicate per region")
    kernel.cfg = cfg
    kernel.predicates = tuple(predicates)
    kernel.dtype = cfg.cutlass_dtype
    kernel.head_dim = cfg.head_dim
    kernel.tile_m = cfg.tile_m
    kernel.tile_n = cfg.tile_n
    kernel.K = cfg.num_intervals
    kernel.mask = IntervalMask(cfg.num_intervals, kernel.predicates, cfg.has_fallback)


def fake_tensor(dtype, shape, d=1, align=16):
    """A fake tensor with symbolic strides (divisible by ``d``), unit stride in the last mode."""
    from cutlass.cute.runtime import make_fake_tensor

    stride = tuple(cute.sym_int64(divisibility=d) for _ in shape[:-1]) + (1,)
    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def compile_kernel(kernel, args, gpu_arch=None, extra_options: str = "", with_scale: bool = True):
    """``cute.compile`` of a kernel object over fake ``args`` (+ a float32 scale when
    ``with_scale``, and the TVM-FFI environment stream); ``gpu_arch`` (e.g. "sm_90a") needs no
    GPU."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = "--enable-tvm-ffi" + (f" --gpu-arch {gpu_arch}" if gpu_arch else "")
    if extra_options:
        options += " " + extra_options
    scale = (Float32(1.0),) if with_scale else ()
    return cute.compile(kernel, *args, *scale, stream, options=options)


def compile_cache_key(cfg, gpu_arch=None, options=None):
    """Compile-cache key: the config, the target (``gpu_arch``, else ``CUTE_DSL_ARCH``) and the
    kernel options as the caller gave them (None: the defaults). The config already holds what
    the options select; keying on the options too means that two option sets never share a
    kernel, even for a variant the config were to miss."""
    return (cfg, gpu_arch or cute_dsl_arch(), options or KernelOptions())


def fallback_predicates(cfg, fallback, kernel_name: str, with_arch: bool = False) -> tuple:
    """The generated predicates of ``fallback`` (one per fallback region) for a kernel build of
    ``cfg``, () without fallback; logs the build once (the caller caches it)."""
    if not cfg.has_fallback:
        return ()
    assert fallback is not None and fallback.hash == cfg.fallback_hash
    preds = fallback.functions()
    log.info(
        "compilemask: building %s kernel with fallback predicate %s for regions %s "
        "(%s, hdim %d, tile %dx%d, K=%d" + (", sm%d)" if with_arch else ")"),
        kernel_name,
        cfg.fallback_hash,
        cfg.fallback_regions,
        cfg.dtype,
        cfg.head_dim,
        cfg.tile_m,
        cfg.tile_n,
        cfg.num_intervals,
        *((cfg.arch,) if with_arch else ()),
    )
    return preds
