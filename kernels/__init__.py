"""CuTe DSL attention kernels driven by the Execution Descriptor.

``cm.attention`` calls :func:`kernel_available` / :func:`attention_cuda` (forward only: when
autograd needs a backward, ``kernel_available`` says no and the reference path runs).
"""

from __future__ import annotations

from .flash_fwd import Fallback, FlashFwd, FlashFwdConfig, compile_flash_fwd, flash_fwd

__all__ = [
    "Fallback",
    "FlashFwd",
    "FlashFwdConfig",
    "compile_flash_fwd",
    "flash_fwd",
    "kernel_available",
    "attention_cuda",
]


def _needs_grad(*ts) -> bool:
    import torch

    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def kernel_available(q, desc, k=None, v=None) -> bool:
    """True when the CuTe forward kernel can run this call (CUDA sm80+, bf16/fp16, D 64/128)."""
    import torch

    try:
        import cutlass  # noqa: F401
    except ImportError:
        return False
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if q.shape[-1] not in (64, 128):
        return False
    if _needs_grad(q, *(t for t in (k, v) if t is not None)):
        return False
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return False
    tiles = desc.fwd_tiles
    arch = 90 if major == 9 else 80
    cfg = FlashFwdConfig(
        dtype="bf16" if q.dtype == torch.bfloat16 else "fp16",
        head_dim=q.shape[-1],
        tile_m=tiles.tile_m,
        tile_n=tiles.tile_n,
        num_intervals=max(desc.num_intervals, 1),
        arch=arch,
    )
    return FlashFwd.can_implement(cfg)


_FALLBACKS: dict = {}


def attention_cuda(q, k, v, desc, *, softmax_scale=None, return_lse=False):
    """Forward attention on the GPU for an ExecutionDescriptor (see ``flash_fwd``)."""
    mask = desc.mask
    key = getattr(mask, "key", id(mask))
    if key not in _FALLBACKS:
        _FALLBACKS[key] = Fallback.from_mask(mask) if mask.has_fallback else None
    fb = _FALLBACKS[key]
    d = desc if desc.device == q.device else desc.to(q.device)
    out, lse = flash_fwd(
        q,
        k,
        v,
        d.intervals,
        d.fwd_bitmap,
        d.row_region,
        d.params,
        d.row_params,
        tile_m=d.fwd_tiles.tile_m,
        tile_n=d.fwd_tiles.tile_n,
        softmax_scale=softmax_scale,
        fallback=fb,
    )
    return (out, lse) if return_lse else out
