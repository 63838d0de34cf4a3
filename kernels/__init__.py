"""The attention engines driven by the Execution Descriptor.

A call goes ``cm.attention`` -> ``dispatch.select_engine`` (every engine's capability check,
one place) -> ``autograd.attention_op`` -> the ``compilemask::attention_fwd`` custom op
(its arguments: ``contract``) (autograd: ``compilemask::attention_bwd``, so
``torch.compile`` traces both without graph breaks) -> ``fa4`` for the ``native`` and ``fa4``
engines, ``interface`` (this package's CuTe kernels) for ``cute``, or the dense reference.

Modules: one kernel class each in ``flash_fwd`` (the forward, mma.sync and single-role wgmma),
``flash_fwd_sm90`` (the warp-specialized wgmma forward), ``flash_bwd`` (the mma.sync backward)
and ``flash_bwd_sm90`` (the warp-specialized wgmma backward); ``bwd_aux`` (the backward's pre-
and postprocess kernels); ``interface`` (compile cache and launch: ``compile_flash_fwd``,
``flash_fwd``, ``compile_flash_bwd``, ``flash_bwd``), ``config`` (the compile-time configs),
``fallback`` (the fallback predicates), and the pieces the kernels share:
``descriptor_tensors`` (the descriptor as one kernel argument), ``block_info`` (bitmap-row tile
scans), ``mask`` (the interval mask of a score tile), ``named_barrier`` (barrier ids),
``common`` (layouts, copies, wgmma helpers, compile plumbing); ``autograd`` (the custom ops),
``contract`` (their typed arguments), ``dispatch`` (which engine runs a call), ``fa4`` (the
flash-attn-4 engines) and ``fa4_lib`` (flash-attn-4 itself: the one module that imports it).
"""

from __future__ import annotations

import importlib

if __name__ == "compilemask.kernels":
    from .autograd import attention_op
# else: this folder imported as a top-level ``kernels`` (the repository root on sys.path, where
# transformers probes for the Hugging Face package of that name): registering the custom ops a
# second time, with an empty mask registry, would break ``compilemask.kernels``'s

# The CuTe kernel modules need the CUTLASS DSL, whose import takes seconds: they load on first
# use (the fa4 and native engines never need them); the launch functions are
# ``kernels.interface.flash_fwd / flash_bwd`` (here those names are the kernel modules)
_LAZY = {"FlashFwdConfig": "config", "FlashBwdConfig": "config", "Fallback": "fallback",
         "FlashBwd": "flash_bwd", "FlashBwdSm90": "flash_bwd_sm90", "FlashFwd": "flash_fwd",
         "FlashFwdSm90": "flash_fwd_sm90", "compile_flash_bwd": "interface",
         "compile_flash_fwd": "interface"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Fallback",
    "FlashFwd",
    "FlashFwdSm90",
    "FlashFwdConfig",
    "compile_flash_fwd",
    "FlashBwd",
    "FlashBwdConfig",
    "FlashBwdSm90",
    "compile_flash_bwd",
    "attention_op",
    "kernel_available",
]


def kernel_available(q, desc, k=None, v=None) -> bool:
    """True when the CuTe forward kernel can run this call (CUDA sm80+, bf16/fp16, D 64/128);
    ``dispatch`` holds every engine's checks."""
    from .dispatch import kernel_available as available  # (its import reads fa4: on first use)

    return available(q, desc)
