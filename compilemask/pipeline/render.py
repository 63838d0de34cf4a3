"""Text renderings: ``CompiledMask.explain`` and ``ExecutionDescriptor.to_string``."""

from __future__ import annotations

import sympy as sp
import torch

from compilemask.codegen.cute_mask_mod import mask_mod_variant
from compilemask.codegen.cute_predicate import predicate_source
from compilemask.compiler.compiler import _quotients, extract_intervals, python_str
from compilemask.compiler.segments import derived_kind
from compilemask.contract.descriptor import (
    TILE_EMPTY,
    TILE_FULL,
    TILE_MASKED,
    TILE_PARTIAL,
    TILE_VISIBLE,
)
from compilemask.dsl.frontend import rule_symbols

__all__ = ["explain", "descriptor_to_string", "row_intervals"]


def _indent(text: str, pad: str = "      ") -> str:
    return "\n".join(pad + line for line in text.rstrip().splitlines())


def _table_str(e) -> str:
    return str(e).replace("](i, j)", "]")


def explain(mask, meta=None, row: int | None = None, seqlen_q=None, seqlen_k=None,
            show_code: bool = False, columns: bool = False) -> str:
    """Per region: guard and rule as written, DNF, extracted intervals, proven merges, fallback
    terms, K and the GPU path. With ``meta`` and ``row``: that row's concrete intervals. With
    ``show_code``: the generated TileLang, CuTe and torch code too (some hundred lines). With
    ``columns``: the column view (each key's query rows, ``compiler.columns``), or why the
    mask has none."""
    out = [f"MaskSpec {mask.name!r}  (canonical key {mask.key})",
           f"  params: scalar {list(mask.scalar_params)}, per-row arrays {list(mask.array_params)}"
           + (f", tables {list(mask.table_params)}" if mask.table_params else "")]
    if mask.head_param:
        out.append(f"  {mask.head_param}: the query head, set per head by preprocess(..., "
                   "num_heads=H)")
    for start, end, ids in mask.derived_arrays:
        what = "span of the id" if derived_kind(start, ids) == "span" else "run of equal ids"
        out.append(f"  {start}, {end}: the {what} of {ids} around each row, derived from the "
                   f"metadata")
    for r in mask.regions:
        out.append("")
        out.append(f"  region {r.index} {r.name!r}")
        out.append("    guard, as written:")
        out.append(_indent(r.guard_source))
        out.append(f"    guard: {r.guard}")
        excl = [f"{k}: {'proved exclusive' if v else 'NOT proved exclusive'}"
                for k, v in r.exclusive_with.items()]
        if excl:
            out.append("    vs earlier guards: " + "; ".join(excl))
        if not all(r.exclusive_with.values()):
            out.append("      rows belong to the first region whose guard holds: rows where an "
                       "earlier guard holds too are not in this region")
        out.append("    rule, as written:")
        out.append(_indent(r.rule_source))
        # a table read is an opaque atom named as written ("t[i, j - p](i, j)": drop its args)
        show = _table_str if mask.table_params else str
        out.append(f"    DNF ({len(r.dnf)} term{'s' if len(r.dnf) != 1 else ''}):")
        for t in r.dnf:
            out.append("      " + (" & ".join(show(a) for a in t) or "True"))
        out.append("    extracted intervals (per term, before canonicalization):")
        for t in r.terms:
            lo = ", ".join(str(x) for x in t.lowers) or "0"
            hi = ", ".join(str(x) for x in t.uppers) or "seqlen_k"
            s = f"      j in [max({lo}), min({hi}))"
            if t.cond:
                s += "  if " + " & ".join(str(c) for c in t.cond)
            if t.residual:
                s += "  residual: " + " & ".join(show(c) for c in t.residual)
            out.append(s)
        out += _split_notes(r)
        if r.proofs:
            out.append("    canonicalization (proved under the guard and earlier guards failing):")
            out += ["      " + p for p in r.proofs]
        if r.fallback:
            out.append("    FALLBACK: partial tiles evaluate the rule as a predicate because:")
            out += ["      " + _table_str(why) for why in r.fallback_reasons]
        out.append(f"    intervals ({r.num_intervals} slot{'s' if r.num_intervals != 1 else ''}):")
        for k, iv in enumerate(r.intervals):
            out.append(f"      slot {k}: {iv}")
    out.append("")
    per = ", ".join(f"{r.name} {r.num_intervals}" for r in mask.regions)
    out.append(f"  K = {mask.num_intervals} interval slot(s) per row (max over regions: {per})")
    if mask.has_fallback:
        out.append("  fallback regions: " + ", ".join(r.name for r in mask.fallback_regions))
    pat = mask.native_pattern
    if pat is not None:
        out.append(f"  GPU path: native FA4 ({pat.describe()}); no tile lists, no mask_mod")
        out.append(f"    proof: {pat.proof}")
    else:
        what = {"intervals": "the interval mask_mod", "rules": "the rules as the mask_mod",
                "predicate": "the whole mask as one predicate"}[mask_mod_variant(mask)]
        out.append(f"  GPU path: FA4 block-sparse lists + {what} (not a native "
                   "pattern: no equality with full, causal, a window or segments was proven)")
    if columns:
        out += [""] + _column_lines(mask)
    if meta is not None and row is not None:
        out.append("")
        out.append(row_intervals(mask, meta, row, seqlen_q=seqlen_q, seqlen_k=seqlen_k))
    if show_code:
        out.append("")
        out.append("  generated TileLang preprocess:")
        try:
            out.append(_indent(mask.preprocess_source("cuda"), "    "))
        except Exception as e:  # codegen is optional on a bare install: say why it is missing
            out.append(f"    (not available: {type(e).__name__}: {e})")
        if mask.has_fallback:
            out.append("")
            for r in mask.fallback_regions:
                out.append(f"  generated CuTe fallback predicate (region {r.index} {r.name!r}; "
                           f"the kernel ANDs it with the interval test in partial tiles):")
                try:  # as kernels.fallback.Fallback.from_mask builds it
                    src = predicate_source(r.rule, mask.scalar_params, mask.array_params,
                                           table_params=mask.table_params)
                    out.append(_indent(src, "    "))
                except Exception as e:
                    out.append(f"    (not available: {type(e).__name__}: {e})")
        out.append("")
        out.append("  generated torch reference preprocess:")
        out.append(_indent(mask.reference_source(), "    "))
    return "\n".join(out)


def _column_lines(mask) -> list[str]:
    view = mask.column_view
    if view is None:
        return [f"  column view: none ({mask.column_view_reason})"]
    out = [f"  column view: the query rows q_idx that see key kv_idx, merged per batch into "
           f"{view.slots} slot(s)" + (" (a key with more runs takes the Interval Table test)"
                                     if view.can_overflow else "")]
    # the view is compiled with the key as its row i: shown in the mask's own names
    syms = rule_symbols(mask.spec.params)
    names = {syms["i"]: sp.Symbol("kv_idx", integer=True), syms["seqlen_q"]: syms["seqlen_k"],
             syms["seqlen_k"]: syms["seqlen_q"]}
    for k, iv in enumerate(view.region.intervals):
        lo, hi, cond = (sp.sympify(e).xreplace(names) for e in (iv.lower, iv.upper, iv.cond))
        out.append(f"    interval {k}: q_idx in [{python_str(lo)}, {python_str(hi)})"
                   + ("" if cond is sp.true else f"  if {python_str(cond)}"))
    return out


def _split_notes(region) -> list[str]:
    """Say which DNF terms pass 3 split into several intervals by enumerating a bounded
    quotient range (``X // c`` with ``X % c`` of j), and into how many."""
    if len(region.terms) <= len(region.dnf):
        return []
    try:
        syms = {s.name: s for t in region.dnf for a in t for s in a.free_symbols}
        i, j = syms.get("i"), syms.get("j")
        if j is None:
            return []
        notes = []
        for n, t in enumerate(region.dnf, 1):
            got = extract_intervals([t], i, j)
            if len(got) <= 1:
                continue
            qs = []
            for a in t:
                floors, mods = _quotients(a, j)
                for (x, c) in list(floors) + list(mods):
                    q = f"floor(({x})/{c})"
                    if q not in qs:
                        qs.append(q)
            notes.append(f"      DNF term {n} -> {len(got)} intervals: the quotient "
                         f"{' / '.join(qs) or '?'} has a bounded range of {len(got)} values "
                         f"under this term; each value is enumerated and its % and // of j "
                         f"rewritten linearly, giving one interval per value")
        return (["    quotient ranges enumerated (pass 3):"] + notes) if notes else []
    except Exception:  # a note only: never let it break explain
        return []


def row_intervals(mask, meta, row: int, seqlen_q=None, seqlen_k=None, batch: int = 0) -> str:
    """The concrete intervals of one row for the given metadata."""
    if seqlen_q is None:
        seqlen_q = row + 1
        for v in (meta or {}).values():
            if isinstance(v, torch.Tensor) and v.dim() == 2:
                seqlen_q = v.shape[1]
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    if not 0 <= row < seqlen_q:
        raise ValueError(f"row {row} is outside [0, seqlen_q={seqlen_q})")
    desc = mask.preprocess(meta, seqlen_q=seqlen_q, seqlen_k=seqlen_k, backend="torch")
    reg = int(desc.row_region[batch, row])
    name = mask.regions[reg].name if reg >= 0 else "(no region: sees nothing)"
    pairs = [(int(s), int(n)) for s, n in desc.intervals[batch, row].tolist()]
    spans = ", ".join(f"[{s}, {s + n})" for s, n in pairs if n > 0) or "none"
    return f"  row {row} of sequence {batch}: region {name}; visible keys {spans}"


_CHARS = {TILE_EMPTY: ".", TILE_FULL: "#", TILE_PARTIAL: "~", TILE_MASKED: "?"}


def descriptor_to_string(desc, batch: int = 0, backward: bool = False,
                         max_size: int | None = None, legend: bool = True) -> str:
    """One character per tile ('#' full, '~' partial, '.' empty), counts, and FLOPs skipped.

    ``max_size``: at most this many characters per line and lines; larger grids print one
    character per block of tiles ('#' all full, '.' all empty, '~' otherwise). The counts and
    the FLOPs figure are always over every tile. ``legend``: end the header line with what the
    characters mean."""
    B = desc.batch_size
    if not -B <= batch < B:
        raise IndexError(f"batch {batch} is out of range for a descriptor of batch size {B}")
    st = desc.tile_states(backward=backward)[batch]
    if backward:
        st = st.transpose(0, 1)  # print as q-tiles down, kv-tiles across either way
    tiles = desc.bwd_tiles if backward else desc.fwd_tiles
    grid, note = st, ""
    key = "'#' full, '~' partial, '.' empty"
    if max_size is not None and max(st.shape) > max_size:
        grid, (a, b) = _block_states(st, max(1, int(max_size)))
        note = f" (each character: {a}x{b} tiles)"
        key = "'#' all full, '~' mixed, '.' all empty"
    lines = ["".join(_CHARS[int(x)] for x in rowv) for rowv in grid.tolist()]
    full = int((st == TILE_FULL).sum())
    partial = int((st == TILE_PARTIAL).sum())
    empty = int((st == TILE_EMPTY).sum()) + int((st == TILE_MASKED).sum())
    total = st.numel()
    # FLOPs skipped: the area of empty tiles over the whole score matrix (edge tiles are smaller)
    n_m, n_n = st.shape
    hm = torch.full((n_m,), tiles.tile_m, dtype=torch.float64)
    hm[-1] = desc.seqlen_q - tiles.tile_m * (n_m - 1)
    wn = torch.full((n_n,), tiles.tile_n, dtype=torch.float64)
    wn[-1] = desc.seqlen_k - tiles.tile_n * (n_n - 1)
    area = hm[:, None] * wn[None, :]
    skipped = float((area * ((st & TILE_VISIBLE) == 0)).sum() / area.sum())
    head = (f"{desc.mask.name}: seqlen_q={desc.seqlen_q} seqlen_k={desc.seqlen_k} "
            f"K={desc.num_intervals} {'bwd' if backward else 'fwd'} tiles "
            f"{tiles.tile_m}x{tiles.tile_n} (sequence {batch}){note}"
            + (f"  [{key}]" if legend else ""))
    foot = (f"full {full}  partial {partial}  empty {empty}  of {total} tiles; "
            f"{100 * skipped:.1f}% of FLOPs skipped")
    return "\n".join([head] + lines + [foot])


def _block_states(st: torch.Tensor, max_size: int):
    """Group tiles into blocks so the grid is at most max_size per side: a block is full if all
    its tiles are, empty if all are, partial otherwise."""
    n_m, n_n = st.shape
    a, b = -(-n_m // max_size), -(-n_n // max_size)
    pm, pn = -(-n_m // a) * a - n_m, -(-n_n // b) * b - n_n
    vis = (st & TILE_VISIBLE) != 0
    full = st == TILE_FULL
    valid = torch.ones_like(vis)
    if pm or pn:
        vis = torch.nn.functional.pad(vis, (0, pn, 0, pm))
        full = torch.nn.functional.pad(full, (0, pn, 0, pm))
        valid = torch.nn.functional.pad(valid, (0, pn, 0, pm))
    shape = (vis.shape[0] // a, a, vis.shape[1] // b, b)
    any_vis = vis.view(shape).any(3).any(1)
    all_full = (full | ~valid).view(shape).all(3).all(1)
    out = torch.where(any_vis, TILE_PARTIAL, TILE_EMPTY)
    out = torch.where(all_full, TILE_FULL, out)
    return out.to(torch.uint8), (a, b)
