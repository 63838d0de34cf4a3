"""The column view of a mask: for each key, the query rows that see it, as merged intervals.

flash-attn-4's sm90 backward (head dim 128) holds a score tile transposed: a thread's 32
scores are 16 query rows of 2 keys. The Interval Table (per query row) then costs each thread
the slots of 16 rows per tile, where the column view costs the slots of its 2 keys
(``kernels/fa4_colmask.py``).

The column view is compiled, not searched: the mask as one rule ``V(i, j)`` (each region's
guard, the failure of every earlier guard, its rule) with ``i`` and ``j`` (and ``seqlen_q`` and
``seqlen_k``) exchanged goes through the same passes as a region's rule, so each key's rows are
intervals with proven endpoints (``CompiledMask.column_view``). Their number is the number of
conjunctions the passes keep, which can exceed the rows' K: the regions' intervals lie side by
side whenever the metadata are ordered (a shared-prompt reward model's prompt keys are seen by
the prompt and every response: 13 intervals that merge into one when the ends are sorted), but
nothing proves the order. So the preprocess merges each key's intervals where they overlap or
touch (``merge_runs``) and keeps at most ``COLUMN_SLOTS``; a key with more runs, possible only
for metadata in an unusual order, is flagged (``OVERFLOW``) and the kernel tests its scores
against the Interval Table instead. The result is exact for every input. A view with no more
intervals than slots cannot overflow, and its kernel has no such path.

A column view exists for masks whose rows are intervals (no fallback region), read no tables,
do not read the head index, and whose exchanged rule compiles without a fallback (``reason``
says why not). It applies to square self-attention (``seqlen_q == seqlen_k``, rows 0..).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from compilemask.compiler.compiler import first_match_rule

__all__ = ["COLUMN_SLOTS", "OVERFLOW", "ColumnView", "transposed_rule", "why_no_view",
           "merge_runs", "column_table"]

# merged row intervals kept per key, at most (the kernel loads 2 words per slot and key of a
# tile): a view of at most this many intervals keeps them all, a larger one min(the rows' K,
# this), so that a key costs what a row does
COLUMN_SLOTS = 4
# a key whose rows are more than COLUMN_SLOTS runs: slot 0 holds (0, OVERFLOW)
OVERFLOW = -1


class ColumnView(NamedTuple):
    """A mask's compiled column view: its one region (rows are keys, intervals of queries),
    ``num_intervals`` of them before merging, read by the generated ``interval_table``."""

    region: Any  # compiler's CompiledRegion
    num_intervals: int
    interval_table: Any
    scalar_params: tuple[str, ...]
    array_params: tuple[str, ...]
    slots: int  # merged runs kept per key

    @property
    def can_overflow(self) -> bool:
        """Whether a key can have more runs than slots (only with more intervals than slots)."""
        return self.num_intervals > self.slots


def transposed_rule(mask, syms: dict):
    """The mask as one rule of (i, j) (``compiler.first_match_rule``) with the query and key
    exchanged: ``i <-> j`` and ``seqlen_q <-> seqlen_k``."""
    i, j = syms["i"], syms["j"]
    sq, sk = syms["seqlen_q"], syms["seqlen_k"]
    return first_match_rule(mask.regions).xreplace({i: j, j: i, sq: sk, sk: sq})


def why_no_view(mask) -> str | None:
    """Why ``mask`` has no column view before compiling one (None: try)."""
    if mask.has_fallback:
        names = ", ".join(repr(r.name) for r in mask.fallback_regions)
        return f"region(s) {names} keep a predicate"
    if mask.table_params:
        return f"it reads the table(s) {list(mask.table_params)}"
    if mask.head_param is not None:
        return "its rules read the head index h"
    return None


def merge_runs(starts: torch.Tensor, lens: torch.Tensor, slots: int) -> torch.Tensor:
    """int32 ``[..., slots, 2]`` (start, len) from ``[..., N]`` intervals: the union's runs
    (intervals that overlap or touch merge) in order, empty slots ``(0, 0)``; where the union
    has more than ``slots`` runs, slot 0 is ``(0, OVERFLOW)`` and the others ``(0, 0)``."""
    big = torch.iinfo(torch.int64).max
    starts, lens = starts.to(torch.int64), lens.to(torch.int64)
    valid = lens > 0
    key = torch.where(valid, starts, big)
    key, order = key.sort(dim=-1, stable=True)
    valid = valid.gather(-1, order)
    ends = torch.where(valid, key + lens.gather(-1, order), -1)
    # a run starts at a valid interval past the reach of every interval before it
    reach = torch.cummax(ends, dim=-1).values
    before = torch.cat([torch.full_like(reach[..., :1], -1), reach[..., :-1]], dim=-1)
    new = valid & (key > before)
    run = torch.cumsum(new.to(torch.int64), dim=-1) - 1
    count = new.sum(dim=-1)
    out = torch.zeros(*starts.shape[:-1], slots, 2, dtype=torch.int64, device=starts.device)
    for c in range(slots):
        mine = valid & (run == c)
        lo = torch.where(mine, key, big).amin(dim=-1)
        hi = torch.where(mine, ends, -1).amax(dim=-1)
        has = mine.any(dim=-1)
        out[..., c, 0] = torch.where(has, lo, 0)
        out[..., c, 1] = torch.where(has, hi - lo, 0)
    flag = torch.zeros(slots, 2, dtype=torch.int64, device=starts.device)
    flag[0, 1] = OVERFLOW
    return torch.where((count > slots)[..., None, None], flag, out).to(torch.int32)


def column_table(mask, params: torch.Tensor, row_params: torch.Tensor,
                 seqlen: int) -> torch.Tensor:
    """int32 ``[B, S, slots, 2]``: each key's rows (``merge_runs``) under ``mask``'s column
    view, for a batch of square self-attention, from a descriptor's metadata copies (``params
    [B, P]``, ``row_params [B, S, R]``, in ``mask.scalar_params`` / ``mask.array_params``
    order)."""
    view = mask.column_view
    B, dev = params.shape[0], params.device
    keys = torch.arange(seqlen, device=dev, dtype=torch.int64).unsqueeze(0)
    scal = {p: params[:, n:n + 1].to(torch.int64) for n, p in enumerate(mask.scalar_params)}
    arrs = {a: row_params[..., n].to(torch.int64) for n, a in enumerate(mask.array_params)}
    args = [keys, seqlen, seqlen] + [scal[p] for p in view.scalar_params] + [
        arrs[a] for a in view.array_params]
    starts, lens, _ = view.interval_table(*args, batch_size=B)
    return merge_runs(starts, lens, view.slots)
