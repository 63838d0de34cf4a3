"""The backward's pre- and postprocess kernels (CuTe DSL), around the sm90 backward kernel.

* :class:`BwdPreprocess`: ``dPsum[b, h, s] = sum_d dO[b, s, h, d] * O[b, s, h, d]`` in float32,
  one warp per (b, s, h) row, reading the 16-bit O and dO once (the torch expression made two
  float32 copies of both first).
* :class:`DqPostprocess`: ``dQ[b, s, h, :] = scale * dq_accum`` in the input dtype, reading the
  bulk-reduced ``dq_accum`` ``[B, H, q tiles, tile_m * D]`` in the wgmma-fragment order the
  backward kernel writes it in (``interface._dq_fragment_order`` is the same map on the host),
  one thread per column pair: one pass instead of a gather, a scale and a cast.

Both compile once per (dtype, head dim[, tile_m]) with symbolic shapes, like the attention
kernels (``compile_aux`` caches them).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from compilemask.contract.cache import CompileCache

from .common import compile_cache_key, compile_kernel, fake_tensor

__all__ = ["AuxConfig", "BwdPreprocess", "DqPostprocess", "compile_aux"]

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
_ROWS_PER_BLOCK = 8  # preprocess: one warp per row
_THREADS = 256


@dataclass(frozen=True)
class AuxConfig:
    """Compile-time parameters of one pre- or postprocess build (the compile-cache key)."""

    kind: str  # "dpsum" | "dq"
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    tile_m: int = 64  # dq: the q tile of dq_accum

    @property
    def cutlass_dtype(self):
        return _DTYPES[self.dtype]


class BwdPreprocess:
    """dPsum = rowsum(dO * O) in float32: warp w of block x reduces row 8 x + w of the
    (b, h, s)-ordered rows (s fastest, so a block's eight results are adjacent in dPsum); each
    lane multiplies a contiguous D/32-element chunk."""

    def __init__(self, cfg: AuxConfig):
        if cfg.dtype not in _DTYPES or cfg.head_dim % 64:
            raise NotImplementedError(f"BwdPreprocess cannot implement {cfg}")
        self.cfg = cfg
        self.head_dim = cfg.head_dim

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mdPsum: cute.Tensor, stream):
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mO, mdO, mdPsum).launch(
            grid=[cute.ceil_div(rows, _ROWS_PER_BLOCK), 1, 1],
            block=[_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mdPsum: cute.Tensor):
        chunk = self.head_dim // 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        B, S, H = mO.shape[0], mO.shape[1], mO.shape[2]
        row = bidx * _ROWS_PER_BLOCK + tidx // 32
        if row < B * S * H:
            s = row % S
            bh = row // S
            h = bh % H
            b = bh // H
            rO = cute.make_rmem_tensor((chunk,), mO.element_type)
            rdO = cute.make_rmem_tensor((chunk,), mO.element_type)
            cute.autovec_copy(cute.local_tile(mO[b, s, h, None], (chunk,), (lane,)), rO)
            cute.autovec_copy(cute.local_tile(mdO[b, s, h, None], (chunk,), (lane,)), rdO)
            prod = rO.load().to(Float32) * rdO.load().to(Float32)
            acc = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            for offset in cutlass.range_constexpr(5):
                acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=16 >> offset)
            if lane == 0:
                mdPsum[b, h, s] = acc


class DqPostprocess:
    """dQ = scale * dq_accum, gathered from the fragment order: thread i writes the 8 output
    columns [8 g, 8 g + 8) of row i // (D/8) of the (b, s, h)-ordered rows (h fastest, as dQ is
    laid out) as one 16-byte store, reading them as four 8-byte pairs of dq_accum.

    Fragment order (CUTLASS's sm90 accumulator layout, as the backward writes it): warpgroup w
    owns columns [w D/2, (w + 1) D/2) of the (tile_m, D) tile; column c of that half, row r is
    held by thread t = 32 (r // 16) + 4 (r % 8) + (c % 8) // 2 as element v = 2 ((r % 16) // 8)
    + c % 2 of its k = c // 8-th 4-vector, stored at w tile_m D/2 + 512 k + 4 t + v."""

    def __init__(self, cfg: AuxConfig):
        if cfg.dtype not in _DTYPES or cfg.head_dim % 16 or cfg.tile_m != 64:
            raise NotImplementedError(f"DqPostprocess cannot implement {cfg}")
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.tile_m = cfg.tile_m

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, scale: Float32, stream):
        n = mdQ.shape[0] * mdQ.shape[1] * mdQ.shape[2] * (self.head_dim // 8)
        self.kernel(mAcc, mdQ, scale).launch(
            grid=[cute.ceil_div(n, _THREADS), 1, 1], block=[_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, scale: Float32):
        D = self.head_dim
        groups = D // 8
        half_d = D // 2
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        B, S, H = mdQ.shape[0], mdQ.shape[1], mdQ.shape[2]
        i = bidx * _THREADS + tidx
        if i < B * S * H * groups:
            grp = i % groups
            row = i // groups
            h = row % H
            bs = row // H
            s = bs % S
            b = bs // S
            r = s % self.tile_m
            w = grp // (groups // 2)
            k = grp % (groups // 2)
            # the four column pairs of the group: threads t0 .. t0 + 3, elements v0, v0 + 1
            pos0 = (w * self.tile_m * half_d + 512 * k + 4 * (32 * (r // 16) + 4 * (r % 8))
                    + 2 * ((r % 16) // 8))
            gAcc = mAcc[b, h, s // self.tile_m, None]
            rAcc = cute.make_rmem_tensor((8,), Float32)
            for j in cutlass.range_constexpr(4):
                cute.autovec_copy(cute.local_tile(gAcc, (2,), (pos0 // 2 + 2 * j,)),
                                  cute.local_tile(rAcc, (2,), (j,)))
            rdQ = cute.make_rmem_tensor((8,), mdQ.element_type)
            rdQ.store((rAcc.load() * scale).to(mdQ.element_type))
            cute.autovec_copy(rdQ, cute.local_tile(mdQ[b, s, h, None], (8,), (grp,)))


_COMPILE_CACHE = CompileCache("bwd_aux")


def _fake_args(cfg: AuxConfig):
    dt = cfg.cutlass_dtype
    div = 128 // dt.width
    sym = cute.sym_int
    B, S, H = sym(), sym(), sym()
    D = cfg.head_dim
    if cfg.kind == "dpsum":
        return (fake_tensor(dt, (B, S, H, D), div), fake_tensor(dt, (B, S, H, D), div),
                fake_tensor(Float32, (B, H, S), 1, 4))
    return (fake_tensor(Float32, (B, H, sym(), cfg.tile_m * D), 4, 16),
            fake_tensor(dt, (B, S, H, D), div))


def compile_aux(cfg: AuxConfig, gpu_arch=None, use_cache: bool = True, extra_options: str = ""):
    """Compile (or fetch from the cache) the pre- or postprocess kernel of ``cfg``; shapes stay
    symbolic. ``gpu_arch`` (e.g. "sm_90a") compiles for that target without a GPU."""
    if cfg.kind not in ("dpsum", "dq"):
        raise ValueError(f"AuxConfig.kind must be 'dpsum' or 'dq', got {cfg.kind!r}")

    def build():
        kernel = (BwdPreprocess if cfg.kind == "dpsum" else DqPostprocess)(cfg)
        return compile_kernel(kernel, _fake_args(cfg), gpu_arch, extra_options,
                              with_scale=cfg.kind == "dq")

    return _COMPILE_CACHE.get(compile_cache_key(cfg, gpu_arch), build, use_cache)

