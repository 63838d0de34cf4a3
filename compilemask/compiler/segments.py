"""Segment ids: ``ids[i] == ids[j]`` over per-row ids, exact for any ids.

The compiler rewrites an equality (or inequality) of one per-row array read at ``i`` and at ``j``
into slots bounded by four derived per-row arrays:

* the run ``[<ids>_run_start, <ids>_run_end)``: the maximal run of equal ids that holds row i.
  Every key in it has row i's id, so the slot is exact (it adds tile coverage);
* the span ``[<ids>_span_start, <ids>_span_end)``: from the first occurrence of row i's id to one
  past its last. Every key with row i's id is in it, so with the comparison kept as the region's
  predicate it over-approximates (it adds visibility only).

``ids[i] == ids[j]`` is the run, or the span under the predicate; ``ids[i] != ids[j]`` is
``[0, span_start)`` and ``[span_end, Sk)`` exactly, and the two gaps ``[span_start, run_start)``
and ``[run_end, span_end)`` under the predicate. Where each id's tokens are contiguous the span is
the run and the gaps are empty, so the tiles are those of the run alone.

The preprocess derives the arrays from the metadata on its device with torch ops only (a sort,
cumulative max/min, gathers: no host synchronization), before the interval table; the TileLang
program reads them as more per-row arrays.
"""

from __future__ import annotations

import sympy as sp
import torch

from compilemask.dsl.frontend import array_function

__all__ = ["RUN_START", "RUN_END", "SPAN_START", "SPAN_END", "run_names", "span_names",
           "derived_kind", "run_facts", "run_bounds", "span_bounds", "derive_run_arrays"]

RUN_START, RUN_END = "_run_start", "_run_end"
SPAN_START, SPAN_END = "_span_start", "_span_end"


def run_names(ids: str) -> tuple[str, str]:
    return f"{ids}{RUN_START}", f"{ids}{RUN_END}"


def span_names(ids: str) -> tuple[str, str]:
    return f"{ids}{SPAN_START}", f"{ids}{SPAN_END}"


def derived_kind(start: str, ids: str) -> str:
    """"run" or "span": which bounds a derived ``(start, end, ids)`` triple holds."""
    return "span" if start == span_names(ids)[0] else "run"


def run_facts(derived, i, seqlen_q) -> list:
    """What every row knows of its run and span, for the prover: start <= i < end <= seqlen_q,
    and the run inside the span."""
    facts, bounds = [], {}
    for start, end, ids in derived:
        s, e = array_function(start)(i), array_function(end)(i)
        facts += [sp.Le(s, i), sp.Lt(i, e), sp.Le(e, seqlen_q)]
        bounds[(ids, derived_kind(start, ids))] = (s, e)
    for (ids, kind), (s, e) in bounds.items():
        if kind == "run" and (ids, "span") in bounds:
            s2, e2 = bounds[(ids, "span")]
            facts += [sp.Le(s2, s), sp.Le(e, e2)]
    return facts


def run_bounds(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` ids -> (start, end) of the run of equal ids that holds each position."""
    B, S = ids.shape
    pos = torch.arange(S, device=ids.device, dtype=ids.dtype).expand(B, S)
    first = torch.ones(B, S, dtype=torch.bool, device=ids.device)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    start = torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values
    end = torch.where(last, pos + 1, torch.full_like(pos, S))
    end = end.flip(1).cummin(dim=1).values.flip(1)
    return start.contiguous(), end.contiguous()


def span_bounds(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` ids -> (first position, last position + 1) of each position's id."""
    B, S = ids.shape
    # a stable sort groups equal ids with their positions ascending: a group's first entry is
    # the id's first occurrence, its last entry the last one
    vals, order = ids.sort(dim=1, stable=True)
    pos = torch.arange(S, device=ids.device, dtype=torch.int64).expand(B, S)
    new = torch.ones(B, S, dtype=torch.bool, device=ids.device)
    new[:, 1:] = vals[:, 1:] != vals[:, :-1]
    end_of_group = torch.ones_like(new)
    end_of_group[:, :-1] = new[:, 1:]
    g0 = torch.where(new, pos, torch.zeros_like(pos)).cummax(dim=1).values
    g1 = torch.where(end_of_group, pos, torch.full_like(pos, S - 1))
    g1 = g1.flip(1).cummin(dim=1).values.flip(1)
    first = order.gather(1, g0)
    last = order.gather(1, g1)
    start = torch.empty_like(order).scatter_(1, order, first)
    end = torch.empty_like(order).scatter_(1, order, last + 1)
    return start.to(ids.dtype).contiguous(), end.to(ids.dtype).contiguous()


def derive_run_arrays(derived, arrs: dict, check: bool = False) -> dict:
    """The run and span bounds of the arrays the compiled rules compare at i and j, in the ids'
    dtype on their device. ``check`` is accepted for the callers: any ids are valid."""
    out = {}
    for start, end, ids in derived:
        fn = span_bounds if derived_kind(start, ids) == "span" else run_bounds
        out[start], out[end] = fn(arrs[ids])
    return out
