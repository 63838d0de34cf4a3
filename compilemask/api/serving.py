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
``page_table[b, j // page_size]`` at row ``j % page_size``); ``varlen_attention(q, k, v, desc)``
over a packed batch of requests (FA4's varlen layout, ``query_descriptor(..., seqused_k=,
seqused_q=)``); paged keys take packed queries too.

``DecodeState`` keeps the mask and the metadata of a generation and gives each step's
descriptor (``state.descriptor(seqlen_q, seqlen_k)``), one per step shape, shared by every
layer of that step.

Masks with fallback regions are served as well: the descriptor carries its rows' positions
and the sequence's arrays by position (``ExecutionDescriptor.positions`` / ``key_params``),
which their predicates read (the reference and fa4 engines; the cute engine refuses them).
"""

from __future__ import annotations

import weakref

import torch

from compilemask.api.api import attention, check_arguments
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    ExecutionDescriptor,
)
from compilemask.contract.log import say_once
from compilemask.kernels.autograd import attention_op
from compilemask.kernels.dispatch import select_served_engine
from compilemask.pipeline.compiled import CompiledMask, check_device
from compilemask.pipeline.pipeline import on_device
from compilemask.pipeline.rows import rows_descriptor

__all__ = ["query_descriptor", "paged_attention", "varlen_attention", "DecodeState"]


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


def _counts(name: str, value, dev, limit: int):
    """A per-request count argument (``seqused_k`` / ``seqused_q``) as int64 ``[B]`` on ``dev``,
    and its host copy (None when it is only on CUDA). Host values are checked to lie in
    ``[0, limit]``: free there, whereas reading CUDA counts would synchronize every step."""
    t = torch.as_tensor(value)
    if t.is_floating_point() or t.is_complex() or t.dtype is torch.bool:
        raise TypeError(f"query_descriptor: {name} must be an int tensor [B], got {t.dtype}")
    if t.dim() > 1:
        raise ValueError(f"query_descriptor: {name} must be 1-D [B] (a count per request), got "
                         f"shape {list(t.shape)}")
    t = t.reshape(-1)
    moved = t.to(dev, torch.int64)
    host = t if t.device.type == "cpu" else moved if moved.device.type == "cpu" else None
    if host is not None:
        bad = ((host < 0) | (host > limit)).nonzero().view(-1)
        if bad.numel():
            b = int(bad[0])
            other = "seqlen_k" if name == "seqused_k" else "seqlen_q"
            raise ValueError(f"query_descriptor: {name}[{b}] = {int(host[b])} is outside "
                             f"[0, {other}] = [0, {limit}]")
    return moved, host


def query_descriptor(mask, meta, seqlen_k: int, seqlen_q: int, *, batch_size: int | None = None,
                     seqused_k: torch.Tensor | None = None,
                     seqused_q: torch.Tensor | None = None, device=None,
                     fwd_tiles=DEFAULT_FWD_TILES, bwd_tiles=DEFAULT_BWD_TILES,
                     check: bool = False, backend: str = "auto") -> ExecutionDescriptor:
    """The descriptor of the last ``seqlen_q`` positions of a ``seqlen_k``-token sequence
    against all ``seqlen_k`` keys (see the module docstring); made on the metadata's device,
    on CUDA by the preprocess program's rows variant (one launch and the lists' one), on the
    CPU by the generated torch reference (``backend="torch"`` or ``"tilelang"`` to choose).

    ``seqused_k`` (int ``[B]``, each at most ``seqlen_k``): a batch of requests in one KV
    buffer, sequence ``b`` holding ``seqused_k[b]`` keys (FA4's ``seqused_k``); its queries are
    its last ``seqlen_q`` positions, keys past its length are never shown, and query rows before
    its first position (a request shorter than ``seqlen_q``) see nothing. ``seqused_q`` (int
    ``[B]``, each at most ``seqlen_q`` and its ``seqused_k``, with ``seqused_k``): a packed
    (varlen) batch, request ``b`` having ``seqused_q[b]`` queries, its last positions: its local
    row ``r`` is position ``seqused_k[b] - seqused_q[b] + r`` and rows past ``seqused_q[b]`` are
    padding (``varlen_attention``, ``paged_attention`` with packed queries). The counts are
    checked (ints within those bounds) where they are on the host; counts already on CUDA are
    not (that would synchronize every step; a graph-captured step rewrites them in place).
    A rule that reads ``seqlen_k`` sees ``seqlen_k`` (the buffer), not a request's
    ``seqused_k[b]``: put a request's own length in its metadata. ``device``: where the
    descriptor is made (default: the metadata's, else ``seqused_k``'s, else the CPU); a mask
    without metadata is made there directly, never copied per step."""
    for name, val in (("seqlen_k", seqlen_k), ("seqlen_q", seqlen_q)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"query_descriptor: {name} must be a positive int, got {val!r}")
    if seqlen_q > seqlen_k:
        raise ValueError(f"query_descriptor: seqlen_q ({seqlen_q}) > seqlen_k ({seqlen_k}): the "
                         "queries are the last positions of the keys")
    check_device(device, "query_descriptor")
    found = [v.device for v in (*(meta or {}).values(), seqused_k)
             if isinstance(v, torch.Tensor)]
    dev = torch.device(device) if device is not None else (found[0] if found else
                                                           torch.device("cpu"))
    if meta:  # the metadata where the descriptor is made (a no-op where it is already)
        meta = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in meta.items()}
    if seqused_q is not None and seqused_k is None:
        raise ValueError("query_descriptor: seqused_q (a packed batch's queries per request) "
                         "needs seqused_k (its keys per request)")
    if seqused_k is not None:
        used, used_host = _counts("seqused_k", seqused_k, dev, seqlen_k)
        if batch_size is not None and used.numel() != batch_size:
            raise ValueError(f"query_descriptor: seqused_k has {used.numel()} entries, the "
                             f"batch {batch_size}")
        local = torch.arange(seqlen_q, device=dev).view(1, -1)
        if seqused_q is None:
            rows = used.view(-1, 1) - seqlen_q + local
        else:
            used_q, used_q_host = _counts("seqused_q", seqused_q, dev, seqlen_q)
            if used_q.numel() != used.numel():
                raise ValueError(f"query_descriptor: seqused_q has {used_q.numel()} entries, "
                                 f"seqused_k {used.numel()}")
            if used_q_host is not None and used_host is not None and \
                    (used_q_host > used_host).any():
                raise ValueError(f"query_descriptor: seqused_q {used_q_host.tolist()} exceeds "
                                 f"seqused_k {used_host.tolist()} (a request's queries are "
                                 "among its keys)")
            # padding rows past a request's queries: -1, which sees nothing
            rows = torch.where(local < used_q.view(-1, 1),
                               used.view(-1, 1) - used_q.view(-1, 1) + local, -1)
        # rows at each request's own positions (q_offset -1): never FA4's native
        return rows_descriptor(mask, _sliced(meta, seqlen_k), seqlen_k, rows,
                               batch_size=used.numel(), fwd_tiles=fwd_tiles,
                               bwd_tiles=bwd_tiles, check=check, key_limit=used, device=dev,
                               who="query_descriptor", backend=backend,
                               seqused_k=used.to(torch.int32),
                               seqused_q=None if seqused_q is None else used_q.to(torch.int32))
    rows = torch.arange(seqlen_k - seqlen_q, seqlen_k, device=dev, dtype=torch.int64)
    # the native engine may run it: FA4's causal and windows align bottom-right as these rows
    return rows_descriptor(mask, _sliced(meta, seqlen_k), seqlen_k, rows, batch_size=batch_size,
                           fwd_tiles=fwd_tiles, bwd_tiles=bwd_tiles, check=check, device=dev,
                           who="query_descriptor", backend=backend,
                           q_offset=seqlen_k - seqlen_q)


def _checks(who, q, k, v, page_table, desc, softmax_scale=None) -> None:
    """Arguments of ``paged_attention`` / ``varlen_attention`` (``page_table`` None: the
    latter's contiguous packed keys)."""
    if not isinstance(desc, ExecutionDescriptor):
        raise TypeError(f"{who}: desc must be an ExecutionDescriptor (query_descriptor or "
                        f"preprocess), got {type(desc).__name__}")
    names = ("k_cache", "v_cache") if page_table is not None else ("k", "v")
    for name, t in (("q", q), (names[0], k), (names[1], v)) + (
            (("page_table", page_table),) if page_table is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    check_arguments(q, k, v, softmax_scale, who)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(f"{who}: forward only (serving); run it under "
                                  "torch.no_grad(), or cm.attention on [B, S, H, D] keys to train")
    packed = desc.seqused_q is not None
    if page_table is None and (desc.seqused_k is None or not packed):
        raise ValueError(f"{who}: desc must come from query_descriptor(..., seqused_k=, "
                         "seqused_q=): the requests' keys and queries")
    q_layout = "[total_q, H, D] (the descriptor has seqused_q)" if packed else "[B, Sq, H, D]"
    if q.dim() != (3 if packed else 4):
        raise ValueError(f"{who}: q must be {q_layout}, got {list(q.shape)}")
    k_layout = ("[num_pages, page_size, Hkv, D]" if page_table is not None else
                "[total_k, Hkv, D]")
    if k.dim() != k_layout.count(",") + 1 or k.shape != v.shape:
        raise ValueError(f"{who}: {names[0]} and {names[1]} must be {k_layout}, alike, got "
                         f"{list(k.shape)} and {list(v.shape)}")
    H, D = q.shape[-2:]
    Hkv, Dk = k.shape[-2:]
    if Dk != D or H % Hkv:
        raise ValueError(f"{who}: q {list(q.shape)} and {names[0]} {list(k.shape)} disagree on "
                         "head dim, or q's heads are not a multiple of the keys'")
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"{who}: q, {names[0]}, {names[1]} must share a floating dtype, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not packed and (desc.batch_size, desc.seqlen_q) != tuple(q.shape[:2]):
        raise ValueError(f"{who}: desc was made for batch {desc.batch_size}, seqlen_q "
                         f"{desc.seqlen_q}; q gives batch {q.shape[0]}, seqlen_q {q.shape[1]}")
    if page_table is None:
        return
    if (page_table.dtype != torch.int32 or page_table.dim() != 2
            or page_table.shape[0] != desc.batch_size or page_table.device != q.device):
        raise ValueError(f"{who}: page_table must be int32 [B={desc.batch_size}, max_pages] on "
                         f"{q.device}, got {page_table.dtype} {list(page_table.shape)} on "
                         f"{page_table.device}")
    if page_table.shape[1] * k.shape[1] < desc.seqlen_k:
        raise ValueError(f"{who}: page_table addresses {page_table.shape[1]} pages of "
                         f"{k.shape[1]} keys per sequence, fewer than desc's seqlen_k "
                         f"({desc.seqlen_k})")


def _cu(used):
    """int32 ``[B + 1]`` offsets of a packed batch from its per-request counts (on device)."""
    return torch.nn.functional.pad(used.cumsum(0), (1, 0)).to(torch.int32)


def _unpacked(x, used, S: int):
    """A packed ``[total, ...]`` tensor as ``[B, S, ...]`` (zeros past each request's count), and
    the bool ``[B, S]`` of its real rows."""
    local = torch.arange(S, device=x.device).view(1, -1)
    valid = local < used.view(-1, 1).to(x.device)
    idx = (_cu(used).to(x.device)[:-1].view(-1, 1) + local).clamp(max=max(x.shape[0] - 1, 0))
    if x.shape[0] == 0:
        return x.new_zeros(used.numel(), S, *x.shape[1:]), valid
    rows = x[idx.long()]
    return torch.where(valid.view(*valid.shape, *(1,) * (x.dim() - 1)), rows, 0), valid


def _gathered(cache, page_table, seqlen_k: int, used=None):
    """[B, seqlen_k, Hkv, D]: each sequence's keys read through its page table; the entries
    past a request's ``used`` keys are not read (a serving engine may leave them unset)."""
    page_size = cache.shape[1]
    pages = page_table[:, :(seqlen_k + page_size - 1) // page_size].long()
    if used is not None:
        need = (used.to(pages.device).long() + page_size - 1) // page_size
        pages = torch.where(torch.arange(pages.shape[1], device=pages.device) < need.view(-1, 1),
                            pages, 0)
    if pages.device.type == "cpu" and pages.numel() and (
            int(pages.min()) < 0 or int(pages.max()) >= cache.shape[0]):
        raise ValueError(f"paged_attention: page_table entries must lie in [0, "
                         f"{cache.shape[0]}), got [{int(pages.min())}, {int(pages.max())}]")
    B, P = pages.shape
    rows = cache[pages].reshape(B, P * page_size, *cache.shape[2:])[:, :seqlen_k]
    if used is None:
        return rows
    # rows a request does not own (its last page's tail, page 0 standing in for pages it has
    # not got) may hold anything: zeros, chosen by where (0 * NaN would still be NaN in P @ V)
    own = torch.arange(seqlen_k, device=rows.device) < used.to(rows.device).view(-1, 1)
    return torch.where(own.view(B, seqlen_k, *(1,) * (rows.dim() - 2)), rows, 0)


def _check_tails(k_cache, v_cache, page_table, desc) -> None:
    """On the CPU, say once when a request's last page holds NaN or inf past its length: the
    reference engine never reads those rows, the GPU engines' page loads may (the result would
    be NaN there)."""
    page = k_cache.shape[1]
    B = page_table.shape[0]
    used = (torch.full((B,), desc.seqlen_k) if desc.seqused_k is None
            else desc.seqused_k.to("cpu", torch.int64))
    start = used % page
    has_tail = (used > 0) & (start > 0)
    if not bool(has_tail.any()):
        return
    last = page_table[torch.arange(B), ((used - 1).clamp(min=0) // page)].long()
    last = torch.where(has_tail & (last >= 0) & (last < k_cache.shape[0]), last, -1)
    rows = (torch.arange(page).view(1, -1) >= start.view(-1, 1)) & (last >= 0).view(-1, 1)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        bad = ~torch.isfinite(cache[last.clamp(min=0)]).flatten(2).all(-1) & rows  # [B, page]
        if bool(bad.any()):
            b = int(bad.any(-1).nonzero()[0])
            say_once(f"paged_attention: {name} page {int(last[b])} holds NaN or inf in the rows "
                     f"past request {b}'s {int(used[b])} keys; the reference engine never reads "
                     "them, but the GPU engines may (FA4 loads a page whole where it is one key "
                     "tile) and would give NaN: keep those rows finite (allocate the pool with "
                     "torch.zeros)")
            return


def paged_attention(q, k_cache, v_cache, page_table, desc: ExecutionDescriptor, *,
                    softmax_scale: float | None = None, backend: str = "auto"):
    """The forward of ``cm.attention(q, k, v, desc)`` with keys and values in a paged KV cache:
    ``k_cache, v_cache [num_pages, page_size, Hkv, D]``, ``page_table`` int32
    ``[B, max_pages]`` (sequence ``b``'s key ``j`` at ``[page_table[b, j // page_size],
    j % page_size]``), addressing at least ``desc.seqlen_k`` keys per sequence (a
    ``query_descriptor(..., seqused_k=)`` descriptor stops each at its own length). ``q``:
    ``[B, Sq, H, D]``, or packed ``[total_q, H, D]`` for a descriptor with ``seqused_q``.
    Returns ``out`` in q's layout; forward only.

    On CUDA (sm90) a mask proven causal, windowed or full runs FA4's own paged kernel
    (bottom-right per request); any other runs FA4's paged kernel with the interval
    ``mask_mod`` on every tile (FA4 loads paged keys without block-sparse lists, so no tile is
    skipped: exact, at a decode step's cost little more). Rows of a sequence's last page past
    its length must be finite on the GPU engines (where a page is one of FA4's key tiles its
    TMA loads read the page whole; a masked score's zero probability times NaN is NaN): zeros,
    or an earlier owner's keys; page table entries must lie in ``[0, num_pages)`` (not checked
    on the GPU: that would synchronize). ``backend``: ``"auto"``, ``"native"``, ``"fa4"`` or
    ``"reference"`` (the pages gathered, then the dense float32 path; the CPU's: it reads no
    row past a request's length and no page past its last, so those may hold anything, NaN
    included)."""
    _checks("paged_attention", q, k_cache, v_cache, page_table, desc, softmax_scale)
    engine = select_served_engine("paged_attention", q, desc, backend)
    if engine == "reference":
        if k_cache.device.type == "cpu":
            _check_tails(k_cache, v_cache, page_table, desc)
        k = _gathered(k_cache, page_table, desc.seqlen_k, desc.seqused_k)
        v = _gathered(v_cache, page_table, desc.seqlen_k, desc.seqused_k)
        return _reference(q, k, v, desc, softmax_scale)
    return _fa4(q, k_cache, v_cache, desc, softmax_scale, engine, page_table=page_table)


def varlen_attention(q, k, v, desc: ExecutionDescriptor, *, softmax_scale: float | None = None,
                     backend: str = "auto"):
    """Forward attention over a packed (varlen) batch of requests: ``q [total_q, H, D]`` holds
    request ``b``'s ``desc.seqused_q[b]`` queries after those of requests before it, ``k, v
    [total_k, Hkv, D]`` its ``desc.seqused_k[b]`` keys likewise; ``desc`` from
    ``query_descriptor(mask, meta, seqlen_k=max keys, seqlen_q=max queries, seqused_k=,
    seqused_q=)`` (each request's queries its last positions). Returns ``out [total_q, H, D]``.
    The offsets (FA4's ``cu_seqlens``) are the descriptor's counts summed on the device, so a
    batch's packing can never disagree with its mask. Engines as ``paged_attention``."""
    _checks("varlen_attention", q, k, v, None, desc, softmax_scale)
    engine = select_served_engine("varlen_attention", q, desc, backend)
    if engine == "reference":
        used = desc.seqused_k
        if used is not None and used.device.type == "cpu" and int(used.sum()) > k.shape[0]:
            raise ValueError(f"varlen_attention: k holds {k.shape[0]} rows, the descriptor's "
                             f"seqused_k {used.tolist()} {int(used.sum())}")
        kk, _ = _unpacked(k, desc.seqused_k, desc.seqlen_k)
        vv, _ = _unpacked(v, desc.seqused_k, desc.seqlen_k)
        return _reference(q, kk, vv, desc, softmax_scale)
    return _fa4(q, k, v, desc, softmax_scale, engine)


def _reference(q, k, v, desc, softmax_scale):
    if desc.seqused_q is None:
        return attention(q, k, v, desc, softmax_scale=softmax_scale, backend="reference")
    used = desc.seqused_q
    if q.device.type == "cpu" and int(used.sum()) != q.shape[0]:
        raise ValueError(f"q holds {q.shape[0]} rows, the descriptor's seqused_q "
                         f"{used.tolist()} {int(used.sum())}")
    qq, valid = _unpacked(q, used, desc.seqlen_q)
    out = attention(qq, k, v, desc, softmax_scale=softmax_scale, backend="reference")
    return out[valid]


_LENGTHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lengths(desc, paged: bool) -> dict:
    """The op's served slots for a descriptor (already on its device; FA4's length
    arguments), made once per descriptor: a layer loop launches nothing for them, and a
    captured graph reads fixed buffers."""
    per = _LENGTHS.setdefault(desc, {})
    got = per.get(paged)
    if got is None:
        got = {"seqused_q": desc.seqused_q}
        if desc.seqused_q is not None:
            got["cu_seqlens_q"] = _cu(desc.seqused_q)
        if paged:
            got["seqused_k"] = desc.seqused_k if desc.seqused_k is not None else torch.full(
                (desc.batch_size,), desc.seqlen_k, dtype=torch.int32, device=desc.device)
        else:
            got.update(seqused_k=desc.seqused_k, cu_seqlens_k=_cu(desc.seqused_k))
        per[paged] = got
    return got


def _fa4(q, k, v, desc, softmax_scale, engine, page_table=None):
    """The forward of a served batch through the attention op (its served slots)."""
    desc = on_device(desc, q.device)
    served = dict(_lengths(desc, page_table is not None))
    if page_table is not None:
        served["page_table"] = page_table
    return attention_op(q, k, v, desc, softmax_scale=softmax_scale, engine=engine,
                        served=served)


class DecodeState:
    """A generation's mask and metadata (over every position it will reach); ``descriptor``
    gives the step's, made once per ``(seqlen_q, seqlen_k)`` and metadata and kept until either
    changes: a tensor written in place or replaced, an int changed, an entry added or removed
    (the dict may be updated between calls). Writes are seen through torch's version counter:
    one that bypasses it (through ``.data``, a NumPy array or DLPack sharing the memory) is
    not, as for autograd's saved tensors; write through torch, or pass a new tensor. Metadata
    made under ``torch.inference_mode`` counts no writes, so each call makes its descriptor
    anew."""

    def __init__(self, mask, meta=None, *, batch_size: int | None = None, device=None):
        if not isinstance(mask, CompiledMask):
            raise TypeError(f"DecodeState: mask must be a compile_mask(...) result, got "
                            f"{type(mask).__name__}")
        self.mask, self.meta, self.batch_size, self.device = mask, meta, batch_size, device
        # ((seqlen_q, seqlen_k, mask, batch_size, device), _snapshot(meta), descriptor)
        self._last: tuple | None = None

    def _made_for(self, seqlen_q: int, seqlen_k: int) -> ExecutionDescriptor | None:
        """The kept descriptor if it was made for this shape and this very metadata, else None."""
        if self._last is None:
            return None
        made, snap, desc = self._last
        meta = self.meta or {}
        if made != self._args(seqlen_q, seqlen_k) or snap is None or len(snap) != len(meta):
            return None
        for (name, ref, stamp), (key, v) in zip(snap, meta.items()):
            if name != key:
                return None
            if isinstance(v, torch.Tensor):
                if stamp is None or v.is_inference() or ref() is not v or v._version != stamp:
                    return None
            elif stamp is not None or type(ref) is not type(v) or ref != v:
                return None
        return desc

    def descriptor(self, seqlen_q: int, seqlen_k: int) -> ExecutionDescriptor:
        desc = self._made_for(seqlen_q, seqlen_k)
        if desc is None:
            desc = query_descriptor(self.mask, self.meta, seqlen_k, seqlen_q,
                                    batch_size=self.batch_size, device=self.device)
            self._last = (self._args(seqlen_q, seqlen_k), _snapshot(self.meta), desc)
        return desc

    def _args(self, seqlen_q: int, seqlen_k: int) -> tuple:
        return (seqlen_q, seqlen_k, self.mask, self.batch_size, self.device)


def _snapshot(meta) -> tuple | None:
    """What a descriptor was made from, entry by entry: ``(name, weakref, version)`` for a
    tensor (a weak reference: a freed tensor's id may be a new tensor's, and nothing is kept
    alive), ``(name, value, None)`` for anything else; None when a tensor has no version
    counter (an inference tensor), so that nothing is reused."""
    out = []
    for name, v in (meta or {}).items():
        if isinstance(v, torch.Tensor):
            if v.is_inference():
                return None
            out.append((name, weakref.ref(v), v._version))
        else:
            out.append((name, v, None))
    return tuple(out)
