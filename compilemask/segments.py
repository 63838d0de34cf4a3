"""Segment ids: ``ids[i] == ids[j]`` is the run of equal ids around row i.

The compiler rewrites an equality (or inequality) of one per-row array read at ``i`` and at
``j`` into bounds on ``j`` by two derived per-row arrays, ``<ids>_run_start`` and
``<ids>_run_end`` (the first row of i's run and one past its last). The preprocess computes them
from the metadata in torch, before the interval table (the TileLang kernel reads them as two more
per-row arrays). They equal the rule only when every id's tokens form one contiguous run, which
value-checked preprocessing (CPU, or ``check=True``) verifies.
"""

from __future__ import annotations

import sympy as sp
import torch

__all__ = ["RUN_START", "RUN_END", "run_names", "run_facts", "run_bounds", "check_runs",
           "derive_run_arrays"]

RUN_START, RUN_END = "_run_start", "_run_end"


def run_names(ids: str) -> tuple[str, str]:
    return f"{ids}{RUN_START}", f"{ids}{RUN_END}"


def run_facts(derived, i, seqlen_q) -> list:
    """What every row knows of its run: start <= i < end <= seqlen_q (for the prover)."""
    from compilemask.dsl.frontend import array_function

    facts = []
    for start, end, _ in derived:
        s, e = array_function(start)(i), array_function(end)(i)
        facts += [sp.Le(s, i), sp.Lt(i, e), sp.Le(e, seqlen_q)]
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


def check_runs(ids: torch.Tensor, name: str) -> None:
    """ValueError unless each id's tokens form one contiguous run in every sequence."""
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    srt = ids.sort(dim=1).values
    distinct = 1 + (srt[:, 1:] != srt[:, :-1]).sum(dim=1)
    bad = first.sum(dim=1) != distinct
    if not bool(bad.any()):
        return
    b = int(bad.nonzero()[0])
    starts = ids[b][first[b]].tolist()
    v = next(x for k, x in enumerate(starts) if x in starts[:k])
    raise ValueError(
        f"param {name!r}: id {v} occurs in more than one run of sequence {b}; a rule comparing "
        f"{name}[i] with {name}[j] compiles to the run of equal ids around i, so each id's tokens "
        f"must be contiguous (for scattered ids write the predicate form, "
        f"{name}[i] <= {name}[j] <= {name}[i])"
    )


def derive_run_arrays(derived, arrs: dict, check: bool) -> dict:
    """The run bounds of the arrays the compiled rules compare at i and j."""
    out = {}
    for start, end, ids in derived:
        if check:
            check_runs(arrs[ids], ids)
        out[start], out[end] = run_bounds(arrs[ids])
    return out
