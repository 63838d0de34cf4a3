"""cm.attention: validate, then dispatch to the CuTe kernel (CUDA, sm_90) or the reference path."""

from __future__ import annotations

import logging

import torch

from compilemask.descriptor import ExecutionDescriptor
from compilemask.reference import attention_reference

__all__ = ["attention"]

log = logging.getLogger("compilemask")
_SAID: set[str] = set()


def _say_once(msg: str):
    if msg not in _SAID:
        _SAID.add(msg)
        log.warning(msg)


def _validate(q, k, v, desc):
    if not isinstance(desc, ExecutionDescriptor):
        raise TypeError(f"desc must be an ExecutionDescriptor (from CompiledMask.preprocess), "
                        f"got {type(desc).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, S, H, D], got shape {list(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    B, Sq, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and "
                         f"{list(v.shape)}")
    Bk, Sk, Hkv, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} disagree on batch or head dim")
    if H % Hkv:
        raise ValueError(f"num heads of q ({H}) must be a multiple of those of k/v ({Hkv})")
    if (desc.batch_size, desc.seqlen_q, desc.seqlen_k) != (B, Sq, Sk):
        # metadata without tensors (or no params at all) carries no batch size: preprocess
        # makes one sequence unless told otherwise
        hint = (f"; metadata without tensors gives batch 1: preprocess(..., batch_size={B})"
                if desc.batch_size == 1 and B != 1 else "")
        raise ValueError(
            f"desc was made for batch {desc.batch_size}, seqlen_q {desc.seqlen_q}, seqlen_k "
            f"{desc.seqlen_k}; q/k give batch {B}, seqlen_q {Sq}, seqlen_k {Sk}{hint}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def attention(q, k, v, desc: ExecutionDescriptor, *, softmax_scale: float | None = None,
              return_lse: bool = False, deterministic: bool = False):
    """Masked attention driven by an Execution Descriptor.

    Layouts follow FlashAttention: ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` with
    ``H % Hkv == 0`` (GQA/MQA); returns ``out [B, Sq, H, D]`` and, with ``return_lse``, the
    float32 log-sum-exp ``[B, H, Sq]`` (-inf for rows that see nothing; their output is 0).
    Autograd-capable. CUDA tensors on sm_90 run the CuTe kernels; anything else runs the dense
    reference (said once in the log). ``deterministic=True``: the backward adds the kv tiles'
    dQ contributions in a fixed order, so that gradients are identical run to run (sm90 kernel;
    the reference path is deterministic anyway)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    _validate(q, k, v, desc)
    if q.is_cuda:
        try:
            from compilemask.kernels import attention_cuda, kernel_available

            if kernel_available(q, desc):
                return attention_cuda(q, k, v, desc, softmax_scale=softmax_scale,
                                      return_lse=return_lse, deterministic=deterministic)
        except ImportError:
            pass
        _say_once("cm.attention: no CuTe kernel for this device/configuration; using the "
                  "dense reference path (slow)")
    else:
        _say_once(f"cm.attention: {q.device.type} tensors use the dense reference path (the "
                  "CuTe kernels need CUDA)")
    dense = desc.to(q.device).dense_mask() if desc.device != q.device else desc.dense_mask()
    return attention_reference(q, k, v, dense, softmax_scale=softmax_scale, return_lse=return_lse)
