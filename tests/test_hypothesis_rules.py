"""Property: random rules from the supported grammar compile to descriptors that equal the
brute-force evaluation of the same Python source, on random metadata."""

import itertools
import linecache

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import compilemask as cm

from helpers import compile_in_range, dense_tile_states

PARAMS = ["a", "b", "d"]  # d is only ever a divisor: drawn positive
_counter = itertools.count()

consts = st.integers(min_value=0, max_value=9).map(str)
divisors = st.sampled_from(["2", "3", "5", "d"])
leaf_i = st.sampled_from(["i", "a", "b", "i", "3"]) | consts


def _ints(leaf):
    return st.recursive(
        leaf,
        lambda e: st.one_of(
            st.tuples(e, st.sampled_from(["+", "-"]), e).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(e, consts).map(lambda t: f"({t[0]} * {t[1]})"),
            st.tuples(e, st.sampled_from(["//", "%"]), divisors).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(st.sampled_from(["min", "max"]), e, e).map(
                lambda t: f"{t[0]}({t[1]}, {t[2]})"),
            e.map(lambda x: f"abs({x})"),
        ),
        max_leaves=4,
    )


int_i = _ints(leaf_i)
# expressions in j: j shifted by an expression of i, optionally through // or % by a divisor
int_j = st.one_of(
    st.just("j"),
    st.tuples(st.sampled_from(["+", "-"]), int_i).map(lambda t: f"(j {t[0]} {t[1]})"),
    st.tuples(int_i, st.sampled_from(["//", "%"]), divisors).map(
        lambda t: f"((j - {t[0]}) {t[1]} {t[2]})"),
    st.tuples(int_i).map(lambda t: f"abs(j - {t[0]})"),
)
cmp = st.sampled_from(["<", "<=", ">", ">=", "==", "!="])
atom = st.one_of(
    st.tuples(int_j, cmp, int_i).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
    st.tuples(int_i, cmp, int_j).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
    st.tuples(int_i, int_i).map(lambda t: f"{t[0]} <= j < {t[1]}"),
    st.tuples(int_i, cmp, int_i).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
)
rule = st.recursive(
    atom,
    lambda b: st.one_of(
        st.tuples(b, st.sampled_from(["and", "or"]), b).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        b.map(lambda x: f"(not {x})"),
    ),
    max_leaves=4,
)
guard = st.one_of(
    st.just("True"),
    st.tuples(int_i, cmp, int_i).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
)


def _make(src_when, src_vis):
    name = f"<hypothesis-rule-{next(_counter)}>"
    source = f"def when(i):\n    return {src_when}\n\n\ndef visible(i, j):\n    return {src_vis}\n"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns = {}
    exec(compile(source, name, "exec"), ns)
    return ns["when"], ns["visible"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(w1=guard, v1=rule, v2=rule, sq=st.integers(1, 40), sk=st.integers(1, 40),
       seed=st.integers(0, 2**31 - 1))
def test_random_rules_match_brute_force(w1, v1, v2, sq, sk, seed):
    when1, vis1 = _make(w1, v1)
    _, vis2 = _make("True", v2)
    spec = cm.MaskSpec("hyp", params=PARAMS, regions=[
        cm.Region("first", when=when1, visible=vis1),
        cm.Region("rest", when=lambda i: True, visible=vis2),
    ])
    mask = compile_in_range(spec)
    gen = torch.Generator().manual_seed(seed)
    meta = {"a": torch.randint(0, 45, (2,), generator=gen),
            "b": torch.randint(0, 45, (2,), generator=gen),
            "d": torch.randint(1, 6, (2,), generator=gen)}
    desc = mask.preprocess(meta, seqlen_q=sq, seqlen_k=sk, fwd_tiles=(8, 8), bwd_tiles=(4, 16))
    ref = mask.reference_mask(meta, seqlen_q=sq, seqlen_k=sk)
    assert torch.equal(desc.dense_mask(), ref), (w1, v1, v2, meta)
    if not mask.has_fallback:
        assert torch.equal(desc.tile_states(), dense_tile_states(ref, 8, 8))


# Statement forms: local assignments, if/else, conditional expressions, a per-row array.
leaf_x = st.sampled_from(["i", "a", "x", "arr[i]", "3"]) | consts
int_x = _ints(leaf_x)
atom_x = st.one_of(
    st.tuples(int_j, cmp, int_x).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
    st.tuples(int_x, int_x).map(lambda t: f"{t[0]} <= j < {t[1]}"),
)
rule_x = st.recursive(
    atom_x,
    lambda b: st.tuples(b, st.sampled_from(["and", "or"]), b).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})"),
    max_leaves=3,
)
cond_i = st.tuples(int_x, cmp, int_x).map(lambda t: f"{t[0]} {t[1]} {t[2]}")


def _make_body(body):
    name = f"<hypothesis-body-{next(_counter)}>"
    source = "def visible(i, j):\n" + body
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns = {}
    exec(compile(source, name, "exec"), ns)
    return ns["visible"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(e1=_ints(leaf_i), c1=cond_i, c2=cond_i, r1=rule_x, r2=rule_x, r3=rule_x,
       sq=st.integers(1, 40), sk=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
# an abs() over a quotient by a param: rebuilt, sympy made it sqrt(y * conjugate(y))
@example(e1="((i // 2) + (i % d))", c1="i < i", c2="i < i", r1="j < i", r2="j < i",
         r3="j < abs((x // d))", sq=13, sk=17, seed=0)
def test_random_statement_rules_match_brute_force(e1, c1, c2, r1, r2, r3, sq, sk, seed):
    # x is assigned before use in c1/c2/r*; arr is a per-row array param
    body = (f"    x = {e1}\n    if {c1}:\n        return {r1}\n"
            f"    return ({r2}) if {c2} else ({r3})\n")
    vis = _make_body(body)
    spec = cm.MaskSpec("hyp_stmt", params=["a", "b", "d", "arr"], regions=[
        cm.Region("all", when=lambda i: True, visible=vis)])
    mask = compile_in_range(spec)
    gen = torch.Generator().manual_seed(seed)
    meta = {"a": torch.randint(0, 45, (2,), generator=gen),
            "b": torch.randint(0, 45, (2,), generator=gen),
            "d": torch.randint(1, 6, (2,), generator=gen)}
    if "arr" in mask.array_params:
        meta["arr"] = torch.randint(0, 45, (2, sq), generator=gen)
    else:
        meta["arr"] = torch.randint(0, 45, (2,), generator=gen)  # unused scalar
    desc = mask.preprocess(meta, seqlen_q=sq, seqlen_k=sk, fwd_tiles=(8, 8), bwd_tiles=(4, 16))
    ref = mask.reference_mask(meta, seqlen_q=sq, seqlen_k=sk)
    assert torch.equal(desc.dense_mask(), ref), (body, meta)
