"""Canonicalization's cost: a mask_mod of a few dozen intervals (segment ids, ``torch.where``
and predicates) compiles in seconds, exactly; the prover's caches and counterexample reuse give
the answers a fresh solver gives; a spent proof budget keeps the intervals as they are."""

from __future__ import annotations

import time

import pytest
import sympy as sp
import torch
import z3
from torch.nn.attention.flex_attention import create_mask, or_masks

import compilemask as cm
from compilemask.compiler import compiler
from compilemask.compiler.compiler import canonicalize, extract_intervals, normalize, to_dnf_terms
from compilemask.compiler.prover import Prover
from compilemask.dsl.frontend import array_function, rule_symbols

S = rule_symbols(["a", "b", "w"])
i, j, a, b, w = S["i"], S["j"], S["a"], S["b"], S["w"]


def _windows(doc, off, span, n):
    """or_masks of ``n`` windows, each a ``torch.where`` on the segment ids with a stride
    predicate in one branch: 2n terms before the ids' run/span split."""

    def window(k):
        lo, width = 11 * k, 5 + k

        def m(b, h, q_idx, kv_idx):
            same = doc[b, q_idx] == doc[b, kv_idx]
            near = (kv_idx >= off[b] + lo) & (kv_idx < off[b] + lo + width)
            far = (kv_idx < span[b] + k) & (q_idx >= kv_idx) & ((q_idx - kv_idx) % 3 != 0)
            return torch.where(same, near | (kv_idx == q_idx - k), far)

        return m

    return or_masks(*[window(k) for k in range(n)])


def _interleaved(gen, B, L, n_ids=3, max_run=12):
    out = torch.zeros(B, L, dtype=torch.int64)
    for bi in range(B):
        pos = 0
        while pos < L:
            run = int(torch.randint(1, max_run, (1,), generator=gen))
            out[bi, pos:pos + run] = int(torch.randint(0, n_ids, (1,), generator=gen))
            pos += run
    return out


@pytest.fixture
def solver_runs(monkeypatch):
    runs = [0]
    check = z3.Solver.check

    def counted(self, *args):
        runs[0] += 1
        return check(self, *args)

    monkeypatch.setattr(z3.Solver, "check", counted)
    return runs


def test_many_windows_compile_in_seconds_and_equal_create_mask(solver_runs):
    gen = torch.Generator().manual_seed(0)
    L = 72
    doc = _interleaved(gen, 2, L)
    off, span = torch.tensor([5, 9]), torch.tensor([3, 40])
    mod = _windows(doc, off, span, 13)
    spec, meta = cm.from_mask_mod(mod)
    t0 = time.process_time()
    mask = cm.compile_mask(spec)
    cpu = time.process_time() - t0
    # 104 terms to 52 slots: some 170 solver runs and 3-4 s of CPU here (before the proof
    # caches and counterexample reuse, 26 slots took 26-50 s of CPU and 1500 runs)
    assert mask.num_intervals >= 26
    assert solver_runs[0] < 1000 and cpu < 60, (solver_runs[0], cpu)
    want = create_mask(mod, 2, 1, L, L, device="cpu")[:, 0]
    desc = mask.preprocess(meta, seqlen_q=L, backend="torch")
    assert torch.equal(desc.dense_mask(), want)


def test_spent_budget_keeps_the_intervals_as_they_are(monkeypatch):
    # overlapping windows that canonicalization merges into fewer slots
    terms = extract_intervals(to_dnf_terms(normalize(sp.Or(*[
        sp.And(sp.Le(a + k, j), sp.Lt(j, a + k + 3)) for k in range(6)]), j)), i, j)
    full, _ = canonicalize(terms, Prover([], S), S["seqlen_k"])
    kept, log = canonicalize(terms, Prover([], S), S["seqlen_k"], budget=0)
    assert len(full) == 1 and len(kept) == 6
    assert any("proof budget" in x for x in log)
    part, _ = canonicalize(terms, Prover([], S), S["seqlen_k"], budget=2)
    assert 1 <= len(part) <= 6
    # end to end: a rule compiled with no budget is still exact (only more slots)
    monkeypatch.setattr(compiler, "CANONICALIZE_BUDGET", 0)

    def visible(i, j):
        return (a <= j < a + 3) or (a + 1 <= j < a + 4) or (j <= i and j % 3 == 0)  # noqa: F821

    mask = cm.compile_mask(cm.MaskSpec("budget_zero", params=["a"], regions=[
        cm.Region("no_budget_region", when=lambda i: True, visible=visible)]))
    assert mask.num_intervals == 3
    for av in (0, 5, 38):
        meta = {"a": torch.tensor([av, av + 2])}
        desc = mask.preprocess(meta, seqlen_q=40, fwd_tiles=(8, 8), bwd_tiles=(4, 8))
        assert torch.equal(desc.dense_mask(), mask.reference_mask(meta, seqlen_q=40))


def _claims():
    f = array_function("f")(i)
    lo = sp.Max(a, i - w)
    return [
        sp.Le(i + 1, a), sp.Le(a, i), sp.Lt(i, sp.Max(a, i + 1)), sp.Le(lo, i + 1),
        sp.Ge(sp.Mod(i, 4), 0), sp.Lt(sp.Mod(i, 4), 4), sp.Le(sp.floor(i / 4) * 4, i),
        sp.Le(f, i), sp.Ge(f, 0), sp.Or(sp.Lt(i, a), sp.Ge(i, a)), sp.Le(sp.Min(a, b), a),
        sp.Le(sp.Min(a, b), b - 1), sp.Implies(sp.Lt(i, a), sp.Le(i + 1, a)),
        sp.Or(sp.Not(sp.Lt(i, a)), sp.Le(i + 1, a)), sp.Le(f + 1, i), sp.Ge(w * i, i),
    ]


def test_prover_caches_and_counterexamples_give_a_fresh_solver_answers():
    assumptions = [sp.Le(array_function("f")(i), i)]
    shared = Prover(assumptions, S)
    for claim in _claims() * 3:  # repeats: cached answers
        fresh = Prover(assumptions, S).proves(claim)
        assert shared.proves(claim) == fresh, claim
        if shared.refutes(claim):
            assert not fresh, claim
    # each function application is assumed non-negative once, however often it is translated
    assert len(shared.env.side) == 1


def test_counterexamples_refute_without_a_solver_run():
    p = Prover([sp.Lt(i, a)], S)
    assert not p.proves(sp.Le(i + 2, a))  # a solver run, which keeps its counterexample
    runs = p.work
    assert p.refutes(sp.Le(i + 2, a, evaluate=False))
    assert not p.proves(sp.Le(i + 3, a))  # falsified by the kept counterexample
    assert p.proves(sp.Le(i + 1, a))  # valid: a solver run
    assert p.work == runs + 1
