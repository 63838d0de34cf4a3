"""Masked attention as a ``torch.library`` custom-op pair with autograd.

``compilemask::attention_fwd(q, k, v, *DescriptorArgs, *OpSlots, *OpSettings) -> (out, lse)``
and ``compilemask::attention_bwd(dout, dlse, q, k, v, out, lse, *DescriptorArgs, *OpSlots,
*OpSettings) -> (dq, dk, dv, dsink)`` are opaque to ``torch.compile`` (fake implementations
give the shapes), so a compiled model traces through them without graph breaks; the forward's
autograd formula (``torch.library.register_autograd``) saves ``q, k, v, out, lse`` and calls
the backward op, so activation checkpointing just re-runs the forward op.

What crosses the boundary is ``kernels.contract``'s: the descriptor's core
(``DescriptorArgs``), every optional per-batch tensor in a named slot (``OpSlots``: the fa4
engine's lists and column view, a segments pattern's offsets, a served batch's lengths and
page table, the score_mod's tables, the learnable sink) and the call's frozen settings
(``OpSettings``: the mask's and score_mod's keys, found in ``compilemask.contract.cache``'s bounded
registries, the scale, the engine, the kernels' ``KernelOptions`` as their string); the
schemas are generated from those three. Which engine runs a call is ``kernels.dispatch``'s.

Implementations
* CUDA: FA4 (``kernels.fa4``) for the fa4 and native engines, a served batch's forward
  included; the CuTe forward (``flash_fwd``) and backward (``flash_bwd``) for cute, where a
  configuration either kernel cannot handle falls back to the dense reference, said once.
* CPU (and anything else): the dense float32 reference; forward = ``attention_reference``,
  backward = the explicit formulas ``dS = P * (dP - rowsum(dO * O) + dLSE)``,
  ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dV = P^T dO`` (GQA: summed over the group).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor

from compilemask.codegen.cute_predicate import UnsupportedExpression, predicate_source
from compilemask.compiler.bounds import check_kernel_predicates, fits_int32, kernel_predicates
from compilemask.compiler.reference import attention_reference, descriptor_dense_mask
from compilemask.contract.descriptor import DescriptorArgs
from compilemask.contract.log import say_once
from compilemask.contract.lru import LRU, LRUSet
from compilemask.contract.options import DEFAULT_SCORE_INDEX, DEFAULT_SOFTCAP, KernelOptions

from . import fa4
from .contract import (
    OpSettings,
    OpSlots,
    args_schema,
    fake_outputs,
    mask_for_key,
    op_args,
    register_mask,
    score_mod_for_key,
    unpack,
)
from .dispatch import cute_kernel_reason, op_refusal

__all__ = ["attention_op", "register_mask", "attention_fwd_reference", "attention_bwd_reference"]

_MISSING = object()
_FALLBACKS = LRU(256)  # CompiledMask.key -> kernels.fallback.Fallback | None


def _descriptor(d: DescriptorArgs, slots: OpSlots, settings: OpSettings):
    """The descriptor an op reads, rebuilt from its arguments."""
    return slots.descriptor(d, mask_for_key(settings.mask_key))


def _fallback(mask_key):
    fb = _FALLBACKS.get(mask_key, _MISSING)
    if fb is _MISSING:
        mask = mask_for_key(mask_key)
        fb = None
        if mask.has_fallback:
            from .fallback import Fallback  # the CuTe kernels' module: needs the CUTLASS DSL

            fb = Fallback.from_mask(mask)
        _FALLBACKS[mask_key] = fb
    return fb


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
        m = dense_mask.to(qf.device)
        m = m if m.dim() == 4 else m.unsqueeze(1)  # [B, H, Sq, Sk]: a mask per head
        # rows that see nothing and keys no row sees may be memory the call does not own: their
        # weights are zero, and a zero times a NaN there would still be NaN
        zero = torch.zeros((), dtype=acc)
        key_seen, row_seen = m.any(dim=-2).unsqueeze(-1), m.any(dim=-1).unsqueeze(-1)
        kf, vf = torch.where(key_seen, kf, zero), torch.where(key_seen, vf, zero)
        qf, dof, of = (torch.where(row_seen, t, zero) for t in (qf, dof, of))
        s = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale  # [B, H, Sq, Sk]
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
            dv = dv.view(B, Hkv, G, Sk, v.shape[-1]).sum(2)  # v's head dim may differ
        grads = (dq.transpose(1, 2).to(q.dtype).contiguous(),
                 dk.transpose(1, 2).to(k.dtype).contiguous(),
                 dv.transpose(1, 2).to(v.dtype).contiguous())
        return grads if sink is None else (*grads, dsink)


# ----------------------------------------------------------------------------------------------
# CUDA kernels (with reference fallback)
# ----------------------------------------------------------------------------------------------
def _kernel_options(options: str):
    return KernelOptions.from_str(options) if options else None


def _mask_mod_variant(options: str):
    """The mask_mod variant the options ask for (None: ``variant_for_call`` chooses)."""
    return getattr(_kernel_options(options), "mask_mod", None)


def _score_of(settings: OpSettings, tables):
    """The call's score_mod as the FA4 engines take it, with its tables, or None: a recognized
    softcap is FA4's own only where ``KernelOptions.softcap`` says ``"fa4"`` (the default:
    ``DEFAULT_SOFTCAP``); index expressions convert by bits unless ``KernelOptions.score_index``
    says ``"cvt"``."""
    if not settings.score_mod:
        return None
    opts = _kernel_options(settings.options)
    softcap = getattr(opts, "softcap", None) or DEFAULT_SOFTCAP
    index = getattr(opts, "score_index", None) or DEFAULT_SCORE_INDEX
    return (_score_variant(settings.score_mod, softcap == "score_mod", index == "bits"),
            list(tables))


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
    why = cute_kernel_reason(q)
    if why is None:
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
        say_once(f"compilemask::attention_fwd: {why} (forward); using the dense reference")
    return attention_fwd_reference(q, k, v, descriptor_dense_mask(desc), scale)


def _cuda_bwd(dout, dlse, q, k, v, out, lse, desc, mask_key, scale, deterministic=False,
              options=""):
    why = cute_kernel_reason(q)
    if why is None:
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
        say_once(f"compilemask::attention_bwd: {why} (backward); using the dense reference")
    return attention_bwd_reference(dout, dlse, q, k, v, out, lse, descriptor_dense_mask(desc),
                                   scale)


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------
# The schemas are generated from kernels.contract's groups (a field added there reaches both
# ops); the implementations take them as ``*args`` and unpack them by name.
_FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {args_schema()}) -> (Tensor, Tensor)"
# the backward's fourth output is the sink's gradient (empty without a sink),
# and the fifth the gradients of the score_mod's trained tables (``OpSettings.train_tables``)
_BWD_SCHEMA = ("(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
               f"{args_schema()}) -> (Tensor, Tensor, Tensor, Tensor, Tensor[])")


_READ = LRUSet(1024)  # mask keys whose fallback rules the GPU code generator reads


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
    d, slots, settings = unpack(args)
    return _fwd_impl(q, k, v, _descriptor(d, slots, settings), slots, settings)


def _fwd_impl(q, k, v, desc, slots: OpSlots, settings: OpSettings) -> tuple[Tensor, Tensor]:
    """The forward op's body, on the descriptor itself (the op rebuilds it from its args)."""
    scale, engine = settings.softmax_scale, settings.engine
    why = op_refusal(engine, bool(settings.score_mod), slots.sink is not None, slots.served)
    if why:
        raise NotImplementedError(f"compilemask::attention_fwd: {why}")
    if engine in ("fa4", "cute") and desc.mask.has_fallback:
        # here the checks run eagerly, also under a compiled graph, and once per (mask, length)
        _check_predicates(desc.mask, max(desc.seqlen_q, desc.seqlen_k), desc.meta_max)
    if slots.served:  # a served batch: paged or packed keys, forward only
        out, lse = fa4.fwd_served(q, k, v, desc, scale, engine,
                                  **slots.served_lengths(desc.seqlen_q, desc.seqlen_k))
        return out.contiguous(), lse.contiguous()
    if engine in ("fa4", "native"):
        out, lse = fa4.fwd(q, k, v, desc, scale, engine, lists=slots.lists(backward=False),
                           variant=_mask_mod_variant(settings.options),
                           score=_score_of(settings, slots.score_aux), sink=slots.sink,
                           heads=settings.heads)
        return out.contiguous(), lse.contiguous()
    if q.is_cuda and engine == "cute":
        return _cuda_fwd(q, k, v, desc, settings.mask_key, scale, settings.options)
    dense = descriptor_dense_mask(desc, settings.heads)
    return attention_fwd_reference(q, k, v, dense, scale, slots.sink)


@attention_fwd.register_fake
def _(q, k, v, *args):
    out, lse = fake_outputs(q, unpack(args)[1])
    if v.shape[-1] != q.shape[-1]:  # out has v's head dim
        out = out.new_empty((*out.shape[:-1], v.shape[-1]))
    return out, lse


@torch.library.custom_op("compilemask::attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def attention_bwd(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                  out: Tensor, lse: Tensor, *args) -> tuple[Tensor, Tensor, Tensor]:
    d, slots, settings = unpack(args)
    desc = _descriptor(d, slots, settings)
    scale, engine = settings.softmax_scale, settings.engine
    no_sink = q.new_empty(0)
    if slots.served:
        raise NotImplementedError("compilemask::attention_bwd: a served batch (paged or packed "
                                  "keys) runs forward only")
    if engine in ("fa4", "native"):
        dtables = {n: torch.zeros(slots.score_aux[n].shape, dtype=torch.float32,
                                  device=q.device) for n in settings.trained()}
        grads = fa4.bwd(dout, q, k, v, out, lse, desc, scale, engine, dlse=dlse,
                        deterministic=settings.deterministic,
                        lists=slots.lists(backward=True),
                        variant=_mask_mod_variant(settings.options),
                        score=_score_of(settings, slots.score_aux), sink=slots.sink,
                        heads=settings.heads, table_grads=dtables)
        grads = tuple(g.contiguous() for g in grads)
        dtables = list(dtables.values())
        return (*grads, dtables) if len(grads) == 4 else (*grads, no_sink, dtables)
    if q.is_cuda and engine == "cute":
        return (*_cuda_bwd(dout, dlse, q, k, v, out, lse, desc, settings.mask_key, scale,
                           settings.deterministic, settings.options), no_sink, [])
    grads = attention_bwd_reference(dout, dlse, q, k, v, out, lse,
                                    descriptor_dense_mask(desc, settings.heads), scale,
                                    slots.sink)
    return (*grads, []) if slots.sink is not None else (*grads, no_sink, [])


@attention_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, *args):
    _, slots, settings = unpack(args)
    sink = slots.sink
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            q.new_empty(0) if sink is None else torch.empty_like(sink),
            [q.new_empty(slots.score_aux[n].shape, dtype=torch.float32)
             for n in settings.trained()])


def _setup_context(ctx, inputs, output):
    # an unused output's gradient stays None: a zero dlse would send FA4's backward down its
    # dlse path (and cost an allocation) on every step that does not return the LSE
    ctx.set_materialize_grads(False)
    q, k, v, *args = inputs
    out, lse = output
    d, slots, settings = unpack(args)
    ctx.save_for_backward(q, k, v, out, lse, *d.tensors(), *slots.tensors())
    ctx.desc_scalars, ctx.slots, ctx.settings = d.scalars(), slots.structure(), settings


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    n = len(DescriptorArgs.tensor_fields())
    d = DescriptorArgs(*saved[:n], *ctx.desc_scalars)
    slots = OpSlots.rebuild(ctx.slots, saved[n:])
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink, dtables = torch.ops.compilemask.attention_bwd(
        dout.contiguous(), dlse, q, k, v, out, lse, *op_args(d, slots, ctx.settings))
    # one gradient per input: None but the sink's and the trained tables'; a list of tensors'
    # slot a list of them
    return ((dq, dk, dv) + (None,) * len(d)
            + slots.grads(dsink, dtables, ctx.settings.trained())
            + (None,) * len(OpSettings._fields))


torch.library.register_autograd("compilemask::attention_fwd", _backward,
                                setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------
def attention_op(q, k, v, desc, softmax_scale: Optional[float] = None, return_lse: bool = False,
                 deterministic: bool = False, engine: str = "cute", options=None, score=None,
                 sink=None, heads: int = 1, served: dict | None = None):
    """``cm.attention`` through the custom op: ``out`` (and float32 ``lse [B, H, Sq]``).
    ``engine``: "cute" (this package's kernels), "fa4" / "native" (``kernels.fa4``) or
    "reference" (the dense path on any device), as ``kernels.dispatch`` chose; ``options``: the
    kernels' ``KernelOptions`` (None: the defaults); ``score``: ``(score_mod key, tables as the
    kernels read them)`` (``compilemask.dsl.score_mod``; fa4 / native engines); ``sink``: a
    learnable sink logit per head ``[H]`` (fa4 / native / reference; differentiable);
    ``heads > 1``: the descriptor holds one sequence per (batch, head), ``b * heads + h``
    (fa4 / reference); ``served``: a served batch's slots by name (``OpSlots``: ``seqused_k``,
    ``seqused_q``, ``cu_seqlens_q``, ``cu_seqlens_k``, ``page_table``; fa4 / native, forward
    only: ``compilemask.api.serving``)."""
    # every CompiledMask is registered when made (``compile_mask``), weakly while it lives: a
    # traced call needs only its key (the registry's lock is no graph op)
    key = str(desc.mask.key) if torch.compiler.is_compiling() else register_mask(desc.mask)
    if desc.device != q.device:
        raise ValueError(f"attention_op: the descriptor is on {desc.device} and q on {q.device} "
                         "(cm.attention moves it once: compilemask.pipeline.pipeline.on_device)")
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    why = op_refusal(engine, score is not None, sink is not None, bool(served))
    if why:
        raise NotImplementedError(f"attention_op: {why}")
    slots = OpSlots.of(desc, engine, q.shape[-1], score_aux=score[1] if score else (),
                       sink=sink, **(served or {}))
    tables = list(score[1]) if score is not None else []
    train = sum(1 << n for n, t in enumerate(tables) if t.requires_grad) \
        if torch.is_grad_enabled() else 0
    if train and deterministic:  # (a score_mod runs on the fa4 and native engines only)
        raise NotImplementedError(
            "attention_op: gradients into a score_mod's tables run on the fa4 and native "
            "engines, not deterministically (their adds are unordered float atomics); "
            "backend='reference' runs them deterministically")
    settings = OpSettings(key, scale, bool(deterministic), engine,
                          options.to_str() if options is not None else "",
                          score[0] if score is not None else "", int(heads), train)
    if _needs_op(q, k, v, sink, *tables):
        out, lse = torch.ops.compilemask.attention_fwd(
            q, k, v, *op_args(DescriptorArgs.of(desc), slots, settings))
    else:  # the op's own body: a decode step's host time is mostly the op's dispatch
        out, lse = _fwd_impl(q, k, v, desc, slots, settings)
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
