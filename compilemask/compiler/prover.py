"""Proofs under assumptions, for canonicalization: sympy expressions -> z3 integer arithmetic.

``Prover.proves(claim)`` is sound: it answers True only when z3 shows that no integer assignment
satisfying the assumptions falsifies the claim. Unknown (timeout, nonlinear) counts as not proven.

Canonicalization asks thousands of claims of one prover, most of them false and built from the
same endpoints, so answers are cached by claim, translations by subexpression, and a claim that
one of the last counterexamples z3 found falsifies is answered without a solver run (the answer
z3 would give: a model of the assumptions and the negated claim means it is not provable).

Threads: z3's contexts are not thread-safe, and z3py's default context is one per process. Each
``Prover`` owns a z3 ``Context`` (every term it builds lives there, so a dead prover's terms are
freed by any thread without touching a context in use), and every call into z3 runs under
``Z3_LOCK``, so one prover may also be shared by threads.
"""

from __future__ import annotations

import threading

import sympy as sp
import z3

from compilemask.dsl.frontend import IntBitOp

__all__ = ["Prover", "to_z3", "Z3_LOCK"]

_TIMEOUT_MS = 500
_MODELS = 8  # counterexamples kept per prover, tried before each solver run
# a timed-out run, in ordinary runs (about 500 ms against a few ms), for the work count
_TIMEOUT_WORK = 50

# held by every call into z3 (reentrant: a proof may translate a claim)
Z3_LOCK = threading.RLock()


class _Z3Env:
    def __init__(self):
        self.ctx = z3.Context()  # this prover's own: no term is shared with another thread
        self.vars: dict[str, z3.ArithRef] = {}
        self.funcs: dict[str, z3.FuncDeclRef] = {}
        self.side: list = []  # facts about function applications (non-negative metadata)
        self.memo: dict = {}  # sympy subexpression -> its translation (and side fact, once)

    def var(self, name):
        if name not in self.vars:
            self.vars[name] = z3.Int(name, self.ctx)
        return self.vars[name]


def to_z3(e, env: _Z3Env):
    """``e`` in ``env``'s z3 context (the caller holds ``Z3_LOCK``)."""
    hit = env.memo.get(e)
    if hit is None:
        hit = env.memo[e] = _to_z3(e, env)
    return hit


def _to_z3(e, env: _Z3Env):
    if e is sp.true or e == sp.true:
        return z3.BoolVal(True, env.ctx)
    if e is sp.false or e == sp.false:
        return z3.BoolVal(False, env.ctx)
    if isinstance(e, sp.Symbol):
        return env.var(e.name)
    if isinstance(e, sp.Integer):
        return z3.IntVal(int(e), env.ctx)
    if isinstance(e, sp.Rational):
        raise TypeError(f"rational {e} outside floor()")
    if isinstance(e, sp.Add):
        out = to_z3(e.args[0], env)
        for a in e.args[1:]:
            out = out + to_z3(a, env)
        return out
    if isinstance(e, sp.Mul):
        num, den = sp.fraction(e)
        if den != 1:
            if e.is_integer:  # an exact quotient (sympy dropped a floor it proved redundant)
                return to_z3(num, env) / to_z3(den, env)
            raise TypeError(f"non-integer product {e}")
        out = to_z3(e.args[0], env)
        for a in e.args[1:]:
            out = out * to_z3(a, env)
        return out
    if isinstance(e, sp.Pow) and e.exp.is_Integer and int(e.exp) >= 1:
        b = to_z3(e.base, env)
        out = b
        for _ in range(int(e.exp) - 1):
            out = out * b
        return out
    if isinstance(e, sp.floor):
        num, den = sp.fraction(sp.together(e.args[0]))
        return to_z3(num, env) / to_z3(den, env)  # z3 div is floor for positive divisors
    if isinstance(e, sp.Mod):
        return to_z3(e.args[0], env) % to_z3(e.args[1], env)
    if isinstance(e, (sp.Min, sp.Max)):
        args = [to_z3(a, env) for a in e.args]
        out = args[0]
        for a in args[1:]:
            out = z3.If(a < out, a, out) if isinstance(e, sp.Min) else z3.If(a > out, a, out)
        return out
    if isinstance(e, sp.Abs):
        a = to_z3(e.args[0], env)
        return z3.If(a < 0, -a, a)
    if isinstance(e, sp.Piecewise):
        out = None
        for val, cond in reversed(e.args):
            v = to_z3(val, env)
            out = v if out is None else z3.If(to_z3(cond, env), v, out)
        return out
    if isinstance(e, IntBitOp):
        # uninterpreted (a claim proved for every function is true of the bit operation), with
        # what holds for non-negative operands: a & b <= min(a, b), max(a, b) <= a | b <= a + b
        name = f"int_{type(e).__name__}"
        if name not in env.funcs:
            ints = z3.IntSort(env.ctx)
            env.funcs[name] = z3.Function(name, ints, ints, ints)
        a, b = (to_z3(x, env) for x in e.args)
        r = env.funcs[name](a, b)
        if e.op == "&":
            held = z3.And(r >= 0, r <= a, r <= b)
        elif e.op == "|":
            held = z3.And(r >= a, r >= b, r <= a + b)
        else:
            held = z3.And(r >= 0, r <= a + b)
        env.side.append(z3.Implies(z3.And(a >= 0, b >= 0), held))
        return r
    if isinstance(e, sp.core.function.AppliedUndef):
        name = type(e).__name__
        if name not in env.funcs:  # an array (one index) or a table (row, column)
            env.funcs[name] = z3.Function(name, *[z3.IntSort(env.ctx)] * (len(e.args) + 1))
        app = env.funcs[name](*[to_z3(a, env) for a in e.args])
        env.side.append(app >= 0)
        return app
    if isinstance(e, sp.Eq):
        return to_z3(e.lhs, env) == to_z3(e.rhs, env)
    if isinstance(e, sp.Ne):
        return to_z3(e.lhs, env) != to_z3(e.rhs, env)
    if isinstance(e, sp.Lt):
        return to_z3(e.lhs, env) < to_z3(e.rhs, env)
    if isinstance(e, sp.Le):
        return to_z3(e.lhs, env) <= to_z3(e.rhs, env)
    if isinstance(e, sp.Gt):
        return to_z3(e.lhs, env) > to_z3(e.rhs, env)
    if isinstance(e, sp.Ge):
        return to_z3(e.lhs, env) >= to_z3(e.rhs, env)
    if isinstance(e, sp.And):
        return z3.And(*[to_z3(a, env) for a in e.args])
    if isinstance(e, sp.Or):
        return z3.Or(*[to_z3(a, env) for a in e.args])
    if isinstance(e, sp.Not):
        return z3.Not(to_z3(e.args[0], env))
    raise TypeError(f"cannot translate {type(e).__name__}: {e}")


class Prover:
    """Proves claims about integer expressions under a fixed list of sympy assumptions.

    Thread-safe: each public method holds ``Z3_LOCK`` and does its z3 work in a call below it,
    so that every z3 term it makes is also released under the lock."""

    def __init__(self, assumptions, symbols, divisor_params=()):
        with Z3_LOCK:
            self._init(assumptions, symbols, divisor_params)

    def _init(self, assumptions, symbols, divisor_params):
        self.env = _Z3Env()
        facts = []
        for s in symbols.values():
            facts.append(self.env.var(s.name) >= 0)
        facts.append(self.env.var("seqlen_q") >= 1)
        facts.append(self.env.var("seqlen_k") >= 1)
        facts.append(self.env.var("i") < self.env.var("seqlen_q"))
        facts.append(self.env.var("j") < self.env.var("seqlen_k"))
        for p in divisor_params:
            facts.append(self.env.var(p) >= 1)
        self.ok = True
        try:
            facts += [to_z3(a, self.env) for a in assumptions]
        except TypeError:
            self.ok = False  # unknown construct: prove nothing rather than something wrong
        self.facts = facts
        self._cache: dict = {}  # claim (sympy, compared structurally) -> answer
        self._models: list = []  # the latest counterexamples, newest first
        self._context = None  # (number of side facts, their conjunction with the facts)
        self.work = 0  # solver runs so far, timeouts weighted (callers budget it)

    def proves(self, claim) -> bool:
        if claim is sp.true or claim == sp.true:
            return True
        if not self.ok:
            return False
        with Z3_LOCK:
            return self._proves(claim)

    def _proves(self, claim) -> bool:
        hit = self._cache.get(claim)
        if hit is not None:
            return hit
        try:
            c = to_z3(claim, self.env)
        except TypeError:
            self._cache[claim] = False
            return False
        res = self._valid(c)
        self._cache[claim] = res
        return res

    def refutes(self, claim) -> bool:
        """Whether one of the recent counterexamples falsifies ``claim``, without a solver run;
        then ``proves`` of any claim equivalent to it is False. A cheap first test for claims
        built without sympy's evaluation (``evaluate=False``)."""
        if not self.ok or claim is sp.true or claim == sp.true:
            return False
        with Z3_LOCK:
            return self._refutes(claim)

    def _refutes(self, claim) -> bool:
        try:
            return self._refuted(to_z3(claim, self.env))
        except TypeError:
            return False

    def _refuted(self, c) -> bool:
        """A recent counterexample, completed to every name, satisfies the assumptions and
        falsifies ``c``."""
        if self._context is None or self._context[0] != len(self.env.side):
            self._context = (len(self.env.side), z3.And(*self.facts, *self.env.side))
        refute = z3.And(self._context[1], z3.Not(c))
        return any(z3.is_true(m.eval(refute, model_completion=True)) for m in self._models)

    def _valid(self, c) -> bool:
        """No assignment satisfies the assumptions and falsifies ``c``: first tried against the
        recent counterexamples, then z3."""
        if self._refuted(c):
            return False
        s = z3.Solver(ctx=self.env.ctx)
        s.set("timeout", _TIMEOUT_MS)
        s.add(*self.facts, *self.env.side)
        s.add(z3.Not(c))
        res = s.check()
        self.work += _TIMEOUT_WORK if res == z3.unknown else 1
        if res == z3.sat:
            self._models = [s.model(), *self._models[: _MODELS - 1]]
        return res == z3.unsat

    def satisfiable(self, claim) -> bool:
        """False only if the claim provably never holds under the assumptions."""
        return not self.proves(sp.Not(claim))
