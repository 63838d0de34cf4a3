"""Print compiled sympy endpoints, guards and conditions as TileLang (``T.*``) expressions.

Every integer quantity is int64 in the generated program (metadata buffers are int64, the row
index ``i`` is an int64 local), so sums of params cannot overflow before the clip to
``[0, seqlen_k)``, exactly like the torch reference (which computes in int64).

Floor division and modulo print as ``T.floordiv`` / ``T.floormod``: TIR defines them with
Python's floor semantics, exact for negative numerators (``i - hist_end`` can be negative); both
the CUDA and the C code generators lower them with the sign correction, never as C truncation.
"""

from __future__ import annotations

from compilemask.dsl.exprprint import ExprPrinter

__all__ = ["TileLangPrinter"]


class TileLangPrinter(ExprPrinter):
    """``names`` maps sympy symbol names to code (e.g. ``hist_end`` -> ``hist_end[b]``);
    ``arrays`` maps a per-row array name to its buffer expression indexed by the row."""

    nary = False

    def __init__(self, names: dict[str, str] | None = None, arrays: dict[str, str] | None = None):
        super().__init__(names)
        self.arrays = arrays or {}

    def floordiv(self, a, b):
        return f"T.floordiv({a}, {b})"

    def mod(self, a, b):
        return f"T.floormod({a}, {b})"

    def minimum(self, a, b):
        return f"T.min({a}, {b})"

    def maximum(self, a, b):
        return f"T.max({a}, {b})"

    def abs(self, a):
        return f"T.abs({a})"

    def select(self, c, a, b):
        return f"T.if_then_else({c}, {a}, {b})"

    def bitop(self, op, a, b):  # in int64, as the endpoints are
        fn = {"&": "bitwise_and", "|": "bitwise_or", "^": "bitwise_xor"}[op]
        return f'T.{fn}(T.Cast("int64", {a}), T.Cast("int64", {b}))'

    def array(self, name, index):
        if index.is_Symbol and index.name == "i":
            return self.arrays.get(name, f"{name}[b, row]")
        raise NotImplementedError(
            f"per-row array {name} subscripted by {index}: the preprocess reads arrays at row i "
            "only")

    def land(self, xs):
        out = xs[0]
        for x in xs[1:]:
            out = f"T.And({out}, {x})"
        return out

    def lor(self, xs):
        out = xs[0]
        for x in xs[1:]:
            out = f"T.Or({out}, {x})"
        return out

    def lnot(self, x):
        return f"T.Not({x})"
