"""The middle end: sympy rule -> DNF -> key intervals -> canonical intervals (passes 2-4).

Each pass is a pure function:

* ``normalize`` + ``to_dnf_terms`` (pass 2): push ``abs/min/max`` that contain ``j`` out of
  comparisons, split ``!=``, turn ``ids[i] == ids[j]`` into the run of equal ids around i (exact)
  or the span of i's id under the comparison (compiler.segments), and return the rule as a
  list of conjunctions of atoms.
* ``extract_intervals`` (pass 3): per conjunction, atoms in ``i`` only become a row condition,
  atoms linear in ``j`` become bounds, ``j // c`` atoms are solved through the quotient, a ``j % c``
  with a bounded quotient is split into one conjunction per quotient value; anything else in ``j``
  is a *fallback* atom: dropped from the (then over-approximating) interval, kept in the predicate.
* ``canonicalize`` (pass 4): under the region's guard (and the failure of earlier guards), drop
  provably empty intervals, drop redundant bounds, merge provably overlapping or adjacent ones, and
  order them by their lower end.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import sympy as sp

from compilemask.compiler.prover import Prover
from compilemask.compiler.segments import (
    RUN_END,
    RUN_START,
    SPAN_END,
    SPAN_START,
    run_names,
    span_names,
)
from compilemask.dsl.exprprint import ExprPrinter
from compilemask.dsl.frontend import array_function

__all__ = [
    "Interval",
    "Term",
    "normalize",
    "to_dnf_terms",
    "extract_intervals",
    "canonicalize",
    "MAX_QUOTIENT_SPLIT",
    "CANONICALIZE_BUDGET",
    "CANONICALIZE_TESTS",
    "python_str",
    "run_arrays",
    "first_match_rule",
]

# A `j % c` atom is split into one interval per quotient value only up to this many values.
MAX_QUOTIENT_SPLIT = 64
# Solver work (``Prover.work``: runs, timeouts weighted) canonicalization may spend on one
# region's pairs of slots and their order: seconds; 52 slots from 104 terms take some 160 runs.
CANONICALIZE_BUDGET = 1000
# Pair tests (contained / mergeable / ordered, each built in sympy and mostly settled by a
# recent counterexample, so not solver runs) one region may spend: the scan is quadratic in its
# slots, and each test costs about a millisecond: 10000 are some ten seconds (104 terms to 52
# slots take some 7300), where 229 slots would take two minutes.
CANONICALIZE_TESTS = 10000

_REL = (sp.Lt, sp.Le, sp.Gt, sp.Ge, sp.Eq, sp.Ne)


def _has(e, s) -> bool:
    return e.has(s)


# --------------------------------------------------------------------------------------------
# pass 2: normalization and DNF
# --------------------------------------------------------------------------------------------


def _split_rel(rel, j):
    """Rewrite one relational whose sides contain abs/min/max/Piecewise of j."""
    if not isinstance(rel, _REL):
        return rel  # a comparison that sympy already decided
    lhs, rhs, cls = rel.lhs, rel.rhs, type(rel)
    if cls is sp.Ne:
        return sp.Or(_split_rel(sp.Lt(lhs, rhs), j), _split_rel(sp.Gt(lhs, rhs), j))
    # |x| OP r with the absolute value a whole side: a band, no case split needed.
    if isinstance(rhs, sp.Abs) and rhs.has(j) and not isinstance(lhs, sp.Abs):
        lhs, rhs = rhs, lhs
        cls = {sp.Lt: sp.Gt, sp.Le: sp.Ge, sp.Gt: sp.Lt, sp.Ge: sp.Le, sp.Eq: sp.Eq}[cls]
    if isinstance(lhs, sp.Abs) and lhs.has(j):
        x = lhs.args[0]
        if cls in (sp.Lt, sp.Le):
            return sp.And(_split_rel(cls(-rhs, x), j), _split_rel(cls(x, rhs), j))
        if cls in (sp.Gt, sp.Ge):
            return sp.Or(_split_rel(cls(x, rhs), j), _split_rel(cls(-rhs, x), j))
        return sp.And(sp.Ge(rhs, 0), sp.Or(_split_rel(sp.Eq(x, rhs), j),
                                           _split_rel(sp.Eq(x, -rhs), j)))
    # Put the relation in the form d OP 0 with d = lhs - rhs; find a splittable subterm.
    d = lhs - rhs
    for sub in sp.preorder_traversal(d):
        if isinstance(sub, (sp.Abs, sp.Min, sp.Max, sp.Piecewise)) and _has(sub, j):
            break
    else:
        return rel
    if isinstance(sub, sp.Abs):
        x = sub.args[0]
        pos = _split_rel(cls(d.subs(sub, x), 0), j)
        neg = _split_rel(cls(d.subs(sub, -x), 0), j)
        return sp.Or(sp.And(sp.Ge(x, 0), pos), sp.And(sp.Lt(x, 0), neg))
    if isinstance(sub, (sp.Min, sp.Max)):
        # min(a, b, ...) takes one of its values: a case split on which one is the extremum.
        alts = []
        args = list(sub.args)
        for k, a in enumerate(args):
            conds = [
                (sp.Le(a, b) if isinstance(sub, sp.Min) else sp.Ge(a, b))
                for m, b in enumerate(args)
                if m != k
            ]
            alts.append(sp.And(*conds, _split_rel(cls(d.subs(sub, a), 0), j)))
        return sp.Or(*alts)
    # Piecewise
    alts, prev = [], []
    for val, cond in sub.args:
        case = _split_rel(cls(d.subs(sub, val), 0), j)
        alts.append(sp.And(cond, *[sp.Not(c) for c in prev], case))
        prev.append(cond)
    return sp.Or(*alts)


def normalize(expr, j):
    """Pass 2a: negations pushed to the atoms, then comparisons become plain atoms that a DNF
    can hold."""
    return _normalize(sp.to_nnf(expr, simplify=False), j)


def _normalize(expr, j):
    if not isinstance(expr, _REL) and isinstance(expr, sp.logic.boolalg.BooleanAtom):
        return expr
    run = _run_atom(expr, j)
    if run is not None:
        return run
    if isinstance(expr, _REL):
        return _split_rel(expr, j) if (_has(expr, j) or isinstance(expr, sp.Ne)) else expr
    if isinstance(expr, (sp.And, sp.Or, sp.Not)):
        return type(expr)(*[_normalize(a, j) for a in expr.args])
    return expr


def _same_array_at_i_and_j(rel, j):
    """``ids(i) == ids(j)`` (or ``!=``, either side first) -> (ids(i), the array's name); else
    None."""
    if not isinstance(rel, (sp.Eq, sp.Ne)):
        return None
    a, b = rel.lhs, rel.rhs
    undef = sp.core.function.AppliedUndef
    if not (isinstance(a, undef) and isinstance(b, undef) and len(a.args) == len(b.args) == 1
            and type(a).__name__ == type(b).__name__):
        return None
    if a.args[0] == j:
        a, b = b, a
    i = a.args[0]
    if b.args[0] != j or not (i.is_Symbol and i.name == "i"):
        return None
    return a, type(a).__name__


def _run_atom(rel, j):
    """``ids[i] == ids[j]`` (or ``!=``) -> bounds on j by the run and the span of row i's id
    (see compilemask.compiler.segments); None for any other atom.

    The run terms are exact; the span terms keep the comparison as a residual atom, so the
    region keeps it as its predicate. The rewrite is an equivalence: the run holds only keys
    with row i's id and the span holds all of them."""
    found = _same_array_at_i_and_j(rel, j)
    if found is None:
        return None
    app, ids = found
    i = app.args[0]
    rs, re_ = (array_function(n)(i) for n in run_names(ids))
    ss, se = (array_function(n)(i) for n in span_names(ids))
    if isinstance(rel, sp.Eq):
        return sp.Or(sp.And(sp.Ge(j, rs), sp.Lt(j, re_)),
                     sp.And(sp.Ge(j, ss), sp.Lt(j, se), rel))
    return sp.Or(sp.Lt(j, ss), sp.Ge(j, se),
                 sp.And(sp.Ge(j, ss), sp.Lt(j, rs), rel),
                 sp.And(sp.Ge(j, re_), sp.Lt(j, se), rel))


_DERIVED = ((RUN_START, run_names), (RUN_END, run_names), (SPAN_START, span_names),
            (SPAN_END, span_names))


def run_arrays(terms) -> list[tuple[str, str, str]]:
    """(start, end, ids) of the run- and span-bound arrays that DNF terms read, in a stable
    order."""
    names = set()
    for t in terms:
        for atom in t:
            names |= {type(f).__name__ for f in atom.atoms(sp.core.function.AppliedUndef)}
    out = set()
    for n in names:
        for suffix, names_of in _DERIVED:
            if n.endswith(suffix):
                ids = n[: -len(suffix)]
                out.add((*names_of(ids), ids))
    return sorted(out)


def to_dnf_terms(expr) -> list[list]:
    """Pass 2b: a Boolean -> list of conjunctions (lists of atoms). [] is False, [[]] is True."""
    if expr is sp.false or expr == sp.false:
        return []
    if expr is sp.true or expr == sp.true:
        return [[]]
    dnf = sp.to_dnf(expr, simplify=False)
    if dnf is sp.true:
        return [[]]
    if dnf is sp.false:
        return []
    terms = dnf.args if isinstance(dnf, sp.Or) else (dnf,)
    out = []
    for t in terms:
        atoms = list(t.args) if isinstance(t, sp.And) else [t]
        if any(a is sp.false for a in atoms):
            continue
        out.append([a for a in atoms if a is not sp.true])
    return out


# --------------------------------------------------------------------------------------------
# pass 3: interval extraction
# --------------------------------------------------------------------------------------------


@dataclass
class Term:
    """One conjunction's interval: j in [max(lowers), min(uppers)) on rows where cond holds."""

    lowers: list = field(default_factory=list)
    uppers: list = field(default_factory=list)
    cond: list = field(default_factory=list)  # atoms in i and params only
    residual: list = field(default_factory=list)  # fallback atoms (the interval over-approximates)
    reasons: list = field(default_factory=list)


def _linear_bound(rel, var):
    """For an atom ``lhs REL rhs`` linear in ``var`` with an integer coefficient, return
    (lower, upper) as half-open bounds on var (either may be None); else None."""
    d = sp.expand(rel.lhs - rel.rhs)
    if not d.has(var):
        return None
    a = d.coeff(var, 1)
    b = sp.expand(d - a * var)
    if b.has(var) or not a.is_Integer or a == 0:
        return None
    a = int(a)
    cls = type(rel)
    # Normalize to a*var + b OP 0 with a > 0.
    if a < 0:
        a, b = -a, -b
        cls = {sp.Lt: sp.Gt, sp.Le: sp.Ge, sp.Gt: sp.Lt, sp.Ge: sp.Le, sp.Eq: sp.Eq}.get(cls)
        if cls is None:
            return None  # != is split before this pass; anything else stays a predicate

    def fl(x):  # floor(x / a) for an integer expression x
        return x if a == 1 else sp.floor(x / a)

    if cls is sp.Lt:  # var < -b/a  <=>  var <= floor((-b-1)/a)
        return None, fl(-b - 1) + 1
    if cls is sp.Le:
        return None, fl(-b) + 1
    if cls is sp.Gt:  # var > -b/a  <=>  var >= floor(-b/a) + 1
        return fl(-b) + 1, None
    if cls is sp.Ge:  # var >= ceil(-b/a) = -floor(b/a)
        return -fl(b), None
    if cls is sp.Eq:
        return -fl(b), fl(-b) + 1
    return None


def _quotients(e, j):
    """(floor(X/c) subterms, Mod(X, c) subterms) with X containing j, as {(X, c): node}."""
    floors, mods = {}, {}
    for sub in sp.preorder_traversal(e):
        if isinstance(sub, sp.floor) and sub.has(j):
            num, den = sp.fraction(sp.together(sub.args[0]))
            if not den.has(j):
                floors[(sp.expand(num), den)] = sub
        elif isinstance(sub, sp.Mod) and sub.args[0].has(j) and not sub.args[1].has(j):
            mods[(sp.expand(sub.args[0]), sub.args[1])] = sub
    return floors, mods


def _j_coeff_one(x, j):
    """x = j + r with r free of j: return r, else None."""
    x = sp.expand(x)
    if x.coeff(j, 1) != 1:
        return None
    r = sp.expand(x - j)
    return None if r.has(j) else r


def extract_intervals(terms, i, j) -> list[Term]:
    """Pass 3: each conjunction of atoms -> a Term (interval + row condition + residual)."""
    out = []
    work = [list(t) for t in terms]
    while work:
        atoms = work.pop(0)
        split = _split_quotient(atoms, j)
        if split is not None:
            work[0:0] = split
            continue
        t = Term()
        for atom in atoms:
            if not atom.has(j):
                t.cond.append(atom)
                continue
            bound = _bound_of(atom, j) if isinstance(atom, _REL) else None
            if bound is not None and any(e is not None and e.has(j) for e in bound):
                bound = None  # not solved for j after all: keep the atom as a predicate
            if bound is None:
                t.residual.append(atom)
                t.reasons.append(_why_fallback(atom, j))
                continue
            lo, hi = bound
            if lo is not None:
                t.lowers.append(lo)
            if hi is not None:
                t.uppers.append(hi)
        # the invariant the generated preprocess relies on: endpoints are functions of the row
        assert not any(e.has(j) for e in t.lowers + t.uppers), (atoms, t.lowers, t.uppers)
        out.append(t)
    return out


def _bound_of(atom, j):
    """Half-open (lower, upper) on j from one atom, through floor(X/c) if needed; else None."""
    if any(isinstance(s, sp.core.function.AppliedUndef) and s.has(j)
           for s in sp.preorder_traversal(atom)):
        return None
    floors, mods = _quotients(atom, j)
    if mods:
        return None
    if not floors:
        return _linear_bound(atom, j)
    if len(floors) != 1:
        return None
    (x, c), node = next(iter(floors.items()))
    r = _j_coeff_one(x, j)
    if r is None:
        return None
    q = sp.Dummy("q", integer=True)
    sub = atom.func(atom.lhs.subs(node, q), atom.rhs.subs(node, q))
    if sub is sp.false:  # decided by sympy once the quotient is a plain integer (parity)
        return sp.Integer(0), sp.Integer(0)
    if sub is sp.true:
        return None, None
    if sub.has(j):  # j outside the quotient too: a*j + b*(j + r)//c
        return _monotone_bound(atom, node, x, c, r, j)
    qb = _linear_bound(sub, q)
    if qb is None:
        return None
    # q >= e  <=>  X >= c*e ;  q < e  <=>  X < c*e ;  X = j + r.
    lo = None if qb[0] is None else sp.expand(c * qb[0] - r)
    hi = None if qb[1] is None else sp.expand(c * qb[1] - r)
    return lo, hi


def _monotone_bound(atom, node, x, c, r, j):
    """Bounds on j from ``a*j + b*floor(x/c) + rest OP 0`` with x = j + r, when the left side
    is monotone in j (a >= 0 and a + b >= 0, or both <= 0), solved exactly; else None.

    With x = c*q + s (0 <= s < c) the left side is g(x) = A*q + a*s with A = a*c + b, non-
    decreasing when a >= 0 and a + b >= 0 (the step from s = c - 1 to the next q is a + b). The
    largest x with g(x) <= T is c*q* + min(c - 1, (T - A*q*) // a) with q* = T // A."""
    if not (c.is_Integer and int(c) > 1):
        return None
    cls = type(atom)
    if cls not in (sp.Lt, sp.Le, sp.Gt, sp.Ge, sp.Eq):
        return None
    q = sp.Dummy("q", integer=True)
    d = sp.expand((atom.lhs - atom.rhs).subs(node, q))
    a, b = d.coeff(j, 1), d.coeff(q, 1)
    rest = sp.expand(d - a * j - b * q)
    if not (a.is_Integer and b.is_Integer) or rest.has(j) or rest.has(q):
        return None
    a, b, c = int(a), int(b), int(c)
    flip = {sp.Lt: sp.Gt, sp.Le: sp.Ge, sp.Gt: sp.Lt, sp.Ge: sp.Le, sp.Eq: sp.Eq}
    if a <= 0 and a + b <= 0 and (a, b) != (0, 0):  # non-increasing: negate both sides
        a, b, rest, cls = -a, -b, -rest, flip[cls]
    if a < 0 or a + b < 0 or (a, b) == (0, 0):
        return None  # not monotone in j (j % c in disguise): a predicate
    A = a * c + b  # > 0: a >= 0, a + b >= 0, c >= 2 and not both zero
    # a*j + b*q + rest = g(x) - a*r + rest with g(x) = A*q + a*s: g(x) OP T
    T = sp.expand(a * r - rest)

    def last(t):  # the largest x with g(x) <= t
        qs = sp.floor(t / A)
        if a == 0:
            return c * qs + c - 1
        return c * qs + sp.Min(c - 1, sp.floor((t - A * qs) / a))

    def upper(t):  # j < upper(t)  <=>  g(x) <= t
        return sp.expand(last(t) - r + 1)

    if cls is sp.Le:
        return None, upper(T)
    if cls is sp.Lt:
        return None, upper(T - 1)
    if cls is sp.Ge:
        return upper(T - 1), None
    if cls is sp.Gt:
        return upper(T), None
    return upper(T - 1), upper(T)  # Eq


def _split_quotient(atoms, j):
    """If the conjunction holds ``X % c`` of j and bounds ``X // c`` to a constant number of
    values, return one conjunction per value (with ``%`` and ``//`` rewritten linearly)."""
    for atom in atoms:
        _, mods = _quotients(atom, j)
        if not mods:
            continue
        (x, c), _ = next(iter(mods.items()))
        if _j_coeff_one(x, j) is None:
            return None
        q = sp.Dummy("q", integer=True)
        lowers, uppers = [], []
        for other in atoms:
            if not isinstance(other, _REL):
                continue
            f2, m2 = _quotients(other, j)
            if m2 or list(f2) != [(x, c)]:
                continue
            sub = other.func(other.lhs.subs(f2[(x, c)], q), other.rhs.subs(f2[(x, c)], q))
            if not isinstance(sub, _REL) or sub.has(j):
                continue
            b = _linear_bound(sub, q)
            if b is None:
                continue
            if b[0] is not None:
                lowers.append(b[0])
            if b[1] is not None:
                uppers.append(b[1])
        best = None
        for lo, hi in itertools.product(lowers, uppers):
            n = sp.simplify(hi - lo)
            if n.is_Integer and (best is None or int(n) < best[2]):
                best = (lo, hi, int(n))
        if best is None or best[2] > MAX_QUOTIENT_SPLIT:
            return None
        lo, _, n = best
        out = []
        for d in range(max(n, 0)):
            qv = lo + d
            new = []
            for a in atoms:
                f2, m2 = _quotients(a, j)
                a2 = a
                for (x2, c2), node in f2.items():
                    if (x2, c2) == (x, c):
                        a2 = a2.xreplace({node: qv})
                for (x2, c2), node in m2.items():
                    if (x2, c2) == (x, c):
                        a2 = a2.xreplace({node: x - c * qv})
                if a2 is sp.true:
                    continue
                if a2 is sp.false:
                    new = None
                    break
                new.append(a2)
            if new is None:
                continue
            new += [sp.Ge(x, c * qv), sp.Lt(x, c * qv + c)]
            out.append(new)
        return out
    return None


def _why_fallback(atom, j) -> str:
    if _same_array_at_i_and_j(atom, j) is not None:
        return (f"{atom}: an id may recur outside the run around i (the run is exact, the "
                "span from its first to its last occurrence is checked by the predicate)")
    if any(isinstance(s, sp.core.function.AppliedUndef) and len(s.args) == 2
           for s in sp.preorder_traversal(atom)):
        return f"{atom}: a table read (an entry per key)"
    if any(isinstance(s, sp.core.function.AppliedUndef) and s.has(j)
           for s in sp.preorder_traversal(atom)):
        return f"{atom}: a per-row array subscripted by j"
    _, mods = _quotients(atom, j)
    if mods:
        return f"{atom}: j % c without a bounded quotient range to split on"
    if isinstance(atom, _REL):
        d = sp.expand(atom.lhs - atom.rhs)
        if d.is_polynomial(j) and sp.Poly(d, j).degree() > 1:
            return f"{atom}: nonlinear in j"
    return f"{atom}: not an interval in j (coefficient of j is not an integer constant)"


# --------------------------------------------------------------------------------------------
# pass 4: canonicalization under the guard's assumptions
# --------------------------------------------------------------------------------------------


def first_match_rule(regions):
    """The mask as one Boolean in i, j and params: a row belongs to the first region whose guard
    holds, so ``Or`` over regions of (its guard, no earlier guard, its rule)."""
    terms, earlier = [], []
    for r in regions:
        guard = sp.sympify(r.guard)
        terms.append(sp.And(guard, *[sp.Not(g) for g in earlier], r.rule))
        earlier.append(guard)
    return sp.Or(*terms)


def python_str(e) -> str:
    """An endpoint as the user would write it in Python (``//``, ``%``, ``min``), for explain."""
    s = ExprPrinter()(e)
    if s.startswith("(") and s.endswith(")"):
        depth = 0
        for k, ch in enumerate(s):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and k < len(s) - 1:
                return s  # the outer parentheses do not enclose the whole string
        return s[1:-1]
    return s


@dataclass
class Interval:
    """A compiled slot: ``[lower, upper)`` on rows where ``cond`` holds; symbolic in i, params."""

    lower: sp.Basic
    upper: sp.Basic
    cond: sp.Basic = sp.true
    exact: bool = True  # False: over-approximation of a fallback term

    def __str__(self):
        s = f"[{python_str(self.lower)}, {python_str(self.upper)})"
        if self.cond is not sp.true:
            s += f"  if {python_str(self.cond)}"
        return s + ("" if self.exact else "  (over-approximation)")


def _prune(bounds, prover: Prover, keep_larger: bool):
    """Drop bounds dominated by another (for lowers keep the larger, for uppers the smaller)."""
    bounds = list(dict.fromkeys(bounds))
    out = []
    for k, b in enumerate(bounds):
        dominated = False
        for m, o in enumerate(bounds):
            if m == k:
                continue
            claim = sp.Ge(o, b) if keep_larger else sp.Le(o, b)
            if prover.proves(claim):
                # o dominates b; break ties by position so that one of two equal bounds stays
                rev = sp.Ge(b, o) if keep_larger else sp.Le(b, o)
                if not prover.proves(rev) or m < k:
                    dominated = True
                    break
        if not dominated:
            out.append(b)
    return out


def _simplify_endpoint(e):
    """x % c = x - c * (x // c): lets sympy cancel quotient/remainder pairs (CLEAR's rows).
    Rebuilding an ``Abs`` whose argument sympy cannot prove real (a division by a param that
    may be 0) turns it into ``sqrt(y * conjugate(y))``, which no later stage reads: such an
    endpoint stays as written."""
    out = sp.expand(e.replace(sp.Mod, lambda a, b: a - b * sp.floor(a / b)))
    return e if out.has(sp.conjugate) else out


def _term_interval(t: Term, prover: Prover, seqlen_k) -> Interval | None:
    t = Term([_simplify_endpoint(x) for x in t.lowers], [_simplify_endpoint(x) for x in t.uppers],
             t.cond, t.residual, t.reasons)
    # Keys outside [0, seqlen_k) are clipped at run time: add those bounds only when a side has
    # none, so that endpoints stay as the user wrote them.
    lowers = _prune(t.lowers or [sp.Integer(0)], prover, keep_larger=True)
    uppers = _prune(t.uppers or [seqlen_k], prover, keep_larger=False)
    lower = lowers[0] if len(lowers) == 1 else sp.Max(*lowers)
    upper = uppers[0] if len(uppers) == 1 else sp.Min(*uppers)
    cond_atoms = [c for c in t.cond if not prover.proves(c)]
    cond = sp.And(*cond_atoms) if cond_atoms else sp.true
    if cond is sp.false or not prover.satisfiable(cond):
        return None
    if prover.proves(sp.Or(sp.Not(cond), sp.Ge(lower, upper))):
        return None  # provably empty on every row of the region
    return Interval(lower=lower, upper=upper, cond=cond, exact=not t.residual)


def canonicalize(terms: list[Term], prover: Prover, seqlen_k,
                 budget: int | None = None,
                 tests: int | None = None) -> tuple[list[Interval], list[str]]:
    """Pass 4: Terms -> canonical interval slots, plus a log of what was proven.

    Pairs are scanned in order and the scan restarts after each drop or merge; what a pair
    proved is kept (by the pair's slots), so a restart proves only pairs with the new slot.
    ``budget`` caps the solver work of the pair scan and the ordering (default
    ``CANONICALIZE_BUDGET``), ``tests`` the pair tests (default ``CANONICALIZE_TESTS``): past
    either the slots are kept as they are, which is sound since canonicalization only drops and
    merges."""
    log: list[str] = []
    stop = prover.work + (CANONICALIZE_BUDGET if budget is None else budget)
    left = [CANONICALIZE_TESTS if tests is None else tests]

    def spent():
        return prover.work >= stop or left[0] <= 0
    ivs = []
    for t in terms:
        iv = _term_interval(t, prover, seqlen_k)
        if iv is None:
            log.append(f"dropped provably empty interval from term {_term_str(t)}")
        else:
            ivs.append(iv)
    tokens = list(range(len(ivs)))  # a slot's identity for the memo (a merge makes a new one)
    fresh = itertools.count(len(ivs))
    inside: dict = {}  # (A, B) -> B adds nothing to A
    joins: dict = {}  # (A, B) -> A and B merge

    # Each test first asks whether a recent counterexample falsifies the whole test, built
    # without sympy's evaluation (which costs more than the check); most pairs end there.
    def contained(a, b):
        key = (tokens[a], tokens[b])
        if key not in inside:
            left[0] -= 1
            A, B = ivs[a], ivs[b]
            quick = _implies(B.cond, [A.cond, _rel(sp.Le, A.lower, B.lower),
                                      _rel(sp.Ge, A.upper, B.upper)])
            inside[key] = not prover.refutes(quick) and prover.proves(
                sp.Implies(B.cond, A.cond)) and prover.proves(
                sp.Implies(B.cond, sp.And(sp.Le(A.lower, B.lower), sp.Ge(A.upper, B.upper))))
        return inside[key]

    def mergeable(a, b):
        key = (tokens[a], tokens[b])
        if key not in joins:
            left[0] -= 1
            A, B = ivs[a], ivs[b]
            quick = sp.And(_implies(A.cond, [B.cond]), _implies(B.cond, [A.cond]),
                           _implies(A.cond, [_rel(sp.Le, A.lower, B.upper),
                                             _rel(sp.Le, B.lower, A.upper)]), evaluate=False)
            joins[key] = not prover.refutes(quick) and prover.proves(
                sp.Equivalent(A.cond, B.cond)) and prover.proves(
                sp.Implies(A.cond, sp.And(sp.Le(A.lower, B.upper), sp.Le(B.lower, A.upper))))
        return joins[key]

    changed = True
    while changed:
        changed = False
        for a, b in itertools.permutations(range(len(ivs)), 2):
            if spent():
                log.append(f"stopped at the proof budget ({_spent_what(prover, stop, left)}): "
                           "the remaining intervals are kept as they are")
                break
            A, B = ivs[a], ivs[b]
            # B inside A on every row where B's condition holds: B adds nothing.
            if (A.exact or not B.exact) and contained(a, b):
                log.append(f"dropped {B} as contained in {A}")
                del ivs[b], tokens[b]
                changed = True
                break
            if A.exact == B.exact and mergeable(a, b):
                lo = _prune([A.lower, B.lower], prover, keep_larger=False)
                hi = _prune([A.upper, B.upper], prover, keep_larger=True)
                merged = Interval(
                    lower=lo[0] if len(lo) == 1 else sp.Min(*lo),
                    upper=hi[0] if len(hi) == 1 else sp.Max(*hi),
                    cond=A.cond,
                    exact=A.exact,
                )
                log.append(f"merged {A} and {B} (proved overlapping or adjacent) into {merged}")
                keep = [k for k in range(len(ivs)) if k not in (a, b)]
                ivs = [ivs[k] for k in keep] + [merged]
                tokens = [tokens[k] for k in keep] + [next(fresh)]
                changed = True
                break
    # Order by lower end where provable (a stable insertion sort on proofs).
    ordered: list[Interval] = []
    for iv in ivs:
        pos = len(ordered)
        for k, o in enumerate(ordered):
            if spent():
                break
            left[0] -= 1
            if prover.proves(sp.Lt(iv.lower, o.lower)):
                pos = k
                break
        ordered.insert(pos, iv)
    if spent() and not any(x.startswith("stopped at the proof budget") for x in log):
        log.append(f"stopped at the proof budget ({_spent_what(prover, stop, left)}) while "
                   "ordering: the remaining intervals are kept in their order")
    return ordered, log


def _spent_what(prover, stop, left) -> str:
    return ("CANONICALIZE_BUDGET solver runs" if prover.work >= stop else
            "CANONICALIZE_TESTS pair tests")


def _rel(cls, a, b):
    return cls(a, b, evaluate=False)


def _implies(cond, parts):
    """``cond -> And(parts)`` as ``Or(Not(cond), And(parts))`` (which the prover translates),
    unevaluated (for ``Prover.refutes``)."""
    return sp.Or(sp.Not(cond), sp.And(*parts, evaluate=False), evaluate=False)


def _term_str(t: Term) -> str:
    parts = [str(x) for x in t.cond + t.residual]
    parts += [f"j >= {lo}" for lo in t.lowers] + [f"j < {hi}" for hi in t.uppers]
    return " & ".join(parts) or "True"
