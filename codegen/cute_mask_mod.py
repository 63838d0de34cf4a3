"""The compiled mask as a flash-attn-4 ``mask_mod``: the interval test, generated per mask.

FA4 evaluates a mask_mod only in the partial tiles of its block-sparse lists (full tiles run
unmasked, empty tiles are never visited). The generated function reads the row's Interval Table
entries from ``aux_tensors[0]`` (int32 ``[B, Sq, 2K]``, one row's ``(start, len)`` pairs
contiguous) and tests ``OR over m of uint32(kv_idx - start[m]) < uint32(len[m])``, K unrolled at
compile time. Masks with fallback regions also get ``row_region`` ``[B, Sq]``, then ``params``
``[B, P]`` if ``P > 0`` and ``row_params`` ``[B, Sq, R]`` if ``R > 0`` as aux tensors, and AND
the region's
generated predicate (``codegen.cute_predicate``) onto the interval test. Rows that see nothing
have only empty slots, so every score is masked (FA4 then writes output 0 and LSE -inf).

A descriptor of chosen rows (a served request's last rows, a context-parallel shard) of a
mask with fallback regions runs the ``"intervals"`` form with ``positions`` ``[B, Sq]`` and
``key_params`` ``[B, Sk, R]`` in place of ``row_params``: the same predicates, called with the
row's position as ``i`` and the sequence's arrays by position (``_positions_lines``).

When every region is a fallback region (its predicate is exact, so the interval test adds
nothing in a partial tile), the mask_mod is the whole mask as one predicate: the first region
whose guard holds decides, by its rule, with no Interval Table or region reads (a metadata-free
mask such as dilated causal is then index arithmetic only); its aux tensors are ``params`` and
``row_params`` where present.

A mask whose rules read no per-row arrays (constants, ``i``, ``j``, per-sequence scalars: a
window with sinks, chunks, blocks, CLEAR) gets the same single-predicate form over its rules
where a cost model says it is cheaper than the interval test's ``2K`` Interval Table loads per
score (``mask_mod_variant`` chooses; ``docs/decisions/engine.md`` has the measurements).

FA4 calls the mask_mod on padded rows past ``seqlen_q`` in the last q tile, so the row index is
clamped before any load (their results are discarded). Every read is clamped, and every key
past ``seqlen_k`` is masked (by the table's clipped intervals, or a compare in the whole-mask
forms), so FA4 need neither wrap the indices nor, in the backward, test the keys' bound
(``UNWRAPPED_ATTR``, ``kernels/fa4_unwrap.py``).
"""

from __future__ import annotations

from sympy.core.function import AppliedUndef

from compilemask.codegen.cute_predicate import (
    UNWRAPPED_ATTR,
    compile_predicate,
    predicate_source,
)
from compilemask.compiler.bounds import fits_int32, fits_metadata, kernel_predicates
from compilemask.compiler.compiler import first_match_rule
from compilemask.contract.cache import CompileCache
from compilemask.contract.lru import LRU

__all__ = ["mask_mod_source", "mask_mod", "aux_tensors", "aux_layout", "whole_mask_predicate",
           "reads_positions",
           "variant_for_call",
           "mask_mod_variant", "forward_variant", "call_variant", "rules_fit", "metadata_matters",
           "VARIANTS", "ROWS_ATTR", "COLUMNS_ATTR"]

# "predicate": every region is a fallback region; "rules": the rules as one predicate (no
# per-row arrays read); "intervals": the Interval Table test (and fallback predicates);
# "rows": the interval test, which FA4's sm90 forward applies a row at a time
# (kernels/fa4_rowmask.py; masks without fallback regions; a backward takes the default);
# "columns": the interval test, which FA4's transposed sm90 backward replaces by the column
# view (kernels/fa4_colmask.py; descriptors that carry it; a forward takes the default)
VARIANTS = ("predicate", "rules", "intervals", "rows", "columns")

# on a "rows" mask_mod: (K, heads), read by kernels/fa4_rowmask.py
ROWS_ATTR = "__compilemask_rows__"
# on a "columns" mask_mod: (K, column slots, whether a key can overflow them), read by
# kernels/fa4_colmask.py
COLUMNS_ATTR = "__compilemask_columns__"

_CACHE = CompileCache("mask_mod")


def _fallback_sources(mask):

    return [(r.index, predicate_source(r.rule, mask.scalar_params, mask.array_params,
                                       name=f"predicate_{r.index}",
                                       table_params=mask.table_params))
            for r in mask.fallback_regions]


_WHOLE = LRU(1024)  # (mask key, all regions) -> predicate (aux_tensors asks on every call)


def whole_mask_predicate(mask, any_region: bool = False):
    """The mask as one sympy boolean of (i, j, params) when every region is a fallback region
    (``any_region``: whatever its regions): ``Or`` over regions of (its guard, no earlier guard,
    its rule); None otherwise, or when a rule reads ``seqlen_q`` / ``seqlen_k`` (not in a
    predicate's arguments)."""
    key = (mask.key, any_region)
    got = _WHOLE.get(key, _WHOLE)  # the store itself: not computed (None is an answer)
    if got is _WHOLE:
        got = _WHOLE[key] = _whole_mask_predicate(mask, any_region)
    return got


_VARIANT = LRU(1024)  # mask key -> mask_mod variant


def mask_mod_variant(mask) -> str:
    """Which mask_mod a mask gets (the one place this is decided): the whole predicate when
    every region is one; the rules when they read no per-row arrays, print, and cost less per
    score than the table (``_rules_cheaper``); else the Interval Table test."""
    v = _VARIANT.get(mask.key)
    if v is None:
        if whole_mask_predicate(mask) is not None:
            v = "predicate"
        else:
            expr = whole_mask_predicate(mask, any_region=True)
            v = "intervals"
            if expr is not None and not expr.atoms(AppliedUndef):
                try:
                    v = "rules" if _rules_cheaper(mask, _whole_source(mask, expr)) else v
                except Exception:  # a rule the CuTe printer cannot write: the table then
                    pass
        _VARIANT[mask.key] = v
    return v


# FA4 calls the mask_mod on the padded rows and keys of the last tiles, past the length
PAD = 256


def rules_fit(mask, length: int, meta_max: int = 0) -> bool:
    """Whether the ``"rules"`` mask_mod, which evaluates the whole first-match rule (guards
    included) in int32, computes it exactly at this length: indices up to the padded length
    and, as for the kernels' predicates (``compilemask.compiler.bounds.check_kernel_predicates``),
    metadata up to ``max(length, meta_max)`` (``ExecutionDescriptor.meta_max``). The Interval
    Table's endpoints are int64 in the preprocess, so where the rules may wrap the table test
    runs instead."""
    expr = whole_mask_predicate(mask, any_region=True)
    return expr is not None and fits_int32(("rules", mask.key), lambda: [expr], length,
                                           meta_max, PAD)


_META = LRU(1024)  # mask key -> whether metadata past the length may change its int32 checks


def metadata_matters(mask) -> bool:
    """Whether metadata given on the host past the sequence may make the GPU's int32
    arithmetic of this mask (its fallback predicates, its rules mask_mod) wrap where metadata
    up to the length would not: only then does a descriptor record how far they reach
    (``ExecutionDescriptor.meta_max``), so a loop of other masks never sees the value."""
    got = _META.get(mask.key)
    if got is None:
        rules = whole_mask_predicate(mask, any_region=True)
        got = _META[mask.key] = not (
            fits_metadata([e for _, _, e in kernel_predicates(mask)])
            and (rules is None or fits_metadata([rules], pad=PAD)))
    return got


def call_variant(mask, variant: str | None, length: int, meta_max: int = 0) -> str:
    """The per-score mask_mod of a call at ``length`` (metadata up to ``meta_max`` past it):
    ``variant``, or ``mask_mod_variant``'s choice; its rules give way to the table where they
    may wrap there, and asked for by name there they raise."""
    if variant is not None:
        variant = _check_variant(mask, variant)
        if variant == "rules" and not rules_fit(mask, length, meta_max):
            reach = (f"metadata up to {meta_max}" if meta_max > length
                     else "metadata up to the length")
            raise ValueError(f"mask {mask.name!r}: the 'rules' mask_mod computes the rules in "
                             f"int32, and at length {length} they may pass its range ({reach}); "
                             "'intervals' reads the int64-computed table")
        return variant
    variant = mask_mod_variant(mask)
    return ("intervals" if variant == "rules" and not rules_fit(mask, length, meta_max)
            else variant)


# per score, in ALU operations: a global load counts LOAD_COST, so the interval test costs
# K * (2 loads + 3 operations) and the rules their operations plus one load per scalar; fitted
# to the four masks measured both ways (docs/decisions/engine.md)
LOAD_COST = 4


def _rules_cheaper(mask, source_lines) -> bool:
    lines = "\n".join(source_lines).splitlines()
    ops = sum(1 for line in lines if line.lstrip().startswith("t") and " = " in line)
    rules = ops + LOAD_COST * len(mask.scalar_params)
    intervals = max(mask.num_intervals, 1) * (2 * LOAD_COST + 3)
    return rules < intervals


def _whole_mask_predicate(mask, any_region: bool = False):
    regions = mask.regions
    if not regions or not (any_region or all(r.fallback for r in regions)):
        return None
    expr = first_match_rule(regions)
    allowed = {"i", "j", *mask.scalar_params}
    if any(s.name not in allowed for s in expr.free_symbols):
        return None
    if any(f.func.__name__ not in (*mask.array_params, *mask.table_params)
           for f in expr.atoms(AppliedUndef)):
        return None
    return expr


def _batch_line(heads: int) -> str:
    # a descriptor of a sequence per (batch, head) (heads > 1): its row b * heads + h
    if heads == 1:
        return "    b = batch[0]"
    return f"    b = batch[0] * Int32({heads}) + head[0]"


def _whole_source(mask, expr, heads: int = 1) -> list[str]:

    P, R = len(mask.scalar_params), len(mask.array_params)
    out = [predicate_source(expr, mask.scalar_params, mask.array_params,
                            name="predicate_mask", table_params=mask.table_params).rstrip(),
           "", "",
           "@cute.jit",
           "def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):",
           _batch_line(heads),
           "    row = cutlass.min(q_idx[0], seqlen_info.seqlen_q - 1)",
           "    col = kv_idx[0]",
           "    max_row = seqlen_info.seqlen_q - 1"]
    layout = aux_layout(mask, "rules")  # the predicate forms read the same aux tensors
    if "params" in layout:
        out.append(f"    params = aux_tensors[{layout.index('params')}]")
    out.append(f"    row_params = aux_tensors[{layout.index('row_params')}]"
               if "row_params" in layout else
               "    row_params = None  # no per-row arrays: never read")
    args = ([f"params[b, {p}]" for p in range(P)]
            + [f"row_params[b, row, {r}]" for r in range(R)])
    call = ", ".join(["row", "col"] + args + ["row_params", "b", "max_row"])
    # the keys' bound (the Interval Table test has it from the table's clipped intervals)
    out.append(f"    vis = predicate_mask({call}) & (col < seqlen_info.seqlen_k)")
    return out


def mask_mod_source(mask, variant: str | None = None, heads: int = 1,
                    positions: bool = False) -> str:
    """Python source of the ``@cute.jit`` mask_mod for ``mask`` (what ``mask_mod`` compiles);
    ``variant`` (one of ``VARIANTS``) overrides ``mask_mod_variant``'s choice; ``heads > 1``:
    for a descriptor of a sequence per (batch, head), read at row ``b * heads + h``;
    ``positions``: for a descriptor of chosen rows (``ExecutionDescriptor.positions``; the
    ``"intervals"`` variant of a mask with fallback regions), whose predicates read ``i`` as
    the row's position and the arrays through ``key_params``."""
    variant = _check_variant(mask, variant, heads)
    positions = _check_positions(mask, variant, positions)
    if variant not in ("intervals", "rows", "columns"):
        whole = whole_mask_predicate(mask, any_region=variant == "rules")
        what = "every region is a predicate" if variant == "predicate" else "its rules"
        out = [f"# mask_mod for {mask.name!r} (key {mask.key}): {what}",
               "import cutlass", "import cutlass.cute as cute", "from cutlass import Int32, Uint32",
               "", *_UNWRAPPED, *_whole_source(mask, whole, heads)]
        return "\n".join(out + _select())
    K = max(mask.num_intervals, 1)
    fbs = _fallback_sources(mask)
    layout = aux_layout(mask, variant, positions)
    out = [
        f"# mask_mod for {mask.name!r} (key {mask.key}), K = {K}",
        "import cutlass",
        "import cutlass.cute as cute",
        "from cutlass import Int32, Uint32",
        "",
        *_UNWRAPPED,
    ]
    if variant == "rows":  # code, not a comment: FA4's kernel key must tell it from "intervals"
        out += ["# FA4's sm90 forward masks a row at a time (kernels/fa4_rowmask.py)",
                f"ROWS = ({K}, {heads})", ""]
    if variant == "columns":
        out += ["# FA4's transposed sm90 backward masks by the column view "
                "(kernels/fa4_colmask.py)", f"COLUMNS = {_columns_attr(mask)}", ""]
    for _, src in fbs:
        out += [src.rstrip(), ""]
    out += [
        "",
        "@cute.jit",
        "def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):",
        f"    intervals = aux_tensors[{layout.index('intervals')}]",
        _batch_line(heads),
        "    row = cutlass.min(q_idx[0], seqlen_info.seqlen_q - 1)",
        "    col = kv_idx[0]",
    ]
    for m in range(K):
        hit = f"Uint32(col - intervals[b, row, {2 * m}]) < Uint32(intervals[b, row, {2 * m + 1}])"
        out.append(f"    vis = {hit}" if m == 0 else f"    vis = vis | ({hit})")
    if fbs and positions:
        out += _positions_lines(mask, fbs, layout)
    elif fbs:
        P, R = len(mask.scalar_params), len(mask.array_params)
        out += [f"    row_region = aux_tensors[{layout.index('row_region')}]",
                "    region = row_region[b, row]", "    max_row = seqlen_info.seqlen_q - 1"]
        if "params" in layout:
            out.append(f"    params = aux_tensors[{layout.index('params')}]")
        out.append(f"    row_params = aux_tensors[{layout.index('row_params')}]"
                   if "row_params" in layout else
                   "    row_params = intervals  # no per-row arrays: never read")
        args = ([f"params[b, {p}]" for p in range(P)] + [f"row_params[b, row, {r}]"
                                                         for r in range(R)])
        for idx, _ in fbs:
            call = ", ".join(["row", "col"] + args + ["row_params", "b", "max_row"])
            out.append(f"    vis = vis & ((region != {idx}) | predicate_{idx}({call}))")
    return "\n".join(out + _select())


def _positions_lines(mask, fbs, layout) -> list[str]:
    """The fallback predicates of a descriptor of chosen rows: ``i`` is the row's position
    (``positions[b, row]``, in ``[0, Sk)``), every array read through ``key_params`` (the
    sequence's arrays by position, ``[B, Sk, R]``) at that position or at a key clamped into
    the request's keys; the predicates' sources are the square path's."""
    P, R = len(mask.scalar_params), len(mask.array_params)
    out = [f"    row_region = aux_tensors[{layout.index('row_region')}]",
           "    region = row_region[b, row]",
           f"    positions = aux_tensors[{layout.index('positions')}]",
           "    pos = positions[b, row]",
           "    max_row = seqlen_info.seqlen_k - 1"]
    if "params" in layout:
        out.append(f"    params = aux_tensors[{layout.index('params')}]")
    out.append(f"    key_params = aux_tensors[{layout.index('key_params')}]"
               if "key_params" in layout else
               "    key_params = intervals  # no per-row arrays: never read")
    args = [f"params[b, {p}]" for p in range(P)] + [f"key_params[b, pos, {r}]" for r in range(R)]
    call = ", ".join(["pos", "col"] + args + ["key_params", "b", "max_row"])
    for idx, _ in fbs:
        out.append(f"    vis = vis & ((region != {idx}) | predicate_{idx}({call}))")
    return out


def _check_positions(mask, variant: str, positions: bool) -> bool:
    if positions and (variant != "intervals" or not mask.has_fallback):
        raise ValueError(f"mask {mask.name!r}: a descriptor of chosen rows reads its rows' "
                         "positions in the 'intervals' mask_mod of a mask with fallback regions "
                         f"only, not {variant!r}")
    return bool(positions)


# code, not a comment: FA4's kernel key sees that its indices are not wrapped
_UNWRAPPED = ["# every read clamped, and False for every key past seqlen_k: FA4 need not wrap",
              "# the indices, nor test the keys' bound (kernels/fa4_unwrap.py)",
              "UNWRAPPED = True", ""]


def _columns_attr(mask) -> tuple[int, int, bool]:
    view = mask.column_view
    return max(mask.num_intervals, 1), view.slots, view.can_overflow


def _select() -> list[str]:
    # a select, not a branch: the mask_mod runs once per score of every partial tile
    return ["    frag = cute.make_rmem_tensor(1, cutlass.Boolean)", "    frag[0] = vis",
            "    return frag.load()", ""]


def _check_variant(mask, variant, heads: int = 1):
    if variant is None:
        return mask_mod_variant(mask)
    if variant not in VARIANTS:
        raise ValueError(f"mask_mod variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "predicate" and whole_mask_predicate(mask) is None:
        raise ValueError(f"mask {mask.name!r}: the 'predicate' mask_mod needs every region to "
                         "be a fallback region")
    if variant == "rows" and mask.has_fallback:
        raise ValueError(f"mask {mask.name!r}: the 'rows' mask_mod needs every region to be "
                         "intervals (regions " + ", ".join(repr(r.name) for r in
                                                          mask.fallback_regions)
                         + " keep a predicate)")
    if variant == "columns" and mask.column_view is None:
        raise ValueError(f"mask {mask.name!r}: the 'columns' mask_mod needs a column view "
                         f"({mask.column_view_reason})")
    if variant == "columns" and heads != 1:
        raise ValueError(f"mask {mask.name!r}: the 'columns' mask_mod reads one sequence per "
                         f"batch row, not {heads} heads folded into it")
    if variant == "rules" and whole_mask_predicate(mask, any_region=True) is None:
        raise ValueError(f"mask {mask.name!r}: its rules do not form one predicate (a rule "
                         "reads seqlen_q / seqlen_k or a derived array)")
    return variant


def mask_mod(mask, variant: str | None = None, heads: int = 1, positions: bool = False):
    """The compiled mask's mask_mod (a ``@cute.jit`` function), cached by the mask's key, the
    variant, the heads folded into the batch and whether it reads the rows' positions
    (``mask_mod_source``)."""
    variant = _check_variant(mask, variant, heads)
    positions = _check_positions(mask, variant, positions)

    def build():
        # a real module file: the CuTe DSL reads a jit function's source to build its AST
        fn = compile_predicate(mask_mod_source(mask, variant, heads, positions), "mask_mod")
        setattr(fn, UNWRAPPED_ATTR, True)  # the source's UNWRAPPED
        if variant == "rows":
            setattr(fn, ROWS_ATTR, (max(mask.num_intervals, 1), heads))  # the source's ROWS
        if variant == "columns":  # the source's COLUMNS
            setattr(fn, COLUMNS_ATTR, _columns_attr(mask))
        return fn

    key = (mask.key, variant, heads, True) if positions else (mask.key, variant, heads)
    return _CACHE.get(key, build)


def forward_variant(mask, variant: str | None, backward: bool, columns: bool = False,
                    length: int | None = None, meta_max: int = 0) -> str:
    """The mask_mod variant of one FA4 block-sparse call. A forward of a mask without fallback
    regions reads its intervals a row at a time (``"rows"``: 1-7% faster train steps than the
    per-score tests, docs/decisions/engine.md); ``"rows"`` is a forward strategy only (FA4's
    sm90 backward holds the tile transposed), so a backward takes the per-score default. A
    backward of a descriptor that carries the column view (``columns``) reads it
    (``"columns"``), a backward strategy only; asked for without it, it raises. ``length``:
    the call's longest sequence, where the rules must fit int32 with metadata up to
    ``meta_max`` past it (``call_variant``)."""
    if backward:
        if variant == "columns" and not columns:
            raise ValueError(f"mask {mask.name!r}: the 'columns' mask_mod reads the descriptor's "
                             "column view: preprocess with "
                             "config=PipelineConfig(column_view=True)")
        if variant is None and columns:
            return "columns"
        variant = None if variant == "rows" else variant
    elif variant in (None, "columns") and not mask.has_fallback:
        return "rows"
    else:
        variant = None if variant == "columns" else variant
    if length is None:
        return _check_variant(mask, variant)
    return call_variant(mask, variant, length, meta_max)


def variant_for_call(desc, requested: str | None, backward: bool, heads: int = 1,
                     served: bool = False) -> str:
    """The mask_mod variant of one FA4 call of the fa4 engine: the policy's one entry point.
    ``requested``: ``KernelOptions.mask_mod`` (None: the policy's choice). Rows elsewhere in
    the sequence (``q_offset != 0``) are known to the table only: ``"intervals"`` (or the
    forward's ``"rows"``, asked for). A served batch (paged or packed keys, no lists) tests
    every score: ``call_variant``'s choice. Otherwise ``forward_variant``: the forward's row
    mask, the backward's column view where the descriptor has it (one sequence per batch row),
    rules that fit int32 at the call's length."""
    length = max(desc.seqlen_q, desc.seqlen_k)
    if desc.positions is not None:  # chosen rows of a mask with fallback regions
        if requested not in (None, "intervals"):
            raise ValueError(f"mask_mod variant {requested!r}: this descriptor's rows are chosen "
                             "positions of their sequences and its mask keeps predicates; only "
                             "'intervals' reads them right")
        return "intervals"
    if desc.q_offset:
        if requested not in (None, "intervals", "rows"):
            raise ValueError(f"mask_mod variant {requested!r}: this descriptor's rows are not "
                             "0.. of the sequence (q_offset != 0); only 'intervals' and "
                             "'rows' read them right")
        return "rows" if requested == "rows" and not backward and not served else "intervals"
    if served:  # the row mask is measured and tested on the block-sparse forward only
        return call_variant(desc.mask, None, length, desc.meta_max)
    columns = desc.columns is not None and heads == 1
    return forward_variant(desc.mask, requested, backward, columns, length, desc.meta_max)


def aux_layout(mask, variant: str, positions: bool = False) -> tuple[str, ...]:
    """The mask_mod's ``aux_tensors`` by name, in order: the one description of the layout,
    which the generated source reads (``aux_tensors[i]``) and :func:`aux_tensors` passes.
    Tensors of zero width are not passed (FA4 needs a stride-1 dimension of size > 1).
    ``positions``: a descriptor of chosen rows (``mask_mod_source``), whose predicates read
    the rows' positions and the sequence's arrays (``key_params``) instead of ``row_params``."""
    arrays = mask.array_params or mask.table_params
    if positions:
        return ("intervals", "row_region", *(("params",) if mask.scalar_params else ()),
                "positions", *(("key_params",) if arrays else ()))
    meta = (("params",) if mask.scalar_params else ()) + (("row_params",) if arrays else ())
    if variant not in ("intervals", "rows", "columns"):  # the predicate forms
        return meta
    if variant == "columns":  # the view's masks have no fallback region
        return ("intervals", "columns")
    return ("intervals", "row_region", *meta) if mask.has_fallback else ("intervals",)


def _aux_tensor(desc, name: str):
    """A descriptor's tensor as the mask_mod reads it (a view: one row's pairs contiguous)."""
    if name == "intervals":
        B, Sq, K, _ = desc.intervals.shape
        return desc.intervals.view(B, Sq, 2 * K)
    if name == "columns":
        B, Sk, slots, _ = desc.columns.shape
        return desc.columns.view(B, Sk, 2 * slots)
    return getattr(desc, name)


def reads_positions(desc, variant: str) -> bool:
    """Whether a descriptor's mask_mod of ``variant`` reads its rows' positions: a descriptor
    of chosen rows (``ExecutionDescriptor.positions``; ``variant_for_call`` gives it
    ``"intervals"``)."""
    return desc.positions is not None and variant == "intervals"


def aux_tensors(desc, variant: str | None = None) -> list | None:
    """The mask_mod's ``aux_tensors`` for a descriptor (views, no copies; ``aux_layout``), or
    None for none."""
    variant = _check_variant(desc.mask, variant)
    layout = aux_layout(desc.mask, variant, reads_positions(desc, variant))
    return [_aux_tensor(desc, n) for n in layout] or None
