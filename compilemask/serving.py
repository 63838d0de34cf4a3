"""Serving with the training mask: queries at the end of the keys (prefill, chunked prefill, a
decode step over a KV cache).

A mask's rules and metadata speak of positions in the whole sequence, cached tokens and new
ones alike. ``query_descriptor(mask, meta, seqlen_k, seqlen_q)`` is the descriptor of the last
``seqlen_q`` rows of a ``seqlen_k``-token sequence against all its keys (local row ``r`` is
position ``seqlen_k - seqlen_q + r``): the generated interval table evaluated at those rows,
their per-row metadata gathered, the bitmaps and tile lists made for the local rows, and
``q_offset = seqlen_k - seqlen_q`` recorded: a mask proven causal, windowed or full then runs
FA4's own kernels (bottom-right aligned, a decode step's as FA4 serves it). Metadata
arrays cover at least ``seqlen_k`` positions (those of every position the sequences will
reach are fine: the first ``seqlen_k`` are read), so rules read at ``j`` work for any
``seqlen_k``; ``seqlen_q`` / ``seqlen_k`` in a rule mean the whole sequence's length.

``paged_attention(q, k_cache, v_cache, page_table, desc)`` runs such a descriptor's forward over
a paged KV cache (FA4's ``page_table``: sequence ``b``'s key ``j`` lives in page
``page_table[b, j // page_size]`` at row ``j % page_size``).

``DecodeState`` keeps the mask and the metadata of a generation and gives each step's
descriptor (``state.descriptor(seqlen_q, seqlen_k)``), one per step shape, shared by every
layer of that step.

Masks with fallback regions are refused (their predicates read the local row, not the
position), as for row-sharded context-parallel descriptors.
"""

from __future__ import annotations

import dataclasses

import torch

from compilemask.compiled import CompiledMask
from compilemask.descriptor import DEFAULT_BWD_TILES, DEFAULT_FWD_TILES, ExecutionDescriptor
from compilemask.distributed import rows_descriptor

__all__ = ["query_descriptor", "paged_attention", "DecodeState"]


def _sliced(meta, seqlen_k: int):
    """Per-token arrays cut to the first ``seqlen_k`` positions; scalars as they are."""
    if not meta:
        return meta
    out = {}
    for name, v in meta.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            if v.shape[1] < seqlen_k:
                raise ValueError(f"query_descriptor: metadata {name!r} covers {v.shape[1]} "
                                 f"positions, the keys are {seqlen_k}: give it every position "
                                 "the sequences reach")
            v = v[:, :seqlen_k]
        out[name] = v
    return out


def query_descriptor(mask, meta, seqlen_k: int, seqlen_q: int, *, batch_size: int | None = None,
                     seqused_k: torch.Tensor | None = None, device=None,
                     fwd_tiles=DEFAULT_FWD_TILES, bwd_tiles=DEFAULT_BWD_TILES,
                     check: bool = False) -> ExecutionDescriptor:
    """The descriptor of the last ``seqlen_q`` positions of a ``seqlen_k``-token sequence
    against all ``seqlen_k`` keys (see the module docstring); built with torch on the
    metadata's device (a decode step's is a few small launches).

    ``seqused_k`` (int ``[B]``, each at most ``seqlen_k``): a batch of requests in one KV
    buffer, sequence ``b`` holding ``seqused_k[b]`` keys (FA4's ``seqused_k``); its queries are
    its last ``seqlen_q`` positions, keys past its length are never shown, and query rows before
    its first position (a request shorter than ``seqlen_q``) see nothing. ``device``: where the
    descriptor is made (default: the metadata's, else ``seqused_k``'s, else the CPU); a mask
    without metadata is made there directly, never copied per step."""
    for name, val in (("seqlen_k", seqlen_k), ("seqlen_q", seqlen_q)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"query_descriptor: {name} must be a positive int, got {val!r}")
    if seqlen_q > seqlen_k:
        raise ValueError(f"query_descriptor: seqlen_q ({seqlen_q}) > seqlen_k ({seqlen_k}): the "
                         "queries are the last positions of the keys")
    found = [v.device for v in (*(meta or {}).values(), seqused_k)
             if isinstance(v, torch.Tensor)]
    dev = torch.device(device) if device is not None else (found[0] if found else
                                                           torch.device("cpu"))
    if meta:  # the metadata where the descriptor is made (a no-op where it is already)
        meta = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in meta.items()}
    if seqused_k is not None:
        used = torch.as_tensor(seqused_k).to(dev, torch.int64).view(-1)
        if batch_size is not None and used.numel() != batch_size:
            raise ValueError(f"query_descriptor: seqused_k has {used.numel()} entries, the "
                             f"batch {batch_size}")
        rows = used.view(-1, 1) - seqlen_q + torch.arange(seqlen_q, device=dev).view(1, -1)
        desc = rows_descriptor(mask, _sliced(meta, seqlen_k), seqlen_k, rows,
                               batch_size=used.numel(), fwd_tiles=fwd_tiles,
                               bwd_tiles=bwd_tiles, check=check, key_limit=used, device=dev,
                               who="query_descriptor")
        # rows at each request's own positions (q_offset -1): never FA4's native
        return dataclasses.replace(desc, seqused_k=used.to(torch.int32))
    rows = torch.arange(seqlen_k - seqlen_q, seqlen_k, device=dev, dtype=torch.int64)
    desc = rows_descriptor(mask, _sliced(meta, seqlen_k), seqlen_k, rows, batch_size=batch_size,
                           fwd_tiles=fwd_tiles, bwd_tiles=bwd_tiles, check=check, device=dev,
                           who="query_descriptor")
    # the native engine may run it: FA4's causal and windows align bottom-right as these rows
    return dataclasses.replace(desc, q_offset=seqlen_k - seqlen_q)


def _paged_checks(q, k_cache, v_cache, page_table, desc) -> None:
    if not isinstance(desc, ExecutionDescriptor):
        raise TypeError(f"paged_attention: desc must be an ExecutionDescriptor "
                        f"(query_descriptor or preprocess), got {type(desc).__name__}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("page_table", page_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"paged_attention: {name} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError("paged_attention: the paged KV path is forward only (FA4's "
                                  "page_table has no backward); run it under torch.no_grad() "
                                  "or use cm.attention on contiguous keys to train")
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"paged_attention: q must be [B, Sq, H, D] and k_cache / v_cache "
                         f"[num_pages, page_size, Hkv, D], got {list(q.shape)} and "
                         f"{list(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention: k_cache {list(k_cache.shape)} and v_cache "
                         f"{list(v_cache.shape)} differ")
    B, Sq, H, D = q.shape
    num_pages, page_size, Hkv, Dk = k_cache.shape
    if Dk != D or H % Hkv:
        raise ValueError(f"paged_attention: q {list(q.shape)} and k_cache {list(k_cache.shape)} "
                         "disagree on head dim, or q's heads are not a multiple of the cache's")
    if not q.is_floating_point() or q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise TypeError(f"paged_attention: q, k_cache, v_cache must share a floating dtype, got "
                        f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if (page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != B
            or page_table.device != q.device):
        raise ValueError(f"paged_attention: page_table must be int32 [B={B}, max_pages] on "
                         f"{q.device}, got {page_table.dtype} {list(page_table.shape)} on "
                         f"{page_table.device}")
    if page_table.shape[1] * page_size < desc.seqlen_k:
        raise ValueError(f"paged_attention: page_table addresses {page_table.shape[1]} pages of "
                         f"{page_size} keys per sequence, fewer than desc's seqlen_k "
                         f"({desc.seqlen_k})")
    if (desc.batch_size, desc.seqlen_q) != (B, Sq):
        raise ValueError(f"paged_attention: desc was made for batch {desc.batch_size}, seqlen_q "
                         f"{desc.seqlen_q}; q gives batch {B}, seqlen_q {Sq}")


def _gathered(cache, page_table, seqlen_k: int):
    """[B, seqlen_k, Hkv, D]: each sequence's keys read through its page table."""
    page_size = cache.shape[1]
    pages = page_table[:, :(seqlen_k + page_size - 1) // page_size].long()
    B, P = pages.shape
    return cache[pages].reshape(B, P * page_size, *cache.shape[2:])[:, :seqlen_k]


def paged_attention(q, k_cache, v_cache, page_table, desc: ExecutionDescriptor, *,
                    softmax_scale: float | None = None, backend: str = "auto"):
    """The forward of ``cm.attention(q, k, v, desc)`` with keys and values in a paged KV cache:
    ``k_cache, v_cache [num_pages, page_size, Hkv, D]``, ``page_table`` int32
    ``[B, max_pages]`` (sequence ``b``'s key ``j`` at ``[page_table[b, j // page_size],
    j % page_size]``), addressing at least ``desc.seqlen_k`` keys per sequence (a
    ``query_descriptor(..., seqused_k=)`` descriptor stops each at its own length). Returns
    ``out [B, Sq, H, D]``; forward only.

    On CUDA (sm90) a mask proven native runs FA4's own paged kernel (causal or windowed,
    bottom-right aligned); any other runs FA4's paged kernel with the interval ``mask_mod`` on
    every tile (FA4 loads paged keys without block-sparse lists, so no tile is skipped: exact,
    at a decode step's cost little more). Rows of a sequence's last page past its length must be
    finite (FA4's TMA loads read the whole page; masked scores times NaN are NaN); page table
    entries must lie in ``[0, num_pages)`` (not checked on the GPU: that would synchronize).
    ``backend``: ``"auto"``, ``"native"``, ``"fa4"`` or
    ``"reference"`` (the pages gathered, then the dense float32 path; the CPU's)."""
    from compilemask.api import attention, select_engine

    _paged_checks(q, k_cache, v_cache, page_table, desc)
    if backend == "cute":
        raise NotImplementedError("paged_attention: the cute engine has no paged KV; backend="
                                  "'auto', 'fa4', 'native' or 'reference'")
    engine = select_engine(q, desc, backend)
    if engine == "native" and desc.native.kind == "segments":
        # FA4's varlen segments take cu_seqlens, which its page_table excludes: the mask_mod
        # runs them exactly
        if backend == "native":
            raise NotImplementedError("paged_attention: this mask runs natively as FA4 varlen "
                                      "segments, which FA4 does not page; backend='fa4' runs it")
        engine = select_engine(q, desc, "fa4")
    if engine == "cute":
        raise NotImplementedError(f"paged_attention: neither FA4 engine runs this call "
                                  f"(fa4: {_fa4_reason(q, desc)}); backend='reference' runs "
                                  "it densely")
    if engine == "reference":
        k = _gathered(k_cache, page_table, desc.seqlen_k)
        v = _gathered(v_cache, page_table, desc.seqlen_k)
        return attention(q, k, v, desc, softmax_scale=softmax_scale, backend="reference")
    from compilemask.kernels import fa4
    from compilemask.pipeline import on_device

    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, _ = fa4.fwd_paged(q, k_cache, v_cache, page_table, on_device(desc, q.device), scale,
                           engine)
    return out


def _fa4_reason(q, desc) -> str:
    from compilemask.kernels.fa4 import why_unavailable

    return why_unavailable(q, desc, "fa4") or "unavailable"


class DecodeState:
    """A generation's mask and metadata (over every position it will reach); ``descriptor``
    gives the step's, made once per ``(seqlen_q, seqlen_k)`` and kept until the next shape."""

    def __init__(self, mask, meta=None, *, batch_size: int | None = None, device=None):
        if not isinstance(mask, CompiledMask):
            raise TypeError(f"DecodeState: mask must be a compile_mask(...) result, got "
                            f"{type(mask).__name__}")
        self.mask, self.meta, self.batch_size, self.device = mask, meta, batch_size, device
        self._last: tuple | None = None

    def descriptor(self, seqlen_q: int, seqlen_k: int) -> ExecutionDescriptor:
        # metadata written in place between steps is a new descriptor too
        key = (seqlen_q, seqlen_k, tuple(v._version for v in (self.meta or {}).values()
                                        if isinstance(v, torch.Tensor)))
        if self._last is None or self._last[0] != key:
            desc = query_descriptor(self.mask, self.meta, seqlen_k, seqlen_q,
                                    batch_size=self.batch_size, device=self.device)
            self._last = (key, desc)
        return self._last[1]
