"""Host interface of the CuTe kernels: the compile cache, fake launch arguments for compiling
without a GPU, and the launch functions :func:`flash_fwd` and :func:`flash_bwd`."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import replace
from typing import Optional

import cutlass.cute as cute
from cutlass import Float32, Int32

from compilemask.contract.cache import CompileCache
from compilemask.contract.descriptor import bitmap_shape, unpack_bitmap
from compilemask.contract.env import cute_dsl_arch
from compilemask.contract.options import KernelOptions, bitmap_fits_smem, device_arch

from .bwd_aux import AuxConfig, compile_aux
from .common import (
    compile_cache_key,
    compile_kernel,
    fake_tensor,
    fallback_predicates,
)
from .config import FlashBwdConfig, FlashFwdConfig
from .descriptor_tensors import DescriptorTensors, DescriptorTensorsTorch
from .fallback import Fallback, config_fields
from .flash_bwd import FlashBwd
from .flash_bwd_sm90 import FlashBwdSm90
from .flash_fwd import FlashFwd
from .flash_fwd_sm90 import FlashFwdSm90

__all__ = [
    "make_fake_args_fwd",
    "compile_flash_fwd",
    "flash_fwd",
    "make_fake_args_bwd",
    "compile_flash_bwd",
    "flash_bwd",
]

log = logging.getLogger("compilemask")

_FWD_CACHE = CompileCache("flash_fwd")
_BWD_CACHE = CompileCache("flash_bwd")


def _arch_from_env_or_device() -> int:
    """The target arch (e.g. 90): ``CUTE_DSL_ARCH``, else the current device's, else 90."""
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


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def make_fake_args_fwd(cfg: FlashFwdConfig):
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
    return q, k, v, o, lse, DescriptorTensors.fake(B, Sq, cfg.num_intervals)


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
            kernel = FlashFwdSm90(cfg, preds)
        else:
            kernel = FlashFwd(cfg, preds)
        return compile_kernel(kernel, make_fake_args_fwd(cfg), gpu_arch, extra_options)

    return _FWD_CACHE.get(compile_cache_key(cfg, gpu_arch, options), build, use_cache)


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
        **config_fields(fallback),
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
    desc = DescriptorTensorsTorch.of(B, intervals, fwd_bitmap, row_region, params, row_params)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    fn(q, k, v, out, lse, desc, float(scale * math.log2(math.e)))
    return out, lse


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
def make_fake_args_bwd(cfg: FlashBwdConfig):
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
    args = (q, k, v, do, lse, dpsum, dq_accum, dk, dv,
            DescriptorTensors.fake(B, Sq, cfg.num_intervals))
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
        return compile_kernel(kernel, make_fake_args_bwd(cfg), gpu_arch, extra_options)

    return _BWD_CACHE.get(compile_cache_key(cfg, gpu_arch, options), build, use_cache)


@functools.lru_cache(maxsize=64)  # (tile_m, head_dim, device): a few per process
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
        **config_fields(fallback),
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
    desc = DescriptorTensorsTorch.of(B, intervals, bwd_bitmap, row_region, params, row_params)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    det_args = ()
    if cfg.arch >= 90:
        det_args = (None, None)
        if deterministic:  # per dQ tile half: adds done; per (kv tile, q tile): adds before it
            nonempty = (unpack_bitmap(desc.bitmap, n_m) & 1).to(torch.int32)  # [B, n_n, n_m]
            rank = (torch.cumsum(nonempty, dim=1, dtype=torch.int32) - nonempty).contiguous()
            det_args = (torch.zeros(B, H, n_m, 2, dtype=torch.int32, device=dev), rank)
    fn(q, k, v, dout, lse, dpsum, dq_accum, dk, dv, desc, *det_args, float(scale))
    # postprocess: dQ = scale * dq_accum, in the input dtype (bulk: gathered from the fragment
    # order in the same pass)
    if cfg.dq_reduce == "bulk":
        dq = torch.empty(B, Sq, H, D, dtype=q.dtype, device=dev)
        compile_aux(AuxConfig("dq", cfg.dtype, D, tile_m))(dq_accum, dq, float(scale))
    else:
        dq = (dq_accum * scale).to(q.dtype)
    return dq, dk, dv
