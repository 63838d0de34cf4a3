"""A compiled score_mod as flash-attn-4's ``score_mod`` and ``score_mod_bwd``, generated per
score_mod and per position of its tables among the call's aux tensors.

FA4 calls ``score_mod(score, batch_idx, head_idx, q_idx=, kv_idx=, seqlen_info=,
aux_tensors=)`` on vectors of 1, 2 or 4 scaled scores (the width depends on the kernel and on
whether aux tensors are passed), and ``score_mod_bwd(grad, score, ...)`` for the gradient, which
is ``grad * d score_mod / d score`` at the pre-modification score. Both functions loop over the
vector, evaluate the expression per element in float32 (integers in Int32), and return the
vector. FA4's sm90 backward (4.0.0b40) runs GQA unpacked but hands the score_mod indices in its
packed-GQA form (``q_idx // G`` and ``h * G + q_idx % G``, G query heads per kv head); the
backward's functions (``gqa=G``) undo that, and a GPU test with GQA fails if FA4 changes it.
Tables are ``aux_tensors[offset + t]`` (the mask_mod's aux tensors come first); a
negative index counts from the end as in torch, and every index is clamped into the table so
that no read leaves it.

FA4 wraps q_idx and kv_idx into the sequence (a fast division per index and score) whenever a
call has aux tensors, so that a score_mod's reads stay inside them. Ours are clamped already,
and a score_mod that is finite for any integer index (``index_total``: ALiBi's
``slopes[h] * (kv_idx - q_idx)``, a per-head temperature) needs no valid index on the padded
rows and columns of edge tiles either (their scores are masked, their rows' LSE is +inf): its
source says ``UNWRAPPED = True`` and ``kernels/fa4_unwrap.py`` skips the wrap for it.
"""

from __future__ import annotations

import sympy as sp

from compilemask.codegen.cute_predicate import UNWRAPPED_ATTR, VECTOR_ATTR, compile_predicate
from compilemask.contract.cache import CompileCache
from compilemask.dsl.score_mod import SCORE, ScoreMod, fdiv, log2, tofloat, trunc

__all__ = ["score_mod_source", "score_mod_fns", "index_total"]

_CACHE = CompileCache("score_mod")
# scores per call of a score_mod_bwd that trains a table (``VECTOR_ATTR``): FA4's sm90 backward
# holds 32 per thread and tile, and calls the hook on one at a time when a call has aux tensors
TRAIN_VECTOR = 8
_NAMES = {"b": "b", "h": "h", "i": "q", "j": "kv"}


# operations finite for finite arguments: an expression built of these alone (and tables read
# at batch / head only) is finite at any q_idx / kv_idx, padded ones included
_TOTAL = (sp.Add, sp.Mul, sp.Min, sp.Max, sp.Abs, sp.Piecewise, sp.ITE, sp.And, sp.Or,
          sp.Not, sp.Xor, sp.core.relational.Relational, sp.logic.boolalg.BooleanAtom,
          sp.functions.elementary.piecewise.ExprCondPair)


# indices below this bound (the engines' choice from the call's lengths) let linear index
# expressions convert to float by bits (``_i2f``) rather than I2F
INDEX_BOUND = 1 << 20
_BITS_LIMIT = 1 << 22  # |x| < 2**22: 0x4B400000 + x stays in the mantissa of 1.5 * 2**23


def _bits_convertible(e) -> bool:
    """Whether the integer ``e`` is linear in q_idx / kv_idx with a bound below 2**22 when both
    are below INDEX_BOUND (so ``_i2f`` is exact)."""
    if not e.free_symbols or not {s.name for s in e.free_symbols} <= {"i", "j"}:
        return False
    try:
        poly = sp.Poly(e, *sorted(e.free_symbols, key=str))
    except sp.PolynomialError:
        return False
    if poly.total_degree() > 1 or not all(c.is_Integer for c in poly.coeffs()):
        return False
    const = poly.coeff_monomial(1)
    reach = sum(abs(int(c)) for m, c in poly.terms() if any(m)) * INDEX_BOUND
    return reach + abs(int(const)) < _BITS_LIMIT


def _uniform(e) -> bool:
    """Whether ``e`` reads no score, q_idx or kv_idx (batch, head, constants and tables read
    there): one value for a whole tile, which the compiler computes once."""
    return not any(s.name in ("score", "i", "j") for s in e.free_symbols)


def index_total(sm: ScoreMod, relative: bool = False) -> bool:
    """Whether ``sm``'s value and gradient are finite at every integer q_idx / kv_idx given
    finite scores and tables: where they read an index, only through sums, products,
    non-negative integer powers, min / max / abs and selects (no division, function or table
    read of an index); ``relative``: its relative indices are read from their tables, and a
    table read at them and at finite indices is a clamped load."""
    loaded = {a for a, _ in sm.relative} if relative else set()

    def total(e) -> bool:
        if not any(s.name in ("i", "j") for s in e.free_symbols):
            return True
        if isinstance(e, sp.Symbol):
            return True
        if isinstance(e, sp.core.function.AppliedUndef) and any(a in loaded for a in e.args):
            return all(a in loaded or total(a) for a in e.args)
        if isinstance(e, sp.Pow):
            return bool(e.args[1].is_Integer and int(e.args[1]) >= 0 and total(e.args[0]))
        return isinstance(e, _TOTAL) and all(total(a) for a in e.args)

    return total(sm.expr) and total(sm.grad)


class _Emit:
    """Expression -> CuTe DSL code on whole vectors (TensorSSA): FA4's vector of scores and
    indices in, one value per temporary. Vector arithmetic, not a loop of scalar operations:
    the scalar form made ptxas spill in FA4's block-sparse backward where this form does not
    (ALiBi: 68 bytes per thread, ``docs/decisions/engine.md``). A table read takes its indices
    through a register fragment, one element at a time."""

    def __init__(self, sm: ScoreMod, offset: int, index_bits: bool = False,
                 relative: bool = False):
        self.index_bits = index_bits
        self.tables = {t.name: (offset + n, t) for n, t in enumerate(sm.tables)}
        # relative indices read from their tables, after the score_mod's own
        self.relative = ({a: offset + len(sm.tables) + n for n, (a, _) in enumerate(sm.relative)}
                         if relative else {})
        self.lines: list[str] = []
        self.memo: dict = {}
        self.n = 0
        self.exact = 0  # > 0 inside a float -> int conversion: no approximate math there

    def tmp(self, code: str) -> str:
        name = f"t{self.n}"
        self.n += 1
        self.lines.append(f"{name} = {code}")
        return name

    def fold(self, args, op: str) -> str:
        """``args[0] op args[1] op ...`` for an infix ``op``, one temporary per step."""
        acc = args[0]
        for a in args[1:]:
            acc = self.tmp(f"{acc} {op} {a}")
        return acc

    def get(self, e, ctx: str) -> str:
        key = (e, ctx, self.exact > 0)
        if key not in self.memo:
            self.memo[key] = {"f": self._f, "i": self._i, "b": self._b}[ctx](e)
        return self.memo[key]

    @property
    def fm(self) -> str:
        return f"fastmath={self.exact == 0}"

    @staticmethod
    def _is_int(e) -> bool:
        return bool(e.is_integer)

    def _min(self, a, b) -> str:
        return self.tmp(f"cute.where({a} < {b}, {a}, {b})")

    def _max(self, a, b) -> str:
        return self.tmp(f"cute.where({a} > {b}, {a}, {b})")

    # ---- float32 -------------------------------------------------------------------------
    def _f(self, e) -> str:
        if e == SCORE:
            return "s"
        if e.is_Number:
            return self.tmp(f"cute.full_like(s, {float(e)!r})")
        if self._is_int(e) and not isinstance(e, sp.Piecewise):
            if self.index_bits and _bits_convertible(e):
                return self.tmp(f"_i2f({self.get(e, 'i')})")
            return self.tmp(f"{self.get(e, 'i')}.to(Float32)")
        if isinstance(e, sp.core.function.AppliedUndef):
            return self._load(e)
        if isinstance(e, tofloat):  # .float() of an integer: converted here, float above
            return self.get(e.args[0], "f")
        if isinstance(e, log2):
            return self.tmp(f"cute.math.log2({self.get(e.args[0], 'f')}, {self.fm})")
        if isinstance(e, (sp.Add, sp.Mul)):
            if isinstance(e, sp.Mul):
                num, den = e.as_numer_denom()
                if den != 1 and num != 1 and self.exact == 0 and _uniform(den):
                    # a divisor the same for the whole tile (``temps[h]``): one reciprocal,
                    # then a multiply per score (within 1.5 ulp of the IEEE division)
                    rcp = self.get(sp.Pow(den, -1, evaluate=False), "f")
                    return self.tmp(f"{self.get(num, 'f')} * {rcp}")
                if den != 1 and num != 1:  # a / b as one division (not a * (1 / b))
                    return self.tmp(f"{self.get(num, 'f')} / {self.get(den, 'f')}")
            return self.fold([self.get(a, "f") for a in e.args],
                             "+" if isinstance(e, sp.Add) else "*")
        if isinstance(e, sp.Pow):
            base, ex = e.args
            if ex == sp.Rational(1, 2):
                return self.tmp(f"cute.math.sqrt({self.get(base, 'f')}, {self.fm})")
            if ex == sp.Rational(-1, 2):
                return self.tmp(f"cute.math.rsqrt({self.get(base, 'f')}, {self.fm})")
            if ex.is_Integer:
                k = int(ex)
                b = self.get(base, "f")
                acc = b
                for _ in range(abs(k) - 1):
                    acc = self.tmp(f"{acc} * {b}")
                if k == 0:
                    return self.tmp("cute.full_like(s, 1.0)")
                return self.tmp(f"Float32(1.0) / {acc}") if k < 0 else acc
            if base == 2:
                return self.tmp(f"cute.math.exp2({self.get(ex, 'f')}, {self.fm})")
            return self._pow(base, ex)
        fns = {sp.exp: "exp", sp.log: "log", sp.tanh: "tanh", sp.sin: "sin", sp.cos: "cos"}
        for k, fn in fns.items():
            if isinstance(e, k):
                return self.tmp(f"cute.math.{fn}({self.get(e.args[0], 'f')}, {self.fm})")
        if isinstance(e, sp.Piecewise):
            return self._piecewise(e, "f")
        if isinstance(e, fdiv):
            return self.tmp(f"{self.get(e.args[0], 'f')} / {self.get(e.args[1], 'f')}")
        if isinstance(e, sp.floor):
            return self.tmp(f"cute.math.floor({self.get(e.args[0], 'f')})")
        raise NotImplementedError(f"score_mod: no float32 code for {type(e).__name__}: {e}")

    def _pow(self, base, ex) -> str:
        """torch's pow for any signs: ``|x| ** y`` as ``exp2(y * log2|x|)``, ``x ** 0 == 1``,
        and for ``x < 0`` the sign of an odd integral ``y`` (NaN for a fractional one)."""
        x, y = self.get(base, "f"), self.get(ex, "f")
        ax = self.tmp(f"cute.where({x} < Float32(0.0), -{x}, {x})")
        lg = self.tmp(f"cute.math.log2({ax}, {self.fm})")
        r = self.tmp(f"cute.math.exp2({y} * {lg}, {self.fm})")
        r = self.tmp(f"cute.where({y} == Float32(0.0), cute.full_like(s, 1.0), {r})")
        if base.is_nonnegative:
            return r
        fy = self.tmp(f"cute.math.floor({y})")
        half = self.tmp(f"cute.math.floor({y} * Float32(0.5))")
        odd = self.tmp(f"{fy} - {half} * Float32(2.0)")  # 1.0 for an odd integral y
        signed = self.tmp(f"cute.where({odd} == Float32(1.0), -{r}, {r})")
        neg = self.tmp(f"cute.where({fy} == {y}, {signed}, cute.full_like(s, float('nan')))")
        return self.tmp(f"cute.where({x} < Float32(0.0), {neg}, {r})")

    # ---- Int32 ---------------------------------------------------------------------------
    def _i(self, e) -> str:
        if e in self.relative:
            return self._relative(e)
        if isinstance(e, sp.Symbol):
            if e.name not in _NAMES:
                raise NotImplementedError(f"score_mod: unknown symbol {e}")
            return _NAMES[e.name]
        if e.is_Integer:
            return self.tmp(f"cute.full_like(kv, {int(e)})")
        if isinstance(e, sp.core.function.AppliedUndef):
            return self._load(e)
        if isinstance(e, sp.Add):
            # negated terms as subtractions: ``kv - q``, not ``kv + q * -1``
            pos = [a for a in e.args if not a.could_extract_minus_sign()]
            neg = [-a for a in e.args if a.could_extract_minus_sign()]
            acc = (self.fold([self.get(a, "i") for a in pos], "+") if pos
                   else self.tmp("cute.full_like(kv, 0)"))
            for a in neg:
                acc = self.tmp(f"{acc} - {self.get(a, 'i')}")
            return acc
        if isinstance(e, sp.Mul):
            coeff, rest = e.as_coeff_Mul()
            if not coeff.is_Integer:
                return self.tmp(f"cute.math.floor({self.get(e, 'f')}).to(Int32)")
            acc = None
            for f in sp.Mul.make_args(rest):
                x = self.get(f, "i")
                acc = x if acc is None else self.tmp(f"{acc} * {x}")
            if coeff != 1:
                acc = self.tmp(f"{acc} * Int32({int(coeff)})")
            return acc
        if isinstance(e, sp.Pow) and e.args[1].is_Integer and int(e.args[1]) >= 0:
            b = self.get(e.args[0], "i")
            acc = self.tmp("cute.full_like(kv, 1)")
            for _ in range(int(e.args[1])):
                acc = self.tmp(f"{acc} * {b}")
            return acc
        if isinstance(e, sp.floor):
            num, den = sp.fraction(sp.together(e.args[0]))
            if num.is_integer and den.is_integer:
                # floor(a / b) = (a - a mod b) / b, an exact division, so neither the DSL's
                # division (floors) nor its remainder (the dividend's sign) rounding matters
                a, b = self.get(sp.expand(num), "i"), self.get(sp.expand(den), "i")
                m = self.get(sp.Mod(sp.expand(num), sp.expand(den)), "i")
                return self.tmp(f"({a} - {m}) // {b}")
            return self.tmp(f"cute.math.floor({self._exact_f(e.args[0])}).to(Int32)")
        if isinstance(e, sp.Mod):
            # Python's mod (the divisor's sign) from a remainder of either sign convention
            a, b = self.get(e.args[0], "i"), self.get(e.args[1], "i")
            r = self.tmp(f"{a} % {b}")
            fix = self.tmp(f"({r} != Int32(0)) & (({r} < Int32(0)) != ({b} < Int32(0)))")
            return self.tmp(f"cute.where({fix}, {r} + {b}, {r})")
        if isinstance(e, trunc):
            return self.tmp(f"{self._exact_f(e.args[0])}.to(Int32)")  # fptosi: toward zero
        if isinstance(e, (sp.Min, sp.Max)):
            pick = self._min if isinstance(e, sp.Min) else self._max
            acc = self.get(e.args[0], "i")
            for a in e.args[1:]:
                acc = pick(acc, self.get(a, "i"))
            return acc
        if isinstance(e, sp.Abs):
            a = self.get(e.args[0], "i")
            return self.tmp(f"cute.where({a} < Int32(0), Int32(0) - {a}, {a})")
        if isinstance(e, sp.Piecewise):
            return self._piecewise(e, "i")
        raise NotImplementedError(f"score_mod: no Int32 code for {type(e).__name__}: {e}")

    def _exact_f(self, e) -> str:
        # a float rounded to an integer (T5's log buckets): a one-ulp error of approximate
        # math moves a boundary, so this value is computed with the precise functions
        self.exact += 1
        try:
            return self.get(e, "f")
        finally:
            self.exact -= 1

    # ---- Boolean -------------------------------------------------------------------------
    def _b(self, e) -> str:
        if e is sp.true or e == sp.true:
            return self.tmp("kv == kv")
        if e is sp.false or e == sp.false:
            return self.tmp("kv != kv")
        rel = {sp.StrictLessThan: "<", sp.LessThan: "<=", sp.StrictGreaterThan: ">",
               sp.GreaterThan: ">=", sp.Equality: "==", sp.Unequality: "!="}
        if type(e) in rel:
            ctx = "i" if self._is_int(e.lhs) and self._is_int(e.rhs) else "f"
            return self.tmp(f"{self.get(e.lhs, ctx)} {rel[type(e)]} {self.get(e.rhs, ctx)}")
        if isinstance(e, (sp.And, sp.Or, sp.Xor)):
            return self.fold([self.get(a, "b") for a in e.args],
                             {sp.And: "&", sp.Or: "|", sp.Xor: "^"}[type(e)])
        if isinstance(e, sp.Not):
            return self.tmp(f"{self.get(e.args[0], 'b')} ^ {self.get(sp.true, 'b')}")
        if isinstance(e, sp.ITE):
            c, a, b = (self.get(x, "b") for x in e.args)
            return self.tmp(f"cute.where({c}, {a}, {b})")
        raise NotImplementedError(f"score_mod: no boolean code for {type(e).__name__}: {e}")

    def _piecewise(self, e, ctx) -> str:
        # selects, not branches: evaluated per score
        acc = self.get(e.args[-1][0], ctx)
        for val, cond in reversed(e.args[:-1]):
            acc = self.tmp(f"cute.where({self.get(cond, 'b')}, {self.get(val, ctx)}, {acc})")
        return acc

    def _load(self, e) -> str:
        pos, tab = self.tables[type(e).__name__]
        src = f"aux_tensors[{pos}]"
        frags = self.index_frags(e, src)
        out = self.tmp(f"cute.make_rmem_tensor(n, {'Float32' if tab.is_float else 'Int32'})")
        idx = ", ".join(f"{f}[e]" for f in frags)
        self.lines += ["for e in cutlass.range_constexpr(n):", f"    {out}[e] = {src}[{idx}]"]
        return self.tmp(f"{out}.load()")

    def _relative(self, e) -> str:
        """A relative index read from its table at ``q - kv`` (``ScoreMod.relative_table``):
        one load for the rounding float arithmetic; positions clamped into the table (only
        the padded rows and columns of edge tiles, whose scores are masked, reach past it)."""
        src = f"aux_tensors[{self.relative[e]}]"
        size = self.tmp(f"Int32(cute.size({src}.shape[0]))")
        pos = self.tmp(f"q - kv + ({size} - Int32(1)) // Int32(2)")
        pos = self._min(self._max(pos, "Int32(0)"), f"{size} - Int32(1)")
        frag = self.tmp("cute.make_rmem_tensor(n, Int32)")
        self.lines.append(f"{frag}.store({pos})")
        out = self.tmp("cute.make_rmem_tensor(n, Int32)")
        self.lines += ["for e in cutlass.range_constexpr(n):", f"    {out}[e] = {src}[{frag}[e]]"]
        return self.tmp(f"{out}.load()")

    def index_frags(self, e, src: str, first_dim: int = 0) -> list[str]:
        """Register fragments of the table read ``e``'s indices into ``src`` (a tensor of the
        table's shape from dimension ``first_dim``): torch's negative indices, then clamped
        into the table."""
        frags = []
        for n, a in enumerate(e.args):
            x = self.get(a, "i")
            # torch's negative indices, then clamped into the table: no read leaves it
            size = self.tmp(f"Int32(cute.size({src}.shape[{n + first_dim}]))")
            x = self.tmp(f"cute.where({x} < Int32(0), {x} + {size}, {x})")
            x = self._min(self._max(x, "Int32(0)"), f"{size} - Int32(1)")
            frag = self.tmp("cute.make_rmem_tensor(n, Int32)")
            self.lines.append(f"{frag}.store({x})")
            frags.append(frag)
        return frags

    def table_grads(self, sm: ScoreMod, train: tuple, first: int) -> None:
        """Code that adds ``grad * d expr / d read`` for every read of the tables at positions
        ``train`` into their gradient buffers (``aux_tensors[first + k]``, float32, ``[C,
        *table shape]``: C private copies, the CTA's copy chosen by its linear block index and
        summed after the kernel), at the reads' indices; zeros (masked scores) add nothing.
        FA4 calls the hook on whole fragments in every lane (no divergence), so warp votes and
        shuffles are safe here."""
        if not train:
            return
        # CTAs running at once add into different copies: hot entries stop serializing in L2
        self.lines += ["bx, by, bz = cute.arch.block_idx()",
                       "gx, gy, _gz = cute.arch.grid_dim()",
                       "cta = Int32(bx) + Int32(gx) * (Int32(by) + Int32(gy) * Int32(bz))"]
        for k, n in enumerate(train):
            dst = f"aux_tensors[{first + k}]"
            copy = self.tmp(f"cta % Int32(cute.size({dst}.shape[0]))")
            for read, d in sm.table_reads(n):
                val = self.tmp(f"grad * {self.get(d, 'f')}")
                frags = self.index_frags(read, dst, first_dim=1)
                buf = self.tmp("cute.make_rmem_tensor(n, Float32)")
                self.lines.append(f"{buf}.store({val})")
                idx = ", ".join(f"{f}[e]" for f in frags)
                idx0 = ", ".join(f"{f}[0]" for f in frags)
                # the lane's fragment summed first: where every score of the warp's fragments
                # reads one entry (a far T5 tile, a per-head value), one add per warp and call
                acc, diff = self.tmp("Float32(0.0)"), self.tmp("Int32(0)")
                lane_diff = " | ".join(f"({f}[0] - cute.arch.shuffle_sync({f}[0], 0))"
                                       for f in frags)
                elem_diff = " | ".join(f"({f}[e] - cute.arch.shuffle_sync({f}[e], 0))"
                                       for f in frags)
                # the lanes whose element e reads the same entry (every index equal)
                peers = " & ".join(f"cute.arch.match_sync(0xFFFFFFFF, {f}[e])" for f in frags)
                self.lines += [
                    "for e in cutlass.range_constexpr(n):",
                    f"    {acc} = {acc} + {buf}[e]",
                    *(f"    {diff} = {diff} | ({f}[e] - {f}[0])" for f in frags),
                    f"if cute.arch.vote_all_sync(({diff} | {lane_diff}) == Int32(0)):",
                    f"    total = cute.arch.warp_reduction_sum({acc})",
                    "    if cute.arch.lane_idx() == Int32(0) and total != Float32(0.0):",
                    f"        atomic_add_fp32(total, elem_pointer({dst}, ({copy}, {idx0})))",
                    "else:",
                    # entry by entry: one add per distinct entry the warp reads (near a T5
                    # diagonal a lane's scores read several buckets, and lanes share them)
                    "    for e in cutlass.range_constexpr(n):",
                    f"        if cute.arch.vote_all_sync(({elem_diff}) == Int32(0)):",
                    f"            total = cute.arch.warp_reduction_sum({buf}[e])",
                    "            if cute.arch.lane_idx() == Int32(0) and total != Float32(0.0):",
                    f"                atomic_add_fp32(total, elem_pointer({dst}, ({copy}, {idx})))",
                    "        else:",
                    f"            peers = {peers}",
                    # every lane sums its group in lane order (32 shuffles); the group's lowest
                    # lane adds the sum
                    "            total = Float32(0.0)",
                    # a loop, not unrolled: this path runs on the diagonal tiles only, and 32
                    # shuffles per element unrolled made the backward 4.4x its instructions
                    "            for src in cutlass.range(32, unroll=1):",
                    f"                v = cute.arch.shuffle_sync({buf}[e], src)",
                    "                if (peers >> Uint32(src)) & Uint32(1) != Uint32(0):",
                    "                    total = total + v",
                    "            if (peers & cute.arch.lanemask_lt()) == Uint32(0) and "
                    "total != Float32(0.0):",
                    f"                atomic_add_fp32(total, elem_pointer({dst}, ({copy}, {idx})))"]


def _body(sm: ScoreMod, expr, offset: int, index_bits: bool,
          relative: bool) -> tuple[list[str], str]:
    em = _Emit(sm, offset, index_bits, relative)
    out = em.get(expr, "f")
    return em.lines, out


def _plain(expr) -> str:
    """``expr`` as text with each float at double precision: sympy's cache may hand back an
    equal Float made earlier at another precision, and the text names the program's file."""
    return sp.sstr(expr.xreplace({f: sp.Float(float(f)) for f in expr.atoms(sp.Float)}))


def score_mod_source(sm: ScoreMod, offset: int = 0, gqa: int = 1,
                     index_bits: bool = False, train: tuple = (), relative: bool = False) -> str:
    """Python source of the ``@cute.jit`` ``score_mod`` and ``score_mod_bwd`` of ``sm``, its
    tables at ``aux_tensors[offset:]``; ``gqa > 1``: for FA4's backward, whose indices come
    packed (see the module's docstring); ``index_bits``: q_idx and kv_idx are below
    INDEX_BOUND, and linear index expressions convert to float by bits (no I2F, whose
    quarter rate competes with the softmax's exp2); ``train``: the positions of the tables
    whose gradients ``score_mod_bwd`` adds into float32 buffers after the tables
    (``docs/decisions/trainable-score-tables.md``); ``relative``: ``sm.relative``'s indices
    are read from their tables (``ScoreMod.relative_table``), passed after the score_mod's
    own and before the gradient buffers."""
    head = ["    n = cute.size(score.shape)",
            "    s = score",
            "    b = batch_idx"]
    if gqa > 1:
        head += [f"    h = head_idx // Int32({gqa})",
                 f"    q = q_idx * Int32({gqa}) + head_idx % Int32({gqa})"]
    else:
        head += ["    h = head_idx", "    q = q_idx"]
    head += ["    kv = kv_idx"]
    fwd, out = _body(sm, sm.expr, offset, index_bits, relative)
    em = _Emit(sm, offset, index_bits, relative)
    dout = em.get(sm.grad, "f")
    if train:  # trainable tables: their gradients, in the backward's per-score hook
        em.table_grads(sm, train, offset + len(sm.tables) + len(em.relative))
    bwd = em.lines
    ind = "    "
    return "\n".join(
        [f"# score_mod {sm.name!r} (key {sm.key}), tables at aux_tensors[{offset}:]"
         + (f", indices packed by {gqa} query heads per kv head" if gqa > 1 else ""),
         f"# score <- {_plain(sm.expr)}",
         f"# d/dscore = {_plain(sm.grad)}",
         *([f"# gradients of tables {list(train)} added at aux_tensors"
            f"[{offset + len(sm.tables) + len(em.relative)}:]"] if train else []),
         "import cutlass", "import cutlass.cute as cute",
         "from cutlass import Float32, Int32, Uint32",
         *(["from compilemask.kernels import fa4_lib", "",
            "atomic_add_fp32 = fa4_lib.module('utils').atomic_add_fp32",
            "elem_pointer = fa4_lib.module('utils').elem_pointer"] if train else []),
         *([f"# indices read from tables over q_idx - kv_idx at aux_tensors"
            f"[{offset + len(sm.tables)}:]"] if relative and sm.relative else []),
         "", "", f"UNWRAPPED = {index_total(sm, relative)}",
         *([f"VECTOR = {TRAIN_VECTOR}"] if train else []), "", "",
         *(_I2F if index_bits else []),
         "@cute.jit",
         "def score_mod(score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):",
         *head, *[ind + line for line in fwd], f"    return {out}", "", "",
         "@cute.jit",
         "def score_mod_bwd(grad, score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info,",
         "                  aux_tensors):",
         *head, *[ind + line for line in bwd], f"    return grad * {dout}", ""])


_I2F = [
    "@cute.jit",
    "def _i2f(x):",
    "    # float(x) for |x| < 2**22: x added to the bits of 1.5 * 2**23, less 1.5 * 2**23",
    "    bits = cute.make_rmem_tensor(x.shape, Int32)",
    "    bits.store(x + Int32(0x4B400000))",
    "    return cute.recast_tensor(bits, Float32).load() - Float32(12582912.0)",
    "", ""]


def score_mod_fns(sm: ScoreMod, offset: int = 0, gqa: int = 1, index_bits: bool = False,
                  train: tuple = (), relative: bool = False):
    """``(score_mod, score_mod_bwd)`` for FA4, compiled once per (score_mod, offset, gqa,
    index_bits, trainable tables, relative)."""
    relative = relative and bool(sm.relative)

    def build():
        src = score_mod_source(sm, offset, gqa, index_bits, train, relative)
        fns = compile_predicate(src, "score_mod"), compile_predicate(src, "score_mod_bwd")
        for fn in fns:  # the source's UNWRAPPED and VECTOR (so FA4's kernel key sees them)
            setattr(fn, UNWRAPPED_ATTR, index_total(sm, relative))
        if train:
            setattr(fns[1], VECTOR_ATTR, TRAIN_VECTOR)
        return fns

    return _CACHE.get((sm.key, offset, gqa, index_bits, tuple(train), relative), build)
