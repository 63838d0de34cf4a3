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
  predecessor's start).

Candidates come from the compiled intervals (constant offsets from ``i``); the proof is over the
rules themselves, for every ``0 <= i < seqlen_q``, ``0 <= j < seqlen_k`` and every value of the
metadata, so a pattern is never taken on the strength of the intervals alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy as sp
import torch

from compilemask.dsl.frontend import rule_symbols
from compilemask.prover import Prover

__all__ = ["NativePattern", "native_pattern", "segments", "finish_descriptor"]


@dataclass(frozen=True)
class NativePattern:
    """What FA4's native path runs. ``window_left/right``: None = unbounded on that side."""

    kind: str  # "full" | "window" | "segments"
    window_left: int | None = None
    window_right: int | None = None
    bottom_right: bool = True  # False: proven top-left only (native when seqlen_q == seqlen_k)
    segment_param: str | None = None
    proof: str = ""

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
        if self.kind == "segments":
            return f"causal within segments starting at {self.segment_param}[i], {w} (varlen)"
        name = "causal" if self.causal else "sliding window"
        align = "bottom-right" if self.bottom_right else "top-left (native when Sq == Sk)"
        return f"{name}, {w}, {align}"


def _visible_expr(mask) -> sp.Basic:
    """The user's mask as one Boolean in i, j, params: first region whose guard holds."""
    terms, earlier = [], []
    for r in mask.regions:
        terms.append(sp.And(r.guard, *[sp.Not(g) for g in earlier], r.rule))
        earlier.append(r.guard)
    return sp.Or(*terms)


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


def _candidates(mask, syms):
    """(kind, left, right, segment array) guesses from a single-interval mask."""
    if len(mask.regions) != 1 or mask.has_fallback:
        return
    reg = mask.regions[0]
    if len(reg.intervals) != 1 or reg.intervals[0].cond is not sp.true:
        return
    iv = reg.intervals[0]
    i, sk = syms["i"], syms["seqlen_k"]
    bases = (i, i + sk - syms["seqlen_q"])
    lo, hi = iv.lower, iv.upper
    right = None if hi == sk else _offset(hi, bases, sk)
    if right is not None:
        right -= 1
    elif hi != sk:
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


def _pattern_expr(kind, left, right, app, syms, bottom_right):
    i, j = syms["i"], syms["j"]
    c = i + (syms["seqlen_k"] - syms["seqlen_q"] if bottom_right else 0)
    if kind == "full":
        return sp.true
    conds = []
    if kind == "segments":
        conds.append(sp.Le(app, j))
    if left is not None:
        conds.append(sp.Ge(j, c - left))
    if right is not None:
        conds.append(sp.Le(j, c + right))
    return sp.And(*conds)


def _run_axioms(mask, syms) -> list:
    """For each compared per-token array ``ids`` (``ids[i] == ids[j]``): the preprocess checks
    that equal ids form one run and derives its bounds, so ``ids[j] == ids[i]`` iff ``j`` is in
    ``[run_start[i], run_end[i])``."""
    from compilemask.dsl.frontend import array_function

    i, j = syms["i"], syms["j"]
    facts = []
    for start, end, ids in mask.derived_arrays:
        a, s0, e0 = array_function(ids), array_function(start)(i), array_function(end)(i)
        inside = sp.And(sp.Le(s0, j), sp.Lt(j, e0))
        same = sp.Eq(a(j), a(i))
        facts.append(sp.Or(sp.And(same, inside), sp.And(sp.Not(same), sp.Not(inside))))
        facts += [sp.Le(s0, i), sp.Lt(i, e0)]
    return facts


def native_pattern(mask) -> NativePattern | None:
    """The native pattern z3 proves the mask equal to, or None (see the module docstring)."""
    syms = rule_symbols(mask.spec.params)
    try:
        vis = _visible_expr(mask)
    except (TypeError, ValueError):
        return None
    divisors = mask.divisor_params
    prover = Prover(_run_axioms(mask, syms), syms, divisors)
    for kind, left, right, app in _candidates(mask, syms):
        if (left is not None and left < 0) or (right is not None and right < 0):
            continue  # FA4 reads a negative window size as unbounded: never hand it one
        for bottom_right in (True, False):
            pat = _pattern_expr(kind, left, right, app, syms, bottom_right)
            if prover.proves(sp.And(sp.Or(sp.Not(vis), pat), sp.Or(sp.Not(pat), vis))):
                seg = type(app).__name__ if app is not None else None
                proof = (f"z3: for all 0 <= i < seqlen_q, 0 <= j < seqlen_k and all metadata, "
                         f"visible(i, j) <=> {sp.sstr(pat)}")
                if kind == "full":
                    return NativePattern("full", proof=proof)
                return NativePattern(kind, left, right, bottom_right, seg, proof)
    return None


def segments(mask, desc):
    """``(cu_seqlens int32 [n + 1], max_seqlen)`` over the batch's ``B * Sq`` flattened rows for
    a segments pattern, or None when this batch's starts are not a segmentation (or the pattern
    does not apply). Synchronizes once: FA4's varlen grid needs the count and the longest."""
    pat = mask.native_pattern
    if pat is None or pat.kind != "segments" or desc.seqlen_q != desc.seqlen_k:
        return None
    B, S = desc.row_region.shape
    col = mask.array_params.index(pat.segment_param)
    start = desc.row_params[:, :, col]
    first = start == torch.arange(S, device=start.device, dtype=start.dtype)
    # a segmentation: row 0 starts a segment, every later row starts one or continues its
    # predecessor's (then by induction every row's start is the first row of its run)
    ok = first[:, 0].all() & (first[:, 1:] | (start[:, 1:] == start[:, :-1])).all()
    # one transfer: the segment starts, and index B * S when the check failed
    flags = torch.cat([first.reshape(-1), (~ok).reshape(1)])
    begins = torch.nonzero(flags).reshape(-1).cpu()
    if len(begins) and int(begins[-1]) == B * S:
        return None
    cu = torch.cat([begins, begins.new_full((1,), B * S)])
    longest = int((cu[1:] - cu[:-1]).max())
    return cu.to(device=start.device, dtype=torch.int32), longest


def finish_descriptor(desc):
    """What every producer adds after the Interval Table and bitmaps: the segments of a
    segments-pattern mask, and on CUDA the FA4 block-sparse lists of a non-native mask."""
    mask = desc.mask
    pat = mask.native_pattern
    if pat is not None and pat.kind == "segments":
        desc = dataclasses.replace(desc, segments=segments(mask, desc))
    elif pat is None:
        from compilemask.blocksparse import attach_lists

        desc = attach_lists(desc)
    return desc
