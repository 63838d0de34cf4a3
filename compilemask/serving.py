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

__all__ = ["query_descriptor", "DecodeState"]


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
        return desc  # rows at each request's own positions (q_offset -1): never FA4's native
    rows = torch.arange(seqlen_k - seqlen_q, seqlen_k, device=dev, dtype=torch.int64)
    desc = rows_descriptor(mask, _sliced(meta, seqlen_k), seqlen_k, rows, batch_size=batch_size,
                           fwd_tiles=fwd_tiles, bwd_tiles=bwd_tiles, check=check, device=dev,
                           who="query_descriptor")
    # the native engine may run it: FA4's causal and windows align bottom-right as these rows
    return dataclasses.replace(desc, q_offset=seqlen_k - seqlen_q)


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
