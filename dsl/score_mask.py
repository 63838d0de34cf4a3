"""A score_mod's -inf as a mask: ``torch.where(cond, score, -float("inf"))`` is a masked score,
so ``from_mask_mod(mask_mod, score_mod=fn)`` converts ``mask_mod(...) & cond``, and the GPU
engines run the score_mod's finite value on that mask (``ScoreMod.mask``: where it is finite).

``cond`` is read from the compiled score_mod (``compilemask.dsl.score_mod``) and rebuilt on the
mask_mod reader's traced values, so it converts by the same rules as a mask_mod written with it
(a table it reads becomes metadata as a captured tensor does); a condition the mask_mod reader
cannot read (one on floats, on the score) is refused naming the score_mod and the rewrite."""

from __future__ import annotations

import sympy as sp
import torch

from compilemask.dsl.score_mod import SCORE, fdiv, log2, tofloat, trunc

__all__ = ["rebuild_condition"]

def rebuild_condition(cond, env: dict, tables: dict, fail):
    """``cond`` (a sympy boolean of the score_mod reader) computed with traced values: ``env``
    maps the index symbols (b, h, i, j) to the mask_mod reader's, ``tables`` a table's name to
    its stand-in; ``fail(what)`` makes the error for what the mask cannot read."""

    def ev(e):
        if e in env:
            return env[e]
        if e is sp.true or e == sp.true:
            return True
        if e is sp.false or e == sp.false:
            return False
        if e == SCORE or SCORE in getattr(e, "free_symbols", ()):
            raise fail("its -inf condition reads the score (a mask does not see it)")
        if e.is_Integer:
            return int(e)
        if e.is_Number or isinstance(e, (tofloat, fdiv, log2, trunc)):
            raise fail(f"its -inf condition computes with floats ({e}), which a mask does not")
        if isinstance(e, sp.core.function.AppliedUndef):
            t = tables[type(e).__name__]
            args = tuple(ev(a) for a in e.args)
            return t[args if len(args) > 1 else args[0]]
        args = [ev(a) for a in e.args]
        if isinstance(e, sp.Add):
            out = args[0]
            for a in args[1:]:
                out = out + a
            return out
        if isinstance(e, sp.Mul):
            num, den = sp.fraction(e)
            if den != 1:
                raise fail(f"its -inf condition divides ({e}); compare before dividing")
            out = args[0]
            for a in args[1:]:
                out = out * a
            return out
        if isinstance(e, sp.Pow) and e.args[1].is_Integer and int(e.args[1]) > 0:
            out = args[0]
            for _ in range(int(e.args[1]) - 1):
                out = out * args[0]
            return out
        if isinstance(e, sp.floor):
            num, den = sp.fraction(sp.together(e.args[0]))
            if not (num.is_integer and den.is_integer):
                raise fail(f"its -inf condition rounds a float ({e})")
            return ev(num) // ev(den)
        if isinstance(e, sp.Mod):
            return args[0] % args[1]
        if isinstance(e, sp.Abs):
            return abs(args[0])
        if isinstance(e, (sp.Min, sp.Max)):
            f = torch.minimum if isinstance(e, sp.Min) else torch.maximum
            out = args[0]
            for a in args[1:]:
                out = f(out, a)
            return out
        if isinstance(e, sp.Piecewise):
            out = ev(e.args[-1][0])
            for val, c in reversed(e.args[:-1]):
                out = torch.where(ev(c), ev(val), out)
            return out
        rel = {sp.Lt: "__lt__", sp.Le: "__le__", sp.Gt: "__gt__", sp.Ge: "__ge__",
               sp.Eq: "__eq__", sp.Ne: "__ne__"}
        for k, op in rel.items():
            if isinstance(e, k):
                a, b = args
                if isinstance(a, (int, bool)):  # a constant on the left: the mirrored test
                    a, b, op = b, a, {"__lt__": "__gt__", "__le__": "__ge__", "__gt__": "__lt__",
                                      "__ge__": "__le__"}.get(op, op)
                return getattr(a, op)(b)
        if isinstance(e, (sp.And, sp.Or, sp.Xor)):
            out = args[0]
            for a in args[1:]:
                out = (out & a if isinstance(e, sp.And) else out | a if isinstance(e, sp.Or)
                       else out ^ a)
            return out
        if isinstance(e, sp.Not):
            return ~args[0] if not isinstance(args[0], bool) else not args[0]
        raise fail(f"its -inf condition holds {type(e).__name__} ({e}), which a mask does not "
                   "read")

    return ev(cond)
