"""Build every compiled program a job needs ahead of time: ``cm.warmup`` and ``python -m
compilemask warmup FILE.py:NAME --seqlens ...``.

A mask's first use compiles its preprocess program (TileLang), the tile-list program and the
attention kernels (flash-attn-4's CuTe kernels, forward and backward, per head dim and head
grouping). The programs take lengths at run time, but flash-attn-4 picks some kernel variants
from the problem size, so warmup runs one small step at each length asked for. Everything is
kept on disk under the compilemask cache folder (``COMPILEMASK_CACHE_DIR``, default
``~/.cache/compilemask``): later processes load it instead of compiling.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from compilemask.api.api import attention
from compilemask.contract.env import configure_compile_caches
from compilemask.dsl import MaskSpec
from compilemask.pipeline.compiled import CompiledMask, check_device, compile_mask

__all__ = ["warmup", "zero_meta"]


def zero_meta(mask: CompiledMask, batch_size: int, seqlen: int, device) -> dict:
    """Metadata that every mask accepts (0, and 1 for divisors): the values do not change what
    compiles."""
    meta = {}
    for p in mask.spec.params:
        fill = 1 if p in mask.divisor_params else 0
        shape = ((batch_size, seqlen) if p in mask.array_params else
                 (batch_size, seqlen, 1) if p in mask.table_params else (batch_size,))
        meta[p] = torch.full(shape, fill, dtype=torch.int32, device=device)
    return meta


def warmup(mask: CompiledMask | MaskSpec, seqlens: Iterable[int], head_dims=(128,),
           num_heads: int = 8, num_kv_heads: int | None = None, *, dtype=torch.bfloat16,
           device=None, backward: bool = True, backend: str = "auto", verbose: bool = False,
           config=None) -> dict:
    """Compile what ``mask`` needs at ``seqlens`` and ``head_dims`` (one sequence per length,
    ``num_heads`` query heads over ``num_kv_heads``): its preprocess, lists and attention
    forward (and backward); ``config``: the ``PipelineConfig`` the job preprocesses with (its
    column view, say). Returns seconds per step, by (seqlen, head dim)."""
    configure_compile_caches()
    mask = compile_mask(mask) if isinstance(mask, MaskSpec) else mask
    if not isinstance(mask, CompiledMask):
        raise TypeError(f"warmup: mask must be a MaskSpec or CompiledMask, got "
                        f"{type(mask).__name__}")
    check_device(device, "warmup")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    took = {}
    for S in seqlens:
        meta = zero_meta(mask, 1, S, device)
        if device.type != "cuda":  # the CPU runs the dense reference: only TileLang compiles
            t0 = time.perf_counter()
            mask.preprocess(meta, S, batch_size=1, device=device, backend="tilelang",
                            config=config)
            took[(S, None)] = time.perf_counter() - t0
            continue
        desc = mask.preprocess(meta, S, batch_size=1, device=device, config=config)
        for D in head_dims:
            t0 = time.perf_counter()
            q = torch.zeros(1, S, num_heads, D, dtype=dtype, device=device,
                            requires_grad=backward)
            k, v = (torch.zeros(1, S, num_kv_heads, D, dtype=dtype, device=device,
                                requires_grad=backward) for _ in range(2))
            out = attention(q, k, v, desc, backend=backend)
            if backward:
                out.sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            took[(S, D)] = time.perf_counter() - t0
            if verbose:
                print(f"warmup {mask.name}: seqlen {S}, head dim {D}: {took[(S, D)]:.1f} s")
    return took
