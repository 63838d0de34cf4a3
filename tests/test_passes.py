"""Unit tests of the four compiler passes, each a pure function."""

import sympy as sp

from compilemask.compiler.compiler import canonicalize, extract_intervals, normalize, to_dnf_terms
from compilemask.compiler.prover import Prover
from compilemask.dsl.frontend import RuleContext, rule_symbols, translate_rule

S = rule_symbols(["a", "b", "w"])
i, j, a, b, w = S["i"], S["j"], S["a"], S["b"], S["w"]
RADIUS = 1


def tr(fn, role="visible"):
    return translate_rule(fn, RuleContext("r", role, ("a", "b", "w"), S)).expr


def _helper(x, y):
    return x <= y


def test_pass1_ast_to_sympy():
    assert tr(lambda i, j: a <= j < b) == sp.And(sp.Le(a, j), sp.Lt(j, b))  # noqa: F821
    assert tr(lambda i, j: not j > i) == sp.Not(sp.Gt(j, i))
    assert tr(lambda i, j: _helper(j, i + 1)) == sp.Le(j, i + 1)
    assert tr(lambda i, j: j // 4 == i // 4) == sp.Eq(sp.floor(j / 4), sp.floor(i / 4))
    assert tr(lambda i, j: abs(j - i) <= RADIUS) == sp.Le(sp.Abs(j - i), 1)

    def conditional(i, j):
        lo = i - 3
        if i < a:  # noqa: F821
            return j <= i
        return lo <= j

    e = tr(conditional)
    assert e.subs({i: 1, a: 5, j: 1}) is sp.true and e.subs({i: 9, a: 5, j: 5}) is sp.false


def test_pass2_dnf_splits_abs_ne_and_negation():
    terms = to_dnf_terms(normalize(sp.Not(sp.And(sp.Le(a, j), sp.Lt(j, b))), j))
    assert sorted(map(str, terms)) == ["[a > j]", "[j >= b]"]
    terms = to_dnf_terms(normalize(sp.Ne(j, i), j))
    assert len(terms) == 2
    terms = to_dnf_terms(normalize(sp.Le(sp.Abs(j - i), 2), j))
    assert len(terms) == 1 and len(terms[0]) == 2  # a band, not a case split
    assert to_dnf_terms(sp.false) == [] and to_dnf_terms(sp.true) == [[]]


def test_pass3_interval_extraction():
    (t,) = extract_intervals([[sp.Le(a, j), sp.Lt(j, b), sp.Lt(i, a)]], i, j)
    assert t.lowers == [a] and t.uppers == [b] and t.cond == [sp.Lt(i, a)] and not t.residual
    (t,) = extract_intervals([[sp.Le(j, i)]], i, j)  # non-strict upper -> half-open
    assert t.uppers == [i + 1]
    (t,) = extract_intervals([[sp.Eq(sp.floor(j / w), sp.floor(i / w))]], i, j)
    assert t.lowers == [w * sp.floor(i / w)] and t.uppers == [w * sp.floor(i / w) + w]
    (t,) = extract_intervals([[sp.Eq(sp.Mod(i - j, 2), 0), sp.Le(j, i)]], i, j)
    assert t.residual and t.uppers == [i + 1]  # fallback keeps the interval part
    # j % c with a bounded quotient range: one conjunction per quotient value
    q = sp.floor(j / 4)
    atoms = [sp.Ge(q, sp.floor(i / 4) - 1), sp.Le(q, sp.floor(i / 4) + 1),
             sp.Le(sp.Mod(j, 4), 2)]
    assert len(extract_intervals([atoms], i, j)) == 3


def test_pass4_canonicalization_under_guard():
    p = Prover([sp.Le(a, i)], S)  # guard: a <= i
    terms = extract_intervals([[sp.Lt(j, a)], [sp.Le(a, j), sp.Le(j, i)]], i, j)
    ivs, log = canonicalize(terms, p, S["seqlen_k"])
    assert len(ivs) == 1 and ivs[0].lower == 0 and ivs[0].upper == i + 1
    assert any("merged" in x for x in log)
    # [0, a) and [b, i + 1) merge only where b <= a is known
    terms = extract_intervals([[sp.Lt(j, a)], [sp.Le(b, j), sp.Le(j, i)]], i, j)
    ivs, _ = canonicalize(terms, Prover([sp.Le(b, a)], S), S["seqlen_k"])
    assert len(ivs) == 1
    ivs, _ = canonicalize(terms, Prover([], S), S["seqlen_k"])
    assert len(ivs) == 2
    # provably empty interval dropped; ordering by lower end
    terms = extract_intervals([[sp.Gt(j, i), sp.Lt(j, i)], [sp.Ge(j, i + 5)], [sp.Lt(j, 1)]], i, j)
    ivs, log = canonicalize(terms, Prover([], S), S["seqlen_k"])
    assert [str(x.lower) for x in ivs] == ["0", "i + 5"]
    assert any("empty" in x for x in log)


def test_prover_is_sound():
    p = Prover([sp.Lt(i, a)], S)
    assert p.proves(sp.Le(i + 1, a))
    assert not p.proves(sp.Le(i + 2, a))
    assert p.proves(sp.Ge(sp.Mod(i, 4), 0)) and p.proves(sp.Lt(sp.Mod(i, 4), 4))


def test_exact_quotients_without_floor_print_and_prove():
    # sympy drops floor() from min(2, 2*i) // 2 (it proves the quotient integral)
    from compilemask.dsl.exprprint import TorchPrinter

    e = sp.floor(sp.Min(2, 2 * i) / 2)
    assert not isinstance(e, sp.floor)
    assert "_fdiv" in TorchPrinter()(e)
    assert Prover([], S).proves(sp.Le(e, 1))
