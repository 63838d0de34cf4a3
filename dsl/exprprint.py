"""Print compiled sympy expressions as code. The torch printer drives the reference preprocess;
codegen/ subclasses ``ExprPrinter`` for TileLang and CuTe."""

from __future__ import annotations

import sympy as sp

from compilemask.dsl.frontend import IntBitOp

__all__ = ["ExprPrinter", "TorchPrinter", "split_floor"]


def split_floor(arg):
    """floor(arg) -> (numerator, denominator) with an integer numerator expression."""
    num, den = sp.fraction(sp.together(arg))
    if den.is_Integer and int(den) < 0:
        num, den = -num, -den
    return sp.expand(num), den


class ExprPrinter:
    """Recursive printer; subclasses override the leaf spellings. The base spells Python."""

    nary = True  # min/max of several arguments in one call (False: folded pairwise)

    def __init__(self, names: dict[str, str] | None = None):
        self.names = names or {}

    def __call__(self, e) -> str:
        return self.p(e)

    def p(self, e) -> str:
        if e is sp.true or e == sp.true:
            return self.true()
        if e is sp.false or e == sp.false:
            return self.false()
        if isinstance(e, sp.Symbol):
            return self.names.get(e.name, e.name)
        if isinstance(e, sp.Integer):
            return self.integer(int(e))
        if isinstance(e, sp.Add):
            # symbols first, the constant last: i + 1, not 1 + i
            args = sorted(e.args, key=lambda a: a.is_number)
            pos = [a for a in args if not _negative(a)]
            neg = [-a for a in args if _negative(a)]
            s = " + ".join(self.p(a) for a in pos) if pos else self.integer(0)
            for a in neg:
                s += " - " + self.atom(a)
            return f"({s})"
        if isinstance(e, sp.Mul):
            num, den = sp.fraction(e)
            if den != 1:
                # sympy drops floor() where it proves the quotient integral (min(2, 2*i) // 2):
                # the division is then exact, and floor division spells it in integers
                if e.is_integer:
                    return self.floordiv(self.p(sp.expand(num)), self.p(den))
                raise TypeError(f"non-integer product {e}")
            coeff, rest = e.as_coeff_Mul()
            if coeff == -1:
                return f"(-{self.atom(rest)})"
            return "(" + " * ".join(self.atom(a) for a in e.args) + ")"
        if isinstance(e, sp.Pow) and e.exp.is_Integer and int(e.exp) >= 1:
            return "(" + " * ".join([self.atom(e.base)] * int(e.exp)) + ")"  # j * j stays exact
        if isinstance(e, sp.floor):
            num, den = split_floor(e.args[0])
            return self.floordiv(self.p(num), self.p(den))
        if isinstance(e, sp.Mod):
            return self.mod(self.p(e.args[0]), self.p(e.args[1]))
        if isinstance(e, (sp.Min, sp.Max)):
            if self.nary:
                f = "min" if isinstance(e, sp.Min) else "max"
                return f"{f}(" + ", ".join(self.p(a) for a in e.args) + ")"
            return self.fold(self.minimum if isinstance(e, sp.Min) else self.maximum, e.args)
        if isinstance(e, sp.Abs):
            return self.abs(self.p(e.args[0]))
        if isinstance(e, sp.Piecewise):
            out = None
            for val, cond in reversed(e.args):
                out = self.p(val) if out is None else self.select(self.p(cond), self.p(val), out)
            return out
        if isinstance(e, IntBitOp):
            return self.bitop(e.op, self.p(e.args[0]), self.p(e.args[1]))
        if isinstance(e, sp.core.function.AppliedUndef):
            if len(e.args) == 2:  # a table param read at (row, column)
                return self.table(type(e).__name__, e.args[0], e.args[1])
            return self.array(type(e).__name__, e.args[0])
        if isinstance(e, (sp.Lt, sp.Le, sp.Gt, sp.Ge, sp.Eq, sp.Ne)):
            op = {sp.Lt: "<", sp.Le: "<=", sp.Gt: ">", sp.Ge: ">=", sp.Eq: "==", sp.Ne: "!="}
            lhs, rhs = e.lhs, e.rhs
            if not e.has(sp.floor, sp.Mod):
                # sympy solves a Piecewise condition into rationals (i >= 5/7): compare in
                # integers, times the positive common denominator
                num, den = sp.fraction(sp.together(lhs - rhs))
                if den != 1 and den.is_Integer and den > 0:
                    lhs, rhs = sp.expand(num), sp.Integer(0)
            return f"({self.p(lhs)} {op[type(e)]} {self.p(rhs)})"
        if isinstance(e, sp.And):
            return self.land([self.p(a) for a in e.args])
        if isinstance(e, sp.Or):
            return self.lor([self.p(a) for a in e.args])
        if isinstance(e, sp.Not):
            return self.lnot(self.p(e.args[0]))
        raise TypeError(f"cannot print {type(e).__name__}: {e}")

    def atom(self, e) -> str:
        return self.p(e)

    def fold(self, f, args):
        out = self.p(args[0])
        for a in args[1:]:
            out = f(out, self.p(a))
        return out

    # leaves: Python/torch spelling
    def true(self):
        return "True"

    def false(self):
        return "False"

    def integer(self, v):
        return str(v) if v >= 0 else f"({v})"

    def floordiv(self, a, b):
        return f"({a} // {b})"

    def mod(self, a, b):
        return f"({a} % {b})"

    def minimum(self, a, b):
        return f"min({a}, {b})"

    def maximum(self, a, b):
        return f"max({a}, {b})"

    def abs(self, a):
        return f"abs({a})"

    def select(self, c, a, b):
        return f"({a} if {c} else {b})"

    def bitop(self, op, a, b):  # & | ^ of integers
        return f"({a} {op} {b})"

    def array(self, name, index):
        return f"{name}[{self.p(index)}]"

    def table(self, name, row, col):
        return f"{name}[{self.p(row)}, {self.p(col)}]"

    def land(self, xs):
        return "(" + " and ".join(xs) + ")"

    def lor(self, xs):
        return "(" + " or ".join(xs) + ")"

    def lnot(self, x):
        return f"(not {x})"


def _negative(a) -> bool:
    c, _ = a.as_coeff_Mul()
    return c.is_number and c < 0


class TorchPrinter(ExprPrinter):
    """Vectorized torch: every name is an int64 tensor (or broadcastable); booleans are tensors.

    Per-row arrays print as the [B, Sq] tensor when subscripted by ``i`` and as a key-indexed
    view when subscripted by ``j`` (``name_j``), both prepared by the caller."""

    nary = False

    def __init__(self, names: dict[str, str] | None = None, array_prefix: str = ""):
        super().__init__(names)
        self.array_prefix = array_prefix

    def true(self):
        return "_TRUE"

    def false(self):
        return "_FALSE"

    def floordiv(self, a, b):
        return f"_fdiv({a}, {b})"

    def mod(self, a, b):
        return f"_mod({a}, {b})"

    def minimum(self, a, b):
        return f"_min({a}, {b})"

    def maximum(self, a, b):
        return f"_max({a}, {b})"

    def abs(self, a):
        return f"_abs({a})"

    def select(self, c, a, b):
        return f"_where({c}, {a}, {b})"

    def bitop(self, op, a, b):
        return f"(_t({a}) {op} _t({b}))"

    def array(self, name, index):
        if index.is_Symbol and index.name in ("i", "j"):
            return f"{self.array_prefix}{name}_{index.name}"
        raise NotImplementedError(f"per-row array {name} subscripted by {index} (only i or j)")

    def table(self, name, row, col):
        if not (row.is_Symbol and row.name == "i"):
            raise NotImplementedError(f"table {name} read at row {row} (only i)")
        return f"_table({self.array_prefix}{name}_t, {self.p(col)})"

    def land(self, xs):
        return "(" + " & ".join(xs) + ")"

    def lor(self, xs):
        return "(" + " | ".join(xs) + ")"

    def lnot(self, x):
        return f"(~{x})"


TORCH_PRELUDE = '''
import torch

def _t(x):
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, dtype=torch.bool if isinstance(x, bool) else torch.int64)

def _on(x, dev):
    # a value on dev without a host-to-device copy (a fill launch): capturable in a CUDA graph
    if isinstance(x, torch.Tensor):
        if x.device == dev:
            return x
        if x.dim() == 0 and x.device.type == "cpu":
            x = x.item()
        else:
            return x.to(dev)
    return torch.full((), x, dtype=torch.bool if isinstance(x, bool) else torch.int64,
                      device=dev)

def _fdiv(a, b):
    return torch.div(_t(a), _t(b), rounding_mode="floor")

def _mod(a, b):
    return torch.remainder(_t(a), _t(b))

def _min(a, b):
    return torch.minimum(_t(a), _t(b))

def _max(a, b):
    return torch.maximum(_t(a), _t(b))

def _abs(a):
    return torch.abs(_t(a))

def _where(c, a, b):
    return torch.where(_t(c), _t(a), _t(b))

def _table(t, c):
    # t: int64 0/1 [B, Sq, M], each row's entries; c: the columns read, on the [B, Sq, Sk] grid.
    # A column outside [0, M) reads 0.
    c = _t(c)
    B, S, M = t.shape
    c = torch.broadcast_to(c, (B, S, c.shape[-1]))
    if M == 0:
        return torch.zeros_like(c)
    got = t.gather(2, c.clamp(0, M - 1))
    return torch.where((c >= 0) & (c < M), got, 0)

_TRUE = torch.tensor(True)
_FALSE = torch.tensor(False)
'''
