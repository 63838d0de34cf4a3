"""The interval mask of a score tile (CuTe DSL): the descriptor's element test in one place.

A score ``(q_idx, kv_idx)`` is visible iff ``OR_k uint32(kv_idx - start_k) < uint32(len_k)`` over
the row's K interval slots (``contract.descriptor.in_interval``), AND-ed with the fallback
predicate of the row's fallback region. :class:`IntervalMask` applies it to a tile, with q along
the rows (forward, mma.sync backward) or along the columns (the sm90 backward's transposed
``S^T``); the row sources say where a q row's slots live (registers or shared memory).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

__all__ = ["IntervalMask", "RegisterRows", "SharedRows", "interval_visible", "column_pattern",
           "pattern_of_offsets", "cols_below", "low_bits", "interval_bits", "bit_visible",
           "fallback_visible"]


def _at(t, row, i):
    return t[i] if row is None else t[row, i]


def interval_visible(kv_idx, rInt, num_intervals: int, row=None):
    """``OR_k start_k <= kv_idx < end_k`` over the row's K interval slots, unrolled.

    ``rInt`` holds the row's slots as (start, end = start + len) pairs: ``rInt[2k]``,
    ``rInt[2k + 1]`` (or ``rInt[row, 2k]``, ``rInt[row, 2k + 1]`` when ``row`` is given). The
    two signed compares equal ``uint32(kv_idx - start) < uint32(len)`` for
    ``0 <= start, len < 2^31``."""
    vis = (kv_idx >= _at(rInt, row, 0)) & (kv_idx < _at(rInt, row, 1))
    for k in range(1, num_intervals):
        vis = vis | ((kv_idx >= _at(rInt, row, 2 * k)) & (kv_idx < _at(rInt, row, 2 * k + 1)))
    return vis


# Partial tiles by bits: the interval test once per row instead of once per element. A thread's
# columns of an mma/wgmma score fragment are ``g * (c // w) + c % w`` past its first one (pairs
# of adjacent columns every 8: w = 2, g = 8), so the columns that one interval [start, end)
# covers are a contiguous run of c: [cols_below(start), cols_below(end)). OR-ing those runs
# gives the row's visible columns as one 32-bit word; each element then tests one bit, and K
# no longer multiplies the per-element work. Written with >>, &, ^ and a caller's min/max, so
# that the CPU tests run these very functions on Python ints.
def column_pattern(t_mn):
    """``(n, w, g)`` when the static column offsets of the (rows, cols) coordinate view ``t_mn``
    are ``g * (c // w) + c % w`` for its ``n <= 32`` columns, with ``w`` and ``g`` powers of
    two; ``None`` otherwise (the caller keeps the per-element test). Trace time only."""
    n = cute.size(t_mn, mode=[1])
    offs = [cute.crd2idx((0, c), t_mn.layout)[1] for c in range(n)]
    return pattern_of_offsets(offs)


def pattern_of_offsets(offs):
    """``(n, w, g)`` if ``offs[c] == g * (c // w) + c % w`` (see :func:`column_pattern`)."""
    n = len(offs)
    if n == 0 or n > 32 or not all(isinstance(o, int) for o in offs):
        return None
    w = next((c for c in range(1, n) if offs[c] != c), n)
    g = offs[w] if w < n else w
    pow2 = all(x > 0 and x & (x - 1) == 0 for x in (w, g))
    if not pow2 or n % w or any(o != g * (c // w) + c % w for c, o in enumerate(offs)):
        return None
    return n, w, g


def cols_below(x, pattern, mn, mx):
    """How many of the thread's columns lie below ``x`` (relative to its first column)."""
    n, w, g = pattern
    xc = mn(mx(x, 0), g * (n // w))
    return (xc >> (g.bit_length() - 1)) * w + mn(xc & (g - 1), w)


def low_bits(n, one):
    """The ``n`` low bits set, ``0 <= n <= 32``, in 32-bit arithmetic without a shift by 32
    (``one``: the constant 1 of the caller's integer type)."""
    h = n >> 1
    return ((one << h) << (n - h)) - 1


def interval_bits(rInt, row, num_intervals: int, x0, pattern, one, mn, mx):
    """Bit ``c`` set iff the thread's column ``c`` lies in one of the row's interval slots
    (``rInt`` as in :func:`interval_visible`); ``x0`` is the kv index of its first column."""
    bits = None
    for k in range(num_intervals):
        lo = cols_below(_at(rInt, row, 2 * k) - x0, pattern, mn, mx)
        hi = cols_below(_at(rInt, row, 2 * k + 1) - x0, pattern, mn, mx)
        run = low_bits(hi, one) & (low_bits(lo, one) ^ -1)  # columns [lo, hi)
        bits = run if bits is None else bits | run
    return bits


def bit_visible(bits, c: int):
    """Column ``c`` (a compile-time index) of a row's :func:`interval_bits` word."""
    return ((bits >> c) & 1) != 0


def fallback_visible(
    vis, predicates, fb, fb_row, q_idx, kv_idx, args, mRowParams, batch_idx, max_row
):
    """``vis`` AND-ed with the fallback predicate of the row's fallback slot.

    The row's slot (-1: none) is ``fb`` (a value), or ``fb[fb_row]`` when ``fb_row`` is given;
    ``args`` are the predicate's scalar params followed by the row's per-row params."""
    for slot in range(len(predicates)):
        ok = predicates[slot](q_idx, kv_idx, *args, mRowParams, batch_idx, max_row)
        vis = vis & (((fb if fb_row is None else fb[fb_row]) != slot) | ok)
    return vis


# ----------------------------------------------------------------------------------------------
# Where a q row's slots live. ``load(i, q_off)`` (trace time; ``i`` the q row's index in the
# fragment, ``q_off`` its offset in the tile) gives what the element test reads:
# ``(slots, slots_row, fallback_slot, fallback_row, predicate_args)``.
# ----------------------------------------------------------------------------------------------
class RegisterRows:
    """The q tile's rows already in registers, indexed by fragment row (the forward)."""

    def __init__(self, rInt, rFb, rP, rRowP, num_params: int, num_row_params: int):
        self.rInt, self.rFb, self.rP, self.rRowP = rInt, rFb, rP, rRowP
        self.num_params, self.num_row_params = num_params, num_row_params

    def load(self, i, q_off, has_fallback: bool):
        args = None
        if has_fallback:
            args = [self.rP[p] for p in range(self.num_params)]
            args += [self.rRowP[i, a] for a in range(self.num_row_params)]
        return self.rInt, i, self.rFb, i, args


class SharedRows:
    """The q tile's rows in shared memory, indexed by the row's offset in the tile (the
    backward): copied to registers once per q row."""

    def __init__(self, sInt, sFb, sRowP, rP, num_intervals: int, num_params: int,
                 num_row_params: int):
        self.sInt, self.sFb, self.sRowP, self.rP = sInt, sFb, sRowP, rP
        self.K, self.num_params, self.num_row_params = num_intervals, num_params, num_row_params

    def load(self, i, q_off, has_fallback: bool):
        rInt = cute.make_rmem_tensor((2 * self.K,), Int32)
        for k in range(2 * self.K):
            rInt[k] = self.sInt[q_off, k]
        fb = args = None
        if has_fallback:
            fb = self.sFb[q_off]
            args = [self.rP[p] for p in range(self.num_params)]
            args += [self.sRowP[q_off, a] for a in range(self.num_row_params)]
        return rInt, None, fb, None, args


class IntervalMask:
    """The element test of partial tiles: the K interval slots (per element, or once per row
    as a word of column bits), then the fallback predicates of fallback rows."""

    def __init__(self, num_intervals: int, predicates: tuple = (), has_fallback: bool = False):
        self.K = num_intervals
        self.predicates = tuple(predicates)
        self.has_fallback = has_fallback

    @cute.jit
    def apply(
        self, acc_mn, tScS_mn, rows, m_start, n_start, mRowParams, batch_idx, max_row,
        transposed: cutlass.Constexpr = False, pattern: cutlass.Constexpr = None,
    ):
        """-inf where ``(q, kv)`` is not visible in the (rows, cols) score view ``acc_mn`` with
        coordinates ``tScS_mn``: q along the rows, or along the columns when ``transposed``.
        ``pattern``: the fragment's :func:`column_pattern` for the bit test (rows only)."""
        K = self.K
        q_mode, kv_mode = (1, 0) if const_expr(transposed) else (0, 1)
        for i in cutlass.range_constexpr(cute.size(tScS_mn, mode=[q_mode])):
            q_off = _coord(tScS_mn, i, q_mode)
            q_idx = m_start + q_off
            rInt, slots_row, fb, fb_row, args = rows.load(i, q_off, self.has_fallback)
            if const_expr(pattern is not None):
                x0 = n_start + tScS_mn[0, 0][1]  # kv index of the thread's first column
                bits = interval_bits(rInt, slots_row, K, x0, pattern, Int32(1), cutlass.min,
                                     cutlass.max)
            for j in cutlass.range_constexpr(cute.size(tScS_mn, mode=[kv_mode])):
                kv_idx = n_start + _coord(tScS_mn, j, kv_mode)
                if const_expr(pattern is not None):
                    vis = bit_visible(bits, j)
                else:
                    vis = interval_visible(kv_idx, rInt, K, row=slots_row)
                if const_expr(self.has_fallback):
                    vis = fallback_visible(
                        vis, self.predicates, fb, fb_row, q_idx, kv_idx, args, mRowParams,
                        batch_idx, max_row,
                    )
                if not vis:
                    acc_mn[_rc(i, j, transposed)] = -Float32.inf


def _coord(t_mn, i, mode: int):
    """The tile offset of row ``i`` (mode 0) or column ``i`` (mode 1) of a coordinate view."""
    return t_mn[i, 0][0] if mode == 0 else t_mn[0, i][1]


def _rc(i, j, transposed: bool):
    return (j, i) if transposed else (i, j)
