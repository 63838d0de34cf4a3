"""Magnitude bounds of compiled expressions: the largest |value| any subexpression can take as
the generated code evaluates it, given ranges for the indices, the lengths and the metadata.

The generated preprocess computes endpoints in int64 (torch and TileLang) and the kernels'
fallback predicates in int32; Python's rules are exact. An expression whose bound fits the
evaluation type is computed exactly; one that may not is refused rather than wrapped."""

from __future__ import annotations

import sympy as sp

from compilemask.contract.lru import LRU
from compilemask.dsl.exprprint import split_floor
from compilemask.dsl.frontend import IntBitOp

__all__ = ["INDEX_MAX", "META_MAX", "INT32_MAX", "INT64_MAX", "magnitude", "check_fits",
           "check_kernel_predicates", "kernel_predicates", "longest_fit", "fits_metadata",
           "fits_int32"]

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INDEX_MAX = INT32_MAX  # rows, keys and lengths are int32 indices
META_MAX = 2**30  # the largest metadata value preprocess accepts

_INDEX_NAMES = ("i", "j", "seqlen_q", "seqlen_k")


def magnitude(e, index_max: int = INDEX_MAX, meta_max: int = META_MAX) -> int:
    """Upper bound of |x| over every subexpression x of ``e`` (sympy), with the indices and
    lengths in [0, index_max] and every param and per-row array value in [0, meta_max]."""
    top = 0

    def walk(x) -> int:  # bound of |x|; records the largest bound seen
        nonlocal top
        b = _node(x)
        top = max(top, b)
        return b

    def _node(x) -> int:
        if x is sp.true or x is sp.false or isinstance(x, sp.logic.boolalg.BooleanAtom):
            return 1
        if isinstance(x, sp.Integer):
            return abs(int(x))
        if isinstance(x, sp.Rational):  # a coefficient the printers clear or floor
            return abs(int(x.p))
        if isinstance(x, sp.Symbol):
            return index_max if x.name in _INDEX_NAMES else meta_max
        if isinstance(x, IntBitOp):  # |a op b| < 2**n for |a|, |b| < 2**n (two's complement)
            return 1 << max(walk(a) for a in x.args).bit_length()
        if isinstance(x, sp.core.function.AppliedUndef):
            for a in x.args:  # the subscripts
                walk(a)
            return 1 if len(x.args) == 2 else meta_max  # a table's entry is 0 or 1
        if isinstance(x, sp.Add):
            return sum(walk(a) for a in x.args)
        if isinstance(x, sp.Mul):
            num, den = sp.fraction(x)
            if den != 1:  # printed as floor division of the expanded numerator
                walk(den)
                return walk(sp.expand(num)) + 1
            out = 1
            for a in x.args:
                out *= walk(a)
            return out
        if isinstance(x, sp.Pow) and x.exp.is_Integer and int(x.exp) >= 1:
            return walk(x.base) ** int(x.exp)
        if isinstance(x, sp.floor):
            num, den = split_floor(x.args[0])
            walk(den)
            return walk(num) + 1
        if isinstance(x, sp.Mod):
            walk(x.args[0])
            return walk(x.args[1])
        if isinstance(x, (sp.Min, sp.Max, sp.Abs)):
            return max(walk(a) for a in x.args)
        if isinstance(x, sp.Piecewise):
            for _, c in x.args:
                walk(c)
            return max(walk(v) for v, _ in x.args)
        if isinstance(x, sp.core.relational.Relational):
            # the preprocess evaluates both sides as written; the kernels' predicates compare
            # the positive and negative terms of the expanded, denominator-free difference
            walk(x.lhs)
            walk(x.rhs)
            num, _ = sp.fraction(sp.together(x.lhs - x.rhs))
            terms = sp.Add.make_args(sp.expand(num))
            pos = [t for t in terms if not t.as_coeff_Mul()[0] < 0]
            neg = [-t for t in terms if t.as_coeff_Mul()[0] < 0]
            walk(sp.Add(*pos))
            walk(sp.Add(*neg))
            return 1
        if isinstance(x, sp.logic.boolalg.Boolean):  # And, Or, Not, Xor, ITE...
            for a in x.args:
                walk(a)
            return 1
        raise TypeError(f"no magnitude bound for {type(x).__name__}: {x}")

    walk(sp.sympify(e))
    return top


def check_fits(e, limit: int, what: str, index_max: int = INDEX_MAX,
               meta_max: int = META_MAX) -> None:
    """Raise ``ValueError`` naming ``what`` if ``e`` may exceed ``limit`` in magnitude."""
    b = magnitude(e, index_max, meta_max)
    if b > limit:
        bits = 64 if limit == INT64_MAX else 32
        raise ValueError(
            f"{what}: {e} can reach about 2**{b.bit_length() - 1} with indices up to {index_max} "
            f"and metadata up to {meta_max}, past the {bits}-bit integers the generated code "
            "computes in (Python's rule is exact, the code would wrap); rewrite it with smaller "
            "terms, e.g. divide before multiplying")


def check_kernel_predicates(mask, length: int, meta_max: int = 0) -> None:
    """The GPU kernels evaluate fallback predicates (and, for an all-fallback mask, the guards)
    in int32: refuse a rule that may not fit at this length, before any kernel is built.

    Indices are bounded by ``length``, metadata by ``max(length, meta_max)``: ``meta_max`` is
    what a descriptor knows of metadata given on the host (``ExecutionDescriptor.meta_max``).
    Metadata on the GPU is not read back (that would synchronize), and values there past the
    sequence (a sentinel of 2**30 in a product) are the caller's to keep within int32, as the
    docs say."""
    for r, what, e in kernel_predicates(mask):
        check_fits(e, INT32_MAX, f"Region {r.name!r}, {what} (evaluated per score by the GPU "
                   "kernels; backend='reference' computes it exactly)", index_max=length,
                   meta_max=max(length, meta_max))


def kernel_predicates(mask) -> list:
    """``(region, "rule" | "guard", expr)`` of what the GPU kernels evaluate in int32."""
    whole = all(r.fallback for r in mask.regions)  # one predicate with the guards in it
    return [(r, what, e) for r in mask.regions
            for what, e in ([("rule", r.rule)] if r.fallback else [])
            + ([("guard", r.guard)] if whole else [])]


def fits_metadata(exprs, limit: int = INT32_MAX, pad: int = 0) -> bool:
    """Whether metadata up to ``META_MAX`` keep every expression within ``limit`` at each
    length up to its ``longest_fit`` (else a descriptor records how far metadata given on the
    host reach past the length: ``ExecutionDescriptor.meta_max``). The bounds only grow with
    the length, so the longest such length (at most ``META_MAX``) decides."""
    exprs = list(exprs)
    n = min(longest_fit(exprs, limit, pad), META_MAX)
    return n < 0 or all(magnitude(e, n + pad, META_MAX) <= limit for e in exprs)


# bounded: a job of many masks (keys) and lengths meets new keys every step; a dropped entry is
# a bisection (_LONGEST) or a magnitude walk (_WIDE) again
_LONGEST = LRU(4096)  # (key, pad) -> longest_fit of the key's expressions
_WIDE = LRU(4096)  # (key, pad, length, meta_max) -> whether they fit there


def fits_int32(key, exprs, length: int, meta_max: int = 0, pad: int = 0) -> bool:
    """Whether the expressions ``exprs()`` (asked for once per ``key``) fit int32 with indices
    up to ``length + pad`` and metadata up to ``max(length, meta_max)``. Their ``longest_fit``
    is found once per key, so a loop whose length changes every step pays a compare; metadata
    given on the host past the length (``ExecutionDescriptor.meta_max``) are bounded once per
    (length, meta_max)."""
    k = (key, pad)
    longest = _LONGEST.get(k)
    if longest is None:
        longest = _LONGEST[k] = longest_fit(exprs(), pad=pad)
    if meta_max <= length or length > longest:
        return length <= longest
    w = (key, pad, length, meta_max)
    wide = _WIDE.get(w)
    if wide is None:
        wide = _WIDE[w] = all(magnitude(e, length + pad, meta_max) <= INT32_MAX for e in exprs())
    return wide


def longest_fit(exprs, limit: int = INT32_MAX, pad: int = 0) -> int:
    """The longest length L at which every expression fits ``limit``, with indices up to
    ``L + pad`` and metadata up to L (-1: none). The bounds only grow with L, so a bisection
    finds it once per mask, not once per length of a loop whose length changes every step."""
    exprs = list(exprs)

    def fits(n):
        return all(magnitude(e, n + pad, n) <= limit for e in exprs)

    lo, hi = 0, INDEX_MAX - pad
    if not fits(lo):
        return -1
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
