"""Masked attention as a ``torch.library`` custom-op pair with autograd.

``compilemask::attention_fwd(q, k, v, *DescriptorArgs, *_Call) -> (out, lse)`` and
``compilemask::attention_bwd(dout, dlse, q, k, v, out, lse, *DescriptorArgs, *_Call)
-> (dq, dk, dv)`` are opaque to ``torch.compile`` (fake implementations give the
shapes), so a compiled model traces through them without graph breaks; the forward's autograd
formula (``torch.library.register_autograd``) saves ``q, k, v, out, lse`` and calls the backward
op, so activation checkpointing just re-runs the forward op.

The descriptor enters as ``compilemask.descriptor.DescriptorArgs`` (its non-differentiable
tensors, then its ints; the schemas are generated from its fields) and the compiled mask's
semantic key (a string: the
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

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compilemask.blocksparse import BlockSparseLists
from compilemask.bounds import check_kernel_predicates, fits_int32, kernel_predicates
from compilemask.cache import mask_for_key, register_mask
from compilemask.codegen.cute_predicate import UnsupportedExpression, predicate_source
from compilemask.descriptor import DescriptorArgs
from compilemask.log import say_once
from compilemask.options import DEFAULT_SCORE_INDEX, DEFAULT_SOFTCAP, KernelOptions
from compilemask.reference import attention_reference, descriptor_dense_mask
from compilemask.score_mod import score_mod_for_key

from . import fa4

__all__ = ["attention_op", "register_mask", "attention_fwd_reference", "attention_bwd_reference"]

_FALLBACKS: dict = {}  # CompiledMask.key -> kernels.fallback.Fallback | None


class _Call(NamedTuple):
    """The ops' arguments after the descriptor's (``DescriptorArgs``): the call's settings and
    the engine's per-batch tensors (``op_extra``)."""

    mask_key: str
    softmax_scale: float
    deterministic: bool
    engine: str
    extra: list
    max_seqlen: int
    options: str
    score_mod: str  # a compiled score_mod's key ("" for none)
    score_aux: list  # its tables, as the kernels read them
    sink: Optional[Tensor]  # a per-head learnable sink logit [H] (gpt-oss), or None
    heads: int  # > 1: the descriptor's sequences are (batch, head) pairs, head-major per batch


_CALL_SCHEMA = ("str mask_key, float softmax_scale, bool deterministic, str engine, "
                "Tensor[] extra, SymInt max_seqlen, str options, str score_mod, "
                "Tensor[] score_aux, Tensor? sink, int heads")
_LISTS = ("extra", "score_aux")  # the fields that are lists of tensors


def _unpack(args) -> tuple[DescriptorArgs, _Call]:
    """An op's arguments past its own tensors: the descriptor fields, then the call's."""
    d = DescriptorArgs.from_op_args(args)
    return d, _Call(*args[len(d):])


def _descriptor(d: DescriptorArgs, call: _Call):
    # a single extra tensor is a segments pattern's cu_seqlens (see op_extra)
    segments = (call.extra[0], call.max_seqlen) if len(call.extra) == 1 else None
    desc = d.descriptor(mask_for_key(call.mask_key), segments)
    n = len(BlockSparseLists._fields)
    if len(call.extra) == 2 * n + 1:  # the lists, then the column view
        desc = dataclasses.replace(desc, columns=call.extra[2 * n])
    return desc


def _lists(extra, backward: bool):
    """The forward or backward BlockSparseLists of the fa4 engine's ``extra`` (``op_extra``),
    else None."""
    n = len(BlockSparseLists._fields)
    if len(extra) not in (2 * n, 2 * n + 1):
        return None
    return BlockSparseLists(*extra[n:2 * n] if backward else extra[:n])


def op_extra(desc, engine: str, head_dim: int) -> tuple[list, int]:
    """The engine's per-batch tensors beyond the descriptor core, as op inputs: the forward
    and backward block-sparse lists (fa4) and the column view where the descriptor has it, or
    a segments pattern's cu_seqlens (native)."""
    if engine == "fa4":
        bwd = desc.block_sparse("bwd64" if head_dim == 128 else "bwd128")
        cols = [] if desc.columns is None else [desc.columns]
        return [*desc.block_sparse("fwd"), *bwd, *cols], 0
    if engine == "native" and desc.segments is not None:
        return [desc.segments[0]], int(desc.segments[1])
    return [], 0


def _fallback(mask_key):
    if mask_key not in _FALLBACKS:
        mask = mask_for_key(mask_key)
        fb = None
        if mask.has_fallback:
            from .fallback import Fallback  # the CuTe kernels' module: needs the CUTLASS DSL

            fb = Fallback.from_mask(mask)
        _FALLBACKS[mask_key] = fb
    return _FALLBACKS[mask_key]


# ----------------------------------------------------------------------------------------------
# Reference implementations (CPU path, and the CUDA fallback)
# ----------------------------------------------------------------------------------------------
def attention_fwd_reference(q, k, v, dense_mask, softmax_scale, sink=None):
    with torch.no_grad():
        out, lse = attention_reference(q, k, v, dense_mask, softmax_scale=softmax_scale,
                                       return_lse=True, learnable_sink=sink)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.contiguous(), lse.to(acc).contiguous()


def attention_bwd_reference(dout, dlse, q, k, v, out, lse, dense_mask, softmax_scale, sink=None):
    """Explicit dense backward in float32 (float64 for float64 inputs); with a learnable sink
    (its logit is in ``lse``) also ``dsink[h] = -sum over rows exp(sink[h] - lse) * (dO.O -
    dlse)``, returned fourth."""
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
        m = dense_mask.to(s.device)
        m = m if m.dim() == 4 else m.unsqueeze(1)  # [B, H, Sq, Sk]: a mask per head
        sees = torch.isfinite(lse).unsqueeze(-1)  # rows that see something
        lse_safe = torch.where(sees, lse.unsqueeze(-1), torch.zeros_like(lse.unsqueeze(-1)))
        p = torch.where(m & sees, torch.exp(s - lse_safe), torch.zeros_like(s))
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        dpsum = (dof * of).sum(-1, keepdim=True)
        if dlse is not None:
            dpsum = dpsum - torch.where(sees, dlse.to(acc).unsqueeze(-1), torch.zeros_like(dpsum))
        ds = p * (dp - dpsum)
        dsink = None
        if sink is not None:
            dsink = -(torch.exp(sink.to(acc).view(1, H, 1, 1) - lse.unsqueeze(-1))
                      * dpsum).sum(dim=(0, 2, 3)).to(sink.dtype)
        dq = torch.matmul(ds, kf) * softmax_scale
        dk = torch.matmul(ds.transpose(-1, -2), qf) * softmax_scale
        dv = torch.matmul(p.transpose(-1, -2), dof)
        if G != 1:
            Sk = k.shape[1]
            dk = dk.view(B, Hkv, G, Sk, D).sum(2)
            dv = dv.view(B, Hkv, G, Sk, D).sum(2)
        grads = (dq.transpose(1, 2).to(q.dtype).contiguous(),
                 dk.transpose(1, 2).to(k.dtype).contiguous(),
                 dv.transpose(1, 2).to(v.dtype).contiguous())
        return grads if sink is None else (*grads, dsink)


# ----------------------------------------------------------------------------------------------
# CUDA kernels (with reference fallback)
# ----------------------------------------------------------------------------------------------
def _score(call: _Call):
    """``(ScoreMod, tables)`` of the call's score_mod, or None."""
    if not call.score_mod:
        return None
    return score_mod_for_key(call.score_mod), list(call.score_aux)


def _kernel_dtype_ok(q) -> bool:
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128)


def _kernel_options(options: str):
    return KernelOptions.from_str(options) if options else None


def _mask_mod_variant(options: str):
    return getattr(_kernel_options(options), "mask_mod", None)


def _score_of(call: _Call):
    """The call's score_mod as the FA4 engines take it: a recognized softcap is FA4's own only
    where ``KernelOptions.softcap`` says ``"fa4"`` (the default: ``DEFAULT_SOFTCAP``); index
    expressions convert by bits unless ``KernelOptions.score_index`` says ``"cvt"``."""
    score = _score(call)
    if score is None:
        return None
    opts = _kernel_options(call.options)
    softcap = getattr(opts, "softcap", None) or DEFAULT_SOFTCAP
    index = getattr(opts, "score_index", None) or DEFAULT_SCORE_INDEX
    return _score_variant(call.score_mod, softcap == "score_mod", index == "bits"), score[1]


@functools.lru_cache(maxsize=256)
def _score_variant(key: str, softcap_as_score_mod: bool, index_bits: bool):
    """The score_mod of ``key`` as the options run it, made once per (score_mod, options): its
    new key hashes the whole expression, too slow for every call."""
    sm = score_mod_for_key(key)
    if sm.softcap is not None and softcap_as_score_mod:
        sm = dataclasses.replace(sm, softcap=None, key="")
    if sm.softcap is None and index_bits:
        sm = dataclasses.replace(sm, index_bits=True, key="")
    return sm


def _cuda_fwd(q, k, v, desc, mask_key, scale, options=""):
    if _kernel_dtype_ok(q):
        try:
            from .interface import flash_fwd  # the CuTe kernels: need the CUTLASS DSL

            out, lse = flash_fwd(q, k, v, desc.intervals, desc.fwd_bitmap, desc.row_region,
                                 desc.params, desc.row_params, tile_m=desc.fwd_tiles.tile_m,
                                 tile_n=desc.fwd_tiles.tile_n, softmax_scale=scale,
                                 fallback=_fallback(mask_key),
                                 options=_kernel_options(options))
            return out.contiguous(), lse.contiguous()  # the strides the fake kernel promises
        except (NotImplementedError, ImportError) as e:
            say_once(f"compilemask::attention_fwd: CuTe forward unavailable ({e}); using the "
                     f"dense reference")
    else:
        say_once(f"compilemask::attention_fwd: no CuTe forward for {q.dtype}, head dim "
                 f"{q.shape[-1]}; using the dense reference")
    return attention_fwd_reference(q, k, v, descriptor_dense_mask(desc), scale)


def _cuda_bwd(dout, dlse, q, k, v, out, lse, desc, mask_key, scale, deterministic=False,
              options=""):
    if _kernel_dtype_ok(q):
        try:
            from .interface import flash_bwd  # the CuTe kernels: need the CUTLASS DSL

            grads = flash_bwd(dout, q, k, v, out, lse, desc.intervals, desc.bwd_bitmap,
                              desc.row_region, desc.params, desc.row_params,
                              tile_m=desc.bwd_tiles.tile_m, tile_n=desc.bwd_tiles.tile_n,
                              softmax_scale=scale, fallback=_fallback(mask_key), dlse=dlse,
                              deterministic=deterministic,
                              options=_kernel_options(options))
            return tuple(g.contiguous() for g in grads)
        except (NotImplementedError, ImportError) as e:
            say_once(f"compilemask::attention_bwd: CuTe backward unavailable ({e}); using the "
                     f"dense reference")
    else:
        say_once(f"compilemask::attention_bwd: no CuTe backward for {q.dtype}, head dim "
                 f"{q.shape[-1]}; using the dense reference")
    return attention_bwd_reference(dout, dlse, q, k, v, out, lse, descriptor_dense_mask(desc),
                                   scale)


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------
# The schemas list the descriptor's fields from ``DescriptorArgs`` (a field added there reaches
# both ops); the implementations take them as ``*args`` and unpack them by name.
_FWD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, {DescriptorArgs.schema()}, {_CALL_SCHEMA}) "
               "-> (Tensor, Tensor)")
# the backward's fourth output is the sink's gradient (empty without a sink)
_BWD_SCHEMA = ("(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
               f"{DescriptorArgs.schema()}, {_CALL_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)")


_READ: set = set()  # mask keys whose fallback rules the GPU code generator reads


def _check_predicates(mask, length: int, meta_max: int = 0) -> None:
    """Before any kernel is built: the GPU code generator reads every fallback rule (else a
    clear error naming the region), once per mask, and the predicates fit int32 at this length
    with metadata up to ``max(length, meta_max)`` (else the error names the term)."""
    if mask.key not in _READ:
        for r in mask.fallback_regions:
            try:
                predicate_source(r.rule, mask.scalar_params, mask.array_params,
                                 table_params=mask.table_params)
            except UnsupportedExpression as e:
                raise NotImplementedError(
                    f"Region {r.name!r}, rule {r.rule}: the GPU kernels cannot evaluate it as a "
                    f"predicate ({e}); backend='reference' runs it") from None
        _READ.add(mask.key)
    if not fits_int32(("predicates", mask.key),
                      lambda: [e for _, _, e in kernel_predicates(mask)], length, meta_max):
        check_kernel_predicates(mask, length, meta_max)  # raises, naming the region and term


@torch.library.custom_op("compilemask::attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, *args) -> tuple[Tensor, Tensor]:
    d, call = _unpack(args)
    return _fwd_impl(q, k, v, _descriptor(d, call), call)


def _fwd_impl(q, k, v, desc, call: _Call) -> tuple[Tensor, Tensor]:
    """The forward op's body, on the descriptor itself (the op rebuilds it from its args)."""
    scale, engine = call.softmax_scale, call.engine
    if engine in ("fa4", "cute") and desc.mask.has_fallback:
        # here the checks run eagerly, also under a compiled graph, and once per (mask, length)
        _check_predicates(desc.mask, max(desc.seqlen_q, desc.seqlen_k), desc.meta_max)
    if engine in ("fa4", "native"):
        lists = _lists(call.extra, backward=False)
        out, lse = fa4.fwd(q, k, v, desc, scale, engine, lists=lists,
                           variant=_mask_mod_variant(call.options), score=_score_of(call),
                           sink=call.sink, heads=call.heads)
        return out.contiguous(), lse.contiguous()
    if call.sink is not None and engine != "reference":
        raise NotImplementedError(f"compilemask::attention_fwd: no learnable sink on the "
                                  f"{engine} engine")
    if q.is_cuda and engine == "cute":
        return _cuda_fwd(q, k, v, desc, call.mask_key, scale, call.options)
    dense = descriptor_dense_mask(desc, call.heads)
    return attention_fwd_reference(q, k, v, dense, scale, call.sink)


@attention_fwd.register_fake
def _(q, k, v, *args):
    B, Sq, H, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (B, H, Sq), dtype=acc)


@torch.library.custom_op("compilemask::attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def attention_bwd(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                  out: Tensor, lse: Tensor, *args) -> tuple[Tensor, Tensor, Tensor]:
    d, call = _unpack(args)
    desc = _descriptor(d, call)
    scale, engine = call.softmax_scale, call.engine
    no_sink = q.new_empty(0)
    if engine in ("fa4", "native"):
        grads = fa4.bwd(dout, q, k, v, out, lse, desc, scale, engine, dlse=dlse,
                        deterministic=call.deterministic, lists=_lists(call.extra, backward=True),
                        variant=_mask_mod_variant(call.options), score=_score_of(call),
                        sink=call.sink, heads=call.heads)
        grads = tuple(g.contiguous() for g in grads)
        return grads if len(grads) == 4 else (*grads, no_sink)
    if q.is_cuda and engine == "cute":
        return (*_cuda_bwd(dout, dlse, q, k, v, out, lse, desc, call.mask_key, scale,
                           call.deterministic, call.options), no_sink)
    grads = attention_bwd_reference(dout, dlse, q, k, v, out, lse,
                                    descriptor_dense_mask(desc, call.heads), scale, call.sink)
    return grads if call.sink is not None else (*grads, no_sink)


@attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, *args):
    sink = _unpack(args)[1].sink
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            q.new_empty(0) if sink is None else torch.empty_like(sink))


def _setup_context(ctx, inputs, output):
    # an unused output's gradient stays None: a zero dlse would send FA4's backward down its
    # dlse path (and cost an allocation) on every step that does not return the LSE
    ctx.set_materialize_grads(False)
    q, k, v, *args = inputs
    out, lse = output
    d, call = _unpack(args)
    sink = [] if call.sink is None else [call.sink]
    ctx.save_for_backward(q, k, v, out, lse, *d.tensors(), *call.extra, *call.score_aux, *sink)
    ctx.desc_scalars = d.scalars()
    ctx.call = call._replace(extra=len(call.extra), score_aux=len(call.score_aux),
                             sink=len(sink))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    n = len(DescriptorArgs.tensor_fields())
    d = DescriptorArgs(*saved[:n], *ctx.desc_scalars)
    ne, na = ctx.call.extra, ctx.call.score_aux
    call = ctx.call._replace(extra=list(saved[n:n + ne]), score_aux=list(saved[n + ne:n + ne + na]),
                             sink=saved[n + ne + na] if ctx.call.sink else None)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = torch.ops.compilemask.attention_bwd(
        dout.contiguous(), dlse, q, k, v, out, lse, *d.to_op_args(), *call)
    # one None per input; a list of tensors' slot is a list of them; the sink its gradient
    rest = tuple([None] * len(getattr(call, f)) if f in _LISTS
                 else (dsink if f == "sink" and call.sink is not None else None)
                 for f in _Call._fields)
    return (dq, dk, dv) + (None,) * len(d) + rest


torch.library.register_autograd("compilemask::attention_fwd", _backward,
                                setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------
def attention_op(q, k, v, desc, softmax_scale: Optional[float] = None, return_lse: bool = False,
                 deterministic: bool = False, engine: str = "cute", options=None, score=None,
                 sink=None, heads: int = 1):
    """``cm.attention`` through the custom op: ``out`` (and float32 ``lse [B, H, Sq]``).
    ``engine``: "cute" (this package's kernels), "fa4" / "native" (``kernels.fa4``) or
    "reference" (the dense path on any device); ``options``: the cute kernels'
    ``KernelOptions`` (None: the defaults); ``score``: ``(score_mod key, tables as the kernels
    read them)`` (``compilemask.score_mod``; fa4 / native engines); ``sink``: a learnable sink
    logit per head ``[H]`` (fa4 / native / reference; differentiable); ``heads > 1``: the
    descriptor holds one sequence per (batch, head), ``b * heads + h`` (fa4 / reference)."""
    key = register_mask(desc.mask)
    if desc.device != q.device:
        raise ValueError(f"attention_op: the descriptor is on {desc.device} and q on {q.device} "
                         "(cm.attention moves it once: compilemask.pipeline.on_device)")
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    extra, max_seqlen = op_extra(desc, engine, q.shape[-1])
    if score is not None and engine not in ("fa4", "native"):
        raise NotImplementedError(f"attention_op: a score_mod runs on the fa4 and native "
                                  f"engines, not {engine!r}")
    call = _Call(key, scale, bool(deterministic), engine, extra, max_seqlen,
                 options.to_str() if options is not None else "",
                 score[0] if score is not None else "",
                 list(score[1]) if score is not None else [], sink, int(heads))
    if _needs_op(q, k, v, sink):
        out, lse = torch.ops.compilemask.attention_fwd(
            q, k, v, *DescriptorArgs.of(desc).to_op_args(), *call)
    else:  # the op's own body: a decode step's host time is mostly the op's dispatch
        out, lse = _fwd_impl(q, k, v, desc, call)
    return (out, lse) if return_lse else out


def _needs_op(*tensors) -> bool:
    """The custom op is for autograd and for graphs (torch.compile, its fake tensors, tracing
    modes); eager calls without gradients run its body directly, with the same result."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    ts = [t for t in tensors if t is not None]
    if any(type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) for t in ts):
        return True  # a tensor subclass (fake, functional, DTensor...) dispatches through the op
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)
