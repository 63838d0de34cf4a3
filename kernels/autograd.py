"""Masked attention as a ``torch.library`` custom-op pair with autograd.

``compilemask::attention_fwd(q, k, v, <descriptor tensors>, <ints>, mask_key, scale)
-> (out, lse)`` and ``compilemask::attention_bwd(dout, dlse, q, k, v, out, lse, <descriptor
tensors>, ...) -> (dq, dk, dv)`` are opaque to ``torch.compile`` (fake implementations give the
shapes), so a compiled model traces through them without graph breaks; the forward's autograd
formula (``torch.library.register_autograd``) saves ``q, k, v, out, lse`` and calls the backward
op, so activation checkpointing just re-runs the forward op.

The descriptor enters as non-differentiable tensors (intervals, row_region, bitmaps, params,
row_params) plus ints (seqlens, tiles) and the compiled mask's semantic key (a string: the
``CompiledMask`` object itself is kept in a registry here, needed for fallback predicates and the
dense reference); the ``KernelOptions`` of the cute kernels enter as their string
(``KernelOptions.to_str``).

Implementations
* CUDA: the CuTe forward (``flash_fwd``) and backward (``flash_bwd``); a configuration either
  kernel cannot handle falls back to the dense reference, said once in the log.
* CPU (and anything else): the dense float32 reference; forward = ``attention_reference``,
  backward = the explicit formulas ``dS = P * (dP - rowsum(dO * O) + dLSE)``,
  ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dV = P^T dO`` (GQA: summed over the group).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

__all__ = ["attention_op", "register_mask", "attention_fwd_reference", "attention_bwd_reference"]

log = logging.getLogger("compilemask")
_SAID: set = set()
_MASKS: dict = {}  # CompiledMask.key -> CompiledMask
_FALLBACKS: dict = {}  # CompiledMask.key -> kernels.flash_fwd.Fallback | None


def _say_once(msg: str):
    if msg not in _SAID:
        _SAID.add(msg)
        log.warning(msg)


def register_mask(mask) -> str:
    """Keep ``mask`` reachable from its semantic key (equal keys compile to equal code)."""
    key = str(mask.key)
    _MASKS.setdefault(key, mask)
    return key


def _mask(key):
    if key in _MASKS:
        return _MASKS[key]
    from compilemask.compiled import mask_for_key

    return mask_for_key(key)


def _descriptor(mask_key, seqlen_q, seqlen_k, intervals, row_region, fwd_bitmap, bwd_bitmap,
                params, row_params, fwd_tm, fwd_tn, bwd_tm, bwd_tn, extra=(), max_seqlen=0):
    from compilemask.descriptor import ExecutionDescriptor, TileConfig

    # a single extra tensor is a segments pattern's cu_seqlens (see op_extra)
    segments = (extra[0], max_seqlen) if len(extra) == 1 else None
    return ExecutionDescriptor(
        mask=_mask(mask_key), seqlen_q=seqlen_q, seqlen_k=seqlen_k, intervals=intervals,
        row_region=row_region, fwd_tiles=TileConfig(fwd_tm, fwd_tn), fwd_bitmap=fwd_bitmap,
        bwd_tiles=TileConfig(bwd_tm, bwd_tn), bwd_bitmap=bwd_bitmap, params=params,
        row_params=row_params, segments=segments)


def _lists(extra, at):
    """The BlockSparseLists at ``extra[at:at + 4]`` (fa4 engine), else None."""
    if len(extra) < 8:
        return None
    from compilemask.blocksparse import BlockSparseLists

    return BlockSparseLists(*extra[at:at + 4])


def op_extra(desc, engine: str, head_dim: int) -> tuple[list, int]:
    """The engine's per-batch tensors beyond the descriptor core, as op inputs: the forward
    and backward block-sparse lists (fa4), or a segments pattern's cu_seqlens (native)."""
    if engine == "fa4":
        bwd = desc.block_sparse("bwd64" if head_dim == 128 else "bwd128")
        return [*desc.block_sparse("fwd"), *bwd], 0
    if engine == "native" and desc.segments is not None:
        return [desc.segments[0]], int(desc.segments[1])
    return [], 0


def _fallback(mask_key):
    if mask_key not in _FALLBACKS:
        mask = _mask(mask_key)
        fb = None
        if mask.has_fallback:
            from .flash_fwd import Fallback

            fb = Fallback.from_mask(mask)
        _FALLBACKS[mask_key] = fb
    return _FALLBACKS[mask_key]


# ----------------------------------------------------------------------------------------------
# Reference implementations (CPU path, and the CUDA fallback)
# ----------------------------------------------------------------------------------------------
def attention_fwd_reference(q, k, v, dense_mask, softmax_scale):
    from compilemask.reference import attention_reference

    with torch.no_grad():
        out, lse = attention_reference(q, k, v, dense_mask, softmax_scale=softmax_scale,
                                       return_lse=True)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.contiguous(), lse.to(acc).contiguous()


def attention_bwd_reference(dout, dlse, q, k, v, out, lse, dense_mask, softmax_scale):
    """Explicit dense backward in float32 (float64 for float64 inputs)."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        qf, kf, vf, dof, of = (t.to(acc).transpose(1, 2) for t in (q, k, v, dout, out))
        if G != 1:
            kf = kf.repeat_interleave(G, dim=1)
            vf = vf.repeat_interleave(G, dim=1)
        lse = lse.to(acc)
        s = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale  # [B, H, Sq, Sk]
        m = dense_mask.to(s.device).unsqueeze(1)
        sees = torch.isfinite(lse).unsqueeze(-1)  # rows that see something
        lse_safe = torch.where(sees, lse.unsqueeze(-1), torch.zeros_like(lse.unsqueeze(-1)))
        p = torch.where(m & sees, torch.exp(s - lse_safe), torch.zeros_like(s))
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        dpsum = (dof * of).sum(-1, keepdim=True)
        if dlse is not None:
            dpsum = dpsum - torch.where(sees, dlse.to(acc).unsqueeze(-1), torch.zeros_like(dpsum))
        ds = p * (dp - dpsum)
        dq = torch.matmul(ds, kf) * softmax_scale
        dk = torch.matmul(ds.transpose(-1, -2), qf) * softmax_scale
        dv = torch.matmul(p.transpose(-1, -2), dof)
        if G != 1:
            Sk = k.shape[1]
            dk = dk.view(B, Hkv, G, Sk, D).sum(2)
            dv = dv.view(B, Hkv, G, Sk, D).sum(2)
        return (dq.transpose(1, 2).to(q.dtype).contiguous(),
                dk.transpose(1, 2).to(k.dtype).contiguous(),
                dv.transpose(1, 2).to(v.dtype).contiguous())


# ----------------------------------------------------------------------------------------------
# CUDA kernels (with reference fallback)
# ----------------------------------------------------------------------------------------------
def _kernel_dtype_ok(q) -> bool:
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128)


def _kernel_options(options: str):
    from compilemask.options import KernelOptions

    return KernelOptions.from_str(options) if options else None


def _cuda_fwd(q, k, v, desc, mask_key, scale, options=""):
    if _kernel_dtype_ok(q):
        try:
            from .flash_fwd import flash_fwd

            out, lse = flash_fwd(q, k, v, desc.intervals, desc.fwd_bitmap, desc.row_region,
                                 desc.params, desc.row_params, tile_m=desc.fwd_tiles.tile_m,
                                 tile_n=desc.fwd_tiles.tile_n, softmax_scale=scale,
                                 fallback=_fallback(mask_key),
                                 options=_kernel_options(options))
            return out.contiguous(), lse.contiguous()  # the strides the fake kernel promises
        except (NotImplementedError, ImportError) as e:
            _say_once(f"compilemask::attention_fwd: CuTe forward unavailable ({e}); using the "
                      f"dense reference")
    else:
        _say_once(f"compilemask::attention_fwd: no CuTe forward for {q.dtype}, head dim "
                  f"{q.shape[-1]}; using the dense reference")
    return attention_fwd_reference(q, k, v, desc.dense_mask(), scale)


def _cuda_bwd(dout, dlse, q, k, v, out, lse, desc, mask_key, scale, deterministic=False,
              options=""):
    if _kernel_dtype_ok(q):
        try:
            from .flash_bwd import flash_bwd

            grads = flash_bwd(dout, q, k, v, out, lse, desc.intervals, desc.bwd_bitmap,
                              desc.row_region, desc.params, desc.row_params,
                              tile_m=desc.bwd_tiles.tile_m, tile_n=desc.bwd_tiles.tile_n,
                              softmax_scale=scale, fallback=_fallback(mask_key), dlse=dlse,
                              deterministic=deterministic,
                              options=_kernel_options(options))
            return tuple(g.contiguous() for g in grads)
        except (NotImplementedError, ImportError) as e:
            _say_once(f"compilemask::attention_bwd: CuTe backward unavailable ({e}); using the "
                      f"dense reference")
    else:
        _say_once(f"compilemask::attention_bwd: no CuTe backward for {q.dtype}, head dim "
                  f"{q.shape[-1]}; using the dense reference")
    return attention_bwd_reference(dout, dlse, q, k, v, out, lse, desc.dense_mask(), scale)


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("compilemask::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    intervals: Tensor, row_region: Tensor, fwd_bitmap: Tensor, bwd_bitmap: Tensor,
    params: Tensor, row_params: Tensor,
    seqlen_q: int, seqlen_k: int, fwd_tile_m: int, fwd_tile_n: int, bwd_tile_m: int,
    bwd_tile_n: int, mask_key: str, softmax_scale: float, deterministic: bool,
    engine: str, extra: list[Tensor], max_seqlen: int, options: str,
) -> tuple[Tensor, Tensor]:
    desc = _descriptor(mask_key, seqlen_q, seqlen_k, intervals, row_region, fwd_bitmap,
                       bwd_bitmap, params, row_params, fwd_tile_m, fwd_tile_n, bwd_tile_m,
                       bwd_tile_n, extra, max_seqlen)
    if engine in ("fa4", "native"):
        from . import fa4

        lists = _lists(extra, 0)
        out, lse = fa4.fwd(q, k, v, desc, softmax_scale, engine, lists=lists)
        return out.contiguous(), lse.contiguous()
    if q.is_cuda and engine == "cute":
        return _cuda_fwd(q, k, v, desc, mask_key, softmax_scale, options)
    return attention_fwd_reference(q, k, v, desc.dense_mask(), softmax_scale)


@attention_fwd.register_fake
def _(q, k, v, intervals, row_region, fwd_bitmap, bwd_bitmap, params, row_params, seqlen_q,
      seqlen_k, fwd_tile_m, fwd_tile_n, bwd_tile_m, bwd_tile_n, mask_key, softmax_scale,
      deterministic, engine, extra, max_seqlen, options):
    B, Sq, H, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (B, H, Sq), dtype=acc)


@torch.library.custom_op("compilemask::attention_bwd", mutates_args=())
def attention_bwd(
    dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor,
    intervals: Tensor, row_region: Tensor, fwd_bitmap: Tensor, bwd_bitmap: Tensor,
    params: Tensor, row_params: Tensor,
    seqlen_q: int, seqlen_k: int, fwd_tile_m: int, fwd_tile_n: int, bwd_tile_m: int,
    bwd_tile_n: int, mask_key: str, softmax_scale: float, deterministic: bool,
    engine: str, extra: list[Tensor], max_seqlen: int, options: str,
) -> tuple[Tensor, Tensor, Tensor]:
    desc = _descriptor(mask_key, seqlen_q, seqlen_k, intervals, row_region, fwd_bitmap,
                       bwd_bitmap, params, row_params, fwd_tile_m, fwd_tile_n, bwd_tile_m,
                       bwd_tile_n, extra, max_seqlen)
    if engine in ("fa4", "native"):
        from . import fa4

        grads = fa4.bwd(dout, q, k, v, out, lse, desc, softmax_scale, engine, dlse=dlse,
                        deterministic=deterministic, lists=_lists(extra, 4))
        return tuple(g.contiguous() for g in grads)
    if q.is_cuda and engine == "cute":
        return _cuda_bwd(dout, dlse, q, k, v, out, lse, desc, mask_key, softmax_scale,
                         deterministic, options)
    return attention_bwd_reference(dout, dlse, q, k, v, out, lse, desc.dense_mask(),
                                   softmax_scale)


@attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, *args):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))




def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse = output
    extra = list(inputs[19])
    ctx.n_extra = len(extra)
    ctx.save_for_backward(q, k, v, out, lse, *inputs[3:9], *extra)
    ctx.desc_scalars = tuple(inputs[9:19])
    ctx.max_seqlen = inputs[20]
    ctx.options = inputs[21]


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    desc_tensors, extra = saved[:6], saved[6:]
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.compilemask.attention_bwd(
        dout.contiguous(), dlse, q, k, v, out, lse, *desc_tensors, *ctx.desc_scalars,
        list(extra), ctx.max_seqlen, ctx.options)
    # one None per input; the extra tensors' slot is a list of them
    return (dq, dk, dv) + (None,) * 16 + ([None] * ctx.n_extra, None, None)


torch.library.register_autograd("compilemask::attention_fwd", _backward,
                                setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------
def attention_op(q, k, v, desc, softmax_scale: Optional[float] = None, return_lse: bool = False,
                 deterministic: bool = False, engine: str = "cute", options=None):
    """``cm.attention`` through the custom op: ``out`` (and float32 ``lse [B, H, Sq]``).
    ``engine``: "cute" (this package's kernels), "fa4" / "native" (``kernels.fa4``) or
    "reference" (the dense path on any device); ``options``: the cute kernels'
    ``KernelOptions`` (None: the defaults)."""
    key = register_mask(desc.mask)
    if desc.device != q.device:
        if not torch.compiler.is_compiling():
            _say_once(f"cm.attention: the descriptor is on {desc.device} and q on {q.device}: it "
                      f"is copied (and its tile lists rebuilt) on every call; preprocess on "
                      f"{q.device} (device= or metadata there)")
        desc = desc.to(q.device)
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    extra, max_seqlen = op_extra(desc, engine, q.shape[-1])
    out, lse = torch.ops.compilemask.attention_fwd(
        q, k, v, desc.intervals, desc.row_region, desc.fwd_bitmap, desc.bwd_bitmap, desc.params,
        desc.row_params, int(desc.seqlen_q), int(desc.seqlen_k), desc.fwd_tiles.tile_m,
        desc.fwd_tiles.tile_n, desc.bwd_tiles.tile_m, desc.bwd_tiles.tile_n, key, scale,
        bool(deterministic), engine, extra, max_seqlen,
        options.to_str() if options is not None else "")
    return (out, lse) if return_lse else out
