"""compile_mask: MaskSpec -> CompiledMask (offline), and CompiledMask.preprocess (per batch)."""

from __future__ import annotations

import logging
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import sympy as sp
import torch

from compilemask.codegen.preprocess import tilelang_source
from compilemask.codegen.torch_reference import exec_source, torch_source
from compilemask.compiler.blocksparse import descriptor_lists
from compilemask.compiler.bounds import INT64_MAX, META_MAX, check_fits
from compilemask.compiler.columns import COLUMN_SLOTS, ColumnView, transposed_rule, why_no_view
from compilemask.compiler.compiler import (
    Interval,
    Term,
    canonicalize,
    extract_intervals,
    normalize,
    run_arrays,
    to_dnf_terms,
)
from compilemask.compiler.native import native_pattern
from compilemask.compiler.prover import Prover
from compilemask.compiler.reference import brute_force_mask, descriptor_dense_mask
from compilemask.compiler.segments import run_facts
from compilemask.contract.cache import CompileCache, mask_for_key, register_mask
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    ExecutionDescriptor,
    TileConfig,
)
from compilemask.contract.log import say_once
from compilemask.contract.lru import LRU
from compilemask.dsl.fingerprint import Uncacheable, Walk
from compilemask.dsl.frontend import (
    HEAD_INDEX,
    HeadIndexRead,
    RuleContext,
    boolean_basis,
    is_table_read,
    rule_symbols,
    translate_rule,
)
from compilemask.dsl.spec import MaskSpec, canonical_hash
from compilemask.pipeline import pipeline
from compilemask.pipeline.heads import HeadGroups, head_count, per_head_meta, preprocess_heads
from compilemask.pipeline.render import descriptor_to_string, explain

__all__ = ["CompiledRegion", "CompiledMask", "MaskFacts", "compile_mask", "mask_for_key",
           "DEFAULT_FWD_TILES", "DEFAULT_BWD_TILES"]

log = logging.getLogger("compilemask")

_INT32_MAX = 2**31 - 1


@dataclass
class CompiledRegion:
    """One region after passes 1-4."""

    index: int
    name: str
    guard: sp.Basic
    guard_source: str
    rule: sp.Basic
    rule_source: str
    dnf: list
    terms: list[Term]
    intervals: list[Interval]
    proofs: list[str]
    fallback_reasons: list[str] = field(default_factory=list)
    exclusive_with: dict = field(default_factory=dict)  # earlier region -> proven exclusive?

    @property
    def fallback(self) -> bool:
        return bool(self.fallback_reasons)

    @property
    def num_intervals(self) -> int:
        return len(self.intervals)


@dataclass(frozen=True)
class MaskFacts:
    """What a compiled form's rules prove, found when it compiles (under the compile lock), so
    that no preprocess, from any thread, runs a proof: the native pattern z3 proves the mask
    equal to (``compilemask.compiler.native``) and the per-row arrays a rule subscripts by j."""

    native: Any  # NativePattern | None
    key_indexed_arrays: tuple[str, ...]


@dataclass
class _IR:
    key: str
    canonical: str
    regions: list[CompiledRegion]
    scalar_params: tuple[str, ...]
    array_params: tuple[str, ...]
    divisor_params: tuple[str, ...]
    num_intervals: int
    torch_source: str
    torch_fns: dict
    derived: tuple = ()  # (run start, run end, ids) arrays computed from the metadata
    table_params: tuple[str, ...] = ()  # [B, Sq, M] tables, packed after the arrays
    # set once, before the IR is published in _IR_CACHE (None for a column view's IR)
    facts: MaskFacts | None = None


# bounded (a compiled mask keeps its own _IR; a dropped entry compiles again): ~50-100 KB each
_IR_CACHE = LRU(256)  # canonical key -> _IR
_SPEC_CACHE = LRU(1024)  # what the rule functions read -> (_IR, reads h): skips the source
_LOCK = threading.Lock()
# (semantic key, head param) -> (column view or None, why not): compiled on first request, once
# (a column view can cost more than the mask's own compile, and the default pipeline reads none)
_COLUMN_VIEWS = CompileCache("column_view")


def _spec_key(spec: MaskSpec):
    """The spec's name, params and, per region, everything its functions can read (code,
    closure cells, globals, helpers: compilemask.dsl.fingerprint); None if not keyable."""
    walk = Walk()
    try:
        regions = []
        for r in spec.regions:
            if type(r.when) is not types.FunctionType or type(r.visible) is not types.FunctionType:
                return None
            regions.append((r.name, walk.function(r.when)[0], walk.function(r.visible)[0]))
    except Uncacheable:
        return None
    # the score_mods whose -inf the rules hold: a spec that names them is not another's
    return spec.name, spec.params, tuple(regions), tuple(sorted(spec.masked_scores))


def compile_mask(spec: MaskSpec) -> CompiledMask:
    """Compile a MaskSpec (offline; cached by the canonical form of its rules, and in front of
    that by what its rule functions read, so a spec rebuilt from the same code and constants
    costs microseconds)."""
    if not isinstance(spec, MaskSpec):
        raise TypeError(f"compile_mask expects a MaskSpec, got {type(spec).__name__}")
    fkey = _spec_key(spec)
    entry = _SPEC_CACHE.get(fkey) if fkey is not None else None
    if entry is None:
        try:
            entry = _compile_spec_or_heads(spec)
        except RecursionError:  # past translation (sympy's passes recurse too)
            raise NotImplementedError(f"compile_mask: MaskSpec {spec.name!r}: a rule "
                                      f"{_TOO_DEEP}") from None
        if fkey is not None:
            with _LOCK:
                if len(_SPEC_CACHE) > 4096:
                    _SPEC_CACHE.clear()
                _SPEC_CACHE[fkey] = entry
    ir, reads_head = entry
    if reads_head:
        spec = _with_head_param(spec)
    mask = CompiledMask(spec, ir, head_param=HEAD_INDEX if reads_head else None)
    # registered when compiled, so that a traced model's custom ops find it without a side
    # effect at trace time
    register_mask(mask)
    return mask


_TOO_DEEP = ("nests deeper than Python's recursion limit (thousands of chained | / & / or "
             "terms?): write runs of keys as ranges ((j >= lo) & (j <= hi)), or split the rule "
             "over Regions")


def _translated(spec, region, role, ctx):
    try:
        return translate_rule(getattr(region, role), ctx)
    except RecursionError:
        raise NotImplementedError(f"MaskSpec {spec.name!r}, Region {region.name!r}: the {role} "
                                  f"rule {_TOO_DEEP}") from None


def _one_batch_hint(v, B) -> str:
    """Why a batch-1 tensor may meet a larger batch: a 1-D tensor a mask_mod read at q_idx /
    kv_idx is the same for every sequence and converts to batch 1 unless told the batch."""
    if v.shape[0] != 1:
        return ""
    return (f"; a tensor the same for every sequence (a 1-D tensor a mask_mod reads) converts "
            f"to batch 1: pass from_mask_mod(..., batch_size={B}), or expand it: "
            f"t.expand({B}, *t.shape[1:])")


def _batch_of(p: str, v, B):
    """The batch size so far, checked against param ``p``'s leading dim (tables and arrays
    alike)."""
    if B is None:
        return v.shape[0]
    if v.shape[0] != B:
        raise ValueError(f"param {p!r}: batch size {v.shape[0]} != {B}" + _one_batch_hint(v, B))
    return B


def check_device(device, who: str) -> None:
    """A ``device=`` argument: refused with the fix where CUDA is named and absent (torch's own
    message is an AssertionError from deep inside the first copy)."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{who}: device must be a torch.device or a name like 'cpu' / "
                         f"'cuda:0', got {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{who}: device={device!r}, but CUDA is not available here "
                         "(torch.cuda.is_available() is False); use device='cpu'")


def _with_head_param(spec: MaskSpec) -> MaskSpec:
    return MaskSpec(spec.name, (*spec.params, HEAD_INDEX), spec.regions)


def _compile_spec_or_heads(spec: MaskSpec) -> tuple[_IR, bool]:
    """The spec's IR, and whether its rules read the head index ``h`` (then compiled as the
    last scalar param, which per-head preprocessing sets to each head's index)."""
    try:
        return _compile_spec(spec), False
    except HeadIndexRead:
        return _compile_spec(_with_head_param(spec)), True


def _compile_spec(spec: MaskSpec) -> _IR:
    syms = rule_symbols(spec.params)
    ctx_all = RuleContext("", "", spec.params, syms)
    translated = []
    for r in spec.regions:
        ctx = RuleContext(r.name, "when", spec.params, syms, ctx_all.array_params,
                          ctx_all.scalar_params, ctx_all.divisor_params, ctx_all.table_params)
        g = _translated(spec, r, "when", ctx)
        if g.expr.has(syms["j"]):
            raise ValueError(f"Region {r.name!r}: the guard {g.func_name} must not use j")
        ctx.role = "visible"
        v = _translated(spec, r, "visible", ctx)
        translated.append((r, g, v))
    # Which params are per-row arrays is part of the interface (the metadata's shapes), even when
    # sympy simplifies every use of an array away.
    arrays = sorted(ctx_all.array_params)
    tables = sorted(ctx_all.table_params)
    if len(tables) > 1:
        raise NotImplementedError(f"MaskSpec {spec.name!r}: tables {tables}: a mask reads at "
                                  "most one table param")
    canonical = "\n".join(
        [f"params={spec.params} arrays={arrays}" + (f" tables={tables}" if tables else "")
         # a divisor sympy cancels is still checked (> 0) at preprocess
         + (f" divisors={sorted(ctx_all.divisor_params)}" if ctx_all.divisor_params else "")]
        + [f"{r.name}|{sp.srepr(g.expr)}|{sp.srepr(v.expr)}" for r, g, v in translated]
    )
    key = canonical_hash(canonical)
    with _LOCK:
        ir = _IR_CACHE.get(key)
        if ir is None:
            ir = _compile_ir(spec, translated, syms, ctx_all, canonical, key)
            ir.facts = _mask_facts(CompiledMask(spec, ir))
            _IR_CACHE[key] = ir
    return ir


def _mask_facts(mask: CompiledMask) -> MaskFacts:
    j = rule_symbols(())["j"]
    names = {type(f).__name__ for r in mask.regions
             for f in r.rule.atoms(sp.core.function.AppliedUndef) if f.has(j)}
    return MaskFacts(native=native_pattern(mask),
                     key_indexed_arrays=tuple(a for a in mask.array_params if a in names))


def _compile_ir(spec, translated, syms, ctx, canonical, key) -> _IR:
    i, j = syms["i"], syms["j"]
    divisors = tuple(p for p in spec.params if p in ctx.divisor_params)
    regions = []
    unconditional = Prover([], syms, divisors)  # for guard exclusivity, proved once per pair
    derived = {}
    # Xor / ITE (also inside a Piecewise condition) as And / Or / Not, for every pass after
    guards = [boolean_basis(g.expr) for _, g, _ in translated]
    rules = [boolean_basis(v.expr) for _, _, v in translated]
    for idx, (r, g, v) in enumerate(translated):
        guard, rule = guards[idx], rules[idx]
        dnf = to_dnf_terms(normalize(_opaque_tables(rule, i, j), j))
        runs = run_arrays(dnf)
        derived.update({d[0]: d for d in runs})
        assumptions = [guard] + [sp.Not(e) for e in guards[:idx]]
        prover = Prover(assumptions + run_facts(runs, i, syms["seqlen_q"]), syms, divisors)
        terms = extract_intervals(dnf, i, j)
        ivs, proofs = canonicalize(terms, prover, syms["seqlen_k"])
        reasons = [why for t in terms for why in t.reasons]
        stopped = [x for x in proofs if x.startswith("stopped at the proof budget")]
        if stopped:  # exact, yet more slots than a full canonicalization may leave: said
            say_once(f"compile_mask: MaskSpec {spec.name!r}, Region {r.name!r}: {stopped[0]} "
                     f"({len(ivs)} interval slots, exact); to merge more, raise "
                     "compilemask.compiler.compiler.CANONICALIZE_TESTS / CANONICALIZE_BUDGET "
                     "before compile_mask")
        excl = {}
        for (r2, _, _), g2 in zip(translated[:idx], guards[:idx]):
            excl[r2.name] = unconditional.proves(sp.Not(sp.And(guard, g2)))
        regions.append(CompiledRegion(
            index=idx, name=r.name, guard=guard, guard_source=g.source, rule=rule,
            rule_source=v.source, dnf=dnf, terms=terms, intervals=ivs, proofs=proofs,
            fallback_reasons=reasons, exclusive_with=excl,
        ))
    for r in regions:
        _check_int64(r)
    K = max(1, max(r.num_intervals for r in regions))
    scalar = tuple(p for p in spec.params
                   if p not in ctx.array_params and p not in ctx.table_params)
    tables = tuple(p for p in spec.params if p in ctx.table_params)
    derived = tuple(derived[k] for k in sorted(derived))
    clash = [n for d in derived for n in d[:2] if n in spec.params]
    if clash:
        raise ValueError(f"MaskSpec {spec.name!r}: param(s) {clash} clash with the run bounds "
                         "derived for an ids[i] == ids[j] comparison; rename them")
    # run bounds are per-row arrays the preprocess derives from the metadata
    arrays = tuple(p for p in spec.params if p in ctx.array_params) + tuple(
        n for d in derived for n in d[:2])
    source = torch_source(spec.name, key, regions, scalar, arrays, K, tables)
    fns = exec_source(source, f"<compilemask-torch-{spec.name}-{key}>")
    return _IR(key, canonical, regions, scalar, arrays, divisors, K, source, fns, derived,
               tables)


def _column_view(mask) -> tuple[ColumnView | None, str | None]:
    """(view, None) or (None, why not): the exchanged rule through passes 2-4 as one region."""
    why = why_no_view(mask)
    if why is not None:
        return None, why
    spec = mask.spec
    syms = rule_symbols(spec.params)
    rule = transposed_rule(mask, syms)
    derived = {n for d in mask.derived_arrays for n in d[:2]}
    ctx = RuleContext("columns", "visible", spec.params, syms,
                      set(mask.array_params) - derived, set(mask.scalar_params),
                      set(mask.divisor_params))
    translated = [(types.SimpleNamespace(name="columns"),
                   types.SimpleNamespace(expr=sp.true, source="True"),
                   types.SimpleNamespace(expr=rule, source=str(rule)))]
    canonical = f"columns of {mask.key}"
    try:
        ir = _compile_ir(spec, translated, syms, ctx, canonical, canonical_hash(canonical))
    except (ValueError, NotImplementedError) as e:
        return None, f"its exchanged rule does not compile ({e})"
    region = ir.regions[0]
    if region.fallback:
        return None, "its exchanged rule keeps a predicate (" + "; ".join(
            region.fallback_reasons) + ")"
    missing = [a for a in ir.array_params if a not in mask.array_params]
    if missing:
        return None, f"its exchanged rule reads arrays {missing} the descriptor does not carry"
    # every interval its own slot where they fit: no key can then overflow, and the kernel
    # has no Interval Table path (whose registers made ptxas spill next to a score_mod)
    n = max(ir.num_intervals, 1)
    slots = n if n <= COLUMN_SLOTS else min(max(mask.num_intervals, 1), COLUMN_SLOTS)
    return ColumnView(region, ir.num_intervals, ir.torch_fns["interval_table"],
                      ir.scalar_params, ir.array_params, slots), None


def _opaque_tables(rule, i, j):
    """The rule with each table read as an opaque atom of (i, j), named as written: the
    interval passes would otherwise solve inside its column (``t[i, min(6, j)]`` split at
    ``j = 6``) and leave a table read in a row condition, which the preprocess does not read.
    The region's predicate keeps the rule itself."""
    reads = [f for f in rule.atoms(sp.core.function.AppliedUndef) if is_table_read(f)]
    if not reads:
        return rule
    return rule.xreplace({f: sp.Function(f"{type(f).__name__}[i, {f.args[1]}]", integer=True,
                                         nonnegative=True)(i, j) for f in reads})


def _check_int64(r: CompiledRegion) -> None:
    """The preprocess evaluates guards and endpoints in int64 (the reference predicate too):
    refuse a region whose terms may not fit, rather than wrap."""
    parts = [("guard", r.guard)]
    for k, iv in enumerate(r.intervals):
        parts += [(f"interval {k} start", iv.lower), (f"interval {k} end", iv.upper),
                  (f"interval {k} condition", iv.cond)]
    if r.fallback:
        parts.append(("rule", r.rule))
    for what, e in parts:
        check_fits(e, INT64_MAX, f"Region {r.name!r}, {what}")


class CompiledMask:
    """The offline artefact of one MaskSpec: per-region intervals, K, generated code."""

    def __init__(self, spec: MaskSpec, ir: _IR, head_param: str | None = None):
        self.spec = spec
        self._ir = ir
        # "h" where the rules read the query head: a scalar param that preprocess(...,
        # num_heads=H) sets per head (``spec.params`` ends with it)
        self.head_param = head_param

    # ---- inspection ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def key(self) -> str:
        """Semantic key (hash of the canonical rules); equal keys compile to equal code."""
        return self._ir.key

    @property
    def regions(self) -> list[CompiledRegion]:
        return self._ir.regions

    @property
    def num_intervals(self) -> int:
        return self._ir.num_intervals

    @property
    def scalar_params(self) -> tuple[str, ...]:
        return self._ir.scalar_params

    @property
    def array_params(self) -> tuple[str, ...]:
        return self._ir.array_params

    @property
    def table_params(self) -> tuple[str, ...]:
        """Table params (``[B, Sq, M]`` metadata read as ``t[i, column]``): packed 32 entries to
        an int32 word in ``row_params`` after the arrays (``compilemask.tables``)."""
        return self._ir.table_params

    @property
    def has_fallback(self) -> bool:
        return any(r.fallback for r in self.regions)

    @property
    def facts(self) -> MaskFacts:
        """What the rules prove, found when the mask compiled (``MaskFacts``)."""
        return self._ir.facts

    @property
    def key_indexed_arrays(self) -> tuple[str, ...]:
        """Per-row arrays that a rule subscripts by j (their terms are fallback predicates)."""
        return self._ir.facts.key_indexed_arrays

    @property
    def native_pattern(self):
        """The FA4-native pattern z3 proves this mask equal to, or None (``compiler.native``);
        proved once per compiled form, when it compiles."""
        return self._ir.facts.native

    @property
    def column_view(self) -> ColumnView | None:
        """The query rows that see each key, compiled (``compiler.columns``), or None where
        the mask has none (``column_view_reason`` says why)."""
        return self._column_view()[0]

    @property
    def column_view_reason(self) -> str | None:
        return self._column_view()[1]

    def _column_view(self):
        # per head_param: a spec declaring ``h`` and one reading it implicitly share the IR
        return _COLUMN_VIEWS.get((self.key, self.head_param), lambda: _column_view(self))

    @property
    def divisor_params(self) -> tuple[str, ...]:
        """Params the rules divide by (positive at run time)."""
        return self._ir.divisor_params

    @property
    def derived_arrays(self) -> tuple:
        """(run start, run end, ids) per-row arrays the preprocess derives for ``ids[i] ==
        ids[j]`` comparisons."""
        return self._ir.derived

    def torch_function(self, name: str):
        """A function of the generated torch reference: ``interval_table(i, seqlen_q, seqlen_k,
        *params, batch_size=)`` (any row indices ``i``) or ``predicate_<region>``."""
        return self._ir.torch_fns[name]

    @property
    def fallback_regions(self) -> list[CompiledRegion]:
        return [r for r in self.regions if r.fallback]

    def reference_source(self) -> str:
        """The generated torch source of the reference preprocess."""
        return self._ir.torch_source

    def preprocess_source(self, target: str = "cuda") -> str:
        """The generated TileLang preprocess program (see compilemask.codegen)."""
        return tilelang_source(self, target=target)

    def explain(self, meta=None, row: int | None = None, *, show_code: bool = False,
                **kw) -> str:
        """How the mask compiled (``pipeline.render.explain``); ``show_code=True`` appends
        the generated code."""
        return explain(self, meta=meta, row=row, show_code=show_code, **kw)

    def __repr__(self):
        return (f"CompiledMask({self.name!r}, K={self.num_intervals}, "
                f"regions={[r.name for r in self.regions]}, key={self.key})")

    # ---- per batch ---------------------------------------------------------------------------
    def normalize_meta(self, meta, seqlen_q: int, seqlen_k: int, batch_size=None, device=None,
                       check_values: bool | None = None):
        """Validate metadata; returns (B, {scalar: int64 [B, 1]}, {array: int64 [B, Sq], table:
        [B, Sq, M] as given}, dev)."""
        return _normalize_meta(self, meta, seqlen_q, seqlen_k, batch_size, device, check_values)

    def preprocess(self, meta=None, seqlen_q: int | None = None, seqlen_k: int | None = None, *,
                   batch_size: int | None = None, fwd_tiles=DEFAULT_FWD_TILES,
                   bwd_tiles=DEFAULT_BWD_TILES, check: bool = False, device=None,
                   backend: str = "auto", config: pipeline.PipelineConfig | None = None,
                   max_segments: int | None = None, num_heads: int | None = None,
                   fold: bool | None = None, padding=None) -> ExecutionDescriptor | HeadGroups:
        """Metadata of one batch -> Execution Descriptor (forward and backward), with what its
        engines read (``compilemask.pipeline``).

        Per-head masks: with ``num_heads=H`` (required where the rules read the head index
        ``h``), metadata may carry a head axis (a scalar param ``[B, H]``, an array ``[B, H,
        Sq]``, a table ``[B, H, Sq, M]``) and the result is ``HeadGroups`` of the H heads, each
        head's metadata its slice (``h`` its index), folded into one descriptor unless
        ``fold=False`` (``preprocess_heads``); ``dense_mask()`` is ``[B, H, Sq, Sk]``.

        ``backend``: "torch" (the generated reference), "tilelang" (the generated TileLang
        kernel: CUDA on GPU metadata, the C target on CPU) or "auto" (TileLang on CUDA when
        available, the torch reference on CPU). ``check=True`` validates the metadata values
        (non-negative, divisors positive) on any device, which synchronizes with it. ``device``:
        where to build it (default: the metadata tensors' device, else the CPU; a descriptor on
        the CPU is copied to the GPU once by ``cm.attention``). ``config``: the generated
        programs' launch shapes (``pipeline.PipelineConfig``; its tilings replace ``fwd_tiles``
        / ``bwd_tiles``). ``max_segments``: for masks proved causal within segments, an upper
        bound on the segments of a batch, so that FA4's varlen path needs no host
        synchronization (see ``compilemask.compiler.native.segments``). Guards may overlap: a row
        belongs to the first region whose guard holds. ``padding``: a bool or 0/1 ``[B,
        seqlen_k]`` mask of the real tokens (a tokenizer's ``attention_mask``), one contiguous
        run per sequence: each row sees only its sequence's real keys and padded rows see
        nothing (``compilemask.pipeline.padding``; positions stay the tensor's)."""
        if seqlen_q is None:
            raise ValueError("preprocess: seqlen_q is required")
        heads = head_count(self, meta, num_heads)
        if heads is None and fold is not None:
            raise ValueError("preprocess: fold applies to per-head masks (num_heads=H)")
        if heads is not None:
            if padding is not None:
                raise NotImplementedError("preprocess: padding with per-head masks (num_heads) "
                                          "is not supported; put it in the metadata")
            return preprocess_heads(
                [self] * heads, per_head_meta(self, meta, heads), seqlen_q, seqlen_k, fold=fold,
                batch_size=batch_size, fwd_tiles=fwd_tiles, bwd_tiles=bwd_tiles, check=check,
                device=device, backend=backend, config=config, max_segments=max_segments)
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        cfg = _config_arg(config, fwd_tiles, bwd_tiles)
        return pipeline.preprocess(self, meta, seqlen_q, seqlen_k, batch_size=batch_size,
                                   device=device, backend=backend, check=check, config=cfg,
                                   max_segments=max_segments, padding=padding)

    def preprocessor(self, seqlen_q: int, seqlen_k: int | None = None, *, batch_size: int,
                     device=None, fwd_tiles=DEFAULT_FWD_TILES, bwd_tiles=DEFAULT_BWD_TILES,
                     check_values: bool | None = None,
                     config: pipeline.PipelineConfig | None = None,
                     max_segments: int | None = None) -> pipeline.Preprocessor:
        """``preprocess`` bound to a batch size and device, for the per-step loop: ``pre =
        mask.preprocessor(S, batch_size=B)`` once, then ``desc = pre(meta)`` per batch, or
        ``pre(meta, seqlen_q=S2)`` at another length (no compile: the programs take the lengths
        at run time). Validation, program lookup and output shapes happen once per length; a
        call launches the TileLang program directly when the metadata are int32/int64
        contiguous tensors on the device, and otherwise takes the general path (see
        ``pipeline.pipeline.Preprocessor``). ``device``: CUDA where available, else the CPU
        (TileLang's C target). Needs TileLang."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"preprocessor: device {str(device)!r} but CUDA is not available "
                             "here; pass device='cpu' (TileLang's C target) or use preprocess()")
        if seqlen_q is None:
            raise ValueError("preprocessor: seqlen_q is required")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"preprocessor: batch_size must be a positive int, got "
                             f"{batch_size!r}")
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        return pipeline.Preprocessor(self, seqlen_q, seqlen_k, batch_size, device,
                                     _config_arg(config, fwd_tiles, bwd_tiles),
                                     check_values=check_values, max_segments=max_segments)

    # ---- what the descriptors of this mask are asked for ---------------------------------------
    def block_sparse(self, desc: ExecutionDescriptor, kind: str = "fwd"):
        """A descriptor's tile lists of ``kind`` when its producer did not write them: the
        torch reference on its device (``compilemask.compiler.blocksparse``)."""
        return descriptor_lists(desc, kind)

    def dense_mask(self, desc: ExecutionDescriptor) -> torch.Tensor:
        """bool ``[B, Sq, Sk]``: the mask a descriptor of this mask encodes."""
        return descriptor_dense_mask(desc)

    def descriptor_string(self, desc: ExecutionDescriptor, **kw) -> str:
        """A descriptor's tiles as text (``compilemask.pipeline.render.descriptor_to_string``)."""
        return descriptor_to_string(desc, **kw)

    def reference_mask(self, meta=None, seqlen_q: int | None = None, seqlen_k: int | None = None,
                       *, batch_size: int | None = None) -> torch.Tensor:
        """bool [B, Sq, Sk] by calling the user's Python rules on every (i, j): the oracle."""
        if seqlen_q is None:
            raise ValueError("reference_mask: seqlen_q is required")
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        B, scal, arrs, _ = self.normalize_meta(meta, seqlen_q, seqlen_k, batch_size, "cpu")
        return brute_force_mask(self, B, scal, arrs, seqlen_q, seqlen_k)


def _config_arg(config, fwd_tiles, bwd_tiles) -> pipeline.PipelineConfig:
    if config is not None:
        if not isinstance(config, pipeline.PipelineConfig):
            raise TypeError(f"config must be a compilemask.pipeline.pipeline.PipelineConfig, got "
                            f"{type(config).__name__}")
        return config
    fwd = _tiles_arg(fwd_tiles, "fwd_tiles")
    bwd = _tiles_arg(bwd_tiles, "bwd_tiles")
    if (fwd, bwd) == (DEFAULT_FWD_TILES, DEFAULT_BWD_TILES):
        return pipeline.DEFAULT_CONFIG
    return pipeline.PipelineConfig(fwd, bwd)


def _tiles_arg(t, name) -> TileConfig:
    if isinstance(t, TileConfig):
        tc = t
    elif isinstance(t, (tuple, list)) and len(t) == 2:
        tc = TileConfig(*t)
    else:
        raise TypeError(f"{name} must be a TileConfig or (tile_m, tile_n), got {t!r}")
    for v in (tc.tile_m, tc.tile_n):
        if not isinstance(v, int) or v <= 0 or v & (v - 1):
            raise ValueError(f"{name}: tile sizes must be positive powers of two, got {tc}")
    return tc


_META_KINDS = "metadata are non-negative ints (Python ints or integer tensors)"
_META_MAX = META_MAX  # the largest metadata value accepted (docs/masks.md's contract)


def _normalize_meta(mask, meta, seqlen_q, seqlen_k, batch_size, device, check_values):
    spec = mask.spec
    for nm, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{nm} must be a positive int, got {v!r}")
        if v > _INT32_MAX // 2:
            raise ValueError(f"{nm}={v} is beyond the int32 index range")
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict of param name -> int or tensor, got "
                        f"{type(meta).__name__}")
    missing = [p for p in spec.params if p not in meta]
    if missing and missing[-1] == mask.head_param:
        raise ValueError(f"mask {spec.name!r} reads the head index {mask.head_param!r}: "
                         f"preprocess(..., num_heads=H) sets it per head, or pass "
                         f"meta[{mask.head_param!r}] = a head for that head's descriptor"
                         + (f"; metadata is also missing {missing[:-1]}" if missing[:-1]
                            else ""))
    if missing:
        raise ValueError(f"mask {spec.name!r}: metadata is missing param(s) {missing}")
    extra = [k for k in meta if k not in spec.params]
    if extra:
        raise ValueError(f"mask {spec.name!r}: unknown param(s) {extra}; declared: "
                         f"{list(spec.params)}")
    if mask.key_indexed_arrays and seqlen_k > seqlen_q:
        raise ValueError(f"mask {spec.name!r}: per-row array(s) {list(mask.key_indexed_arrays)} "
                         f"are subscripted by j, so seqlen_k ({seqlen_k}) must not exceed "
                         f"seqlen_q ({seqlen_q})")
    if batch_size is not None and (not isinstance(batch_size, int)
                                   or isinstance(batch_size, bool) or batch_size < 1):
        bad = ValueError if isinstance(batch_size, int) and not isinstance(batch_size, bool) \
            else TypeError
        raise bad(f"batch_size must be a positive int (or None: the metadata's batch), got "
                  f"{batch_size!r}")
    check_device(device, "preprocess")
    # batch size and device from the tensors
    B = batch_size
    dev = dev0 = None  # 0-d tensors give the device only where no [B] or [B, Sq] tensor does
    for p in spec.params:
        v = meta[p]
        if isinstance(v, torch.Tensor):
            if v.dtype is torch.bool and p in mask.table_params:
                pass  # a table's entries: set or not
            elif v.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
                raise ValueError(f"param {p!r}: dtype must be an integer type, got {v.dtype}; "
                                 f"{_META_KINDS}")
            if p in mask.table_params:
                if v.dim() != 3 or v.shape[1] != seqlen_q:
                    raise ValueError(f"param {p!r} is a table: expected a [B, Sq={seqlen_q}, M] "
                                     f"tensor (row i's M entries), got {list(v.shape)} (per "
                                     "head: [B, H, Sq, M] with preprocess(..., num_heads=H))")
                B = _batch_of(p, v, B)
                dev = v.device if dev is None else dev
                continue
            want = 2 if p in mask.array_params else 1
            if v.dim() and v.shape[0] == 0:
                raise ValueError(f"param {p!r} is an empty tensor {list(v.shape)}: give a value "
                                 "per sequence (batch >= 1)")
            if want == 1 and v.dim() == 0:
                # a 0-d tensor is one value for every sequence, as a Python int is
                dev0 = v.device if dev0 is None else dev0
                continue
            if v.dim() != want:
                shape = "[B, Sq]" if want == 2 else "[B] (or 0-d)"
                per_head = "[B, H, Sq]" if want == 2 else "[B, H]"
                raise ValueError(f"param {p!r}: expected shape {shape}, got {list(v.shape)} (a "
                                 f"value per head is {per_head} with preprocess(..., "
                                 "num_heads=H))")
            B = _batch_of(p, v, B)
            if want == 2 and v.shape[1] != seqlen_q:
                raise ValueError(f"param {p!r}: per-row array length {v.shape[1]} != seqlen_q "
                                 f"{seqlen_q}")
            dev = v.device if dev is None else dev
        elif p in mask.table_params:
            raise ValueError(f"param {p!r} is a table: pass a [B, Sq, M] tensor")
        elif isinstance(v, int) and not isinstance(v, bool):
            if p in mask.array_params:
                raise ValueError(f"param {p!r} is a per-row array: pass a [B, Sq] tensor")
            # a host value: checked on any device, at no cost
            lo = 1 if p in mask._ir.divisor_params else 0
            if v < lo:
                what = "positive (it is a divisor)" if lo else "non-negative"
                raise ValueError(f"param {p!r} must be {what}; got {v}")
            if v > _META_MAX:
                raise ValueError(f"param {p!r} is {v}, past the largest metadata value 2**30 "
                                 f"({_META_MAX}); pass a value <= 2**30")
        elif isinstance(v, (float, bool)):
            # a value of the wrong kind, as in a float or bool tensor: the same ValueError
            raise ValueError(f"param {p!r}: got the {type(v).__name__} {v!r}; {_META_KINDS}")
        else:
            raise TypeError(f"param {p!r}: expected an int or an integer tensor, got "
                            f"{type(v).__name__}")
    B = 1 if B is None else B
    if not isinstance(B, int) or B < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    dev = torch.device(device) if device is not None else (dev or dev0 or torch.device("cpu"))
    if check_values is None:
        check_values = dev.type == "cpu"  # value checks would synchronize a GPU stream
    scal, arrs = {}, {}
    for p in spec.params:
        v = meta[p]
        if p in mask.table_params:  # entries, not values: no range to check
            arrs[p] = v.to(device=dev)
            continue
        t = (torch.as_tensor(v, dtype=torch.int64, device=dev) if not isinstance(v, torch.Tensor)
             else v.to(device=dev, dtype=torch.int64))
        if check_values:
            lo = 1 if p in mask._ir.divisor_params else 0
            if bool((t < lo).any()):
                what = "positive (it is a divisor)" if lo else "non-negative"
                raise ValueError(f"param {p!r} must be {what}; got min {int(t.min())}")
            if bool((t > _META_MAX).any()):
                raise ValueError(f"param {p!r} is out of range: max {int(t.max())}, past the "
                                 f"largest metadata value 2**30 ({_META_MAX}); pass values "
                                 "<= 2**30")
        if p in mask.array_params:
            arrs[p] = t
        else:
            scal[p] = t.expand(B).reshape(B, 1) if t.dim() == 0 else t.view(B, 1)
    return B, scal, arrs, dev
