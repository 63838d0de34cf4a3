"""Params named like the generated code's own names, conditions on the sequence lengths alone,
and every Boolean connective: the compiled mask equals brute force on the torch reference and on
TileLang's C target."""

import itertools
import linecache

import pytest
import torch

import compilemask as cm

_counter = itertools.count()

# locals and helpers of the generated torch preprocess and TileLang program, and names that
# look like their prefixed spellings
NAMES = ["region", "guard", "take", "ok", "lo", "hi", "shape", "dev", "starts", "lens", "sq",
         "sk", "batch_size", "NUM_INTERVALS", "p_x", "a_x_i", "b", "row", "intervals", "T"]


def _fns(source):
    name = f"<generated-names-{next(_counter)}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns: dict = {}
    exec(compile(source, name, "exec"), ns)
    return ns


def _spec(n, array: bool):
    """Three regions reading param ``n``: in a guard, an interval endpoint and a fallback
    predicate (j * j is not an interval)."""
    v = f"{n}[i]" if array else n
    ns = _fns(
        f"def when0(i):\n    return i < {v}\n\n\n"
        f"def vis0(i, j):\n    return j <= i\n\n\n"
        f"def when1(i):\n    return i % 2 == 0\n\n\n"
        f"def vis1(i, j):\n    return {v} <= j <= i + {v}\n\n\n"
        f"def vis2(i, j):\n    return j * j <= i + {v}\n")
    return cm.MaskSpec(f"names_{n}_{int(array)}", params=[n], regions=[
        cm.Region("first", when=ns["when0"], visible=ns["vis0"]),
        cm.Region("even", when=ns["when1"], visible=ns["vis1"]),
        cm.Region("rest", when=lambda i: True, visible=ns["vis2"]),
    ])


def _meta(n, array, B, S, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (B, S) if array else (B,)
    return {n: torch.randint(0, S + 2, shape, generator=g)}


@pytest.mark.parametrize("array", [False, True], ids=["scalar", "array"])
@pytest.mark.parametrize("n", NAMES)
def test_param_named_like_generated_code(n, array):
    mask = cm.compile_mask(_spec(n, array))
    for seed, S in enumerate((1, 13, 40)):
        meta = _meta(n, array, 2, S, seed)
        ref = mask.reference_mask(meta, seqlen_q=S)
        got = mask.preprocess(meta, seqlen_q=S, fwd_tiles=(8, 8), bwd_tiles=(8, 8))
        assert torch.equal(got.dense_mask(), ref), (n, array, S, meta)
    zero = {n: torch.zeros_like(meta[n])}  # the param decides the mask
    assert not torch.equal(ref, mask.reference_mask(zero, seqlen_q=S))


@pytest.mark.parametrize("n", [n if n == "T" else pytest.param(n, marks=pytest.mark.slow)
                               for n in ["region", "guard", "ok", "lo", "b", "row", "T",
                                         "intervals"]])  # two programs each
def test_param_named_like_generated_code_tilelang(n):
    pytest.importorskip("tilelang")
    for array in (False, True):
        mask = cm.compile_mask(_spec(n, array))
        meta = _meta(n, array, 2, 40, 0)
        ref = mask.preprocess(meta, 40, backend="torch", batch_size=2)
        out = mask.preprocess(meta, 40, backend="tilelang", batch_size=2)
        for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap"):
            assert torch.equal(getattr(ref, f), getattr(out, f)), (n, array, f)
        assert torch.equal(ref.dense_mask(), mask.reference_mask(meta, seqlen_q=40))


def _rule_mask(when, rule, params, rest):
    """Region 'r' from the sources of a guard and a rule, then every other row by ``rest``."""
    ns = _fns(f"def when(i):\n    return {when}\n\n\ndef visible(i, j):\n    return {rule}\n")
    return cm.compile_mask(cm.MaskSpec(f"rule_{next(_counter)}", params=list(params), regions=[
        cm.Region("r", when=ns["when"], visible=ns["visible"]),
        cm.Region("rest", when=lambda i: True, visible=rest)]))


LENGTH_RULES = [
    # a window that depends on the length, a guard on the lengths, a negated compound
    ("True", "i - (4 if seqlen_q >= 9 else 2) < j <= i"),
    ("seqlen_q > 5 and i < 3", "j <= i"),
    ("not (seqlen_q > 8 and seqlen_k < 20)", "j >= i"),
    ("True", "j < i or not (seqlen_k > 10 or seqlen_q < 4)"),
]


@pytest.mark.parametrize("when,rule", LENGTH_RULES)
def test_conditions_on_the_lengths_alone(when, rule):
    mask = _rule_mask(when, rule, (), lambda i, j: j == 0)
    for sq, sk in ((3, 3), (9, 9), (12, 25), (6, 15), (40, 7)):
        ref = mask.reference_mask({}, seqlen_q=sq, seqlen_k=sk)
        got = mask.preprocess({}, seqlen_q=sq, seqlen_k=sk, fwd_tiles=(8, 8), bwd_tiles=(8, 8))
        assert torch.equal(got.dense_mask(), ref), (when, rule, sq, sk)


CONNECTIVE_RULES = [
    # ^ in a guard and in a predicate rule; a conditional expression compared on the row side
    # (sympy's ITE inside a Piecewise condition)
    ("(i < a) ^ (i < b)", "j <= i"),
    ("True", "(j < a) ^ (j * j < i)"),
    ("i % 2 == 0", "(j if (3 if a != 8 else a) == i else a * 2) <= i + b"),
    ("True", "(j < a) ^ (j < b) ^ (j + 2 > i)"),
    # ^ in a condition nested in another conditional's condition
    ("True", "(j if (a if (i < 16) ^ (i > 9) else i) <= b else b) <= i"),
    ("True", "j > (1 if (i < a) ^ (i > b) else 2)"),
    # conditions sympy solves into rationals (i >= 5/7)
    ("(a if i + 5 <= i * 8 else i) <= 2", "j <= i"),
    ("(a if 5 <= i * 7 else i) <= 2", "j <= i + 1"),
]


@pytest.mark.parametrize("when,rule", [c if n == 1 else pytest.param(*c, marks=pytest.mark.slow)
                                       for n, c in enumerate(CONNECTIVE_RULES)])  # a program each
def test_boolean_connectives_in_guards_and_predicates(when, rule):
    mask = _rule_mask(when, rule, ("a", "b"), lambda i, j: j == i)
    g = torch.Generator().manual_seed(0)
    for S in (1, 17, 40):
        meta = {"a": torch.randint(0, S + 3, (3,), generator=g),
                "b": torch.randint(0, S + 3, (3,), generator=g)}
        meta["a"][0] = 8
        ref = mask.reference_mask(meta, seqlen_q=S)
        got = mask.preprocess(meta, seqlen_q=S, fwd_tiles=(8, 8), bwd_tiles=(8, 8))
        assert torch.equal(got.dense_mask(), ref), (when, rule, S, meta)
    if mask.has_fallback:  # the kernels' predicate source is generated for the same rule
        from compilemask.codegen.cute_predicate import predicate_source

        for r in mask.fallback_regions:
            assert "def fallback_predicate" in predicate_source(r.rule, ("a", "b"))
    pytest.importorskip("tilelang")  # TileLang's C target reads the same guard and rule
    meta = {"a": torch.tensor([8, 3, 30]), "b": torch.tensor([5, 0, 12])}
    a = mask.preprocess(meta, 40, backend="torch", batch_size=3)
    b = mask.preprocess(meta, 40, backend="tilelang", batch_size=3)
    for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap"):
        assert torch.equal(getattr(a, f), getattr(b, f)), (when, rule, f)


@pytest.mark.slow  # a program of its own; fallback regions compile in the default run too
def test_three_fallback_regions_tilelang():
    """The preprocess skips coverage on every fallback region's rows (one condition each)."""
    pytest.importorskip("tilelang")
    ns = _fns("def v0(i, j):\n    return j * j <= i\n\n\ndef v1(i, j):\n    return j * j <= i + a\n"
              "\n\ndef v2(i, j):\n    return j * j <= i + 2\n")
    spec = cm.MaskSpec("three_fallbacks", params=["a"], regions=[
        cm.Region("r0", when=lambda i: i < 5, visible=ns["v0"]),
        cm.Region("r1", when=lambda i: i < 10, visible=ns["v1"]),
        cm.Region("mid", when=lambda i: i < 14, visible=lambda i, j: j <= i),
        cm.Region("r2", when=lambda i: True, visible=ns["v2"])])
    mask = cm.compile_mask(spec)
    assert len(mask.fallback_regions) == 3
    meta = {"a": torch.tensor([0, 7])}
    ref = mask.preprocess(meta, 20, 24, backend="torch", batch_size=2)
    out = mask.preprocess(meta, 20, 24, backend="tilelang", batch_size=2)
    for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap"):
        assert torch.equal(getattr(ref, f), getattr(out, f)), f
    assert torch.equal(ref.dense_mask(), mask.reference_mask(meta, seqlen_q=20, seqlen_k=24))
