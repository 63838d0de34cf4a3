"""CuTe DSL attention kernels driven by the Execution Descriptor.

``cm.attention`` calls :func:`kernel_available` / :func:`attention_cuda`, which runs the
``compilemask::attention_fwd`` custom op; autograd runs ``compilemask::attention_bwd`` (the CuTe
backward kernel), so ``torch.compile`` traces both without graph breaks.

Modules: one kernel class each in ``flash_fwd`` (the forward, mma.sync and single-role wgmma),
``flash_fwd_sm90`` (the warp-specialized wgmma forward), ``flash_bwd`` (the mma.sync backward)
and ``flash_bwd_sm90`` (the warp-specialized wgmma backward); ``bwd_aux`` (the backward's pre-
and postprocess kernels); ``interface`` (compile cache and launch: ``compile_flash_fwd``,
``flash_fwd``, ``compile_flash_bwd``, ``flash_bwd``), ``config`` (the compile-time configs),
``fallback`` (the fallback predicates), and the pieces the kernels share:
``descriptor_tensors`` (the descriptor as one kernel argument), ``block_info`` (bitmap-row tile
scans), ``mask`` (the interval mask of a score tile), ``named_barrier`` (barrier ids),
``common`` (layouts, copies, wgmma helpers, compile plumbing); ``autograd`` (the custom ops)
and ``fa4`` (the flash-attn-4 engines).
"""

from __future__ import annotations

import importlib.util

if __name__ == "compilemask.kernels":
    from .autograd import attention_op

    # the kernel modules need the CUTLASS DSL; without it the custom ops and their CPU
    # reference still import
    if importlib.util.find_spec("cutlass") is not None:
        from .config import FlashBwdConfig, FlashFwdConfig
        from .fallback import Fallback
        from .flash_bwd import FlashBwd
        from .flash_bwd_sm90 import FlashBwdSm90
        from .flash_fwd import FlashFwd
        from .flash_fwd_sm90 import FlashFwdSm90
        from .interface import compile_flash_bwd, compile_flash_fwd, flash_bwd, flash_fwd
# else: this folder imported as a top-level ``kernels`` (the repository root on sys.path, where
# transformers probes for the Hugging Face package of that name): registering the custom ops a
# second time, with an empty mask registry, would break ``compilemask.kernels``'s

__all__ = [
    "Fallback",
    "FlashFwd",
    "FlashFwdSm90",
    "FlashFwdConfig",
    "compile_flash_fwd",
    "flash_fwd",
    "FlashBwd",
    "FlashBwdConfig",
    "FlashBwdSm90",
    "compile_flash_bwd",
    "flash_bwd",
    "attention_op",
    "kernel_available",
    "attention_cuda",
]


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
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return False
    from .config import FlashFwdConfig
    from .flash_fwd import FlashFwd

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


def attention_cuda(q, k, v, desc, *, softmax_scale=None, return_lse=False, deterministic=False,
                   options=None):
    """Attention on the GPU for an ExecutionDescriptor, differentiable (custom op pair);
    ``options``: ``KernelOptions`` of the CuTe kernels."""
    return attention_op(q, k, v, desc, softmax_scale=softmax_scale, return_lse=return_lse,
                        deterministic=deterministic, engine="cute", options=options)
