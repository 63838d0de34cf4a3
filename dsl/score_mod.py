"""``compile_score_mod``: a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` as an
expression the GPU engines evaluate, with its derivative with respect to the score.

The score_mod runs once on symbolic stand-ins, as ``from_mask_mod`` reads a mask_mod: ``score``
is a real symbol, ``b``, ``h``, ``q_idx``, ``kv_idx`` are the integer symbols ``b``, ``h``, ``i``,
``j``, and every tensor it captures (closure cells, globals, defaults, through nested functions)
is a *table*: it goes to the kernel as it is (float32 or int32; an aux tensor of FA4) and is read
where the code indexes it (``slopes[h]``, ``bias[bucket(kv_idx - q_idx), h]``, ``scale[b]``), a
negative index counting from the end as in torch. Python numbers are constants.

Read: ``+ - * / // %`` and ``**``, comparisons, ``& | ~`` of booleans, ``torch.where``,
``exp``, ``exp2``, ``log``, ``log2``, ``tanh``, ``sigmoid``, ``sqrt``, ``rsqrt``, ``sin``,
``cos``, ``abs``, ``minimum``/``maximum`` (and two-argument ``torch.min``/``torch.max``),
``clamp``, ``full_like``/``zeros_like``/``ones_like``, ``.float()``/``.long()``/``.to(...)``
(float to int truncates, as torch); NumPy scalars are the Python numbers of their values.
``-inf`` is a masked score where it is chosen or added (``torch.where(cond, score, -inf)``):
``ScoreMod.mask`` is where the value is finite, ``expr`` the value there, and the mask holds the
condition (``compilemask.dsl.score_mask``). Python control flow on a traced value, a tensor made
inside the score_mod and anything else are a NotImplementedError naming the construct and the
line.

Arithmetic is float32 (Int32 for integers) in the order sympy normalizes the expression, so a
float rounded to an integer exactly at a multiple (a log bucket's edge) can land in the
neighbouring bucket where that order rounds differently from torch's (as any two compilers of
one score_mod can); an index of the difference ``q_idx - kv_idx`` alone (``ScoreMod.relative``:
T5's bucket) is computed once per length class by this module's own evaluation and read from
that table by the GPU engines, so both engines pick the same bucket. The derivative
(``ScoreMod.grad``) is sympy's, exact; ``c * tanh(score / c)`` is recognized as a softcap
(``ScoreMod.softcap``: FA4's own under ``KernelOptions(softcap="fa4")``). Conversions are
cached by everything the score_mod reads apart from tensor values
(``compilemask.dsl.fingerprint``) plus the tables' shapes; the key (``ScoreMod.key``) is the
expression itself, so two score_mods of equal meaning share kernels.
"""

from __future__ import annotations

import hashlib
import math
import threading
import types
from dataclasses import dataclass, field

import sympy as sp
import torch

from compilemask.contract.cache import SCORE_MODS
from compilemask.contract.lru import LRU
from compilemask.dsl.fingerprint import Uncacheable as _Uncacheable
from compilemask.dsl.fingerprint import Walk as _Walk
from compilemask.dsl.fingerprint import numpy_scalar
from compilemask.dsl.tracing import KV_INDEX as _J
from compilemask.dsl.tracing import Q_INDEX as _I
from compilemask.dsl.tracing import RELATIONS as _REL
from compilemask.dsl.tracing import TracedOps, user_line

__all__ = ["ScoreMod", "compile_score_mod", "SCORE", "score_mod_for_key", "static_score_args",
           "score_mod_mask", "gpu_refusal", "traced_score_args", "follow", "kernel_table",
           "at_rows", "ROWS_TABLE"]

SCORE = sp.Symbol("score", real=True)
_B = sp.Symbol("b", integer=True, nonnegative=True)
_H = sp.Symbol("h", integer=True, nonnegative=True)
_INDEX_SYMBOLS = (_B, _H, _I, _J)
_FLOAT_DTYPES = (torch.float32, torch.float64)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
_LOCK = threading.Lock()


class trunc(sp.Function):  # noqa: N801 - sympy's spelling of functions
    """torch's float -> integer conversion (toward zero)."""

    is_integer = True

    @classmethod
    def eval(cls, x):
        if x.is_integer:
            return x
        if x.is_Number:
            return sp.Integer(int(x))
        return None

    def fdiff(self, argindex=1):
        return sp.Integer(0)  # piecewise constant


class tofloat(sp.Function):  # noqa: N801
    """An integer value converted to float (``.float()``): what is computed from it is float
    arithmetic, as in torch (``(kv_idx - q_idx).float() ** 2`` must not square in int32)."""

    is_real = True

    @classmethod
    def eval(cls, x):
        if x.is_Number:
            return sp.Float(x, 17)
        return None

    def fdiff(self, argindex=1):
        return sp.Integer(1)


class log2(sp.Function):  # noqa: N801
    """torch.log2, kept whole: ``log(x) / log(2)`` in float32 is 14.999999 at 2**15."""

    is_real = True

    @classmethod
    def eval(cls, x):
        if x.is_Integer and x > 0 and not int(x) & (int(x) - 1):
            return sp.Integer(int(x).bit_length() - 1)
        return None

    def fdiff(self, argindex=1):
        return 1 / (self.args[0] * sp.log(2))


class fdiv(sp.Function):  # noqa: N801
    """True division of two integer-valued expressions, kept whole: sympy would distribute
    ``(j - i) / 3`` into ``j/3 - i/3``, which rounds differently (a float -> int conversion of
    it then moves at exact multiples)."""

    is_real = True

    def fdiff(self, argindex=1):
        a, b = self.args
        return 1 / b if argindex == 1 else -a / b**2


@dataclass(frozen=True)
class Table:
    """A captured tensor as the kernel reads it: ``name`` in the expression, its rank and
    whether it holds floats (float32 aux tensor) or integers (int32)."""

    name: str
    ndim: int
    is_float: bool


@dataclass
class ScoreMod:
    """A compiled score_mod: ``expr`` and ``grad`` (d expr / d score) in ``SCORE``, ``b``,
    ``h``, ``i`` (q_idx), ``j`` (kv_idx) and table reads ``name(index...)``."""

    name: str
    expr: sp.Expr
    grad: sp.Expr
    tables: tuple  # Table per captured tensor, in the order aux_tensors passes them
    softcap: float | None = None
    key: str = field(default="")
    # the GPU code converts linear index expressions to float by bits where the lengths allow
    # (``codegen.cute_score_mod``; ``KernelOptions.score_index``)
    index_bits: bool = False
    # where the score_mod's value is finite (a sympy boolean in b, h, i, j and table reads), or
    # None: everywhere. Elsewhere it is -inf (``torch.where(cond, score, -inf)``): a masked
    # score, which the GPU engines read from the mask (``from_mask_mod(..., score_mod=)``);
    # ``expr`` is the value where it is finite
    mask: object = None
    # index expressions of table reads that depend on q_idx and kv_idx only through
    # ``q_idx - kv_idx`` and round a float to an integer (T5's log buckets), each as ``(expr,
    # g)`` with ``g`` its value in ``RELATIVE``: the GPU engines read them from a table over the
    # difference (``relative_table``) rather than compute them per score
    relative: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        reads = [r for e in (self.expr, self.grad) for r in e.atoms(sp.core.function.AppliedUndef)]
        args = {a for r in reads for a in r.args}
        self.relative = tuple(sorted(((a, g) for a in args if (g := _relative(a)) is not None),
                                     key=lambda p: sp.default_sort_key(p[0])))
        if not self.key:
            text = repr((sp.srepr(self.expr), self.tables, self.softcap)
                        + ((True,) if self.index_bits else ())
                        + ((sp.srepr(self.mask),) if self.mask is not None else ()))
            self.key = hashlib.sha256(text.encode()).hexdigest()[:20]

    def explain(self) -> str:
        lines = [f"score_mod {self.name!r} (key {self.key})",
                 f"  score  <- {sp.sstr(self.expr)}",
                 f"  d/dscore: {sp.sstr(self.grad)}"]
        if self.softcap is not None:
            lines.append(f"  a softcap of {self.softcap:g} (flash-attn-4's own)")
        if self.mask is not None:
            lines.append(f"  -inf (a masked score) unless {sp.sstr(self.mask)}")
        for t in self.tables:
            lines.append(f"  table {t.name}: {t.ndim}-D {'float32' if t.is_float else 'int32'}")
        return "\n".join(lines)

    def aux_tensors(self, tensors, device) -> list:
        """The captured tensors as the kernel reads them, on ``device`` (float32 / int32,
        contiguous, 0-d as one element); a conversion is made once per tensor version (torch's
        version counter: write a table through torch, not through ``.data`` or NumPy)."""
        return [_as_table(t, spec, device, self.name) for t, spec in zip(tensors, self.tables)]

    def evaluate(self, score, b, h, q_idx, kv_idx, tensors, grad: bool = False,
                 mask_tensors=None):
        """``expr`` (or ``grad``) in torch on broadcastable index tensors, floats in
        ``score``'s dtype (float32: the kernels' arithmetic): what the kernels compute, for
        tests against the score_mod as written; -inf where ``mask`` is false, whose tables
        ``mask_tensors`` gives (``score_mod_mask``)."""
        env = {SCORE: score, _B: b, _H: h, _I: q_idx, _J: kv_idx}
        tabs = {t.name: x for t, x in zip(self.tables, tensors)}
        out = _torch_eval(self.grad if grad else self.expr, env, tabs, score.dtype).to(
            score.dtype)
        if self.mask is None:
            return out
        # the masked scores: -inf (their derivative 0), as the mask that holds them gives
        tabs.update(mask_tensors or {})
        keep = _torch_eval(self.mask, env, tabs, score.dtype)
        return torch.where(keep, out, 0.0 if grad else float("-inf")).to(score.dtype)

    def table_reads(self, table: int) -> tuple:
        """``(read, d expr / d read)`` for each read of float table ``table`` (its position in
        ``tables``) in ``expr``: a table's gradient collects ``dM * d expr / d read`` at each
        read's index (``docs/decisions/trainable-score-tables.md``)."""
        tab = self.tables[table]
        if not tab.is_float:
            raise TypeError(f"score_mod {self.name!r}: table {tab.name} holds integers (no "
                            "gradient)")
        stand_in = sp.Dummy("read", real=True)
        out = []
        reads = [r for r in self.expr.atoms(sp.core.function.AppliedUndef)
                 if type(r).__name__ == tab.name]
        for r in sorted(reads, key=sp.default_sort_key):
            d = sp.diff(self.expr.xreplace({r: stand_in}), stand_in).xreplace({stand_in: r})
            if d.has(sp.Derivative, sp.Subs, sp.Heaviside, sp.DiracDelta):
                raise NotImplementedError(
                    f"score_mod {self.name!r}: no closed-form derivative of "
                    f"{sp.sstr(self.expr)} with respect to {sp.sstr(r)}")
            out.append((r, d))
        return tuple(out)

    def relative_table(self, n: int, reach: int, device) -> torch.Tensor:
        """int32 ``[2 * reach - 1]``: relative index ``n``'s value at each ``q_idx - kv_idx``
        from ``-(reach - 1)`` to ``reach - 1`` (position ``d + reach - 1``), computed as the
        reference engine computes it (float32 arithmetic), so that both engines read one
        value; saturated to int32 (the read clamps it into its table either way)."""
        _, g = self.relative[n]
        d = torch.arange(-(reach - 1), reach, device=device, dtype=torch.int64)
        val = _torch_eval(g, {RELATIVE: d}, {}, torch.float32).long().expand(d.shape)
        return val.clamp(-(2**31), 2**31 - 1).to(torch.int32).contiguous()

    def table_grads(self, score, b, h, q_idx, kv_idx, tensors, dm, train) -> list:
        """The gradients of the tables at positions ``train`` given ``dm`` (d loss / d the
        modified score, broadcast with the indices) in torch, as the kernels accumulate them:
        each read's ``dm * d expr / d read`` added at its index, negative indices counted from
        the end and every index clamped into the table (for tests against autograd)."""
        env = {SCORE: score, _B: b, _H: h, _I: q_idx, _J: kv_idx}
        tabs = {t.name: x for t, x in zip(self.tables, tensors)}
        grads = []
        for n in train:
            t = tensors[n]
            g = torch.zeros(t.shape if t.dim() else (1,), dtype=torch.float64)
            for r, d in self.table_reads(n):
                val = (dm * _torch_eval(d, env, tabs, score.dtype)).double()
                idx = []
                for k, a in enumerate(r.args if t.dim() else ()):
                    x = _torch_eval(a, env, tabs, score.dtype).long()
                    x = torch.where(x < 0, x + t.shape[k], x).clamp(0, t.shape[k] - 1)
                    idx.append(x)
                if not idx:
                    idx = [torch.zeros((), dtype=torch.long)]
                shape = torch.broadcast_shapes(val.shape, *(x.shape for x in idx))
                g.index_put_(tuple(x.expand(shape).reshape(-1) for x in idx),
                             val.expand(shape).reshape(-1), accumulate=True)
            grads.append(g.view(t.shape))
        return grads


# q_idx - kv_idx, the variable of a relative index's table (``ScoreMod.relative``)
RELATIVE = sp.Symbol("d", integer=True)
# a float rounded to an integer: a relative index worth a table (computed per score, its log
# or division costs more than the table's load)
_ROUNDED = (trunc, sp.floor)


def _relative(a):
    """``a`` as an expression in ``RELATIVE`` when it reads q_idx and kv_idx only through their
    difference, reads no table, batch or head, and rounds a float; else None."""
    if a.free_symbols != {_I, _J} or a.atoms(sp.core.function.AppliedUndef):
        return None
    if not any(isinstance(x, _ROUNDED) and not x.args[0].is_integer
               for x in sp.preorder_traversal(a)):
        return None
    g = a.subs(_I, _J + RELATIVE)
    return g if g.free_symbols == {RELATIVE} else None


# the table a score_mod at the rows' positions reads last (``at_rows``); user tables are
# named ``tab<leaf>...``, so the name cannot collide
ROWS_TABLE = "rowpos"


@torch.compiler.assume_constant_result
def at_rows(key: str, per_row: bool) -> str:
    """The key of the score_mod ``key`` reading ``q_idx`` as its row's position, for
    descriptors whose rows are not positions ``0..`` (served rows, context-parallel shards):
    ``rowpos[b] + q_idx`` (``per_row`` False: an int32 ``[B]`` table, each sequence's position
    of its local row 0) or ``rowpos[b, q_idx]`` (int32 ``[B, Sq]``, each row's position). The
    caller passes that table after the score_mod's own; the GPU engines then compute at the
    positions what the reference engine computes (no per-row-constant restriction, the LSE
    exact). Registered like the score_mod (``score_mod_for_key``)."""
    moved = _AT_ROWS.get((key, per_row))
    if moved is not None:
        return moved.key
    sm = score_mod_for_key(key)
    if _I not in sm.expr.free_symbols and (sm.mask is None or _I not in sm.mask.free_symbols):
        return key
    rows = sp.Function(ROWS_TABLE, integer=True)
    pos = rows(_B, _I) if per_row else rows(_B) + _I
    moved = ScoreMod(f"{sm.name}@rows", sm.expr.subs(_I, pos), sm.grad.subs(_I, pos),
                     sm.tables + (Table(ROWS_TABLE, 2 if per_row else 1, False),), sm.softcap,
                     index_bits=sm.index_bits,
                     mask=None if sm.mask is None else sm.mask.subs(_I, pos))
    moved.row_shift = "none"
    for attr in ("used_leaves", "mask_leaves", "mask_tables"):
        setattr(moved, attr, getattr(sm, attr, ()))
    moved = SCORE_MODS.find(moved.key) or moved
    SCORE_MODS.register(moved.key, moved)
    _AT_ROWS[(key, per_row)] = moved  # alive while recently used (the registry holds it weakly)
    return moved.key


_AT_ROWS = LRU(256)


def score_mod_for_key(key: str) -> ScoreMod:
    """The converted score_mod of a key (``contract.cache.SCORE_MODS``: bounded, see there)."""
    return SCORE_MODS.get(key)


# --------------------------------------------------------------------------------------------
# tracing
# --------------------------------------------------------------------------------------------


class _Trace:
    def __init__(self, fname: str):
        self.fname = fname
        self.stand_ins: dict = {}
        self.tables: dict[int, Table] = {}  # leaf -> table
        self.narrow: dict = {}  # table name -> its int8 / uint8 / int16 dtype

    def fail(self, what: str):
        return NotImplementedError(f"score_mod {self.fname!r} ({user_line(__file__)}): {what}")

    def new_stand_in(self, leaf, name, tensor):
        if tensor.dtype not in _FLOAT_DTYPES + _INT_DTYPES:
            raise self.fail(f"captured tensor {name!r} of dtype {tensor.dtype} (float32/64 "
                            "or an integer/bool dtype)")
        tab = Table(f"tab{leaf}_{name}" if name.isidentifier() else f"tab{leaf}",
                    tensor.dim(), tensor.dtype in _FLOAT_DTYPES)
        self.tables[leaf] = tab
        if tensor.dtype in (torch.int8, torch.uint8, torch.int16):
            self.narrow[tab.name] = tensor.dtype
        s = _Tab(self, tab, tensor, tensor.dtype)
        if tensor.dim() == 0:  # a scalar tensor reads as its value
            s = s._read(())
        self.stand_ins[leaf] = s
        return s

    def stand_in(self, leaf):
        return self.stand_ins[leaf]


class _Ops(TracedOps):
    __slots__ = ()
    UNCAPTURED = ("a tensor made inside the score_mod, or read as an attribute, in '{name}': "
                  "capture it as a closure variable or global")


def _v(tr, x) -> "_V":
    """An operand as a traced value."""
    if isinstance(x, _V):
        return x
    if isinstance(x, _Tab):
        raise tr.fail(f"captured tensor {x.tab.name.split('_', 1)[-1]!r} used without an index "
                      "(a score_mod reads one element: t[h], t[q_idx - kv_idx], ...)")
    if isinstance(x, bool):
        return _V(tr, sp.true if x else sp.false, "b")
    if isinstance(x, int):
        return _V(tr, sp.Integer(x), "i")
    if isinstance(x, float):
        if x == -math.inf:  # a masked score (its value there: any finite number)
            return _V(tr, sp.Float(0), "f", sp.false)
        if not math.isfinite(x):
            raise tr.fail(f"the constant {x!r} (a score_mod's value is finite, or -inf: a "
                          "masked score)")
        return _V(tr, sp.Float(x, 17), "f")
    if isinstance(x, torch.Tensor):
        raise tr.fail("a tensor made inside the score_mod, or read as an attribute: capture it "
                      "as a closure variable or global")
    raise tr.fail(f"a value of type {type(x).__name__}")


_MASKED_REWRITE = ("a score_mod's -inf is a masked score, read as such where it is chosen or "
                   "added (torch.where(cond, score, -float('inf')), score + bias with bias "
                   "-inf somewhere, times a positive constant); compute the finite score first "
                   "and mask last: torch.where(cond, score_expr, -float('inf'))")


def _finite(x) -> "_V":
    """``x`` where it is finite."""
    return x if x.fin is None else _V(x.tr, x.e, x.kind)


def _fin(x):
    return sp.true if x.fin is None else x.fin


def _masked_arith(tr, op, a, b):
    """``a op b`` where one side may be -inf: -inf + x and -inf * c (c > 0) stay -inf; what
    would be +inf or NaN (-inf - -inf, -inf * x of unknown sign) is refused."""
    def positive(x):
        return x.fin is None and x.e.is_Number and x.e > 0

    if op == "+" or (op == "-" and b.fin is None):
        fin = sp.And(_fin(a), _fin(b))
    elif op in ("*", "/") and a.fin is not None and positive(b):
        fin = a.fin
    elif op == "*" and b.fin is not None and positive(a):
        fin = b.fin
    else:
        raise tr.fail(f"'{op}' of a value that may be -inf, which is +inf or NaN there or of "
                      f"unknown sign; {_MASKED_REWRITE}")
    out = _arith(tr, op, _finite(a), _finite(b))
    return _V(tr, out.e, out.kind, fin)


def _num(tr, x, what) -> "_V":
    x = _v(tr, x)
    if x.fin is not None:
        raise tr.fail(f"a value that may be -inf in '{what}'; {_MASKED_REWRITE}")
    if x.kind == "b":  # torch promotes booleans in arithmetic
        return _V(tr, sp.Piecewise((sp.Integer(1), x.e), (sp.Integer(0), True)), "i")
    return x


def _kind(*xs) -> str:
    return "f" if any(x.kind == "f" for x in xs) else "i"


def _arith(tr, op, a, b):
    a, b = _v(tr, a), _v(tr, b)
    if a.fin is not None or b.fin is not None:
        return _masked_arith(tr, op, a, b)
    if op == "-" and "b" in (a.kind, b.kind):  # torch refuses it
        raise tr.fail("'-' with a boolean (torch refuses it; ~ negates a boolean)")
    if a.kind == "b" and b.kind == "b" and op in ("+", "*"):
        # torch keeps bool + bool a bool (or), bool * bool (and)
        return _V(tr, (sp.Or if op == "+" else sp.And)(a.e, b.e), "b")
    _check_narrow(tr, op, a, b)
    a, b = _num(tr, a, op), _num(tr, b, op)
    if op == "+":
        return _V(tr, a.e + b.e, _kind(a, b))
    if op == "-":
        return _V(tr, a.e - b.e, _kind(a, b))
    if op == "*":
        return _V(tr, a.e * b.e, _kind(a, b))
    if op == "/":
        if a.e.is_integer and b.e.is_integer and not b.e.is_Number:
            return _V(tr, fdiv(a.e, b.e), "f")
        if a.e.is_integer and isinstance(a.e, sp.Add) and b.e.is_Number:
            return _V(tr, fdiv(a.e, b.e), "f")
        return _V(tr, a.e / b.e, "f")
    if op == "//":
        return _V(tr, sp.floor(a.e / b.e), _kind(a, b))
    if op == "%":
        if _kind(a, b) == "f":
            raise tr.fail("% of floats")
        return _V(tr, sp.Mod(a.e, b.e), "i")
    if op == "**":
        if b.e.is_Float and b.e == int(b.e):  # x ** 2.0 is x * x in torch, also for x < 0
            b = _V(tr, sp.Integer(int(b.e)), "f")
        if _kind(a, b) == "i" and not (b.e.is_Integer and int(b.e) >= 0):
            raise tr.fail("an integer raised to a non-constant or negative power")
        return _V(tr, a.e ** b.e, _kind(a, b))
    raise tr.fail(op if op.startswith("torch.") else f"operator {op!r}")


def _check_narrow(tr, op, a, b) -> None:
    """int8 / uint8 / int16 arithmetic wraps in torch where both sides keep that dtype (two
    such reads, or one and a Python number); the kernels compute in int32: refused."""
    def narrow(x):
        return isinstance(x.e, sp.core.function.AppliedUndef) and type(x.e).__name__ in tr.narrow

    def constant(x):
        return x.e.is_Number and x.kind != "f"

    if (narrow(a) and (narrow(b) or constant(b))) or (narrow(b) and constant(a)):
        name = type(a.e if narrow(a) else b.e).__name__.split("_", 1)[-1]
        raise tr.fail(f"'{op}' on captured tensor {name!r} of dtype "
                      f"{tr.narrow[type(a.e if narrow(a) else b.e).__name__]} keeps its dtype "
                      "in torch, which wraps; convert it first (.long() or .int())")


def _compare(tr, op, a, b):
    a, b = _num(tr, a, op), _num(tr, b, op)
    return _V(tr, _REL[op](a.e, b.e), "b")


def _logic(tr, op, a, b):
    a, b = _v(tr, a), _v(tr, b)
    if a.kind != "b" or b.kind != "b":
        raise tr.fail(f"'{op}' of integers (score_mods read & | ^ of booleans only)")
    f = {"&": sp.And, "|": sp.Or, "^": sp.Xor}[op]
    return _V(tr, f(a.e, b.e), "b")


def _select(tr, c, a, b):
    c = _v(tr, c)
    if c.kind != "b":
        raise tr.fail("torch.where's condition is not a boolean")
    a, b = _v(tr, a), _v(tr, b)
    if a.fin is not None or b.fin is not None:
        if a.kind == "b" or b.kind == "b":
            raise tr.fail(f"torch.where of a boolean and a value that may be -inf; "
                          f"{_MASKED_REWRITE}")
        # a side that is only -inf needs no value: the other side's is kept everywhere
        if b.fin is sp.false:
            return _V(tr, a.e, "f", sp.And(c.e, _fin(a)))
        if a.fin is sp.false:
            return _V(tr, b.e, "f", sp.And(sp.Not(c.e), _fin(b)))
        out = _select(tr, c, _finite(a), _finite(b))
        return _V(tr, out.e, "f", sp.Or(sp.And(c.e, _fin(a)), sp.And(sp.Not(c.e), _fin(b))))
    if a.kind == "b" and b.kind == "b":
        return _V(tr, sp.Or(sp.And(c.e, a.e), sp.And(sp.Not(c.e), b.e)), "b")
    a, b = _num(tr, a, "where"), _num(tr, b, "where")
    return _V(tr, sp.Piecewise((a.e, c.e), (b.e, True)), _kind(a, b))


def _min_max(tr, kind, a, b):
    a, b = _num(tr, a, kind), _num(tr, b, kind)
    k = _kind(a, b)
    if k == "i":
        return _V(tr, (sp.Min if kind == "min" else sp.Max)(a.e, b.e), "i")
    # floats as a select: its derivative is the chosen side's (sympy's Min/Max give Heaviside)
    c = sp.Le(a.e, b.e) if kind == "min" else sp.Ge(a.e, b.e)
    return _V(tr, sp.Piecewise((a.e, c), (b.e, True)), "f")


def _abs(tr, a):
    a = _num(tr, a, "abs")
    if a.kind == "i":
        return _V(tr, sp.Abs(a.e), "i")
    return _V(tr, sp.Piecewise((a.e, sp.Ge(a.e, 0)), (-a.e, True)), "f")


def _clamp(tr, x, lo=None, hi=None):
    x = _num(tr, x, "clamp")
    if lo is not None:
        x = _min_max(tr, "max", x, lo)
    if hi is not None:
        x = _min_max(tr, "min", x, hi)
    return x


def _float_fn(fn):
    def apply(tr, a, *args, **kwargs):
        if args or kwargs:
            raise tr.fail("extra arguments of a math function")
        return _V(tr, fn(_num(tr, a, "a math function").e), "f")
    return apply


def _to(tr, x, dtype):
    x = _v(tr, x)
    if x.fin is not None and dtype in _FLOAT_DTYPES:
        return x
    if x.fin is not None:
        raise tr.fail(f"a conversion to {dtype} of a value that may be -inf; {_MASKED_REWRITE}")
    if dtype in _FLOAT_DTYPES:
        if x.kind == "b":
            x = _num(tr, x, "float")
        return _V(tr, tofloat(x.e) if x.kind == "i" else x.e, "f")
    if dtype in (torch.int8, torch.uint8, torch.int16) and not (
            x.kind == "b" or (x.e.is_Number and _fits(x.e, dtype))):
        raise tr.fail(f"a conversion to {dtype}, which wraps in torch (the kernels compute "
                      "in int32)")
    if dtype is torch.bool:
        return x if x.kind == "b" else _V(tr, sp.Ne(x.e, 0), "b")
    if dtype in _INT_DTYPES:
        x = _num(tr, x, "int")
        return _V(tr, trunc(x.e) if x.kind == "f" else x.e, "i")
    raise tr.fail(f"a conversion to {dtype} (its rounding is not reproduced: float32, float64, "
                  "integers, bool)")


def _fits(n, dtype) -> bool:
    info = torch.iinfo(dtype)
    return n.is_Integer and info.min <= int(n) <= info.max


def _like(tr, x, value, dtype=None, **kwargs):
    """``torch.full_like(x, value)`` (``zeros_like`` / ``ones_like``): ``value`` in ``x``'s kind
    (or ``dtype``'s), as torch converts it; ``x`` only gives that kind."""
    if isinstance(x, _Tab):
        raise tr.fail(f"'*_like' of captured tensor {x._label()} (index it: t[h], ...)")
    x = _v(tr, x)
    value = numpy_scalar(value) if numpy_scalar(value) is not None else value
    if isinstance(value, _V) or not isinstance(value, (bool, int, float)):
        raise tr.fail("torch.full_like with a fill value that is not a Python number")
    kind = x.kind if dtype is None else (
        "b" if dtype is torch.bool else "f" if dtype in _FLOAT_DTYPES else
        "i" if dtype in _INT_DTYPES else None)
    if kind is None:
        raise tr.fail(f"torch.full_like with dtype {dtype} (float32, float64, integers, bool)")
    if kind == "b":
        return _V(tr, sp.true if value else sp.false, "b")
    if kind == "i":
        if isinstance(value, float) and not math.isfinite(value):
            raise tr.fail(f"torch.full_like of an integer value with {value!r}")
        return _V(tr, sp.Integer(int(value)), "i")
    return _to(tr, _v(tr, float(value)), torch.float32)


def _reduce_or_min_max(kind):
    def apply(tr, a, b=None, *rest, **kwargs):
        if b is None or rest or kwargs or not isinstance(b, _V):  # torch.min(x, dim)
            raise tr.fail(f"torch.{kind} of one value (a reduction; a score_mod reads "
                          f"torch.{kind}(a, b) of two values)")
        return _min_max(tr, kind, a, b)
    return apply


_TORCH_FUNCS = {
    torch.where: _select,
    torch.full_like: _like,
    torch.zeros_like: lambda tr, x, dtype=None, **kw: _like(tr, x, 0, dtype),
    torch.ones_like: lambda tr, x, dtype=None, **kw: _like(tr, x, 1, dtype),
    torch.min: _reduce_or_min_max("min"),
    torch.max: _reduce_or_min_max("max"),
    torch.minimum: lambda tr, a, b: _min_max(tr, "min", a, b),
    torch.maximum: lambda tr, a, b: _min_max(tr, "max", a, b),
    torch.abs: _abs,
    torch.clamp: lambda tr, x, min=None, max=None: _clamp(tr, x, min, max),  # noqa: A006
    torch.clip: lambda tr, x, min=None, max=None: _clamp(tr, x, min, max),  # noqa: A006
    torch.exp: _float_fn(sp.exp),
    torch.exp2: _float_fn(lambda x: sp.Integer(2) ** x),
    torch.log: _float_fn(sp.log),
    torch.log2: _float_fn(log2),
    torch.tanh: _float_fn(sp.tanh),
    torch.sigmoid: _float_fn(lambda x: 1 / (1 + sp.exp(-x))),
    torch.sqrt: _float_fn(sp.sqrt),
    torch.rsqrt: _float_fn(lambda x: 1 / sp.sqrt(x)),
    torch.sin: _float_fn(sp.sin),
    torch.cos: _float_fn(sp.cos),
    torch.add: lambda tr, a, b: _arith(tr, "+", a, b),
    torch.sub: lambda tr, a, b: _arith(tr, "-", a, b),
    torch.mul: lambda tr, a, b: _arith(tr, "*", a, b),
    torch.div: lambda tr, a, b, rounding_mode=None: _arith(
        tr, "/" if rounding_mode is None else "//" if rounding_mode == "floor" else
        f"torch.div with rounding_mode={rounding_mode!r} (floor division: // or "
        "rounding_mode='floor')", a, b),
    torch.true_divide: lambda tr, a, b: _arith(tr, "/", a, b),
    torch.floor_divide: lambda tr, a, b: _arith(tr, "//", a, b),
    torch.remainder: lambda tr, a, b: _arith(tr, "%", a, b),
    torch.pow: lambda tr, a, b: _arith(tr, "**", a, b),
    torch.neg: lambda tr, a: _arith(tr, "-", 0, a),
    torch.eq: lambda tr, a, b: _compare(tr, "==", a, b),
    torch.ne: lambda tr, a, b: _compare(tr, "!=", a, b),
    torch.lt: lambda tr, a, b: _compare(tr, "<", a, b),
    torch.le: lambda tr, a, b: _compare(tr, "<=", a, b),
    torch.gt: lambda tr, a, b: _compare(tr, ">", a, b),
    torch.ge: lambda tr, a, b: _compare(tr, ">=", a, b),
    torch.logical_and: lambda tr, a, b: _logic(tr, "&", a, b),
    torch.logical_or: lambda tr, a, b: _logic(tr, "|", a, b),
    torch.logical_not: lambda tr, a: _V(tr, sp.Not(_v(tr, a).e), "b"),
}


_Ops.FUNCS = _TORCH_FUNCS


def _binop(op, fn):
    def forward(self, other):
        return fn(self.tr, op, self, other)

    def reflected(self, other):
        return fn(self.tr, op, other, self)

    return forward, reflected


class _V(_Ops):
    """A traced value: a sympy expression and its kind ("f" float, "i" integer, "b" bool);
    ``fin``: where a float that may be -inf is finite (None: everywhere), ``e`` its value
    there."""

    __slots__ = ("tr", "e", "kind", "fin")

    def __init__(self, tr, e, kind, fin=None):
        self.tr, self.e, self.kind, self.fin = tr, e, kind, fin

    __add__, __radd__ = _binop("+", _arith)
    __sub__, __rsub__ = _binop("-", _arith)
    __mul__, __rmul__ = _binop("*", _arith)
    __truediv__, __rtruediv__ = _binop("/", _arith)
    __floordiv__, __rfloordiv__ = _binop("//", _arith)
    __mod__, __rmod__ = _binop("%", _arith)
    __pow__, __rpow__ = _binop("**", _arith)
    __and__, __rand__ = _binop("&", _logic)
    __or__, __ror__ = _binop("|", _logic)
    __xor__, __rxor__ = _binop("^", _logic)
    __lt__, __gt__ = _binop("<", _compare)[0], _binop(">", _compare)[0]
    __le__, __ge__ = _binop("<=", _compare)[0], _binop(">=", _compare)[0]
    __eq__, __ne__ = _binop("==", _compare)[0], _binop("!=", _compare)[0]
    __hash__ = _Ops.__hash__

    def __neg__(self):
        if self.kind == "b":
            raise self.tr.fail("'-' of a boolean (torch refuses it; use ~)")
        return _arith(self.tr, "-", 0, self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _abs(self.tr, self)

    def __invert__(self):
        if self.kind != "b":
            raise self.tr.fail("'~' of an integer (score_mods read ~ of booleans only)")
        return _V(self.tr, sp.Not(self.e), "b")

    def __getattr__(self, name):
        if name.startswith("_") or name in ("tr", "e", "kind", "fin"):
            raise AttributeError(name)
        fn = _METHODS.get(name)
        if fn is None:
            raise self.tr.fail(f"tensor method or attribute '.{name}'")
        return lambda *a, **k: fn(self.tr, self, *a, **k)


_METHODS = {
    "exp": _TORCH_FUNCS[torch.exp], "exp2": _TORCH_FUNCS[torch.exp2],
    "log": _TORCH_FUNCS[torch.log], "log2": _TORCH_FUNCS[torch.log2],
    "tanh": _TORCH_FUNCS[torch.tanh], "sigmoid": _TORCH_FUNCS[torch.sigmoid],
    "sqrt": _TORCH_FUNCS[torch.sqrt], "rsqrt": _TORCH_FUNCS[torch.rsqrt],
    "sin": _TORCH_FUNCS[torch.sin], "cos": _TORCH_FUNCS[torch.cos],
    "abs": _abs, "neg": _TORCH_FUNCS[torch.neg],
    "clamp": lambda tr, x, min=None, max=None: _clamp(tr, x, min, max),  # noqa: A006
    "clamp_min": lambda tr, x, lo: _clamp(tr, x, lo, None),
    "clamp_max": lambda tr, x, hi: _clamp(tr, x, None, hi),
    "minimum": _TORCH_FUNCS[torch.minimum], "maximum": _TORCH_FUNCS[torch.maximum],
    "where": lambda tr, x, c, other: _select(tr, c, x, other),
    "float": lambda tr, x: _to(tr, x, torch.float32),
    "double": lambda tr, x: _to(tr, x, torch.float64),
    "long": lambda tr, x: _to(tr, x, torch.int64),
    "int": lambda tr, x: _to(tr, x, torch.int32),
    "bool": lambda tr, x: _to(tr, x, torch.bool),
    "to": lambda tr, x, *a, dtype=None, **k: _to(
        tr, x, dtype if dtype is not None else next((d for d in a if isinstance(d, torch.dtype)),
                                                    None)),
    "reciprocal": lambda tr, x: _arith(tr, "/", 1.0, x),
    "square": lambda tr, x: _arith(tr, "*", x, x),
}


class _Tab(_Ops):
    """A captured tensor: reads of one element at index expressions."""

    __slots__ = ("tr", "tab", "shape", "dtype")

    def __init__(self, tr, tab, tensor, dtype):
        self.tr, self.tab, self.shape, self.dtype = tr, tab, tuple(tensor.shape), dtype

    def size(self, dim=None):
        return torch.Size(self.shape) if dim is None else self.shape[dim]

    def dim(self):
        return len(self.shape)

    @property
    def ndim(self):
        return len(self.shape)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != len(self.shape):
            raise self.tr.fail(f"captured tensor {self._label()} of shape {list(self.shape)} "
                               f"indexed by {len(idx)} index(es): a score_mod reads one element")
        args = []
        for x in idx:
            if x is None or isinstance(x, (slice, type(Ellipsis))):
                raise self.tr.fail(f"slicing captured tensor {self._label()}")
            v = _v(self.tr, x)
            if v.kind != "i":
                raise self.tr.fail(f"captured tensor {self._label()} indexed by a "
                                   f"{'float' if v.kind == 'f' else 'boolean'}")
            if SCORE in v.e.free_symbols:
                raise self.tr.fail(f"captured tensor {self._label()} indexed by the score")
            args.append(v.e)
        return self._read(tuple(args))

    def _read(self, args):
        f = sp.Function(self.tab.name, real=True) if self.tab.is_float else sp.Function(
            self.tab.name, integer=True)
        e = f(*args) if args else f(sp.Integer(0))
        if self.dtype is torch.bool:
            return _V(self.tr, sp.Ne(e, 0), "b")
        return _V(self.tr, e, "f" if self.tab.is_float else "i")

    def _label(self):
        return repr(self.tab.name.split("_", 1)[-1])

    def __getattr__(self, name):
        if name.startswith("_") or name in ("tr", "tab", "shape", "dtype"):
            raise AttributeError(name)
        raise self.tr.fail(f"'.{name}' of captured tensor {self._label()} (index it: t[h], "
                           "t[kv_idx - q_idx], ...)")


# --------------------------------------------------------------------------------------------
# compile
# --------------------------------------------------------------------------------------------
_CACHE = LRU(1024)  # conversion key -> ScoreMod; bounded: a new captured value is a new key


def _check_signature(score_mod):
    import inspect

    try:
        sig = inspect.signature(score_mod)
    except (TypeError, ValueError):
        raise TypeError(f"score_mod must be a Python function score_mod(score, b, h, q_idx, "
                        f"kv_idx), got {type(score_mod).__name__}") from None
    required = [p for p in sig.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 5 or (len(positional) < 5 and not any(
            p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())):
        raise TypeError(f"score_mod {getattr(score_mod, '__name__', score_mod)!r} must take "
                        f"(score, b, h, q_idx, kv_idx), got {sig}")


def compile_score_mod(score_mod, name: str | None = None) -> tuple[ScoreMod, list]:
    """``(ScoreMod, tensors)``: the score_mod's expression and the tensors it captures now (in
    ``ScoreMod.tables`` order). Calls with the same code and values read return the same
    ScoreMod; only the tensors are collected again."""
    sm, leaves = _compiled(score_mod, name)
    return sm, [leaves[k] for k in sm.used_leaves]


_REFUSED = LRU(1024)  # conversion key -> the converter's message, for gpu_refusal


def gpu_refusal(score_mod) -> str | None:
    """None where the GPU engines' converter compiles ``score_mod``, else its message (naming
    the construct and the user's line); a refusal is remembered by the conversion key, so a
    score_mod that does not convert is traced once, not at every call."""
    walk = _Walk()
    try:
        key = (walk.value(score_mod, "score_mod")[0], None,
               tuple((tuple(t.shape), t.dtype) for t in walk.leaves))
        if _CACHE.get(key) is not None:
            return None
        why = _REFUSED.get(key)
        if why is not None:
            return why
    except _Uncacheable:
        key = None
    try:
        _compiled(score_mod, None)
        return None
    except (NotImplementedError, TypeError) as e:
        if key is not None:
            _REFUSED[key] = str(e)
        return str(e)


def score_mod_mask(score_mod) -> tuple:
    """``(ScoreMod, {table name: tensor})``: the compiled score_mod and the tensors its -inf
    condition (``ScoreMod.mask``) reads, by the names that condition reads them as."""
    sm, leaves = _compiled(score_mod, None)
    return sm, {t.name: leaves[k] for t, k in zip(sm.mask_tables, sm.mask_leaves)}


def _compiled(score_mod, name):
    if isinstance(score_mod, ScoreMod):
        raise TypeError("compile_score_mod takes the FlexAttention score_mod itself")
    _check_signature(score_mod)
    walk = _Walk()
    try:
        key = walk.value(score_mod, "score_mod")[0]
        key = (key, name, tuple((tuple(t.shape), t.dtype) for t in walk.leaves))
        sm = _CACHE.get(key)
    except _Uncacheable:
        key, sm = None, None
    leaves = walk.leaves
    if sm is None:
        try:
            sm, leaves = _convert(score_mod, name)
        except RecursionError:  # sympy's Piecewise folding of some comparisons used as numbers
            raise NotImplementedError(
                f"score_mod {getattr(score_mod, '__name__', 'score_mod')!r}: an expression the "
                "converter cannot simplify (a comparison of two index expressions used as a "
                "number); compare their difference with a constant instead "
                "((3 * kv_idx - 2 * q_idx > 0).float())") from None
        if key is not None:
            _CACHE[key] = sm
    return sm, leaves


def _convert(score_mod, name):
    fname = getattr(score_mod, "__name__", "score_mod")
    tr = _Trace(fname)
    walk = _Walk(tr)
    _, copy = walk.value(score_mod, "score_mod")
    args = [_V(tr, SCORE, "f")] + [_V(tr, s, "i") for s in _INDEX_SYMBOLS]
    try:
        out = copy(*args)
    except (TypeError, AttributeError) as e:
        raise NotImplementedError(f"score_mod {fname!r}: {e}") from e
    out = _v(tr, out) if isinstance(out, (_V, int, float)) and not isinstance(out, bool) else out
    if not isinstance(out, _V) or out.kind == "b":
        raise TypeError(f"score_mod {fname!r} must return the modified score (a number), got "
                        f"{'a boolean' if isinstance(out, _V) else type(out).__name__}")
    expr, mask = out.e, out.fin
    if mask is not None:
        mask = sp.simplify_logic(mask) if mask.is_Boolean and len(mask.atoms(
            sp.core.relational.Relational)) <= 6 else mask
        if mask is sp.false:
            raise NotImplementedError(f"score_mod {fname!r} is -inf at every score (every score "
                                      "masked)")
        if mask is sp.true:
            mask = None
    # the tables the expression reads, in leaf order (an unused capture is not passed)
    names = {type(f).__name__ for f in expr.atoms(sp.core.function.AppliedUndef)}
    used = [k for k, t in sorted(tr.tables.items()) if t.name in names]
    tables = tuple(tr.tables[k] for k in used)
    mnames = ({type(f).__name__ for f in mask.atoms(sp.core.function.AppliedUndef)}
              if mask is not None else set())
    grad = sp.diff(expr, SCORE)
    if grad.has(sp.Derivative) or grad.has(sp.Subs):
        raise NotImplementedError(f"score_mod {fname!r}: no closed-form derivative of "
                                  f"{sp.sstr(expr)} with respect to the score")
    sm = ScoreMod(name or fname, expr, grad, tables, _softcap(expr), mask=mask)
    sm.used_leaves = tuple(used)
    # the tables the -inf condition reads: metadata of the mask it joins
    sm.mask_leaves = tuple(k for k, t in sorted(tr.tables.items()) if t.name in mnames)
    sm.mask_tables = tuple(tr.tables[k] for k in sm.mask_leaves)
    sm.row_shift = _row_shift(expr)
    known = SCORE_MODS.find(sm.key)
    sm = known if known is not None and _same(known, sm) else sm
    SCORE_MODS.register(sm.key, sm)
    return sm, walk.leaves


@torch.compiler.assume_constant_result
def static_score_args(score_mod) -> tuple:
    """``(key, paths, is_float, row_shift, constants)`` of a score_mod, for a traced call
    (``torch.compile``): the conversion runs once, outside the graph, and each table is reached
    from the score_mod by its path (``follow``), which the tracer can read. ``constants``:
    ``(path, value)`` of each Python number or string the score_mod can read (closure cells,
    globals, defaults, items, nested functions), which the caller compares in the graph
    (``same_constant``) so that its guards cover them: the key is a constant of the graph,
    and a changed value must compile again."""
    sm, tables = compile_score_mod(score_mod)
    paths = []
    for t in tables:
        path = _path_to(score_mod, t, 0, set())
        if path is None:
            raise NotImplementedError(
                f"score_mod {sm.name!r}: a captured tensor is reached through an object's "
                "attribute, which a compiled graph cannot follow; capture it as a closure "
                "variable, a global or a default")
        paths.append(path)
    consts = []
    _constants(score_mod, (), 0, set(), consts)
    return (sm.key, tuple(paths), tuple(t.is_float for t in sm.tables), sm.row_shift,
            tuple(consts))


def traced_score_args(score_mod) -> tuple:
    """``(key, tables as the kernels read them, row_shift)`` of a score_mod inside a traced
    call (``torch.compile``): the conversion's constant result, the tables read from the
    score_mod where the graph can follow them, and every constant it reads compared in the
    graph, so that the graph's guards cover it (a changed global scale compiles again)."""
    key, paths, floats, row_shift, consts = static_score_args(score_mod)
    try:
        for path, value in consts:
            if not same_constant(follow(score_mod, path), value):
                raise RuntimeError(f"score_mod {getattr(score_mod, '__name__', '')!r}: a "
                                   "constant changed while traced")
        tables = [follow(score_mod, p) for p in paths]
    except AttributeError:  # the tracer cannot read a closure made inside the graph
        raise NotImplementedError(
            f"score_mod {getattr(score_mod, '__name__', '')!r} is made inside the compiled "
            "region, whose closure the graph cannot read; make it once outside (a module "
            "attribute, a global) and pass that") from None
    return key, [kernel_table(t, f) for t, f in zip(tables, floats)], row_shift


_CONSTANTS = (int, float, bool, complex, str, type(None))


def same_constant(now, then) -> bool:
    """A constant of ``static_score_args`` unchanged (NaN equal to itself)."""
    return now == then or (now != now and then != then)


def _constants(obj, path, depth, seen, out) -> None:
    """``(path, value)`` of the constants reachable from ``obj`` as ``_path_to`` walks."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    for step, v in _steps(obj):
        if isinstance(v, _CONSTANTS) or numpy_scalar(v) is not None:
            out.append(((*path, step), v))
        elif isinstance(v, (types.FunctionType, tuple, list, dict)):
            _constants(v, (*path, step), depth + 1, seen, out)


def _steps(obj) -> list:
    """``(step, value)`` of what a score_mod's function, tuple, list or dict holds."""
    steps = []
    if isinstance(obj, types.FunctionType):
        for n, cell in enumerate(obj.__closure__ or ()):
            try:
                steps.append((("cell", n), cell.cell_contents))
            except ValueError:
                pass
        steps += [(("global", k), obj.__globals__[k]) for k in obj.__code__.co_names
                  if k in obj.__globals__]
        steps += [(("default", n), v) for n, v in enumerate(obj.__defaults__ or ())]
        steps += [(("kwdefault", k), v) for k, v in (obj.__kwdefaults__ or {}).items()]
    elif isinstance(obj, (tuple, list)):
        steps = [(("item", n), v) for n, v in enumerate(obj)]
    elif isinstance(obj, dict):
        steps = [(("item", k), v) for k, v in obj.items() if isinstance(k, (str, int))]
    return steps


def _path_to(obj, target, depth, seen):
    """The steps from ``obj`` to the tensor ``target``: closure cells, globals the code loads,
    defaults, items of tuples / lists / dicts, through nested functions."""
    if obj is target:
        return ()
    if depth > 8 or id(obj) in seen:
        return None
    seen.add(id(obj))
    for step, v in _steps(obj):
        if isinstance(v, (types.FunctionType, tuple, list, dict)) or v is target:
            rest = _path_to(v, target, depth + 1, seen)
            if rest is not None:
                return (step, *rest)
    return None


def follow(obj, path):
    """The value at ``path`` (``static_score_args``) from ``obj``."""
    for kind, k in path:
        if kind == "cell":
            obj = obj.__closure__[k].cell_contents
        elif kind == "global":
            obj = obj.__globals__[k]
        elif kind == "default":
            obj = obj.__defaults__[k]
        elif kind == "kwdefault":
            obj = obj.__kwdefaults__[k]
        else:
            obj = obj[k]
    return obj


def kernel_table(t, is_float: bool):
    """A table as the kernels read it (float32 / int32, contiguous, 0-d as one element), in
    ops a compiled graph records (no host checks)."""
    t = t.reshape(1) if t.dim() == 0 else t
    return t.to(torch.float32 if is_float else torch.int32).contiguous()


def _same(a, b) -> bool:
    return (a.expr == b.expr and a.tables == b.tables and a.used_leaves == b.used_leaves
            and a.mask == b.mask and getattr(a, "mask_leaves", ()) == getattr(
                b, "mask_leaves", ()))


def _row_shift(expr) -> str:
    """What moving ``q_idx`` does to the score: ``"none"`` (the score_mod does not read it),
    ``"row"`` (a per-row constant, which softmax drops from the output but not from the LSE or
    next to a learnable sink: ALiBi's ``slopes[h] * (kv_idx - q_idx)``) or ``"any"`` (a T5
    bucket of ``kv_idx - q_idx``). Queries that are not rows ``0..`` (serving) need it."""
    if _I not in expr.free_symbols:
        return "none"
    c = sp.Symbol("_shift", integer=True)
    expr = expr.replace(tofloat, lambda x: x)  # a conversion is the same value
    d = sp.expand(expr.subs(_I, _I + c) - expr)
    row = not (d.free_symbols & {SCORE, _J, _I}) and not any(
        a.free_symbols & {SCORE, _J, _I} for a in d.atoms(sp.core.function.AppliedUndef))
    return "row" if row else "any"


def _softcap(expr):
    """``c`` when ``expr`` is ``c * tanh(score / c)`` (c > 0), else None."""
    for t in expr.atoms(sp.tanh):
        coeff = sp.simplify(t.args[0] / SCORE)
        if coeff.is_Number and coeff > 0 and sp.simplify(expr - t / coeff) == 0:
            return float(1 / coeff)
    return None


def _as_table(t, spec: Table, device, fname):
    label = spec.name.split("_", 1)[-1]
    if t.device != device:
        raise ValueError(f"score_mod {fname!r}: captured tensor {label!r} is on {t.device}, the "
                         f"attention on {device}; move it there once (a copy per call would be "
                         "a hidden transfer)")
    want = torch.float32 if spec.is_float else torch.int32
    if t.dtype == want and t.dim() and t.is_contiguous():
        return t
    if t.requires_grad and torch.is_grad_enabled():  # a trained table: autograd converts it
        return kernel_table(t, spec.is_float)
    memo = _CONVERTED.get(id(t))
    if memo is not None and memo[0] is t and memo[1] == t._version:
        return memo[2]
    out = t.reshape(1) if t.dim() == 0 else t
    if not spec.is_float and t.dtype == torch.int64 and t.numel():
        lo, hi = int(t.min()), int(t.max())  # once per tensor version
        if lo < -(2**31) or hi >= 2**31:
            raise ValueError(f"score_mod {fname!r}: captured tensor {label!r} holds values "
                             f"outside int32 ([{lo}, {hi}]), which the kernels read")
    out = out.to(want).contiguous()
    _CONVERTED[id(t)] = (t, t._version, out)
    return out


_CONVERTED = LRU(256)  # it keeps the originals alive: a few tables, not every batch's


# --------------------------------------------------------------------------------------------
# evaluation in torch (tests: what the kernels compute)
# --------------------------------------------------------------------------------------------


def _torch_eval(e, env, tabs, fdtype):
    def ev(x):
        if x in env:
            return env[x]
        if x is sp.true or x == sp.true:
            return torch.tensor(True)
        if x is sp.false or x == sp.false:
            return torch.tensor(False)
        if x.is_Integer:
            return torch.tensor(int(x), dtype=torch.int64)
        if x.is_Number:
            return torch.tensor(float(x), dtype=fdtype)
        if isinstance(x, sp.core.function.AppliedUndef):
            t = tabs[type(x).__name__]
            t = t.reshape(1) if t.dim() == 0 else t
            idx = []
            for n, a in enumerate(x.args):
                v = ev(a).long()
                idx.append(torch.where(v < 0, v + t.shape[n], v))
            return t[tuple(idx)].to(fdtype) if t.is_floating_point() else t[tuple(idx)].long()
        if isinstance(x, sp.ITE):
            return torch.where(ev(x.args[0]), ev(x.args[1]), ev(x.args[2]))
        if isinstance(x, sp.Piecewise):
            out = ev(x.args[-1][0])
            for val, cond in reversed(x.args[:-1]):
                out = torch.where(ev(cond), ev(val), out)
            return out
        args = [ev(a) for a in x.args]
        if isinstance(x, sp.Add):
            out = args[0]
            for a in args[1:]:
                out = out + a
            return out
        if isinstance(x, sp.Mul):
            out = args[0]
            for a in args[1:]:
                out = out * a
            return out
        if isinstance(x, sp.Pow):
            base, ex = args
            if x.args[1].is_Integer and int(x.args[1]) < 0:
                return 1.0 / base.to(fdtype) ** (-int(x.args[1]))
            return base.to(fdtype) ** ex if not x.args[1].is_Integer else base ** ex
        if isinstance(x, sp.floor):
            inner = x.args[0]
            num, den = sp.fraction(sp.together(inner))
            if num.is_integer and den.is_integer:
                return torch.div(ev(num), ev(den), rounding_mode="floor")
            return torch.floor(args[0].to(fdtype))
        if isinstance(x, sp.Mod):
            return torch.remainder(*args)
        if isinstance(x, trunc):
            return torch.trunc(args[0].to(fdtype)).long()
        if isinstance(x, fdiv):
            return args[0].to(fdtype) / args[1].to(fdtype)
        if isinstance(x, tofloat):
            return args[0].to(fdtype)
        if isinstance(x, log2):
            return torch.log2(args[0].to(fdtype))
        if isinstance(x, sp.Min):
            out = args[0]
            for a in args[1:]:
                out = torch.minimum(out, a)
            return out
        if isinstance(x, sp.Max):
            out = args[0]
            for a in args[1:]:
                out = torch.maximum(out, a)
            return out
        if isinstance(x, sp.Abs):
            return args[0].abs()
        fns = {sp.exp: torch.exp, sp.log: torch.log, sp.tanh: torch.tanh, sp.sin: torch.sin,
               sp.cos: torch.cos}
        for k, f in fns.items():
            if isinstance(x, k):
                return f(args[0].to(fdtype))
        rel = {sp.Lt: torch.lt, sp.Le: torch.le, sp.Gt: torch.gt, sp.Ge: torch.ge,
               sp.Eq: torch.eq, sp.Ne: torch.ne}
        for k, f in rel.items():
            if isinstance(x, k):
                return f(*args)
        if isinstance(x, sp.And):
            out = args[0]
            for a in args[1:]:
                out = out & a
            return out
        if isinstance(x, sp.Or):
            out = args[0]
            for a in args[1:]:
                out = out | a
            return out
        if isinstance(x, sp.Not):
            return ~args[0]
        if isinstance(x, sp.Xor):
            out = args[0]
            for a in args[1:]:
                out = out ^ a
            return out
        raise NotImplementedError(f"evaluating {type(x).__name__}: {x}")

    return ev(e)
