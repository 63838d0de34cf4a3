"""Descriptors of chosen rows: a sequence's rows at given positions against all its keys.

The pipeline's second producer (``pipeline.preprocess`` writes rows 0.. of a batch): the rows
of a context-parallel rank (``compilemask.api.distributed.shard_descriptor``) and the last
rows of a sequence being served (``compilemask.api.serving.query_descriptor``, each request's
keys ending at its own length: ``key_limit``). The generated interval table is evaluated at the
rows' positions only, their per-row metadata gathered there, and both bitmaps and the lists
made for the local rows; the fields set after that (``q_offset``, ``seqused_k``,
``seqused_q``, ``meta_max``) are set here, through the contract's ``with_fields``.
"""

from __future__ import annotations

import torch

from compilemask.codegen.preprocess import tilelang_preprocess
from compilemask.compiler.segments import derive_run_arrays
from compilemask.compiler.tiles import bitmaps
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    ExecutionDescriptor,
    make_descriptor,
    with_fields,
)
from compilemask.pipeline import pipeline
from compilemask.pipeline.compiled import _tiles_arg
from compilemask.pipeline.padding import _visibility_only, key_range, padded_tables

__all__ = ["rows_descriptor", "normalized", "arrays_at", "rows_table", "predicate_fields"]


def normalized(mask, meta, seqlen, batch_size, check, device=None):
    """(B, scalars, arrays incl. derived run bounds, device) of the global sequence."""
    B, scal, arrs, dev = mask.normalize_meta(meta, seqlen, seqlen, batch_size, device,
                                             check_values=True if check else None)
    derived = mask.derived_arrays
    if derived:
        arrs = {**arrs, **derive_run_arrays(derived, arrs, check or dev.type == "cpu")}
    return B, scal, arrs, dev


def arrays_at(mask, arrs, seqlen, rows):
    """The rows' positions clamped into the sequence, and the arrays there (``[B, n]``; a
    table's rows ``[B, n, M]``)."""
    at = rows.clamp(min=0, max=seqlen - 1)
    if rows.dim() == 1:
        return at, {a: arrs[a].index_select(1, at)
                    for a in (*mask.array_params, *mask.table_params)}
    got = {a: torch.gather(arrs[a], 1, at) for a in mask.array_params}
    for t in mask.table_params:
        table = arrs[t]
        idx = at.to(table.device).unsqueeze(-1).expand(*at.shape, table.shape[-1])
        got[t] = torch.gather(table.expand(at.shape[0], *table.shape[1:]), 1, idx)
    return at, got


def rows_table(mask, B, scal, arrs, seqlen, rows):
    """The generated interval table evaluated at global ``rows`` (int64 [n], or [B, n] per
    sequence; entries outside [0, seqlen) are padding: empty, region -1). Returns starts, lens,
    region and the arrays at the rows."""
    valid = (rows >= 0) & (rows < seqlen)
    at, arrs_at = arrays_at(mask, arrs, seqlen, rows)
    if rows.dim() == 1:
        at, v = at.unsqueeze(0), valid.view(1, -1)
    else:
        v = valid
    args = [at, seqlen, seqlen] + [scal[p] for p in mask.scalar_params] + [
        arrs_at[a] for a in mask.array_params]
    starts, lens, region = mask.torch_function("interval_table")(*args, batch_size=B)
    lens = torch.where(v.unsqueeze(-1), lens, 0)
    starts = torch.where(lens > 0, starts, 0)
    region = torch.where(v, region, -1)
    return starts, lens, region, arrs_at


def rows_descriptor(mask, meta, seqlen: int, rows: torch.Tensor, *,
                    batch_size: int | None = None, fwd_tiles=DEFAULT_FWD_TILES,
                    bwd_tiles=DEFAULT_BWD_TILES, check: bool = False,
                    key_limit: torch.Tensor | None = None, device=None,
                    who: str = "shard_descriptor", backend: str = "auto", q_offset: int = -1,
                    seqused_k: torch.Tensor | None = None,
                    seqused_q: torch.Tensor | None = None,
                    padding=None) -> ExecutionDescriptor:
    """The descriptor of a ``seqlen``-token sequence's ``rows`` (global positions, int64 [n]; at
    or past ``seqlen``: padding, seeing nothing) against all its keys: the rows of a
    context-parallel rank, or the last rows of a sequence being served
    (``compilemask.api.serving``; ``rows`` [B, n] per sequence there, and ``key_limit`` [B]: keys
    at or past it are not shown); ``who`` (the caller) names a refusal. A mask with fallback
    regions gets ``positions`` and ``key_params`` (``predicate_fields``): its predicates read
    ``i`` as the row's position and arrays at the keys' positions.
    ``device``: where it is made (default: the metadata's, else the CPU). ``q_offset``: -1
    (the default: rows are not 0.. of the sequence, so no rule may read ``q_idx`` as the
    position), or the position of the first row where the rows are consecutive positions up
    to the last key (``seqlen - n``: a served sequence's last rows, which FA4's native
    kernels align bottom-right). ``seqused_k`` / ``seqused_q``: a served batch's counts
    (int32 ``[B]``), recorded. ``padding``: a bool or 0/1 ``[B, seqlen]`` mask of the real
    tokens (``compilemask.pipeline.padding``): every row's keys clipped to its sequence's run,
    rows outside it seeing nothing (``q_offset`` then -1).
    ``backend``: "tilelang" (the preprocess program's rows variant: one launch, equal to the
    reference field by field on CUDA and TileLang's C target), "torch" (the generated
    reference: a few dozen small launches), "auto" (the program on CUDA where TileLang is
    installed, else the reference)."""
    if backend not in ("auto", "torch", "tilelang"):
        raise ValueError(f"{who}: backend must be auto, torch or tilelang, got {backend!r}")
    fwd_tiles = _tiles_arg(fwd_tiles, "fwd_tiles")
    bwd_tiles = _tiles_arg(bwd_tiles, "bwd_tiles")
    S = seqlen
    B, scal, arrs, dev = normalized(mask, meta, S, batch_size, check, device)
    rows = rows.to(dev)
    if rows.dim() not in (1, 2) or rows.dim() == 2 and rows.shape[0] not in (1, B):
        raise ValueError(f"{who}: rows must be [n] or [batch, n] with batch {B} (the metadata's "
                         f"or batch_size), got {list(rows.shape)}")
    n = rows.shape[-1]
    if backend == "auto":  # a decode step's descriptor: 0.15 ms in one launch vs 1.2 ms (H200)
        backend = "tilelang" if dev.type == "cuda" and pipeline.has_tilelang() else "torch"
    if backend == "tilelang":
        _, arrs_at = arrays_at(mask, arrs, S, rows)
        key_end = (torch.full((B,), S, dtype=torch.int32, device=dev) if key_limit is None
                   else key_limit.to(dev).expand(B))
        out = tilelang_preprocess(mask, B, scal, arrs_at, n, S, fwd_tiles, bwd_tiles, device=dev,
                                  rows=(rows.expand(B, n), key_end, S))
        out["row_params"] = pipeline.with_tables(mask, arrs_at, out["row_params"])
        desc = make_descriptor(mask, n, S, fwd_tiles, bwd_tiles, **out)
    else:
        starts, lens, region, arrs_at = rows_table(mask, B, scal, arrs, S, rows)
        if key_limit is not None:  # a sequence's keys end at its limit (a KV cache's used part)
            end = torch.minimum(starts + lens, key_limit.to(starts.device).view(-1, 1, 1))
            lens = (end - starts).clamp(min=0)
            starts = torch.where(lens > 0, starts, 0)
        always = _visibility_only(mask, region)  # a fallback region's slots: never full
        fwd, bwd = bitmaps(starts, lens, always, fwd_tiles, bwd_tiles, n, S)
        desc = pipeline.assemble(mask, B, scal, arrs_at, n, S, starts, lens, region, fwd_tiles,
                                 fwd, bwd_tiles, bwd)
    if mask.has_fallback:  # its predicates read i at the rows' positions, arrays at any key
        desc = with_fields(desc, **predicate_fields(mask, arrs, B, S, rows))
    if padding is not None:  # the run's keys only; rows outside it see nothing
        lo, hi = key_range(padding, B, S, device=dev)
        desc = padded_tables(desc, lo, hi, positions=rows, row_start=q_offset)
        q_offset = -1
    # no segments: FA4's varlen needs rows in global order
    return with_fields(pipeline.with_lists(desc), q_offset=q_offset,
                       meta_max=pipeline.meta_reach(mask, meta, n, S), seqused_k=seqused_k,
                       seqused_q=seqused_q)


def predicate_fields(mask, arrs, B: int, seqlen: int, rows: torch.Tensor) -> dict:
    """``positions`` (int32 ``[B, n]``: the rows' positions clamped into the sequence; padding
    rows see nothing, so any position in range is right for them) and ``key_params`` (int32
    ``[B, seqlen, R]``: the sequence's ``row_params``, by position) of a descriptor of chosen
    rows of a mask with fallback regions (``ExecutionDescriptor``)."""
    at = rows.clamp(min=0, max=seqlen - 1)
    positions = at.expand(B, at.shape[-1]).to(torch.int32).contiguous()
    dev = rows.device
    keys = (torch.stack([arrs[a] for a in mask.array_params], dim=-1) if mask.array_params
            else torch.zeros(B, seqlen, 0, dtype=torch.int64, device=dev))
    keys = pipeline.with_tables(mask, arrs, keys.to(torch.int32))
    return {"positions": positions, "key_params": keys.to(torch.int32).contiguous()}
