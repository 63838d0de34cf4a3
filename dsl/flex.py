"""``from_mask_mod``: a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` -> ``(MaskSpec, meta)``.

The mask_mod runs once on symbolic stand-ins: ``q_idx`` and ``kv_idx`` become the rule's ``i`` and
``j``, and every tensor it captures (closure cells, globals, tuples/lists/dicts of them, through
nested mask_mods such as ``and_masks``/``or_masks``) is replaced by a stand-in that records how it
is indexed:

* ``t[b]`` (``t`` of shape ``[B]``) or a 0-d ``t``: a per-sequence scalar param;
* ``t[b, q_idx]`` / ``t[q_idx]`` (``[B, S]`` or ``[S]``): a per-row array read at ``i``;
* ``t[b, kv_idx]`` / ``t[kv_idx]``: the same array read at ``j`` (exact, through the fallback
  predicate or, for ``t[i] == t[j]``, a run interval);
* ``s[t[q_idx]]`` / ``s[b, t[b, q_idx]]``, and any index computed from one of ``q_idx`` /
  ``kv_idx`` with constants, per-sequence values and arrays read at it (``t[kv_idx // 16]``,
  ``s[u[t[q_idx]] + 1]``): a gathered per-row array (``s_at_t``, ``t_at_index``), computed in
  torch with the metadata by torch's indexing rules, read where its index is;
* ``t[x][c]`` / ``t[x, c]`` of a ``[n, m]`` table (``c`` a constant, ``x`` such an index): column
  ``c`` gathered the same way (Flamingo's per-image intervals);
* a constant index (``t[b, 3]``, ``t[0]``, or the head under ``from_mask_mod_heads``:
  ``w[h]``, ``t[b, h, q_idx]``) selects that entry of its dimension first, then reads as above.

Captured values are integers of either sign: nothing read from them folds away at conversion
(``t[q_idx] >= 0`` keeps ``t``, whose negative entries preprocess refuses as any metadata's;
``s[t[q_idx].clamp(min=0)]`` keeps its clamp; a gather's index reads as torch's indexing does).
A uint8/int8/int16 value computes in its dtype in torch: comparisons, selections, ``& | ^`` and
``// % >>`` by a positive constant are exact and kept, while ``+ - * << ~``, negation and a
``.to`` that truncates are refused (``.long()`` first), as is a constant outside the dtype. A
table read at a column that may be negative (torch counts it from the end) is refused unless the
mask does not depend on the read there (``(kv_idx >= p) & anc[q_idx, kv_idx - p]``) or it is
clamped. In-place operators (``x += 2``) are refused: torch would update ``q_idx`` itself.

Python ints (captured or global) are compile-time constants. The operations read are
``& | ^ ~`` (of booleans and of integers), ``>> <<`` by constants, comparisons,
``+ - * // %``, ``abs``/``.abs()``, ``.clamp``, ``torch.where``, ``torch.minimum/maximum`` and
the ``torch.logical_*`` functions. The head index ``h`` is read by ``from_mask_mod_heads``
(one spec per head, ``h`` a constant in each: ``h < 2``, ``w[h]``). Data-dependent Python
control flow and anything else are a NotImplementedError naming the construct and the source
line. The translated rule is generated Python source (``mask.explain()`` shows it),
split into one region per case of its row conditions (``torch.where(q_idx < n, ...)``): fewer
interval slots than one region holding every case.

The conversion is cached by everything the mask_mod reads apart from tensor values (code,
constants, defaults, attributes of captured objects: ``compilemask.dsl.fingerprint``), so calling it
again for a rebuilt mask_mod (same code, new tensors) only collects the new tensors, and a changed
value converts again. What cannot be keyed (the object itself passed on, a property) converts on
every call.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import itertools
import os
import types
from dataclasses import dataclass

import sympy as sp
import torch

from compilemask.contract.log import say_once
from compilemask.contract.lru import LRU, register_source
from compilemask.dsl import tracing
from compilemask.dsl.exprprint import TORCH_PRELUDE, ExprPrinter, TorchPrinter
from compilemask.dsl.fingerprint import Uncacheable as _Uncacheable
from compilemask.dsl.fingerprint import Walk as _Walk
from compilemask.dsl.frontend import (
    array_function,
    bool_xor,
    boolean_basis,
    int_bit_op,
    shift,
    table_function,
)
from compilemask.dsl.score_mask import rebuild_condition
from compilemask.dsl.score_mod import _B, _H, score_mod_mask
from compilemask.dsl.spec import RESERVED_NAMES, MaskSpec, Region
from compilemask.dsl.tracing import KV_INDEX as _J
from compilemask.dsl.tracing import Q_INDEX as _I
from compilemask.dsl.tracing import RELATIONS as _REL
from compilemask.dsl.tracing import TracedOps, user_line

__all__ = ["from_mask_mod", "from_mask_mod_heads"]

_X = sp.Symbol("_x", integer=True, nonnegative=True)  # the index variable of a gather's recipe
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.abspath(__file__)
_TRACING = os.path.abspath(tracing.__file__)
_COUNTER = itertools.count()


_CAPTURE_IT = ("make it a variable outside the mask_mod (t = module.t, or build it there) and "
               "read that: a captured tensor becomes metadata")


def _every_row(i):
    return True


# dtypes narrower than int32: torch computes a value of one of them (with Python ints or values
# of the same dtype) in that dtype, wrapping where the rules' unbounded integers would not
_NARROW = (torch.uint8, torch.int8, torch.int16)


# --------------------------------------------------------------------------------------------
# symbolic stand-ins
# --------------------------------------------------------------------------------------------


def _is_bool(e) -> bool:
    return isinstance(e, (sp.logic.boolalg.Boolean, sp.core.relational.Relational)) and not (
        isinstance(e, sp.Symbol))


class _Trace:
    def __init__(self, fname: str):
        self.fname = fname
        self.stand_ins: dict[int, _Captured] = {}
        self.used_names: set[str] = set()
        # gathered array -> (source leaf, source ndim, index expression in _X)
        self.derived: dict[str, tuple] = {}
        self.gathers: dict[tuple, str] = {}  # the inverse: one array per (source, index)
        self.array_leaf: dict[str, int] = {}  # array param -> leaf
        self.scalar_leaf: dict[str, int] = {}  # scalar param -> leaf
        self.array_ndim: dict[str, int] = {}
        self.shape_deps: dict[tuple, int] = {}  # (leaf, dim) -> the size the rules assumed
        self.table_reads: list = []  # (table read, its column, the user's line)

    def fail(self, what: str):
        return NotImplementedError(f"mask_mod {self.fname!r} ({user_line(__file__)}): {what}")

    def fresh(self, name: str) -> str:
        base = name if name.isidentifier() else "t"
        out = base
        while (out in self.used_names or out in RESERVED_NAMES or hasattr(builtins, out)
               or out in ("b", "h")):
            out += "_"
        self.used_names.add(out)
        return out

    def new_stand_in(self, leaf, name, tensor):
        c = _Captured(self, leaf, self.fresh(name), tensor)
        self.stand_ins[leaf] = c
        return c

    def stand_in(self, leaf):
        return self.stand_ins[leaf]


class _Ops(TracedOps):
    """Operators shared by traced values and captured tensors (Python and torch spellings)."""

    __slots__ = ()
    UNCAPTURED = ("a tensor that is not captured by the mask_mod as a closure variable or "
                  "global (an attribute, or one made inside it) in '{name}'; " + _CAPTURE_IT)

    def __getattr__(self, name):
        if name.startswith("_") or name in ("tr", "e", "tag", "dt", "leaf", "name", "ndim",
                                            "is_bool"):
            raise AttributeError(name)
        raise self.tr.fail(f"tensor method or attribute '.{name}'")

    @property
    def device(self):
        return _TracedDevice(self.tr)


class _TracedDevice:
    """``x.device`` of a traced value: passed on to ``new_ones(..., device=)`` and the like (as
    FlexAttention's ``noop_mask`` does), where it does not change the mask; reading it is refused
    rather than answered with a guessed device."""

    __slots__ = ("tr",)

    def __init__(self, tr):
        self.tr = tr

    def _refuse(self, *_):
        raise self.tr.fail("the device of a traced value read (a mask_mod may only pass "
                           "x.device on to new_ones/new_zeros/new_full/new_tensor/*_like)")

    __eq__ = __ne__ = __bool__ = __str__ = _refuse
    __hash__ = object.__hash__

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    def __repr__(self):
        return "<device of a traced value>"


def _val(tr, x):
    """An operand as a sympy expression."""
    if isinstance(x, _Captured):
        return x.scalar()
    if isinstance(x, _Sym):
        if x.tag == "h":
            raise tr.fail("the head index h: from_mask_mod_heads(mask_mod, num_heads=H) gives "
                          "one spec per head (h a constant in each), for preprocess_heads")
        if x.tag == "b":
            raise tr.fail("the batch index b outside indexing a captured tensor (write t[b])")
        return x.e
    if isinstance(x, bool):
        return sp.true if x else sp.false
    if isinstance(x, int):
        return sp.Integer(x)
    if isinstance(x, torch.Tensor):
        raise tr.fail("a tensor that is not captured by the mask_mod as a closure variable or "
                      f"global (an attribute, or one made inside it); {_CAPTURE_IT}")
    if isinstance(x, float):
        raise tr.fail(f"float constant {x!r} (only ints)")
    if isinstance(x, sp.Basic):  # already converted (torch.logical_* convert their operands)
        return x
    raise tr.fail(f"value of type {type(x).__name__}")


def _result_dtype(tr, what, operands, wraps=False):
    """torch's dtype of an integer operation on ``operands`` where it is narrower than int32
    (every traced operand narrow), else None. Python ints take that dtype (torch casts them to
    it): refused where they do not fit it, as is an operation that can leave its range
    (``wraps``: + - * << ~ and negation), since torch wraps there and the rules do not."""
    traced = [x for x in operands if isinstance(x, _Sym)]
    if not traced or any(x.dt is None for x in traced):
        return None
    dt = functools.reduce(torch.promote_types, [x.dt for x in traced])
    info = torch.iinfo(dt)
    for c in operands:
        if isinstance(c, int) and not info.min <= c <= info.max:
            raise tr.fail(f"the constant {c} with a {dt} value in '{what}': torch casts it to "
                          f"{dt}, wrapping it; convert the value first (.long())")
    if wraps:
        raise tr.fail(f"'{what}' of a {dt} value: torch computes it in {dt}, which wraps where "
                      "the mask's integers do not; convert it first (.long() or "
                      ".to(torch.int64))")
    return dt


def _op_dtype(tr, op, a, b):
    """The narrow dtype of ``a op b`` (see ``_result_dtype``), refusing what wraps in it."""
    if op in ("+", "-", "*", "<<"):
        return _result_dtype(tr, op, (a, b), wraps=True)
    dt = _result_dtype(tr, op, (a, b))
    if op in _REL:
        return None  # a bool: the operands promote exactly
    if dt is not None and op in ("//", "%", ">>") and not (
            type(b) is int and (b >= 0 if op == ">>" else b > 0)):
        # in range only by a constant (int8 -128 // -1 wraps)
        raise tr.fail(f"'{op}' of a {dt} value by a value that is not a positive constant: "
                      "torch computes it in that dtype; convert it first (.long())")
    return dt


def _abs_dtype(tr, x):
    dt = _result_dtype(tr, "abs", (x,))
    if dt is not None and dt.is_signed:
        _result_dtype(tr, "abs", (x,), wraps=True)  # abs(-128) is -128 in int8
    return dt


def _gather_var(tr, x):
    """``i`` or ``j`` when the index ``x`` is computed from that one index variable, constants,
    per-sequence scalars and arrays read at it; else None."""
    if not isinstance(x, sp.Expr) or _is_bool(x):
        return None
    at = x.free_symbols & {_I, _J}
    if len(at) != 1:
        return None
    v = at.pop()
    arrays = x.atoms(sp.core.function.AppliedUndef)
    if any(a.args != (v,) for a in arrays):
        return None
    if any(s.name not in tr.scalar_leaf for s in x.free_symbols - {v}):
        return None
    return v


def _int(tr, e, what):
    if _is_bool(e):
        raise tr.fail(f"a boolean used in arithmetic ('{what}'); convert with .to(torch.int64)")
    return e


def _bool(tr, e, what):
    if not _is_bool(e):
        raise tr.fail(f"an integer used as a boolean ('{what}'); compare it explicitly")
    return e


def _divisor(tr, e, what):
    if e.is_Integer and int(e) > 0:
        return e
    if e.is_Symbol and e not in (_I, _J):
        return e
    raise tr.fail(f"divisor {e} of '{what}' (a positive int or a per-sequence scalar t[b])")


def _arith(tr, op, a, b):
    a, b = _int(tr, _val(tr, a), op), _int(tr, _val(tr, b), op)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "//":
        return sp.floor(a / _divisor(tr, b, op))
    if op == "%":
        return sp.Mod(a, _divisor(tr, b, op))
    if op in (">>", "<<"):
        out = shift(op, a, b)
        if isinstance(out, str):
            raise tr.fail(out)
        return out
    raise AssertionError(op)


def _compare(tr, op, a, b):
    a, b = _val(tr, a), _val(tr, b)
    if _is_bool(a) or _is_bool(b):
        if op in ("==", "!=") and _is_bool(a) and _is_bool(b):
            same = sp.Or(sp.And(a, b), sp.And(sp.Not(a), sp.Not(b)))
            return same if op == "==" else sp.Not(same)
        # torch compares a boolean as the integer 0 or 1 (BD3-LM's ``x0_flag_q == 1``): one
        # case per value of each boolean side
        def cases(x):
            return ((x, sp.Integer(1)), (sp.Not(x), sp.Integer(0))) if _is_bool(x) else (
                (sp.true, x),)
        return sp.Or(*(sp.And(ca, cb, _REL[op](va, vb))
                       for ca, va in cases(a) for cb, vb in cases(b)))
    return _REL[op](a, b)


def _logic(tr, op, a, b):
    a, b = _val(tr, a), _val(tr, b)
    if not _is_bool(a) and not _is_bool(b):  # integers: the bit operation
        return int_bit_op(op, a, b)
    if not (_is_bool(a) and _is_bool(b)):
        raise tr.fail(f"'{op}' of a boolean and an integer")
    if op == "&":
        return sp.And(a, b)
    if op == "|":
        return sp.Or(a, b)
    return bool_xor(a, b)


def _select(tr, c, a, b):
    c = _bool(tr, _val(tr, c), "where")
    a, b = _val(tr, a), _val(tr, b)
    if _is_bool(a) and _is_bool(b):
        return sp.Or(sp.And(c, a), sp.And(sp.Not(c), b))
    if _is_bool(a) or _is_bool(b):
        raise tr.fail("torch.where mixing booleans and integers")
    return sp.Piecewise((a, c), (b, True))


def _clamp(tr, x, lo=None, hi=None):
    e = _int(tr, _val(tr, x), "clamp")
    if lo is not None:
        e = sp.Max(e, _int(tr, _val(tr, lo), "clamp"))
    if hi is not None:
        e = sp.Min(e, _int(tr, _val(tr, hi), "clamp"))
    return e


def _to_int(tr, x):
    e = _val(tr, x)
    return sp.Piecewise((1, e), (0, True)) if _is_bool(e) else e


def _to_bool(tr, x):
    e = _val(tr, x)
    return e if _is_bool(e) else sp.Ne(e, 0)


def _convert(tr, x, dtype):
    if dtype is torch.bool:
        return _Sym(tr, _to_bool(tr, x))
    if isinstance(dtype, torch.dtype) and not dtype.is_floating_point and not dtype.is_complex:
        if dtype in _NARROW:
            src = torch.bool if _is_bool_value(x) else (x.dt or torch.int64)
            if torch.promote_types(src, dtype) != dtype:
                raise tr.fail(f".to({dtype}) of a {src} value: torch truncates it to {dtype}, "
                              "wrapping where the mask's integers do not (compute and compare "
                              "in int64)")
            return _Sym(tr, _to_int(tr, x), dt=dtype)
        return _Sym(tr, _to_int(tr, x))
    raise tr.fail(f"conversion to {dtype}")


def _is_bool_value(x) -> bool:
    """Whether a traced value is a bool tensor (what torch's ``*_like`` / ``new_*`` inherit)."""
    if isinstance(x, _Captured):
        return x.is_bool
    return isinstance(x, _Sym) and x.tag is None and _is_bool(x.e)


def _const_like(tr, like, value, dtype=None):
    """A constant as ``like.new_full((), value, dtype=dtype)`` makes it: without a dtype it has
    ``like``'s (bool or integer), and the value is converted to that dtype."""
    if dtype is None:
        dtype = (torch.bool if _is_bool_value(like) else
                 (like.dt if isinstance(like, _Sym) else None) or torch.int64)
    if dtype is torch.bool and isinstance(value, (bool, int)):
        return _Sym(tr, sp.true if value else sp.false)
    if (isinstance(dtype, torch.dtype) and not dtype.is_floating_point and not dtype.is_complex
            and isinstance(value, (bool, int))):
        narrow = dtype if dtype in _NARROW else None
        if narrow is not None and not (torch.iinfo(narrow).min <= value
                                       <= torch.iinfo(narrow).max):
            raise tr.fail(f"constant {value!r} of dtype {dtype} (torch wraps it)")
        return _Sym(tr, sp.Integer(int(value)), dt=narrow)
    raise tr.fail(f"constant {value!r} of dtype {dtype}")


def _method_min_max(tr, kind, a, b=None):
    if b is None:
        raise tr.fail(f"torch.{kind} reduction (only the two-argument form)")
    a, b = _int(tr, _val(tr, a), kind), _int(tr, _val(tr, b), kind)
    return sp.Min(a, b) if kind in ("min", "minimum") else sp.Max(a, b)


def _div(tr, a, b, rounding_mode=None):
    if rounding_mode != "floor":
        raise tr.fail("torch.div without rounding_mode='floor' (use //)")
    return _arith(tr, "//", a, b)


def _s(fn, dtype=None):
    """Wrap a builder of sympy expressions into one that returns a traced value; ``dtype`` (of
    the same arguments) gives its dtype where narrower than int32 (``_result_dtype``)."""
    def wrapped(tr, *args, **kwargs):
        e = fn(tr, *args, **kwargs)
        return _Sym(tr, e, dt=dtype(tr, *args, **kwargs) if dtype is not None else None)
    return wrapped


def _sel_dt(what):
    return lambda tr, *args, **kwargs: _result_dtype(
        tr, what, [*(args[1:] if what == "where" else args), *kwargs.values()])


def _op_dt(op):
    return lambda tr, a, b, **_: _op_dtype(tr, op, a, b)


_TORCH_FUNCS = {
    torch.where: _s(lambda tr, c, a, b: _select(tr, c, a, b), _sel_dt("where")),
    torch.minimum: _s(lambda tr, a, b: _method_min_max(tr, "minimum", a, b), _sel_dt("minimum")),
    torch.maximum: _s(lambda tr, a, b: _method_min_max(tr, "maximum", a, b), _sel_dt("maximum")),
    torch.min: _s(lambda tr, a, b=None: _method_min_max(tr, "min", a, b), _sel_dt("min")),
    torch.max: _s(lambda tr, a, b=None: _method_min_max(tr, "max", a, b), _sel_dt("max")),
    torch.abs: _s(lambda tr, a: sp.Abs(_int(tr, _val(tr, a), "abs")), _abs_dtype),
    torch.clamp: _s(lambda tr, x, min=None, max=None: _clamp(tr, x, min, max), _sel_dt("clamp")),
    torch.clip: _s(lambda tr, x, min=None, max=None: _clamp(tr, x, min, max), _sel_dt("clip")),
    torch.logical_and: _s(lambda tr, a, b: _logic(tr, "&", _to_bool(tr, a), _to_bool(tr, b))),
    torch.logical_or: _s(lambda tr, a, b: _logic(tr, "|", _to_bool(tr, a), _to_bool(tr, b))),
    torch.logical_xor: _s(lambda tr, a, b: _logic(tr, "^", _to_bool(tr, a), _to_bool(tr, b))),
    torch.logical_not: _s(lambda tr, a: sp.Not(_to_bool(tr, a))),
    torch.remainder: _s(lambda tr, a, b: _arith(tr, "%", a, b), _op_dt("%")),
    torch.floor_divide: _s(lambda tr, a, b: _arith(tr, "//", a, b), _op_dt("//")),
    torch.div: _s(lambda tr, a, b, rounding_mode=None: _div(tr, a, b, rounding_mode),
                  _op_dt("//")),
    torch.add: _s(lambda tr, a, b: _arith(tr, "+", a, b), _op_dt("+")),
    torch.sub: _s(lambda tr, a, b: _arith(tr, "-", a, b), _op_dt("-")),
    torch.mul: _s(lambda tr, a, b: _arith(tr, "*", a, b), _op_dt("*")),
    torch.eq: _s(lambda tr, a, b: _compare(tr, "==", a, b), _op_dt("==")),
    torch.ne: _s(lambda tr, a, b: _compare(tr, "!=", a, b), _op_dt("!=")),
    torch.lt: _s(lambda tr, a, b: _compare(tr, "<", a, b), _op_dt("<")),
    torch.le: _s(lambda tr, a, b: _compare(tr, "<=", a, b), _op_dt("<=")),
    torch.gt: _s(lambda tr, a, b: _compare(tr, ">", a, b), _op_dt(">")),
    torch.ge: _s(lambda tr, a, b: _compare(tr, ">=", a, b), _op_dt(">=")),
    torch.ones_like: lambda tr, x, dtype=None, **_: _const_like(tr, x, 1, dtype),
    torch.zeros_like: lambda tr, x, dtype=None, **_: _const_like(tr, x, 0, dtype),
}


_Ops.FUNCS = _TORCH_FUNCS


def _binop(op, kind):
    def forward(self, other):
        e = kind(self.tr, op, self, other)
        return _Sym(self.tr, e, dt=_op_dtype(self.tr, op, self, other))

    def reflected(self, other):
        e = kind(self.tr, op, other, self)
        return _Sym(self.tr, e, dt=_op_dtype(self.tr, op, other, self))

    return forward, reflected


def _in_place(self, *_):
    raise self.tr.fail("an in-place operator (x += ..., x &= ...) on a traced value: torch "
                       "updates the tensor itself, seen through every name of it (q_idx "
                       "too, also in the next mask_mod of and_masks); write x = x + ...")


class _Sym(_Ops):
    """A traced value: a sympy expression in i, j and params; ``tag`` marks the b and h indices
    (usable only as indices); ``dt`` is its torch dtype where narrower than int32 (uint8, int8,
    int16: torch computes in it), else None (int64, int32 or bool)."""

    __slots__ = ("tr", "e", "tag", "dt")

    def __init__(self, tr, e, tag=None, dt=None):
        self.tr, self.e, self.tag, self.dt = tr, e, tag, dt

    __add__, __radd__ = _binop("+", _arith)
    __sub__, __rsub__ = _binop("-", _arith)
    __mul__, __rmul__ = _binop("*", _arith)
    __floordiv__, __rfloordiv__ = _binop("//", _arith)
    __mod__, __rmod__ = _binop("%", _arith)
    __rshift__, __rrshift__ = _binop(">>", _arith)
    __lshift__, __rlshift__ = _binop("<<", _arith)
    __and__, __rand__ = _binop("&", _logic)
    __or__, __ror__ = _binop("|", _logic)
    __xor__, __rxor__ = _binop("^", _logic)
    __lt__, __gt__ = _binop("<", _compare)[0], _binop(">", _compare)[0]
    __le__, __ge__ = _binop("<=", _compare)[0], _binop(">=", _compare)[0]
    __eq__, __ne__ = _binop("==", _compare)[0], _binop("!=", _compare)[0]
    __hash__ = _Ops.__hash__
    # without these Python rebinds the name to x + 2, where torch updates x (an alias of q_idx)
    __iadd__ = __isub__ = __imul__ = __ifloordiv__ = __imod__ = __itruediv__ = _in_place
    __iand__ = __ior__ = __ixor__ = __ilshift__ = __irshift__ = __ipow__ = _in_place

    def __truediv__(self, other):
        raise self.tr.fail("true division '/' (use //)")

    __rtruediv__ = __truediv__

    def __neg__(self):
        e = -_int(self.tr, _val(self.tr, self), "-")
        return _Sym(self.tr, e, dt=_result_dtype(self.tr, "-", (self,), wraps=True))

    def __pos__(self):
        return self

    def __abs__(self):
        e = sp.Abs(_int(self.tr, _val(self.tr, self), "abs"))
        return _Sym(self.tr, e, dt=_abs_dtype(self.tr, self))

    def __invert__(self):
        e = _val(self.tr, self)
        if not _is_bool(e):  # bitwise not of an integer
            return _Sym(self.tr, -e - 1, dt=_result_dtype(self.tr, "~", (self,), wraps=True))
        return _Sym(self.tr, sp.Not(e))

    def abs(self):
        return abs(self)

    def clamp(self, min=None, max=None):  # noqa: A002 - torch's keyword names
        return _Sym(self.tr, _clamp(self.tr, self, min, max),
                    dt=_result_dtype(self.tr, "clamp", (self, min, max)))

    clip = clamp

    def clamp_min(self, lo):
        return self.clamp(min=lo)

    def clamp_max(self, hi):
        return self.clamp(max=hi)

    def minimum(self, other):
        return _Sym(self.tr, _method_min_max(self.tr, "minimum", self, other),
                    dt=_result_dtype(self.tr, "minimum", (self, other)))

    def maximum(self, other):
        return _Sym(self.tr, _method_min_max(self.tr, "maximum", self, other),
                    dt=_result_dtype(self.tr, "maximum", (self, other)))

    def where(self, cond, other):
        return _Sym(self.tr, _select(self.tr, cond, self, other),
                    dt=_result_dtype(self.tr, "where", (self, other)))

    def logical_and(self, other):
        return _Sym(self.tr, _logic(self.tr, "&", _to_bool(self.tr, self),
                                    _to_bool(self.tr, other)))

    def logical_or(self, other):
        return _Sym(self.tr, _logic(self.tr, "|", _to_bool(self.tr, self),
                                    _to_bool(self.tr, other)))

    def logical_not(self):
        return _Sym(self.tr, sp.Not(_to_bool(self.tr, self)))

    def to(self, *args, dtype=None, **kwargs):
        dtype = next((a for a in args if isinstance(a, torch.dtype)), dtype)
        other = next((a for a in args if isinstance(a, _Ops)), None)
        if dtype is None and other is not None:  # .to(tensor): that tensor's dtype
            dtype = torch.bool if _is_bool_value(other) else (other.dt or torch.int64)
        return self if dtype is None else _convert(self.tr, self, dtype)

    def bool(self):
        return _Sym(self.tr, _to_bool(self.tr, self))

    def long(self):
        return _Sym(self.tr, _to_int(self.tr, self))

    int = long

    def new_ones(self, *size, dtype=None, **kwargs):
        return _const_like(self.tr, self, 1, dtype)

    def new_zeros(self, *size, dtype=None, **kwargs):
        return _const_like(self.tr, self, 0, dtype)

    def new_full(self, size, fill_value, dtype=None, **kwargs):
        return _const_like(self.tr, self, fill_value, dtype)

    def new_tensor(self, value, dtype=None, **kwargs):
        return _const_like(self.tr, self, value, dtype)

    def unsqueeze(self, dim):  # a value per score broadcasts like its unsqueezed self
        return self

    def any(self, dim=None, keepdim=False):  # of one value (a length-1 dim): that value
        return self.bool()

    all = any

    def eq(self, other):
        return self == other

    def ne(self, other):
        return self != other

    def lt(self, other):
        return self < other

    def le(self, other):
        return self <= other

    def gt(self, other):
        return self > other

    def ge(self, other):
        return self >= other

    def remainder(self, other):
        return self % other

    def floor_divide(self, other):
        return self // other


class _Captured(_Sym):
    """A captured tensor: indexing it by ``b``, ``q_idx``, ``kv_idx`` (or by another captured
    array) makes a metadata param."""

    __slots__ = ("leaf", "name", "ndim", "is_bool", "_like")

    def __init__(self, tr, leaf, name, tensor):
        super().__init__(tr, None)
        self.leaf, self.name, self.ndim = leaf, name, tensor.dim()
        self.is_bool = tensor.dtype is torch.bool
        self.dt = tensor.dtype if tensor.dtype in _NARROW else None
        self._like = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    def _selected(self, consts, suffix="sel"):
        """This tensor with constant indices ``[(dim, c)]`` applied: a stand-in of its own over
        the leaf ``(source leaf, selections)``, named after the source alone, so that heads
        reading ``w[h]`` give equal specs (their metadata differ, not their rules)."""
        src, sel = (self.leaf if isinstance(self.leaf, tuple) else (self.leaf, ()))
        like = self._like
        for d, c in sorted(consts, reverse=True):  # the higher dims first: lower ones stay put
            if not -like.shape[d] <= c < like.shape[d]:
                raise self.tr.fail(f"index {c} of dimension {d} of captured tensor "
                                   f"{self.name!r} (shape {list(like.shape)}) is out of range")
            like = like.select(d, c)
            sel += ((d, c),)
        leaf = (src, sel)
        got = self.tr.stand_ins.get(leaf)
        if got is None:
            got = self.tr.new_stand_in(leaf, f"{self.name}_{suffix}", like)
        return got

    def _wrap(self, e):
        return sp.Ne(e, 0) if self.is_bool else e

    def scalar(self):
        if self.ndim != 0:
            raise self.tr.fail(f"captured tensor {self.name!r} ({self.ndim}-d) used without an "
                               "index")
        return self._wrap(self._scalar_symbol())

    def _scalar_symbol(self):
        tr = self.tr
        if self.name in tr.array_leaf:
            raise tr.fail(f"captured tensor {self.name!r} used both per sequence and per token")
        tr.scalar_leaf[self.name] = self.leaf
        # of either sign: a value folded away here would be checked nowhere (t[b] < 0)
        return sp.Symbol(self.name, integer=True)

    def _array_at(self, name, ndim, idx):
        tr = self.tr
        if name in tr.scalar_leaf:
            raise tr.fail(f"captured tensor {name!r} used both per sequence and per token")
        x = _val(tr, idx)
        if x == _I or x == _J:
            return array_function(name, nonnegative=False)(x)
        at = _gather_var(tr, x)
        if at is None:
            raise tr.fail(f"index {name}[{x}]: a captured tensor is indexed by b, q_idx, kv_idx "
                          "or an integer expression of one of them (constants, per-sequence "
                          "values and captured arrays read at that same index)")
        # t[f(q_idx)]: the gathered array t_at_... (computed in torch with the metadata, read
        # where its index is): s[t[q_idx]], t[kv_idx // 16], s[u[t[q_idx]] + 1]
        recipe = (self.leaf, ndim, x.xreplace({at: _X}))
        dname = tr.gathers.get(recipe)
        if dname is None:
            src = x.func.__name__ if isinstance(x, sp.core.function.AppliedUndef) else "index"
            dname = tr.gathers[recipe] = tr.fresh(f"{name}_at_{src}")
            tr.derived[dname] = recipe
            tr.array_leaf[dname] = self.leaf
        return array_function(dname, nonnegative=False)(at)

    def __getitem__(self, idx):
        tr = self.tr
        idx = idx if isinstance(idx, tuple) else (idx,)
        consts = [(d, c) for d, x in enumerate(idx) if (c := _const_index(x)) is not None]
        if consts:
            sub = self._selected(consts)
            rest = tuple(x for d, x in enumerate(idx) if d not in {d for d, _ in consts})
            return sub[rest] if rest else sub
        is_b = [isinstance(x, _Sym) and x.tag == "b" for x in idx]
        if any(isinstance(x, _Sym) and x.tag == "h" for x in idx):
            _val(tr, next(x for x in idx if isinstance(x, _Sym) and x.tag == "h"))
        if self.ndim == 1 and idx and is_b[0] and len(idx) == 1:
            return _Sym(tr, self._wrap(self._scalar_symbol()), dt=self.dt)
        if self.ndim == 2 and len(idx) == 1 and is_b[0]:
            return _Row(self)
        if self.ndim == 2 and len(idx) == 2 and is_b[0]:
            return self._read(idx[1], 2)
        if self.ndim == 3 and len(idx) == 2 and is_b[0]:
            # t[b, x] of [B, n, m]: a row of m values, each its own gathered array (the mask
            # then depends on m: the conversion is keyed by it)
            m = self._like.shape[2]
            if m > _MAX_VECTOR:
                raise tr.fail(f"a row of {m} values of captured tensor {self.name!r} (at most "
                              f"{_MAX_VECTOR}: each becomes its own array)")
            tr.shape_deps[(self.leaf, 2)] = m
            return _Vec(tr, [self._selected([(2, c)], str(c))[idx] for c in range(m)])
        if self.ndim == 3 and len(idx) == 3 and is_b[0]:
            return self._read_pair(idx[1], idx[2], batched=True)
        if self.ndim == 1 and len(idx) == 1:
            return self._read(idx[0], 1)
        if self.ndim == 2 and not is_b[0] and len(idx) == 2 and type(idx[1]) is not int:
            return self._read_pair(idx[0], idx[1], batched=False)
        if self.ndim == 2 and not is_b[0]:
            if len(idx) == 1:  # t[x]: a row of a table, its column chosen next (t[x][0])
                return _TableRow(self, idx[0])
            if len(idx) == 2 and type(idx[1]) is int:
                return self._read_column(idx[0], idx[1])
        shown = ", ".join("b" if f else ("h" if getattr(x, "tag", None) == "h" else "...")
                          for x, f in zip(idx, is_b))
        raise tr.fail(f"index {self.name}[{shown}] of a {self.ndim}-d captured tensor (only "
                      "t[b], t[b, idx], t[idx])")

    def _read_column(self, x, c: int):
        """Column ``c`` of a ``[n, m]`` table at the index ``x`` (of q_idx or kv_idx): a
        gathered per-token array, ``t[:, c]`` read where ``x`` says."""
        tr = self.tr
        e = _val(tr, x)
        at = e if e in (_I, _J) else _gather_var(tr, e)
        if at is None:
            raise tr.fail(f"index {self.name}[{e}, {c}]: a table's row is an integer expression "
                          "of q_idx or kv_idx (constants, per-sequence values and arrays read "
                          "at that same index)")
        recipe = (self.leaf, ("column", c), e.xreplace({at: _X}))
        dname = tr.gathers.get(recipe)
        if dname is None:
            dname = tr.gathers[recipe] = tr.fresh(f"{self.name}_{c}_at_index")
            tr.derived[dname] = recipe
            tr.array_leaf[dname] = self.leaf
        return _Sym(tr, self._wrap(array_function(dname, nonnegative=False)(at)), dt=self.dt)

    def _read_pair(self, x, y, batched: bool, test=None):
        """``t[x, y]`` (``t[b, x, y]``) of a bool table at a token pair: a table param whose
        row ``i`` is the table's row at ``x`` (gathered with the metadata; ``x`` a function of
        q_idx), read at the column ``y`` (a function of kv_idx) in the rule. ``t[kv, q]`` reads
        the transposed table. A table of numbers is read through a comparison with a constant
        (``test``: the operator and the constant, applied to the table at conversion)."""
        tr = self.tr
        if not self.is_bool and test is None:
            return _PairValue(self, x, y, batched)
        ex, ey = _val(tr, x), _val(tr, y)
        transposed = _gather_var(tr, ex) == _J and _J not in ey.free_symbols
        if transposed:
            ex, ey = ey, ex
        shown = f"{self.name}[{'b, ' if batched else ''}{_val(tr, x)}, {_val(tr, y)}]"
        if _gather_var(tr, ex) != _I or not isinstance(ey, sp.Expr) or _is_bool(ey) \
                or _J not in ey.free_symbols or _I in ey.free_symbols:
            raise tr.fail(f"index {shown}: a table read at a token pair takes its row from "
                          "q_idx and its column from kv_idx (or the reverse)")
        if any(len(f.args) == 2 for f in ey.atoms(sp.core.function.AppliedUndef)):
            raise tr.fail(f"index {shown}: a table's column read from another table")
        recipe = (self.leaf, ("rows", batched, transposed, test), ex.xreplace({_I: _X}))
        dname = tr.gathers.get(recipe)
        if dname is None:
            dname = tr.gathers[recipe] = tr.fresh(f"{self.name}_rows")
            tr.derived[dname] = recipe
        read = table_function(dname)(_I, ey)
        tr.table_reads.append((read, ey, self.name, user_line(__file__)))
        return _Sym(tr, sp.Ne(read, 0))

    def _read(self, idx, ndim):
        tr = self.tr
        prev = tr.array_ndim.setdefault(self.name, ndim)
        if prev != ndim:
            raise tr.fail(f"captured tensor {self.name!r} indexed with and without b")
        e = self._array_at(self.name, ndim, idx)
        if type(e).__name__ == self.name:
            tr.array_leaf[self.name] = self.leaf
        return _Sym(tr, self._wrap(e), dt=self.dt)


_MAX_VECTOR = 64

_PAIR_TESTS = {"==": torch.eq, "!=": torch.ne, "<": torch.lt, "<=": torch.le, ">": torch.gt,
               ">=": torch.ge}


class _PairValue:
    """``t[x, y]`` of a table of numbers at a token pair: only compared with a constant
    (``t[q_idx, kv_idx] == 2``), which makes the bool table the rule reads."""

    def __init__(self, cap: _Captured, x, y, batched: bool):
        self.cap, self.x, self.y, self.batched = cap, x, y, batched

    def _test(self, op, c):
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            c = _const_index(c)
            if c is None:
                raise self.cap.tr.fail(f"a table of numbers {self.cap.name!r} read at a token "
                                       f"pair is compared with a constant only (here '{op}' "
                                       "with a computed value)")
        return self.cap._read_pair(self.x, self.y, self.batched, (op, c))

    def __eq__(self, c):
        return self._test("==", c)

    def __ne__(self, c):
        return self._test("!=", c)

    def __lt__(self, c):
        return self._test("<", c)

    def __le__(self, c):
        return self._test("<=", c)

    def __gt__(self, c):
        return self._test(">", c)

    def __ge__(self, c):
        return self._test(">=", c)

    __hash__ = object.__hash__

    def _arith(self, *_):
        raise self.cap.tr.fail(f"arithmetic on a table of numbers {self.cap.name!r} read at a "
                               "token pair (only a comparison with a constant)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arith
    __and__ = __rand__ = __or__ = __ror__ = __invert__ = __neg__ = _arith

    def __bool__(self):
        raise self.cap.tr.fail("data-dependent Python control flow on a table read")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise self.cap.tr.fail(f"'.{name}' of a table of numbers {self.cap.name!r} read at a "
                               "token pair (compare it with a constant)")


class _Vec:
    """A row of traced values (``t[b, x]`` of a 3-D captured tensor): compared with a value
    per score (``x.unsqueeze(-1)``) elementwise and reduced with ``.any(-1)`` / ``.all(-1)``
    (VSA's top-k tiles: one of them equals the key's tile)."""

    def __init__(self, tr, items):
        self.tr, self.items = tr, items

    def _map(self, other, fn):
        if isinstance(other, _Vec):
            if len(other.items) != len(self.items):
                raise self.tr.fail(f"rows of {len(self.items)} and {len(other.items)} values "
                                   "combined")
            return _Vec(self.tr, [fn(a, b) for a, b in zip(self.items, other.items)])
        return _Vec(self.tr, [fn(a, other) for a in self.items])

    def __eq__(self, o):
        return self._map(o, lambda a, b: a == b)

    def __ne__(self, o):
        return self._map(o, lambda a, b: a != b)

    def __lt__(self, o):
        return self._map(o, lambda a, b: a < b)

    def __le__(self, o):
        return self._map(o, lambda a, b: a <= b)

    def __gt__(self, o):
        return self._map(o, lambda a, b: a > b)

    def __ge__(self, o):
        return self._map(o, lambda a, b: a >= b)

    def __and__(self, o):
        return self._map(o, lambda a, b: a & b)

    def __or__(self, o):
        return self._map(o, lambda a, b: a | b)

    __rand__, __ror__ = __and__, __or__
    __hash__ = object.__hash__

    def __iand__(self, o):  # torch would update the row in place (aliases see it)
        raise self.tr.fail("an in-place operator (r &= ..., r |= ...) on a row of values; "
                           "write r = r & ...")

    __ior__ = __iand__

    def _reduce(self, dim, keepdim, op):
        if dim not in (-1, 0) or keepdim:
            raise self.tr.fail("a row of values reduced other than over its one dimension "
                               "(.any(-1) / .all(-1))")
        return _Sym(self.tr, op(*[_to_bool(self.tr, x) for x in self.items]))

    def any(self, dim=-1, keepdim=False):
        return self._reduce(dim, keepdim, sp.Or)

    def all(self, dim=-1, keepdim=False):
        return self._reduce(dim, keepdim, sp.And)

    def __bool__(self):
        raise self.tr.fail("data-dependent Python control flow on a row of values")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise self.tr.fail(f"'.{name}' of a row of values (t[b, x] of a 3-d tensor: compare "
                           "it elementwise, then .any(-1) / .all(-1))")


def _const_index(x) -> int | None:
    """The value of an index known at conversion (a Python int, or a traced constant such as
    the head of ``from_mask_mod_heads``), else None."""
    if type(x) is int:
        return x
    if isinstance(x, _Sym) and not isinstance(x, _Captured) and x.tag is None and isinstance(
            x.e, sp.Integer):
        return int(x.e)
    return None


class _TableRow:
    """``t[x]`` of a 2-D captured tensor that is not per sequence (``[n, m]``: one row per
    image, per document...): a constant column next (``t[x][0]``)."""

    def __init__(self, cap: _Captured, x):
        self.cap, self.x = cap, x

    def __getitem__(self, c):
        if type(c) is not int:
            raise self.cap.tr.fail(f"column of captured table {self.cap.name!r} read at a "
                                   "computed index (only constant columns: t[x][0])")
        return self.cap._read_column(self.x, c)


class _Row:
    """``t[b]`` of a 2-D captured tensor: one sequence's row, indexed next by a token."""

    def __init__(self, cap: _Captured):
        self.cap = cap

    def __getitem__(self, idx):
        return self.cap._read(idx, 2)


# --------------------------------------------------------------------------------------------
# conversion and cache
# --------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    spec: MaskSpec
    scalars: tuple  # (param, leaf)
    arrays: tuple  # (param, leaf, ndim)
    # gathered arrays in the order they are computed: (name, source leaf, source ndim, index
    # expression in _X); ``params`` says which the rules read (the rest are inner gathers)
    derived: tuple
    index_arrays: tuple  # (array, leaf, ndim): read only inside a gather's index
    index_scalars: tuple  # (scalar, leaf): likewise
    params: tuple
    shape_deps: tuple = ()  # ((leaf, dim), size): sizes the rules were converted for


_CACHE = LRU(1024)  # conversion key -> _Entry; bounded: a new captured int is a new key


def from_mask_mod(mask_mod, *, batch_size: int | None = None, name: str | None = None,
                  seqlen: int | None = None, score_mod=None):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` as ``(MaskSpec, meta)``.

    ``meta`` maps each param to the captured tensor it reads, as it is now: ``[B]`` for
    ``t[b]``, ``[B, S]`` for ``t[b, idx]``; a 1-D ``t[idx]`` (or a 0-d ``t``) is the same for every
    sequence and is expanded (a view, no copy) to the batch: ``batch_size``, else the batch of
    the ``b``-indexed tensors, else 1. Bool tensors are viewed as uint8. ``meta`` reads the
    captured tensors as they are at each preprocess: the arrays read directly are views, and
    those gathered from them (below) are computed again once one of their tensors was updated
    in place through torch (its version counter: a write through ``.data`` or a NumPy array
    sharing the memory is not seen); a tensor replaced or resized needs ``from_mask_mod`` again
    (a resize is refused).
    Per-token tensors must have ``seqlen_q`` entries, and those read at ``kv_idx`` need
    ``seqlen_k <= seqlen_q``. A
    tensor read at an index computed from ``q_idx`` or ``kv_idx`` (``t[kv_idx // 16]``,
    ``s[t[q_idx] + 1]``) becomes a per-token array gathered here, by torch's indexing rules;
    ``seqlen`` (its number of tokens) is needed where no per-token tensor in that index says it.

    ``mask_mod`` is a function or a bound method; arguments after the four need defaults, which
    it reads as FlexAttention would call it. ``mask = cm.compile_mask(spec); desc =
    mask.preprocess(meta, seqlen_q=S)``. Calls with the same code and the same values read
    (constants, defaults, attributes of captured objects) return the same spec; only the tensors
    are collected again.

    ``score_mod``: the FlexAttention score_mod the attention runs with, where it gives -inf
    (``torch.where(cond, score, -float("inf"))``: a masked score): the mask is then
    ``mask_mod & cond``, on which the GPU engines run the score_mod's finite value
    (``cm.attention(..., score_mod=)`` refuses such a score_mod on them with any other mask)."""
    _check_signature(mask_mod)
    _check_count("batch_size", batch_size)
    _check_count("seqlen", seqlen)
    return _converted(mask_mod, batch_size, name, seqlen, None, score_mod)


def _check_count(name, value):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        raise (ValueError if isinstance(value, int) and not isinstance(value, bool)
               else TypeError)(f"from_mask_mod: {name} must be a positive int or None, got "
                               f"{value!r}")


def from_mask_mod_heads(mask_mod, num_heads: int, *, batch_size: int | None = None,
                        name: str | None = None, seqlen: int | None = None, score_mod=None):
    """A FlexAttention ``mask_mod`` that reads the head index ``h`` as one ``(MaskSpec, meta)``
    per head: ``(specs, metas)``, lists of ``num_heads``, each converted as
    :func:`from_mask_mod` does with ``h`` that head's constant (``h < 2``, ``w[h]``,
    ``t[b, h, q_idx]`` read at it). Heads whose rules come out equal have equal specs (one
    compiled mask), and share one descriptor where they also read the same tensors::

        specs, metas = cm.from_mask_mod_heads(mask_mod, num_heads=H)
        groups = cm.preprocess_heads([cm.compile_mask(s) for s in specs], metas, seqlen_q=S)
        out = cm.attention(q, k, v, groups)

    ``score_mod``: as in :func:`from_mask_mod` (its -inf condition joins each head's mask)."""
    _check_signature(mask_mod)
    _check_count("batch_size", batch_size)
    _check_count("seqlen", seqlen)
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"from_mask_mod_heads: num_heads must be a positive int, got "
                         f"{num_heads!r}")
    per = [_converted(mask_mod, batch_size, name, seqlen, h, score_mod)
           for h in range(num_heads)]
    return [spec for spec, _ in per], [meta for _, meta in per]


def _converted(mask_mod, batch_size, name, seqlen, head, score_mod=None):
    sm = None
    if score_mod is not None:
        sm = score_mod_mask(score_mod)[0]
        if sm.mask is None:
            score_mod = None  # finite everywhere: the mask is the mask_mod's
    walk = _Walk()
    try:
        # the name labels the spec (and its errors): functions of one code may be renamed
        key = (walk.value(mask_mod if score_mod is None else (mask_mod, score_mod),
                          "mask_mod")[0], name, _fn_name(mask_mod), head,
               None if sm is None else sm.key)
        entry = _CACHE.get(key)
    except _Uncacheable:
        key, entry = None, None
    leaves = walk.leaves
    if entry is not None and any(
            _leaf_value(entry, leaves, leaf).shape[d] != n for (leaf, d), n in entry.shape_deps):
        entry = None  # a row's length changed: its rules do too
    if entry is None:
        entry, leaves = _convert_mask_mod(mask_mod, name, head, score_mod,
                                          None if score_mod is None else sm.key)
        if key is not None:
            _CACHE[key] = entry
            _count_variants(mask_mod, key)
    return entry.spec, _meta(entry, leaves, batch_size, seqlen)


# code object -> the conversion keys seen for it (up to _VARIANTS_SAID): a mask_mod converted
# again and again for new captured values compiles a new mask each time (~50 ms, ~50 KB)
_VARIANTS = LRU(256)
_VARIANTS_SAID = 8


def _count_variants(mask_mod, key) -> None:
    fn = mask_mod
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    seen = _VARIANTS.setdefault(fn.__code__, set())
    if len(seen) >= _VARIANTS_SAID:
        return
    seen.add(key[:2])  # the values read and the name: one conversion per head is no variant
    if len(seen) == _VARIANTS_SAID:
        say_once(f"from_mask_mod: mask_mod {_fn_name(mask_mod)!r} was converted for "
                 f"{_VARIANTS_SAID} different captured values, each a new compiled mask (a "
                 "compile and its memory); capture a value that changes per batch as a 0-d "
                 "tensor (torch.tensor(v)): it is then a param of one compiled mask, read at "
                 "each preprocess")


def _fn_name(mask_mod) -> str:
    """A mask_mod's name; a ``functools.partial``'s is its function's (BD3-LM's
    ``partial(block_diff_mask, block_size=, n=)``)."""
    while isinstance(mask_mod, functools.partial):
        mask_mod = mask_mod.func
    return getattr(mask_mod, "__name__", "mask_mod")


def _check_signature(mask_mod):
    """Refuse what FlexAttention could not call as ``mask_mod(b, h, q_idx, kv_idx)``."""
    if type(mask_mod) is functools.partial:
        _check_partial(mask_mod)
        return
    fn, nself = mask_mod, 0
    if type(mask_mod) is types.MethodType and type(mask_mod.__func__) is types.FunctionType:
        fn, nself = mask_mod.__func__, 1
    if type(fn) is not types.FunctionType:
        raise TypeError(f"from_mask_mod expects a Python function (or bound method) "
                        f"mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}")
    code = fn.__code__
    npos = code.co_argcount - nself
    required = npos - len(fn.__defaults__ or ())
    kwonly = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    no_default = [n for n in kwonly if n not in (fn.__kwdefaults__ or {})]
    if (npos < 4 and not code.co_flags & inspect.CO_VARARGS) or required > 4 or no_default:
        what = (f"keyword-only argument(s) {no_default} without defaults" if no_default else
                f"{npos} positional argument(s), {max(required, 0)} without defaults")
        raise TypeError(f"mask_mod {mask_mod.__name__!r} must take (b, h, q_idx, kv_idx) (further "
                        f"arguments need defaults), takes {what}")


def _check_partial(mask_mod):
    inner = mask_mod.func
    while type(inner) is functools.partial:
        inner = inner.func
    if not (type(inner) is types.FunctionType or (type(inner) is types.MethodType and type(
            inner.__func__) is types.FunctionType)):
        raise TypeError(f"from_mask_mod expects a Python function (or bound method, or a "
                        f"functools.partial of one) mask_mod(b, h, q_idx, kv_idx), got a "
                        f"partial of {type(inner).__name__}")
    try:
        params = inspect.signature(mask_mod).parameters.values()
    except (TypeError, ValueError) as e:
        raise TypeError(f"mask_mod {_fn_name(mask_mod)!r}: {e}") from None
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in pos if p.default is p.empty]
    no_default = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if (len(pos) < 4 and not varargs) or len(required) > 4 or no_default:
        raise TypeError(f"mask_mod {_fn_name(mask_mod)!r} (a functools.partial) must take (b, "
                        f"h, q_idx, kv_idx) once its bound arguments are applied (further "
                        f"arguments need defaults), takes {inspect.signature(mask_mod)}")


def _leaf_value(entry: _Entry, leaves, leaf):
    """A leaf's tensor: a captured one, or ``(source, [(dim, c)])``: its constant selections."""
    if not isinstance(leaf, tuple):
        return leaves[leaf]
    t = leaves[leaf[0]]
    for d, c in leaf[1]:
        if not -t.shape[d] <= c < t.shape[d]:
            raise ValueError(f"mask_mod {entry.spec.name!r}: a captured tensor of shape "
                             f"{list(t.shape)} is read at index {c} of its dimension {d}")
        t = t.select(d, c)
    return t


def _meta(entry: _Entry, leaves, batch_size, seqlen=None):
    """The metadata of a conversion: the captured tensors read directly (views: an in-place
    update is seen at the next preprocess), and the arrays gathered from them, computed again
    at the next read once a tensor they come from changed (``_LiveMeta``)."""
    values = _values(entry, leaves, batch_size, seqlen)
    out = {p: values[p] for p in entry.params}
    if not entry.derived:
        return out  # views only: nothing to compute again
    return _LiveMeta(out, (entry, leaves, batch_size, seqlen))


def _sources(entry: _Entry, leaves):
    """The captured tensors a conversion reads, with their versions (None where torch keeps
    none: inference tensors, computed again at every read) and shapes."""
    ids = {leaf if not isinstance(leaf, tuple) else leaf[0]
           for group in (entry.scalars, entry.index_scalars, entry.arrays, entry.index_arrays,
                         entry.derived) for _, leaf, *_ in group}
    out = []
    for n in sorted(ids):
        t = leaves[n]
        out.append((n, None if t.is_inference() else t._version, tuple(t.shape)))
    return tuple(out)


class _LiveMeta(dict):
    """``from_mask_mod``'s metadata where it holds gathered arrays (``s[t[q_idx]]``, a table's
    rows): a dict whose reads compute those again from the captured tensors once one of them
    was updated in place (its version changed), so that the metadata always equals the
    mask_mod's tensors as they are, as the arrays read directly (views) do."""

    def __init__(self, values, src):
        super().__init__(values)
        self._src = src
        self._stamps = _sources(src[0], src[1])

    def _refresh(self):
        entry, leaves, batch_size, seqlen = self._src
        now = _sources(entry, leaves)
        if now == self._stamps and all(v is not None for _, v, _ in now):
            return
        for (_, _, shape), (_, _, was) in zip(now, self._stamps):
            if shape != was:
                raise ValueError(
                    f"mask_mod {entry.spec.name!r}: a captured tensor changed shape from "
                    f"{list(was)} to {list(shape)} after from_mask_mod; call from_mask_mod "
                    "again for its metadata (and rules)")
        values = _values(entry, leaves, batch_size, seqlen)
        for p in entry.params:
            dict.__setitem__(self, p, values[p])
        self._stamps = now

    def __getitem__(self, key):
        self._refresh()
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._refresh()
        return dict.get(self, key, default)

    def items(self):
        self._refresh()
        return dict.items(self)

    def values(self):
        self._refresh()
        return dict.values(self)

    def __iter__(self):  # defined here, dict(meta) and {**meta} read through __getitem__
        return dict.__iter__(self)

    def copy(self):
        return dict(self)

    def __reduce__(self):  # pickled and deep-copied as the plain dict of its current values
        return (dict, (dict(self),))


def _values(entry: _Entry, leaves, batch_size, seqlen=None):
    def leaf_of(leaf):
        return _leaf_value(entry, leaves, leaf)

    batched = [(p, leaf_of(leaf)) for p, leaf in (*entry.scalars, *entry.index_scalars)
               if leaf_of(leaf).dim() == 1]
    # b-indexed, read directly or in a gather's index
    batched += [(p, leaf_of(leaf)) for p, leaf, ndim in (*entry.arrays, *entry.index_arrays)
                if ndim == 2]
    batched += [(p, leaf_of(leaf)) for p, leaf, ndim, _ in entry.derived
                if ndim == 2 or isinstance(ndim, tuple) and ndim[0] == "rows" and ndim[1]]
    B = batch_size
    if B is None:
        B = max([1] + [t.shape[0] for _, t in batched])
    for p, t in batched:
        if t.shape[0] != B:  # torch would index this batch's entries past the tensor's
            raise ValueError(
                f"from_mask_mod: mask_mod {entry.spec.name!r} reads the tensor behind param "
                f"{p!r} ({list(t.shape)}) at b, a batch of {t.shape[0]}, but "
                + (f"batch_size={B}; pass batch_size={t.shape[0]} (or None)"
                   if batch_size is not None else f"another tensor it reads at b has {B}")
                + f"; or capture tensors of batch {B}")
    values = {}
    for p, leaf in (*entry.scalars, *entry.index_scalars):
        t = _as_int(leaf_of(leaf))
        values[p] = t.reshape(1).expand(B) if t.dim() == 0 else t
    for p, leaf, ndim in (*entry.arrays, *entry.index_arrays):
        t = _as_int(leaf_of(leaf))
        values[p] = t.unsqueeze(0).expand(B, -1) if ndim == 1 else t
    if seqlen is None:  # the tokens of every per-token tensor read at q_idx / kv_idx
        lengths = {values[p].shape[-1] for p, *_ in (*entry.arrays, *entry.index_arrays)}
        seqlen = lengths.pop() if len(lengths) == 1 else None
    for p, leaf, ndim, index in entry.derived:
        values[p] = _gather(entry, p, _as_int(leaf_of(leaf)), ndim, index, values, B, seqlen)
    return values


_TORCH_NS: dict = {}
_GATHER_CODE = LRU(1024)  # index expression -> (compiled torch code, arrays, scalars it reads)


def _gather_code(index):
    """The torch code of a gather's index (``i`` the token), compiled once per expression: a
    mask_mod rebuilt per batch gathers without printing or compiling it again."""
    got = _GATHER_CODE.get(index)
    if got is None:
        if not _TORCH_NS:
            exec(TORCH_PRELUDE, _TORCH_NS)
        e = index.xreplace({_X: _I})
        arrays = tuple(sorted({type(f).__name__
                               for f in e.atoms(sp.core.function.AppliedUndef)}))
        scalars = tuple(sorted(sym.name for sym in e.free_symbols if sym != _I))
        code = compile(TorchPrinter()(e), "<compilemask gather index>", "eval")
        got = _GATHER_CODE[index] = (code, arrays, scalars, ExprPrinter()(e))
    return got


def _gather(entry, name, src, ndim, index, values, B, seqlen):
    """``src`` at ``index`` (an expression in _X) for every token: ``[B, S]``, indexed as torch
    indexes (so as FlexAttention's ``create_mask`` reads the mask_mod)."""
    code, arrays, scalars, shown = _gather_code(index)
    lengths = {values[a].shape[-1] for a in arrays}
    if len(lengths) > 1:
        raise ValueError(f"mask_mod {entry.spec.name!r}: the index of {name} reads per-token "
                         f"tensors of different lengths {sorted(lengths)}")
    S = lengths.pop() if lengths else seqlen
    if S is None and isinstance(ndim, tuple) and ndim[0] == "rows" and index == _X:
        S = src.shape[-1 if ndim[2] else -2]  # t[q_idx, ...]: a row per query
    if S is None:
        raise ValueError(f"mask_mod {entry.spec.name!r}: a tensor is read at {shown} (q_idx or "
                         "kv_idx as i), whose number of tokens no per-token tensor says: pass "
                         "from_mask_mod(..., seqlen=S)")
    ns = dict(_TORCH_NS, i=torch.arange(S).view(1, S))
    ns.update({f"{a}_i": values[a].long() for a in arrays})
    ns.update({p: values[p].long().reshape(-1, 1) for p in scalars})
    idx = torch.broadcast_to(eval(code, ns), (B, S))  # noqa: S307 - generated
    try:
        if isinstance(ndim, tuple) and ndim[0] == "rows":  # a table's rows: [B, S, m]
            _, batched, transposed, test = ndim
            t = src.transpose(-1, -2) if transposed else src
            if test is not None:  # a table of numbers, read through its comparison
                t = _PAIR_TESTS[test[0]](t, test[1])
            return t[torch.arange(B).view(B, 1), idx] if batched else t[idx]
        if isinstance(ndim, tuple):  # ("column", c) of a [n, m] table
            return src[:, ndim[1]][idx]
        if ndim == 1:
            return src[idx]
        return src[torch.arange(B).view(B, 1), idx]
    except IndexError as err:
        raise ValueError(f"mask_mod {entry.spec.name!r}: reading a captured tensor of shape "
                         f"{tuple(src.shape)} at {shown} (i = q_idx or kv_idx): {err}") from err


def _as_int(t):
    return t.view(torch.uint8) if t.dtype is torch.bool else t


def _convert_mask_mod(mask_mod, name, head=None, score_mod=None,
                      score_key=None) -> tuple[_Entry, list]:
    fname = _fn_name(mask_mod)
    tr = _Trace(fname)
    walk = _Walk(tr)
    _, copy = walk.value(mask_mod if score_mod is None else (mask_mod, score_mod), "mask_mod")
    if score_mod is not None:
        copy = _and_score_mask(tr, walk, copy[0], score_mod)
    # h: refused where read, or one head's constant (``from_mask_mod_heads``)
    b, h = _Sym(tr, None, "b"), (_Sym(tr, None, "h") if head is None else
                                 _Sym(tr, sp.Integer(head)))
    try:
        out = copy(b, h, _Sym(tr, _I), _Sym(tr, _J))
    except (TypeError, AttributeError, IndexError) as e:
        arrays = _numpy_names(mask_mod)
        if arrays:  # NumPy indexes with ints only: the symbolic q_idx / kv_idx cannot reach it
            raise NotImplementedError(
                f"mask_mod {fname!r} ({_traceback_where(e)}) reads the NumPy array(s) "
                f"{arrays}: capture torch tensors instead (torch.from_numpy({arrays[0]}))"
            ) from None
        raise NotImplementedError(f"mask_mod {fname!r} ({_traceback_where(e)}): {e}") from e
    if isinstance(out, bool):
        out = _Sym(tr, sp.true if out else sp.false)
    if not isinstance(out, _Sym):
        raise TypeError(f"mask_mod {fname!r} must return a boolean tensor expression, got "
                        f"{type(out).__name__}")
    expr = _val(tr, out)
    if not _is_bool(expr):
        raise TypeError(f"mask_mod {fname!r} must return a boolean, got the integer expression "
                        f"{expr}")
    _check_table_columns(tr, expr)
    try:
        cases = _row_cases(expr)
    except (ArithmeticError, RecursionError, ValueError) as err:  # sympy could not decide
        raise NotImplementedError(
            f"mask_mod {fname!r}: its expression {str(expr)[:300]} could not be split into "
            f"row cases ({type(err).__name__}); simplify the expression, or write the rule as "
            "a MaskSpec") from None
    # the params are what the regions read (a case split can drop a row condition's array)
    used = [e for case in cases for e in case]
    used_arrays = {type(f).__name__ for e in used for f in e.atoms(sp.core.function.AppliedUndef)}
    used_scalars = {s.name for e in used for s in e.free_symbols} - {"i", "j"}
    order = {leaf: n for n, leaf in enumerate(tr.stand_ins)}
    scalars = tuple(sorted(((p, leaf) for p, leaf in tr.scalar_leaf.items()
                            if p in used_scalars), key=lambda t: order[t[1]]))
    # the gathers the rules read and, inner first, the gathers and arrays their indices read
    needed, todo = set(), [p for p in tr.derived if p in used_arrays]
    while todo:
        p = todo.pop()
        if p not in needed:
            needed.add(p)
            todo += [type(f).__name__ for f in tr.derived[p][2].atoms(
                sp.core.function.AppliedUndef) if type(f).__name__ in tr.derived]
    derived = tuple((p, *tr.derived[p]) for p in tr.derived if p in needed)
    in_index = {type(f).__name__ for *_, e in derived
                for f in e.atoms(sp.core.function.AppliedUndef)}
    index_names = {s.name for *_, e in derived for s in e.free_symbols} - {"_x"}
    arrays = tuple((p, leaf, tr.array_ndim[p]) for p, leaf in tr.array_leaf.items()
                   if p not in tr.derived and p in used_arrays)
    index_arrays = tuple((p, leaf, tr.array_ndim[p]) for p, leaf in tr.array_leaf.items()
                         if p not in tr.derived and p in in_index - used_arrays)
    index_scalars = tuple(sorted(((p, leaf) for p, leaf in tr.scalar_leaf.items()
                                  if p in index_names - used_scalars),
                                 key=lambda t: order[t[1]]))
    params = tuple([p for p, _ in scalars] + [p for p, _, _ in arrays]
                   + [p for p, *_ in derived if p in used_arrays])
    label = name or f"flex_{fname.strip('<>')}"
    regions = []
    for k, (guard, rule) in enumerate(cases):
        when = _every_row if guard is sp.true else _generated("when", "i", guard, fname)
        visible = _generated("visible", "i, j", rule, fname)
        regions.append(Region("all" if guard is sp.true else f"rows_{k}", when, visible))
    if not regions:  # the mask_mod sees nothing anywhere
        regions = [Region("all", _every_row, _generated("visible", "i, j", sp.false, fname))]
    spec = MaskSpec(label, params=list(params), regions=regions,
                    masked_scores=() if score_key is None else (score_key,))
    return (_Entry(spec, scalars, arrays, derived, index_arrays, index_scalars, params,
                   tuple(tr.shape_deps.items())), walk.leaves)


def _and_score_mask(tr, walk, mask_copy, score_mod):
    """``mask_copy`` (the traced mask_mod) and the score_mod's -inf condition, read with the
    stand-ins of the tensors that condition reads."""
    sm, tensors = score_mod_mask(score_mod)
    tables = {name: tr.stand_in(walk.by_id[id(t)]) for name, t in tensors.items()}
    sname = getattr(score_mod, "__name__", "score_mod")

    def fail(what):
        return NotImplementedError(
            f"score_mod {sname!r} gives -inf (a masked score), and {what}; compute that "
            "condition in the mask_mod (with q_idx, kv_idx and captured integer tensors) and "
            "make the score_mod finite")

    def both(b, h, q_idx, kv_idx):
        env = {_B: b, _H: h, _I: q_idx, _J: kv_idx}
        return mask_copy(b, h, q_idx, kv_idx) & rebuild_condition(sm.mask, env, tables, fail)

    return both


def _check_table_columns(tr, expr):
    """Refuse a table read at a column that may be negative where the mask depends on the read:
    torch counts such a column from the table's end (FlexAttention's kernel reads outside the
    table), the compiled table reads nothing there. Guarded reads (``(kv_idx >= p) &
    anc[q_idx, kv_idx - p]``) and clamped columns convert. Params are non-negative here, as
    preprocess checks them."""
    for read, col, name, line in tr.table_reads:
        nonneg = {s: sp.Dummy(s.name, integer=True, nonnegative=True)
                  for s in col.free_symbols}
        nonneg.update({f: sp.Dummy(type(f).__name__, integer=True, nonnegative=True)
                       for f in col.atoms(sp.core.function.AppliedUndef)})
        if col.xreplace(nonneg).is_nonnegative:
            continue
        # the rule with the read set and unset differs somewhere the column is negative
        differs = sp.Xor(expr.xreplace({read: sp.Integer(1)}),
                         expr.xreplace({read: sp.Integer(0)}))
        if differs is sp.false or not sp.satisfiable(
                _atoms_canonical(sp.And(sp.Lt(col, 0), differs).xreplace(nonneg))):
            continue
        raise NotImplementedError(
            f"mask_mod {tr.fname!r} ({line}): table {name!r} read at column {col}, which may be "
            "negative where the mask depends on the read (torch counts it from the table's "
            "end); guard the read ((kv_idx >= p) & t[q_idx, kv_idx - p]) or clamp the column")


def _atoms_canonical(e):
    """Integer relations as one boolean atom per pair (``x >= 0`` or its negation, ``x < 0``
    being ``-x - 1 >= 0``), so that the propositional check above sees ``kv_idx - p < 0`` and
    ``kv_idx >= p`` as one atom."""
    atoms: dict = {}

    def one(rel):
        d = sp.expand(rel.lhs - rel.rhs)
        x = {sp.Ge: d, sp.Gt: d - 1, sp.Le: -d, sp.Lt: -d - 1}[type(rel)]
        y = sp.expand(-x - 1)  # not (x >= 0)  <=>  y >= 0
        if x.is_nonnegative or y.is_negative:
            return sp.true
        if y.is_nonnegative or x.is_negative:
            return sp.false
        neg = sp.default_sort_key(y) < sp.default_sort_key(x)
        key = y if neg else x
        atom = atoms.setdefault(key, sp.Symbol(f"_ge{len(atoms)}"))
        return sp.Not(atom) if neg else atom
    return e.replace(lambda a: type(a) in (sp.Ge, sp.Gt, sp.Le, sp.Lt), one)


_MAX_ROW_ATOMS = 3  # up to 8 row cases


def _row_cases(expr):
    """(guard, rule) per assignment of the rule's row conditions (atoms free of j), rules that
    are False dropped: a mask_mod is one expression, but ``torch.where(q_idx < n, a, b)`` is two
    kinds of rows, and separate regions need fewer interval slots than one region holding every
    case's intervals."""
    expr = expr.replace(lambda e: isinstance(e, sp.core.relational.Relational), _one_of_pair)
    atoms = sorted({a for a in expr.atoms(sp.core.relational.Relational) if not a.has(_J)},
                   key=sp.default_sort_key)
    if not atoms or len(atoms) > _MAX_ROW_ATOMS:
        return [(sp.true, expr)]
    cases: dict = {}
    for bits in itertools.product((True, False), repeat=len(atoms)):
        rule = expr.xreplace({a: sp.true if v else sp.false for a, v in zip(atoms, bits)})
        if rule is sp.false:
            continue
        conj = sp.And(*[a if v else sp.Not(a) for a, v in zip(atoms, bits)])
        cases.setdefault(rule, []).append(conj)
    out = []
    for rule, conjs in cases.items():
        # deep=False: the atoms stay as written (simplifying them asks sympy to decide
        # comparisons of floors and maxima numerically, which can exhaust its precision)
        guard = sp.simplify_logic(sp.Or(*conjs), form="dnf", deep=False)
        if guard is not sp.false:
            out.append((guard, rule))
    return out


def _one_of_pair(rel):
    """A relation and its complement (i < a, i >= a) as one atom: the canonical one of the pair,
    negated where needed, so that a case split never assumes both."""
    a, b = rel.canonical, sp.Not(rel).canonical
    if not isinstance(b, sp.core.relational.Relational):
        return a
    return a if sp.default_sort_key(a) <= sp.default_sort_key(b) else sp.Not(b)


def _generated(role, args, e, fname):
    """A rule function from generated source (registered for the front end's reader)."""
    try:  # ITE / Xor / Implies that sympy folds nested wheres into: And / Or / Not
        body = ExprPrinter()(boolean_basis(e))
    except TypeError as err:  # a form the printer has no exact spelling for: refused
        raise NotImplementedError(
            f"mask_mod {fname!r}: its {role} expression {e} has a part this converter cannot "
            f"write exactly ({err}); rewrite that part (e.g. compare before dividing, or split "
            "the torch.where into separate conditions)") from None
    source = f"def {role}({args}):\n    return {body}\n"
    filename = f"<compilemask-from_mask_mod-{fname}-{next(_COUNTER)}>"
    register_source(filename, source)
    ns: dict = {}
    exec(compile(source, filename, "exec"), ns)
    return ns[role]


def _numpy_names(fn) -> list[str]:
    """Names of NumPy arrays among what ``fn`` reads (its globals, closure and defaults)."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    seen = {n: fn.__globals__.get(n) for n in code.co_names}
    for n, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            seen[n] = cell.cell_contents
        except ValueError:
            pass
    names = code.co_varnames[:code.co_argcount]
    seen.update(zip(names[len(names) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()))
    return sorted(n for n, v in seen.items()
                  if type(v).__name__ == "ndarray" and type(v).__module__ == "numpy")


def _traceback_where(e) -> str:
    tb = e.__traceback__
    where = "?"
    while tb is not None:
        fn = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if fn not in (_HERE, _TRACING) and not fn.startswith(_TORCH_DIR):
            where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where
