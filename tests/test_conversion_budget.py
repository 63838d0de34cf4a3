"""Every conversion is exact or refused naming the construct, never an internal error, and
compile time is bounded: compound mask_mods that sympy cannot decide numerically or folds into
ITE convert exactly; a region of many disjoint intervals stops canonicalizing at its budget with
the intervals kept as they are (exact), and says so and how to raise the budget."""

from __future__ import annotations

import logging
import random

import pytest
import sympy as sp
import torch
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
from compilemask.compiler import compiler
from compilemask.compiler.prover import Prover
from compilemask.contract import log as log_module
from compilemask.dsl import flex

S = 48
SCAL = torch.tensor([30, 40])
ROWS = torch.randint(0, 30, (S,), generator=torch.Generator().manual_seed(0))


def _exact(mask_mod, B=2, L=S):
    spec, meta = cm.from_mask_mod(mask_mod, batch_size=B)
    mask = cm.compile_mask(spec)
    got = mask.preprocess(meta, seqlen_q=L, batch_size=B, backend="torch").dense_mask()
    want = create_mask(mask_mod, B, 1, L, L, device="cpu")[:, 0]
    assert torch.equal(got, want), (got != want).nonzero()[:4].tolist()
    return mask


def test_a_floor_of_a_maximum_compared_converts_exactly():
    """sympy's logic simplification used to decide ``max(128, s0) / 8 - 16`` numerically
    (PrecisionExhausted)."""
    s0, u0 = SCAL * 4, ROWS

    def mm(b, h, q_idx, kv_idx):
        return (torch.maximum(128 + q_idx * 0, s0[b]) // 8 >= u0[q_idx]) & (q_idx >= kv_idx)

    _exact(mm)


def test_a_floor_over_a_where_converts_exactly():
    """A floor of a sum with a ``torch.where`` used to reach the printer as a rational product
    (``TypeError: non-integer product``)."""
    s0, u0 = SCAL, ROWS

    def mm(b, h, q_idx, kv_idx):
        x = (torch.maximum(u0[q_idx], q_idx) + torch.where(s0[b] <= 35, s0[b], 84)) // 2
        return (x >= (u0[q_idx] % 2)) & (kv_idx <= x)

    _exact(mm)


def test_generated_rules_spell_ite_and_xor():
    """sympy folds nested boolean ``torch.where`` into ITE / Xor: the generated rule writes
    them with and / or / not, equal on every point."""
    i, j = sp.symbols("i j", integer=True)
    e = sp.ITE(sp.Gt(i, 3), sp.Lt(j, 2), sp.Xor(sp.Gt(j, 5), sp.Eq(i, j)))
    fn = flex._generated("visible", "i, j", e, "nested_where")
    for a in range(8):
        for b in range(8):
            want = (b < 2) if a > 3 else ((b > 5) != (a == b))
            assert bool(fn(a, b)) == want, (a, b)


def test_a_form_the_printer_cannot_write_is_refused_naming_it(monkeypatch):
    i, j = sp.symbols("i j", integer=True)

    def fail(self, e):
        raise TypeError(f"cannot print {type(e).__name__}: {e}")

    monkeypatch.setattr(flex.ExprPrinter, "__call__", fail)
    with pytest.raises(NotImplementedError, match=r"mask_mod 'odd'.*visible expression.*"
                                                  r"cannot write exactly"):
        flex._generated("visible", "i, j", sp.Lt(j, i), "odd")


def _expr(r, d, boolean):
    if boolean:
        if d <= 0 or r.random() < 0.3:
            op = r.choice(["<", "<=", ">", ">=", "==", "!="])
            return f"({_expr(r, d - 1, False)} {op} {_expr(r, d - 1, False)})"
        k = r.randint(0, 3)
        a, b = _expr(r, d - 1, True), _expr(r, d - 1, True)
        return [f"({a} & {b})", f"({a} | {b})", f"(~{a})",
                f"torch.where({_expr(r, d - 1, True)}, {a}, {b})"][k]
    if d <= 0 or r.random() < 0.25:
        return r.choice(["q_idx", "kv_idx", "s0[b]", "u0[q_idx]", str(r.randint(0, 60))])
    a, b = _expr(r, d - 1, False), _expr(r, d - 1, False)
    return r.choice([f"({a} + {b})", f"({a} - {b})", f"({a} // {r.choice([2, 3, 8])})",
                     f"({a} % {r.choice([2, 3, 8])})", f"torch.maximum({a}, {b})",
                     f"torch.minimum({a}, {b})",
                     f"torch.where({_expr(r, d - 1, True)}, {a}, {b})"])


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow)])
def test_random_compound_mask_mods_are_exact_or_refused(seed):
    """Random trees of arithmetic, comparisons, logic and nested ``torch.where`` over q_idx,
    kv_idx, a per-sequence and a per-row tensor: each converts to create_mask's mask or is
    refused with NotImplementedError, never another error."""
    r = random.Random(seed)
    converted = 0
    for _ in range(5):
        src = f"(({_expr(r, 3, True)}) & (kv_idx >= 0))"
        ns = {"torch": torch, "s0": SCAL, "u0": ROWS}
        exec(f"def mm(b, h, q_idx, kv_idx):\n    return {src}\n", ns)  # noqa: S102 - a test
        try:
            _exact(ns["mm"])
            converted += 1
        except NotImplementedError:
            pass
    assert converted >= 2, converted


def _many_windows(n):
    def mm(b, h, q_idx, kv_idx):
        out = q_idx == kv_idx
        for k in range(1, n):
            out = out | ((kv_idx >= q_idx - 7 * k - 3) & (kv_idx <= q_idx - 7 * k))
        return out

    return mm


def test_canonicalization_stops_at_its_test_budget_exactly_and_says_so(monkeypatch, caplog):
    """20 disjoint windows: 380 pairs of slots; with a budget of 150 pair tests the scan
    stops there (counted through the prover's counterexample test, once per pair test), the
    intervals are kept as they are, the mask is exact, and the log names the budget."""
    calls = [0]
    refutes = Prover.refutes

    def counted(self, claim):
        calls[0] += 1
        return refutes(self, claim)

    monkeypatch.setattr(Prover, "refutes", counted)
    monkeypatch.setattr(compiler, "CANONICALIZE_TESTS", 150)
    monkeypatch.setattr(log_module, "said", set())  # said once per process: here again
    mm = _many_windows(20)
    with caplog.at_level(logging.WARNING):
        mask = _exact(mm, B=1, L=150)
    assert calls[0] <= 150, calls[0]
    assert mask.num_intervals == 20
    assert any("CANONICALIZE_TESTS" in rec.getMessage() and "exact" in rec.getMessage()
               for rec in caplog.records)
    log = [x for r in mask.regions for x in r.proofs]
    assert any("stopped at the proof budget (CANONICALIZE_TESTS pair tests)" in x for x in log)


@pytest.mark.stress
def test_229_disjoint_windows_compile_within_the_budget(monkeypatch):
    """229 disjoint windows took two minutes of pairwise tests (some 130000); the default
    budget bounds them and the mask stays exact."""
    calls = [0]
    refutes = Prover.refutes

    def counted(self, claim):
        calls[0] += 1
        return refutes(self, claim)

    monkeypatch.setattr(Prover, "refutes", counted)
    mm = _many_windows(229)
    spec, meta = cm.from_mask_mod(mm)
    mask = cm.compile_mask(spec)
    assert calls[0] <= compiler.CANONICALIZE_TESTS, calls[0]
    assert mask.num_intervals == 229
    L = 7 * 229 + 8
    got = mask.preprocess(meta, seqlen_q=L, backend="torch").dense_mask()
    assert torch.equal(got, create_mask(mm, 1, 1, L, L, device="cpu")[:, 0])
