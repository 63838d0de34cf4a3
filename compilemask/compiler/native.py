"""Compiler-proven native patterns: masks that flash-attn-4 runs without block lists or mask_mod.

A compiled mask is *native* when z3 proves that the user's rules (guards with first-region-wins,
then the region's rule) equal one of

* ``full``: every key;
* ``window(left, right)``: ``i - left <= j <= i + right`` (either side may be unbounded; causal
  is ``window(None, 0)``), aligned top-left (``j`` against ``i``) or bottom-right (``j`` against
  ``i + seqlen_k - seqlen_q``, FlashAttention's alignment);
* ``segments(A, left)``: causal within segments, row ``i`` sees ``A[i] <= j <= i`` (and
  ``j >= i - left`` when windowed) for a per-row array ``A`` of segment starts (packed
  documents). FA4 runs it as varlen over ``cu_seqlens``; the preprocess derives ``cu_seqlens``
  from ``A`` and checks that ``A`` is a segmentation (each row's start is itself or its
  predecessor's start). ``segments(chunk)``: the segments are fixed-size chunks, row ``i``
  sees ``chunk * (i // chunk) <= j <= i`` (Llama 4's local layers); ``cu_seqlens`` is arithmetic
  (made on the device, no check, no host synchronization).

Candidates come from the compiled intervals (constant offsets from ``i``); the proof is over the
rules themselves, for every ``0 <= i < seqlen_q``, ``0 <= j < seqlen_k`` and every value of the
metadata, so a pattern is never taken on the strength of the intervals alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp
import torch

from compilemask.compiler.compiler import first_match_rule
from compilemask.compiler.prover import Prover
from compilemask.compiler.segments import derived_kind, run_names, span_names
from compilemask.dsl.frontend import array_function, rule_symbols

__all__ = ["NativePattern", "native_pattern", "segments"]


@dataclass(frozen=True)
class NativePattern:
    """What FA4's native path runs. ``window_left/right``: None = unbounded on that side."""

    kind: str  # "full" | "window" | "segments"
    window_left: int | None = None
    window_right: int | None = None
    bottom_right: bool = True  # False: proven top-left only (native when seqlen_q == seqlen_k)
    segment_param: str | None = None
    proof: str = ""
    # compared id arrays whose tokens must be contiguous in the batch for the proof to hold
    # (an ``ids[i] == ids[j]`` mask): checked per batch by ``segments``
    contiguous_ids: tuple[str, ...] = ()
    chunk: int | None = None  # segments of this constant size (segment_param is then None)

    @property
    def causal(self) -> bool:
        return self.kind in ("window", "segments") and self.window_left is None \
            and self.window_right == 0

    def applies(self, seqlen_q: int, seqlen_k: int) -> bool:
        """Whether the proof covers this shape (top-left proofs need square attention)."""
        if self.kind == "segments":
            return seqlen_q == seqlen_k
        return self.bottom_right or seqlen_q == seqlen_k

    def describe(self) -> str:
        if self.kind == "full":
            return "full attention"
        w = f"window_size=({self.window_left}, {self.window_right})"
        if self.kind == "segments" and self.chunk is not None:
            return f"causal within chunks of {self.chunk}, {w} (varlen)"
        if self.kind == "segments":
            when = (f"; for batches whose {', '.join(self.contiguous_ids)} are contiguous "
                    "(checked per batch)" if self.contiguous_ids else "")
            return (f"causal within segments starting at {self.segment_param}[i], {w} "
                    f"(varlen){when}")
        name = "causal" if self.causal else "sliding window"
        align = "bottom-right" if self.bottom_right else "top-left (native when Sq == Sk)"
        return f"{name}, {w}, {align}"


def _offset(e, bases, clip_to) -> int | None:
    """``e - base`` as an int for the first base where the bound is ``base + c`` (also under a
    clip ``Max(0, .)`` / ``Min(seqlen_k, .)``)."""
    if isinstance(e, (sp.Max, sp.Min)):
        rest = [a for a in e.args if a != clip_to]
        if len(rest) != 1:
            return None
        e = rest[0]
    for base in bases:
        d = sp.simplify(e - base)
        if d.is_Integer:
            return int(d)
    return None


def _candidates(mask, syms, exact_only: bool = False):
    """(kind, left, right, segment array) guesses from a single-interval mask (``exact_only``:
    from its one exact slot, the over-approximating ones aside)."""
    if len(mask.regions) != 1 or (mask.has_fallback and not exact_only):
        return
    reg = mask.regions[0]
    ivs = [iv for iv in reg.intervals if iv.exact or not exact_only]
    if len(ivs) != 1 or ivs[0].cond is not sp.true:
        return
    iv = ivs[0]
    i, sk = syms["i"], syms["seqlen_k"]
    bases = (i, i + sk - syms["seqlen_q"])
    lo, hi = iv.lower, iv.upper
    right = None if hi == sk else _offset(hi, bases, sk)
    if right is not None:
        right -= 1
    elif hi != sk:
        return
    chunk = _chunk_size(lo, i)
    if chunk is not None:
        if right == 0:
            yield ("segments", None, 0, chunk)
        return
    apps = [a for a in lo.atoms(sp.core.function.AppliedUndef) if a.args == (i,)]
    if apps and len(apps) == 1 and right == 0:
        app = apps[0]
        rest = [a for a in (lo.args if isinstance(lo, sp.Max) else (lo,)) if a != app]
        if not rest:
            yield ("segments", None, 0, app)
        elif len(rest) == 1:
            d = _offset(rest[0], bases, sp.Integer(0))
            if d is not None and d <= 0:
                yield ("segments", -d, 0, app)
        return
    left = None if lo == 0 else _offset(lo, bases, sp.Integer(0))
    if left is None and lo != 0:
        return
    if left is not None:
        left = -left
    if left is None and right is None:
        yield ("full", None, None, None)
    else:
        yield ("window", left, right, None)


def _chunk_size(lo, i) -> int | None:
    """``c`` when the lower bound is ``c * (i // c)`` for an integer ``c > 1``."""
    if not isinstance(lo, sp.Mul) or len(lo.args) != 2:
        return None
    c, fl = lo.args
    if not (c.is_Integer and int(c) > 1 and isinstance(fl, sp.floor)):
        return None
    return int(c) if sp.simplify(fl.args[0] - i / c) == 0 else None


def _pattern_expr(kind, left, right, app, syms, bottom_right):
    i, j = syms["i"], syms["j"]
    c = i + (syms["seqlen_k"] - syms["seqlen_q"] if bottom_right else 0)
    if kind == "full":
        return sp.true
    conds = []
    if kind == "segments" and isinstance(app, int):
        conds.append(sp.Le(app * sp.floor(i / app), j))
    elif kind == "segments":
        conds.append(sp.Le(app, j))
    if left is not None:
        conds.append(sp.Ge(j, c - left))
    if right is not None:
        conds.append(sp.Le(j, c + right))
    return sp.And(*conds)


def _run_axioms(mask, syms) -> list:
    """What the preprocess guarantees of the arrays it derives for a compared per-token array
    ``ids`` (``ids[i] == ids[j]``, compilemask.compiler.segments), for any ids: every key of the run
    ``[run_start[i], run_end[i])`` has row i's id, and every key with row i's id lies in the span
    ``[span_start[i], span_end[i])``. Nothing ties the id to the run alone (ids may recur), so
    no proof takes an id-equality mask for causal-within-segments."""
    i, j = syms["i"], syms["j"]
    facts = []
    for start, end, ids in mask.derived_arrays:
        a, s0, e0 = array_function(ids), array_function(start)(i), array_function(end)(i)
        inside = sp.And(sp.Le(s0, j), sp.Lt(j, e0))
        same = sp.Eq(a(j), a(i))
        if derived_kind(start, ids) == "run":
            facts.append(sp.Or(sp.Not(inside), same))
        else:
            facts.append(sp.Or(sp.Not(same), inside))
        facts += [sp.Le(s0, i), sp.Lt(i, e0)]
    return facts


def _contiguity_axioms(mask, syms) -> tuple[list, tuple[str, ...]]:
    """For each compared id array: its tokens are contiguous, i.e. an id's span is its run (so
    equal ids are exactly the run). ``segments`` checks this per batch."""
    i, j = syms["i"], syms["j"]
    facts, names = [], []
    for start, end, ids in mask.derived_arrays:
        if derived_kind(start, ids) != "run":
            continue
        a, s0, e0 = array_function(ids), array_function(start)(i), array_function(end)(i)
        inside = sp.And(sp.Le(s0, j), sp.Lt(j, e0))
        facts.append(sp.Or(sp.Not(sp.Eq(a(j), a(i))), inside))
        names.append(ids)
    return facts, tuple(names)


def native_pattern(mask) -> NativePattern | None:
    """The native pattern z3 proves the mask equal to, or None (see the module docstring)."""
    pat = _native_pattern(mask, contiguous=False)
    if pat is None and mask.derived_arrays:
        # an ids[i] == ids[j] mask: native on the batches whose ids are contiguous
        pat = _native_pattern(mask, contiguous=True)
    return pat


def _native_pattern(mask, contiguous: bool) -> NativePattern | None:
    syms = rule_symbols(mask.spec.params)
    try:
        vis = first_match_rule(mask.regions)
    except (TypeError, ValueError):
        return None
    divisors = mask.divisor_params
    axioms, names = _run_axioms(mask, syms), ()
    if contiguous:
        extra, names = _contiguity_axioms(mask, syms)
        axioms += extra
    prover = Prover(axioms, syms, divisors)
    for kind, left, right, app in _candidates(mask, syms, exact_only=contiguous):
        if contiguous and kind != "segments":
            continue
        if (left is not None and left < 0) or (right is not None and right < 0):
            continue  # FA4 reads a negative window size as unbounded: never hand it one
        for bottom_right in (True, False):
            pat = _pattern_expr(kind, left, right, app, syms, bottom_right)
            if prover.proves(sp.And(sp.Or(sp.Not(vis), pat), sp.Or(sp.Not(pat), vis))):
                chunk = app if isinstance(app, int) else None
                seg = type(app).__name__ if app is not None and chunk is None else None
                proof = (f"z3: for all 0 <= i < seqlen_q, 0 <= j < seqlen_k and all metadata, "
                         f"visible(i, j) <=> {sp.sstr(pat)}")
                if contiguous:
                    proof += f", when {', '.join(names)} are contiguous in the batch"
                if kind == "full":
                    return NativePattern("full", proof=proof)
                return NativePattern(kind, left, right, bottom_right, seg, proof, names, chunk)
    return None


_FA4_MANY_SEGMENTS = 256  # flash_attn.cute.interface.BIN_BATCH_SEARCH_THRESH


def segments(mask, desc, max_segments: int | None = None):
    """``(cu_seqlens int32 [n + 1], max_seqlen)`` over the batch's ``B * Sq`` flattened rows for
    a segments pattern, or None when the pattern does not apply.

    ``max_segments=None``: the exact segments, or None when this batch's starts are not a
    segmentation (the block-sparse engine then runs it); one host synchronization (FA4's varlen
    grid needs the count). ``max_segments=n``: no host synchronization (CUDA-graph capturable):
    ``cu_seqlens`` has ``n + 1`` entries, the segments then empty ones at ``B * Sq``, and
    ``max_seqlen`` is ``Sq`` (a segment never crosses a sequence); a batch with more segments,
    or whose starts are not a segmentation, fails a device-side assertion."""
    pat = mask.native_pattern
    if pat is None or pat.kind != "segments" or desc.seqlen_q != desc.seqlen_k:
        return None
    B, S = desc.row_region.shape
    if pat.chunk is not None:
        return _chunk_segments(B, S, pat.chunk, desc.row_region.device), min(pat.chunk, S)
    col = mask.array_params.index(pat.segment_param)
    start = desc.row_params[:, :, col]
    first = start == torch.arange(S, device=start.device, dtype=start.dtype)
    # a segmentation: row 0 starts a segment, every later row starts one or continues its
    # predecessor's (then by induction every row's start is the first row of its run)
    ok = first[:, 0].all() & (first[:, 1:] | (start[:, 1:] == start[:, :-1])).all()
    if pat.contiguous_ids:
        if max_segments is not None:
            # telling contiguous ids would need the host: without synchronizing, such a mask
            # runs on the block-sparse engine
            return None
        for ids in pat.contiguous_ids:  # the proof needs each id's span to be its run
            run0, span0 = mask.array_params.index(run_names(ids)[0]), \
                mask.array_params.index(span_names(ids)[0])
            ok = ok & (desc.row_params[:, :, run0] == desc.row_params[:, :, span0]).all()
    if max_segments is not None:
        return _fixed_segments(first.reshape(-1), ok, int(max_segments), B * S), S
    # one transfer: the segment starts, and index B * S when the check failed
    flags = torch.cat([first.reshape(-1), (~ok).reshape(1)])
    begins = torch.nonzero(flags).reshape(-1).cpu()
    if len(begins) and int(begins[-1]) == B * S:
        return None
    longest = int((torch.cat([begins[1:], begins.new_full((1,), B * S)]) - begins).max())
    return _closed(begins, B * S).to(device=start.device, dtype=torch.int32), longest


def _closed(starts: torch.Tensor, total: int) -> torch.Tensor:
    """``cu_seqlens`` from the segment starts: ``total`` appended, then empty segments up to
    past ``_FA4_MANY_SEGMENTS``. FA4 picks its varlen kernels by the segment count (a
    batch-lookup aid above it), so every batch with fewer segments runs one variant and
    compiles nothing."""
    pad = max(1, _FA4_MANY_SEGMENTS + 2 - len(starts))
    return torch.cat([starts, starts.new_full((pad,), total)])


def _chunk_segments(B: int, S: int, chunk: int, device) -> torch.Tensor:
    """``cu_seqlens`` of fixed-size chunks over ``B`` sequences of ``S`` rows, made on the device
    (arithmetic only)."""
    starts = (torch.arange(B, device=device, dtype=torch.int32).view(B, 1) * S
              + torch.arange(0, S, chunk, device=device, dtype=torch.int32).view(1, -1))
    return _closed(starts.reshape(-1), B * S)


def _fixed_segments(first: torch.Tensor, ok: torch.Tensor, cap: int, total: int):
    """``cu_seqlens`` of ``cap + 1`` entries from the flattened segment-start flags, on the
    device: each start goes to its rank, the rest stays ``total`` (empty segments)."""
    if cap < 1:
        raise ValueError(f"max_segments must be a positive int, got {cap}")
    cap = max(cap, _FA4_MANY_SEGMENTS + 1)  # one FA4 variant for every count (see above)
    count = first.sum()
    torch._assert_async(ok, "compilemask: the segment starts of this batch are not a "
                            "segmentation; preprocess without max_segments")
    torch._assert_async(count <= cap, "compilemask: this batch has more segments than "
                                      "max_segments")
    rank = torch.cumsum(first, 0, dtype=torch.int64) - 1
    slot = torch.where(first & (rank < cap), rank, cap + 1)  # cap + 1: a discarded slot
    cu = torch.full((cap + 2,), total, dtype=torch.int64, device=first.device)
    pos = torch.arange(total, device=first.device, dtype=torch.int64)
    cu.scatter_(0, slot, pos)
    return cu[:cap + 1].to(torch.int32)
