"""flash-attn-4 adapter: the Execution Descriptor on FA4's sm90 kernels.

Two engines share this module:

* ``fa4``: FA4's block-sparse path. The preprocess's tile lists (``ExecutionDescriptor
  .block_sparse``) say which kv tiles each q tile runs fully and which partially; partial tiles
  evaluate the compiled interval test as a ``mask_mod`` (``codegen.cute_mask_mod``) over the
  Interval Table passed as an aux tensor.
* ``native``: masks the compiler proved equal to full, causal, windowed or causal-within-segments
  attention (``compiler.native``) run FA4's own ``causal`` / ``window_size`` / varlen paths,
  with no lists and no mask_mod.

FA4 itself is reached through ``fa4_lib``, the one module that imports it (its entry points,
version check and scoped patches); which engine may run a call is ``dispatch``'s to say, and
which mask_mod variant ``codegen.cute_mask_mod.variant_for_call``'s.
"""

from __future__ import annotations

import functools
import time

import torch
from torch._subclasses.fake_tensor import is_fake

from compilemask.codegen.cute_mask_mod import (
    aux_tensors,
    mask_mod,
    reads_positions,
    variant_for_call,
)
from compilemask.codegen.cute_score_mod import INDEX_BOUND, score_mod_fns
from compilemask.contract.log import say_once
from compilemask.contract.lru import LRU

from . import fa4_lib

__all__ = ["fwd", "fwd_served", "bwd", "BWD_TILE_M", "FWD_TILES"]

FWD_TILES = (128, 128)  # FA4 sm90 forward tile for head dim 64 and 128 with 128-row sparse blocks
BWD_TILE_M = {64: 128, 128: 64}  # FA4 sm90 backward q tile per head dim (kv tile 128)


def _window(pat, seqlen_q: int, seqlen_k: int) -> tuple:
    """FA4's ``window_size`` of a proven window at this shape: a side that reaches past the
    sequence (FA4: row i sees ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``) is None, so
    a window of any size (2**32: no window) never reaches FA4's Int32 arguments."""
    left, right = pat.window_left, pat.window_right
    left = None if left is not None and left >= seqlen_k - 1 else left
    right = None if right is not None and right >= seqlen_q - 1 else right
    return left, right


def _native_kwargs(pat, seqlen_q: int, seqlen_k: int) -> dict:
    """FA4's arguments for a native (non-segments) pattern at this shape (the longest of a
    varlen batch's: a side past it is past each request's too)."""
    if pat.kind == "full":
        return {}
    left, right = _window(pat, seqlen_q, seqlen_k)
    if left is None and right == 0:
        return {"causal": True}
    return {} if (left, right) == (None, None) else {"window_size": (left, right)}


def _timed(what: str, desc, engine: str, q):
    """Time a call into FA4 on the host: its launches return at once, so a call that takes
    seconds compiled a kernel (FA4 keeps it on disk for the next process); say so once."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            took = time.perf_counter() - t0
            if took > 1.0 and not torch.compiler.is_compiling():
                say_once(f"compilemask: flash-attn-4 compiled its {what} kernel for mask "
                         f"{desc.mask.name!r} ({engine} engine, head dim {q.shape[-1]}, "
                         f"{q.dtype}) in {took:.1f} s: its first use on this machine")
            return result
        return run
    return wrap


def fwd(q, k, v, desc, softmax_scale: float, engine: str, lists=None, variant=None,
        score=None, sink=None, heads: int = 1):
    """(out [B, Sq, H, D], lse float32 [B, H, Sq]) through FA4; ``variant``: the mask_mod's
    (``KernelOptions.mask_mod``; None: the mask's default); ``score``: ``(ScoreMod, its
    tables)`` of a score_mod, or None; ``sink``: a learnable sink logit per head (FA4's
    ``learnable_sink``; the LSE includes it); ``heads > 1``: the descriptor holds a sequence
    per (batch, head) (``_per_head``)."""
    return _timed("forward", desc, engine, q)(_fwd)(q, k, v, desc, softmax_scale, engine, lists,
                                                    variant, score, sink, heads)


def bwd(dout, q, k, v, out, lse, desc, softmax_scale: float, engine: str, dlse=None,
        deterministic: bool = False, lists=None, variant=None, score=None, sink=None,
        heads: int = 1, table_grads: dict | None = None):
    """(dq, dk, dv), and dsink with a ``sink``, through FA4's backward for the same engine as
    the forward; ``table_grads``: score_mod table position -> float32 zeros of its shape, into
    which the backward adds that table's gradient."""
    copies = {n: g.new_zeros((table_grad_copies(g.numel()), *g.shape))
              for n, g in (table_grads or {}).items()}
    grads = _timed("backward", desc, engine, q)(_bwd)(dout, q, k, v, out, lse, desc,
                                                      softmax_scale, engine, dlse, deterministic,
                                                      lists, variant, score, sink, heads,
                                                      copies)
    for n, c in copies.items():  # on the device: no host synchronization
        table_grads[n].add_(c.sum(0))
    return grads


# private copies of a trained table's gradient buffer, the CTA's own chosen by its block index
# (docs/decisions/trainable-score-tables.md): enough for every CTA an H100 runs at once, within
# 16 MiB
TABLE_GRAD_COPIES, TABLE_GRAD_COPY_BYTES = 256, 16 << 20


def table_grad_copies(numel: int) -> int:
    """How many private copies of a ``numel``-entry float32 gradient buffer the backward adds
    into (a hot entry's adds from CTAs running at once then land in different sectors)."""
    return max(1, min(TABLE_GRAD_COPIES, TABLE_GRAD_COPY_BYTES // (4 * max(numel, 1))))


def _per_head(lists, heads: int):
    """A descriptor of ``B * heads`` sequences (``b * heads + h``) as FA4's per-head lists:
    ``[B * H, 1, R(, C)]`` viewed ``[B, H, R(, C)]`` (FA4 then runs every head in one launch,
    hands the mask_mod the query head and turns pack_gqa off)."""
    if heads == 1:
        return lists
    return type(lists)(*(t.view(-1, heads, *t.shape[2:]) for t in lists))


def _mods(desc, engine: str, variant, score, backward: bool, gqa: int = 1, sink=None,
          heads: int = 1, served: bool = False, table_grads: dict | None = None) -> dict:
    """FA4's mask_mod, score_mod(_bwd) / softcap and aux_tensors for this call: the mask's aux
    tensors first, then the score_mod's tables (its code reads them at that offset); ``gqa``:
    query heads per kv head (the backward's score_mod indices come packed by it); ``variant``:
    the one asked for (``variant_for_call`` decides)."""
    kw, aux = {}, []
    if engine == "fa4":
        variant = variant_for_call(desc, variant, backward, heads, served)
        kw["mask_mod"] = mask_mod(desc.mask, variant, heads, reads_positions(desc, variant))
        aux = list(aux_tensors(desc, variant) or [])
    if score is not None:
        sm, tables = score
        if sm.softcap is not None:
            kw["softcap"] = sm.softcap
        else:
            # rows past the last tile reach seqlen + tile: indices stay below INDEX_BOUND (the
            # backward too, since its indices are not wrapped: no spill, docs/decisions/engine.md)
            bits = (sm.index_bits
                    and max(desc.seqlen_q, desc.seqlen_k) + 256 <= INDEX_BOUND)
            grads = table_grads if backward and table_grads else {}
            # served rows read q_idx at their positions (a table read, never relative)
            luts = (relative_tables(sm, max(desc.seqlen_q, desc.seqlen_k), desc.device)
                    if sm.relative and not served else [])
            fn, fn_bwd = score_mod_fns(sm, len(aux), gqa if backward else 1, bits, tuple(grads),
                                       relative=bool(luts))
            kw["score_mod"] = fn
            if backward:
                kw["score_mod_bwd"] = fn_bwd
            # the relative indices' tables, then the buffers after them, as the code reads
            aux += [*tables, *luts, *grads.values()]
    if aux:
        kw["aux_tensors"] = [_leading_dim(t) for t in aux]
    if sink is not None:
        kw["learnable_sink"] = sink
    kw["patches"] = patches()
    return kw


# relative indices' tables (``ScoreMod.relative_table``) per (score_mod, index, reach, device):
# a few KiB to a MiB each, built once per length class
_RELATIVE = LRU(64)


def relative_tables(sm, seqlen: int, device) -> list:
    """The tables of ``sm``'s relative indices for calls of up to ``seqlen`` queries and keys
    (reach rounded up to a multiple of 4096, so lengths that change share them)."""
    reach = -(-max(seqlen, 1) // 4096) * 4096
    out = []
    for n in range(len(sm.relative)):
        key = (sm.key, n, reach, str(device))
        lut = _RELATIVE.get(key)
        if lut is None:
            lut = sm.relative_table(n, reach, device)
            if not is_fake(lut):  # a traced call's stand-in is no table for a real one
                lut = _RELATIVE.setdefault(key, lut)
        out.append(lut)
    return out


def patches() -> tuple:
    """The FA4 globals this package's calls replace (``fa4_lib.patched``): the forward's row
    mask, the backward's column view, neither index wrap for the generated functions; every
    other mask_mod and score_mod runs FA4's code unchanged."""
    # the mask classes extend FA4's kernel modules (and the CUTLASS DSL): on the first call
    from . import fa4_colmask, fa4_rowmask, fa4_unwrap

    return (*fa4_rowmask.PATCHES, *fa4_colmask.PATCHES, *fa4_unwrap.PATCHES)


def _leading_dim(t):
    """FA4 needs one stride-1 dimension of size > 1 per aux tensor, unless told which: a batch
    of one sequence with one param (``[1, 1]``), or a one-element table, names its last."""
    unit = [d for d, st in enumerate(t.stride()) if st == 1]
    if len(unit) > 1 and sum(t.shape[d] > 1 for d in unit) != 1 and t.stride(-1) == 1:
        t.__leading_dim__ = t.dim() - 1
    return t


def _fwd(q, k, v, desc, softmax_scale: float, engine: str, lists=None, variant=None,
         score=None, sink=None, heads: int = 1):
    mods = _mods(desc, engine, variant, score, backward=False, sink=sink, heads=heads)
    if engine == "native":
        pat = desc.native
        if pat.kind == "segments":
            B, S, H, D = q.shape
            cu, max_len = desc.segments
            window = _window(pat, max_len, max_len)
            out, lse = fa4_lib.varlen_fwd(
                q.reshape(B * S, H, D), k.reshape(B * S, k.shape[2], D),
                v.reshape(B * S, v.shape[2], v.shape[3]), cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=max_len, max_seqlen_k=max_len, softmax_scale=softmax_scale,
                causal=window[0] is None, window_size=window, return_lse=True, **mods)
            return out.view(B, S, H, v.shape[3]), lse.view(H, B, S).permute(1, 0, 2)
        return fa4_lib.fwd(q, k, v, softmax_scale=softmax_scale,
                           **_native_kwargs(pat, q.shape[1], k.shape[1]), **mods)

    lists = _per_head(desc.block_sparse("fwd") if lists is None else lists, heads)
    return fa4_lib.fwd(q, k, v, softmax_scale=softmax_scale,
                       block_sparse_tensors=fa4_lib.block_sparse_tensors(lists, FWD_TILES),
                       **mods)


def fwd_served(q, k, v, desc, softmax_scale: float, engine: str, **lengths):
    """(out, lse) of a serving forward (``compilemask.api.serving``): ``lengths`` are FA4's
    ``page_table`` / ``seqused_k`` / ``cu_seqlens_q/k`` / ``max_seqlen_q/k`` for the batch.
    FA4's paged and varlen loads take no block-sparse lists here, so the fa4 engine's mask_mod
    runs on every tile (its q_idx / kv_idx are each request's own, as the table's rows)."""
    native = (_native_kwargs(desc.native, desc.seqlen_q, desc.seqlen_k) if engine == "native"
              else {})
    mods = _mods(desc, engine, None, None, backward=False, served=True)
    return _timed("serving forward", desc, engine, q)(fa4_lib.fwd)(
        q, k, v, softmax_scale=softmax_scale, **lengths, **native, **mods)


def _bwd(dout, q, k, v, out, lse, desc, softmax_scale: float, engine: str, dlse=None,
         deterministic: bool = False, lists=None, variant=None, score=None, sink=None,
         heads: int = 1, table_grads: dict | None = None):
    D = q.shape[-1]
    mods = _mods(desc, engine, variant, score, backward=True, gqa=q.shape[2] // k.shape[2],
                 sink=sink, heads=heads, table_grads=table_grads)
    if engine == "native":
        pat = desc.native
        if pat.kind == "segments":
            B, S, H, _ = q.shape
            cu, max_len = desc.segments
            window = _window(pat, max_len, max_len)
            flat = [t.reshape(B * S, t.shape[2], t.shape[3]) for t in (q, k, v, out, dout)]
            lse_flat = lse.permute(1, 0, 2).reshape(H, B * S)
            dlse_flat = None if dlse is None else dlse.permute(1, 0, 2).reshape(H, B * S)
            dq, dk, dv, *dsink = fa4_lib.bwd(
                *flat[:3], flat[3], flat[4], lse_flat.contiguous(), softmax_scale,
                causal=window[0] is None, window_size_left=window[0],
                window_size_right=window[1],
                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                deterministic=deterministic,
                dlse=None if dlse_flat is None else dlse_flat.contiguous(), **mods)
            return (dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), *dsink)
        kw = _native_kwargs(pat, q.shape[1], k.shape[1])
        causal = kw.get("causal", False)
        wl, wr = kw.get("window_size", (None, None))
        return fa4_lib.bwd(q, k, v, out, dout, lse, softmax_scale, causal=causal,
                           window_size_left=wl, window_size_right=wr,
                           deterministic=deterministic, dlse=dlse, **mods)

    kind = "bwd64" if D == 128 else "bwd128"
    lists = _per_head(desc.block_sparse(kind) if lists is None else lists, heads)
    bs = fa4_lib.block_sparse_tensors(lists, (BWD_TILE_M[D], 128))
    return fa4_lib.bwd(q, k, v, out, dout, lse, softmax_scale, block_sparse_tensors=bs,
                       deterministic=deterministic, dlse=dlse, **mods)
