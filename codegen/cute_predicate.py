"""Fallback mask predicates: sympy Boolean expression -> Python source of a ``@cute.jit`` function.

The generated function has the signature::

    @cute.jit
    def <name>(q_idx, kv_idx, <scalar params...>, <row arrays at i...>,
               row_params, batch_idx, max_row) -> Boolean

``q_idx``/``kv_idx`` are the absolute row / column of the score (Int32), the scalar params are
``params[b, p]`` in the given order (Int32, loaded once per CTA), and each per-row array
``name(i)`` is passed as its value at the current row, ``row_params[b, q_idx, r]`` (loaded once
per q tile). A per-row array indexed by anything else (``name(j)``, ``name(j - 1)``...) is read
from the ``row_params`` tensor (int32 ``[B, Sq, R]``) of sequence ``batch_idx`` at that index,
clamped into ``[0, max_row]`` (``max_row = Sq - 1``; columns past the sequence in edge tiles are
rejected by the interval test anyway).

Supported expression nodes: And / Or / Not / BooleanTrue / BooleanFalse, relationals
(<, <=, >, >=, ==, !=), integers, symbols ``i`` (q_idx), ``j`` (kv_idx) and scalar params,
``Function(name)(i)`` for per-row arrays, ``Function(name)(i, c)`` for a table param's entry
(0 or 1; see ``_table_read``), Add, Mul with integer (or rational, see below)
coefficients, non-negative integer powers, ``floor(a/b)`` (floor division; the divisor must be
positive at run time), ``Mod(a, b)`` (Python semantics, non-negative divisor), Min, Max, Abs,
and the integer bit operations ``& | ^`` (``IntBitOp``).

Rational coefficients (e.g. ``i/2 < j``) are cleared in relationals by multiplying both sides
by the (positive) common denominator; inside ``floor`` the argument is split with
``sympy.fraction(sympy.together(arg))``.
"""

from __future__ import annotations

import hashlib
import textwrap
from typing import Iterable, Sequence

import sympy

from compilemask.contract.cache import exec_verified, verified_source_file
from compilemask.dsl.frontend import IntBitOp

# on a generated mask_mod / score_mod(_bwd) whose reads are clamped (a mask_mod: which is also
# False for every key past seqlen_k; a score_mod: whose value is finite at any index): FA4 need
# not wrap its indices, nor test a mask_mod's keys (kernels/fa4_unwrap.py)
UNWRAPPED_ATTR = "__compilemask_unwrapped__"
# on a generated score_mod_bwd that adds a trained table's gradient: the scores per call it
# wants from FA4 (which hands one per call when a call has aux tensors), so that its warp sums
# and adds are shared by that many scores (kernels/fa4_unwrap.py)
VECTOR_ATTR = "__compilemask_vector__"

__all__ = ["predicate_source", "compile_predicate", "source_hash", "UnsupportedExpression"]


class UnsupportedExpression(ValueError):
    pass


_REL_OPS = {
    sympy.StrictLessThan: "<",
    sympy.LessThan: "<=",
    sympy.StrictGreaterThan: ">",
    sympy.GreaterThan: ">=",
    sympy.Equality: "==",
    sympy.Unequality: "!=",
}


class _Emitter:
    """Turns sympy nodes into straight-line SSA Python code over cutlass Int32 / Boolean values."""

    def __init__(self, scalar_params: Sequence[str], array_params: Sequence[str],
                 table_params: Sequence[str] = ()):
        self.scalar_params = list(scalar_params)
        self.array_params = list(array_params)
        self.table_params = list(table_params)
        self.lines: list[str] = []
        self.cache: dict[sympy.Basic, str] = {}
        self.n = 0

    def tmp(self, code: str) -> str:
        name = f"t{self.n}"
        self.n += 1
        self.lines.append(f"{name} = {code}")
        return name

    # ---- integer expressions -------------------------------------------------------------
    def int_expr(self, e: sympy.Basic) -> str:
        e = sympy.sympify(e)
        if e in self.cache:
            return self.cache[e]
        out = self._int_expr(e)
        self.cache[e] = out
        return out

    def _int_expr(self, e: sympy.Basic) -> str:
        if e.is_Integer:
            return self.tmp(f"cutlass.Int32({int(e)})")
        if e.is_Rational:
            raise UnsupportedExpression(f"non-integer constant {e} outside floor / relational")
        if isinstance(e, sympy.Symbol):
            if e.name == "i":
                return "q_idx"
            if e.name == "j":
                return "kv_idx"
            if e.name in self.scalar_params:
                return f"p_{e.name}"
            raise UnsupportedExpression(f"unknown symbol {e.name!r}")
        if isinstance(e, sympy.Function) and type(e).__name__ in self.table_params:
            return self._table_read(e)
        if isinstance(e, sympy.Function) and type(e).__name__ in self.array_params:
            name = type(e).__name__
            if len(e.args) != 1:
                raise UnsupportedExpression(f"per-row array {e} takes one index")
            arg = e.args[0]
            if isinstance(arg, sympy.Symbol) and arg.name == "i":
                return f"a_{name}"  # loaded once per row by the kernel
            # any other index (typically j): a load from row_params[b, idx, r], the index
            # clamped into [0, max_row] (edge tiles evaluate columns past the sequence)
            idx = self.int_expr(arg)
            if not (isinstance(arg, sympy.Symbol) and arg.name == "j"):
                idx = self.tmp(f"cutlass.max({idx}, cutlass.Int32(0))")
            idx = self.tmp(f"cutlass.min({idx}, max_row)")
            r = self.array_params.index(name)
            return self.tmp(f"row_params[batch_idx, {idx}, {r}]")
        if isinstance(e, sympy.Add):
            num, den = sympy.fraction(sympy.together(e))
            if den != 1:
                raise UnsupportedExpression(f"rational expression {e} outside floor / relational")
            args = [self.int_expr(a) for a in e.args]
            acc = args[0]
            for a in args[1:]:
                acc = self.tmp(f"{acc} + {a}")
            return acc
        if isinstance(e, sympy.Mul):
            coeff, rest = e.as_coeff_Mul()
            if not coeff.is_Integer and e.is_integer:
                # an exact quotient (sympy dropped a floor it proved redundant): no rounding issue
                num, den = sympy.fraction(e)
                a = self.int_expr(sympy.expand(num))
                return self.tmp(f"{a} // {self.int_expr(den)}")
            if not coeff.is_Integer:
                raise UnsupportedExpression(f"non-integer coefficient in {e}")
            factors = [self.int_expr(a) for a in sympy.Mul.make_args(rest)]
            acc = factors[0]
            for f in factors[1:]:
                acc = self.tmp(f"{acc} * {f}")
            if coeff != 1:
                acc = self.tmp(f"{acc} * cutlass.Int32({int(coeff)})")
            return acc
        if isinstance(e, sympy.Pow):
            base, ex = e.args
            if not (ex.is_Integer and int(ex) >= 0):
                raise UnsupportedExpression(f"power {e}")
            b = self.int_expr(base)
            acc = self.tmp("cutlass.Int32(1)")
            for _ in range(int(ex)):
                acc = self.tmp(f"{acc} * {b}")
            return acc
        if isinstance(e, sympy.floor):
            num, den = sympy.fraction(sympy.together(e.args[0]))
            a = self.int_expr(sympy.expand(num))
            if den == 1:
                return a
            b = self.int_expr(sympy.expand(den))
            # floor(a / b) for b > 0, independent of the hardware's division/remainder rounding:
            # m = ((a % b) + b) % b is the non-negative remainder; (a - m) is a multiple of b.
            m = self.tmp(f"(({a} % {b}) + {b}) % {b}")
            return self.tmp(f"({a} - {m}) // {b}")
        if isinstance(e, sympy.ceiling):
            return self.int_expr(-sympy.floor(-e.args[0]))
        if isinstance(e, sympy.Mod):
            a = self.int_expr(e.args[0])
            b = self.int_expr(e.args[1])
            return self.tmp(f"(({a} % {b}) + {b}) % {b}")
        if isinstance(e, (sympy.Min, sympy.Max)):
            fn = "cutlass.min" if isinstance(e, sympy.Min) else "cutlass.max"
            args = [self.int_expr(a) for a in e.args]
            acc = args[0]
            for a in args[1:]:
                acc = self.tmp(f"{fn}({acc}, {a})")
            return acc
        if isinstance(e, sympy.Abs):
            a = self.int_expr(e.args[0])
            neg = self.tmp(f"cutlass.Int32(0) - {a}")
            return self.tmp(f"cutlass.max({a}, {neg})")
        if isinstance(e, IntBitOp):  # two's complement Int32, as torch's int64 below 2**31
            a, b = self.int_expr(e.args[0]), self.int_expr(e.args[1])
            return self.tmp(f"{a} {e.op} {b}")
        if isinstance(e, sympy.Piecewise):
            raise UnsupportedExpression("Piecewise is not supported")
        raise UnsupportedExpression(f"unsupported integer node {type(e).__name__}: {e}")

    def _table_read(self, e) -> str:
        """Entry ``c`` of the row's table: bit ``c % 32`` of ``row_params[b, q_idx, R + c //
        32]``, 0 outside the table's words; integer operations only (sign bits for the range),
        so the predicate stays straight-line."""
        row, col = e.args
        if not (isinstance(row, sympy.Symbol) and row.name == "i"):
            raise UnsupportedExpression(f"table {e} read at a row other than i")
        base = len(self.array_params)
        c = self.int_expr(col)
        nw = self.tmp(f"cute.size(row_params, mode=[2]) - cutlass.Int32({base})")
        last = self.tmp(f"{nw} * cutlass.Int32(32) - cutlass.Int32(1)")
        below = self.tmp(f"({c} >> cutlass.Int32(31)) & cutlass.Int32(1)")
        above = self.tmp(f"(({last} - {c}) >> cutlass.Int32(31)) & cutlass.Int32(1)")
        cc = self.tmp(f"cutlass.max(cutlass.min({c}, {last}), cutlass.Int32(0))")
        word = self.tmp(f"row_params[batch_idx, q_idx, (({cc}) >> cutlass.Int32(5)) + "
                        f"cutlass.Int32({base})]")
        bit = self.tmp(f"({word} >> ({cc} & cutlass.Int32(31))) & cutlass.Int32(1)")
        return self.tmp(f"{bit} & (cutlass.Int32(1) - ({below} | {above}))")

    # ---- boolean expressions -------------------------------------------------------------
    def bool_expr(self, e: sympy.Basic) -> str:
        if e in self.cache:
            return self.cache[e]
        out = self._bool_expr(e)
        self.cache[e] = out
        return out

    def _bool_expr(self, e: sympy.Basic) -> str:
        if e is sympy.true or e == sympy.true:
            return self.tmp("cutlass.Boolean(True)")
        if e is sympy.false or e == sympy.false:
            return self.tmp("cutlass.Boolean(False)")
        if isinstance(e, sympy.And):
            args = [self.bool_expr(a) for a in e.args]
            acc = args[0]
            for a in args[1:]:
                acc = self.tmp(f"{acc} & {a}")
            return acc
        if isinstance(e, sympy.Or):
            args = [self.bool_expr(a) for a in e.args]
            acc = args[0]
            for a in args[1:]:
                acc = self.tmp(f"{acc} | {a}")
            return acc
        if isinstance(e, sympy.Not):
            a = self.bool_expr(e.args[0])
            return self.tmp(f"{a} == cutlass.Boolean(False)")
        if isinstance(e, (sympy.Xor,)):
            args = [self.bool_expr(a) for a in e.args]
            acc = args[0]
            for a in args[1:]:
                acc = self.tmp(f"{acc} != {a}")
            return acc
        if type(e) in _REL_OPS:
            op = _REL_OPS[type(e)]
            divisible = self._divisible(e)
            if divisible is not None:
                return divisible
            diff = sympy.together(e.lhs - e.rhs)
            num, den = sympy.fraction(diff)
            if den != 1:
                # clear denominators: only safe when the denominator is a positive constant
                if not (den.is_number and den > 0):
                    raise UnsupportedExpression(f"non-constant denominator in relational {e}")
            lhs, rhs = self._split_sides(sympy.expand(num))
            a = self.int_expr(lhs)
            b = self.int_expr(rhs)
            return self.tmp(f"{a} {op} {b}")
        raise UnsupportedExpression(f"unsupported boolean node {type(e).__name__}: {e}")

    def _divisible(self, e) -> str | None:
        """``Mod(a, b) == 0`` (or ``!=``): any remainder is 0 exactly when the floor one is, so
        no sign fix-up; a power-of-two constant divisor is a bit test."""
        if type(e) not in (sympy.Equality, sympy.Unequality):
            return None
        mod, zero = (e.lhs, e.rhs) if isinstance(e.lhs, sympy.Mod) else (e.rhs, e.lhs)
        if not isinstance(mod, sympy.Mod) or zero != 0:
            return None
        op = _REL_OPS[type(e)]
        a, b = mod.args
        if b.is_Integer and b > 0 and (int(b) & (int(b) - 1)) == 0:
            x = self.int_expr(a)
            r = self.tmp(f"{x} & cutlass.Int32({int(b) - 1})")
        else:
            r = self.tmp(f"{self.int_expr(a)} % {self.int_expr(b)}")
        return self.tmp(f"{r} {op} cutlass.Int32(0)")

    @staticmethod
    def _split_sides(expr: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
        """``expr (op) 0`` -> ``pos (op) neg`` with non-negative coefficients on each side."""
        pos, neg = [], []
        for term in sympy.Add.make_args(expr):
            c, _ = term.as_coeff_Mul()
            (neg if c < 0 else pos).append(term)
        lhs = sympy.Add(*pos) if pos else sympy.Integer(0)
        rhs = -sympy.Add(*neg) if neg else sympy.Integer(0)
        return lhs, rhs


def predicate_source(
    expr: sympy.Basic,
    scalar_params: Iterable[str] = (),
    array_params: Iterable[str] = (),
    name: str = "fallback_predicate",
    table_params: Iterable[str] = (),
) -> str:
    """Python source (with imports) of a ``@cute.jit`` predicate ``name(q_idx, kv_idx, ...)``;
    a table param is read from ``row_params`` after the arrays (``pack_table``'s words)."""
    scalar_params = list(scalar_params)
    array_params = list(array_params)
    em = _Emitter(scalar_params, array_params, list(table_params))
    result = em.bool_expr(sympy.sympify(expr))
    args = (
        ["q_idx", "kv_idx"]
        + [f"p_{p}" for p in scalar_params]
        + [f"a_{a}" for a in array_params]
        + ["row_params", "batch_idx", "max_row"]
    )
    body = "\n".join(em.lines + [f"return {result}"])
    return (
        "import cutlass\nimport cutlass.cute as cute\n\n\n"
        f"# generated from: {sympy.sstr(expr)}\n"
        "@cute.jit\n"
        f"def {name}({', '.join(args)}):\n" + textwrap.indent(body, "    ") + "\n"
    )


def source_hash(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def compile_predicate(src: str, name: str = "fallback_predicate"):
    """Write the generated source to a cache file (checked against ``src``), run ``src`` as a
    module, return the ``@cute.jit`` function.

    (A real file, not a bare ``exec``: the DSL's AST preprocessor reads the function's source.)
    """
    mod_name = f"cm_pred_{source_hash(src)}"
    path = verified_source_file("predicates", mod_name + ".py", src)
    mod = exec_verified(src, path, mod_name)
    fn = getattr(mod, name)
    # flash-attn-4 keys its compiled kernels by the hash of this one function's source, which
    # does not see the generated functions it calls (two masks' mask_mods can read the same):
    # the whole module's code (comments aside, so masks whose code is equal share) is the key
    code = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("#"))
    full = hashlib.sha256(code.encode()).hexdigest()
    for f in (fn, getattr(fn, "__wrapped__", None)):
        if f is not None:
            f.__cute_hash__ = full
    return fn
