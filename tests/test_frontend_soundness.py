"""The front end reads the rule Python runs: a function's identity comes from its code object
(first line, instruction columns, constants, names), never from the first match on a line."""

import itertools
import linecache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compilemask as cm
from compilemask.dsl import frontend

_counter = itertools.count()
LONG = True


def _compile(visible, params=()):
    return cm.compile_mask(cm.MaskSpec("m", params=list(params), regions=[
        cm.Region("all", when=lambda i: True, visible=visible)]))


def _exec(source):
    """exec ``source`` under a linecache entry (as a file would be), return its namespace."""
    name = f"<soundness-{next(_counter)}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns = {}
    exec(compile(source, name, "exec"), ns)
    return ns, name


def _assert_exact(mask, meta=None, sq=70, sk=None):
    desc = mask.preprocess(meta or {}, seqlen_q=sq, seqlen_k=sk)
    assert torch.equal(desc.dense_mask(), mask.reference_mask(meta or {}, seqlen_q=sq,
                                                              seqlen_k=sk))


def test_conditional_expression_picks_the_lambda_python_runs():
    sees = (lambda i, j: i - 8 < j <= i) if not LONG else (lambda i, j: i - 64 < j <= i)
    mask = _compile(sees)
    assert [str(iv) for iv in mask.regions[0].intervals] == ["[i - 63, i + 1)"]
    _assert_exact(mask)
    other = (lambda i, j: i - 8 < j <= i) if LONG else (lambda i, j: i - 64 < j <= i)
    assert [str(iv) for iv in _compile(other).regions[0].intervals] == ["[i - 7, i + 1)"]


def test_same_constants_other_operators_on_one_line():
    a, b = (lambda i, j: j < i), (lambda i, j: j > i)
    assert str(_compile(a).regions[0].intervals[0]) == "[0, i)"
    assert str(_compile(b).regions[0].intervals[0]) == "[i + 1, seqlen_k)"


def test_lambda_returned_by_a_lambda_on_one_line():
    make = lambda w: (lambda i, j: i - w < j <= i)  # noqa: E731
    mask = _compile(make(5))
    assert [str(iv) for iv in mask.regions[0].intervals] == ["[i - 4, i + 1)"]
    _assert_exact(mask)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(consts=st.lists(st.integers(0, 40), min_size=2, max_size=5),
       ops=st.lists(st.sampled_from(["<", "<=", ">", ">="]), min_size=5, max_size=5),
       form=st.sampled_from(["tuple", "ifexp", "dict"]))
def test_several_lambdas_on_one_line(consts, ops, form):
    lams = [f"lambda i, j: i - {c} {op} j" for c, op in zip(consts, ops)]
    if form == "tuple":
        line = "FNS = (" + ", ".join(lams) + ")"
    elif form == "dict":
        line = "FNS = tuple({" + ", ".join(f"{k}: {x}" for k, x in enumerate(lams)) + "}.values())"
    else:  # nested conditional expressions: FNS holds every branch, one at a time
        line = "FNS = tuple(" + " ".join(
            f"({x}) if K == {k} else" for k, x in enumerate(lams[:-1])) + f" ({lams[-1]})"
        line += f" for K in range({len(lams)}))"
    ns, _ = _exec(line + "\n")
    assert len(ns["FNS"]) == len(lams)
    for fn, c, op in zip(ns["FNS"], consts, ops):
        mask = _compile(fn)
        region = mask.regions[0]
        assert f"i - {c} {op} j" in region.rule_source, (region.rule_source, c)
        _assert_exact(mask, sq=50, sk=50)


def test_changed_source_is_an_error_naming_region_and_line():
    ns, name = _exec("def sees(i, j):\n    return j <= i\n")
    fn = ns["sees"]
    text = "def sees(i, j):\n    return j >= i + 3\n"
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    with pytest.raises(ValueError, match=rf"Region 'all', visible function 'sees' "
                       rf"\({name}:1\): .*file may have changed"):
        _compile(fn)
    linecache.cache[name] = (1, None, ["x = 1\n"], name)
    with pytest.raises(ValueError, match=r"Region 'all', visible function 'sees'.*cannot locate"):
        _compile(fn)


def test_without_columns_ambiguous_lambdas_are_an_error(monkeypatch):
    # -X no_debug_ranges strips instruction columns: two lambdas of one line with the same
    # constants and names cannot be told apart, so the reader refuses rather than guesses
    monkeypatch.setattr(frontend, "_code_positions", lambda code: set())
    _a, b = (lambda i, j: j < i), (lambda i, j: j > i)
    with pytest.raises(ValueError, match=r"Region 'all', visible function '<lambda>' "
                       r"\(.*:\d+\): 2 functions on this line match"):
        _compile(b)
    # different constants still tell them apart without columns
    _c, d = (lambda i, j: i - 8 < j <= i), (lambda i, j: i - 64 < j <= i)
    assert [str(iv) for iv in _compile(d).regions[0].intervals] == ["[i - 63, i + 1)"]
    # identical text is the same rule: either node reads the same
    _e, f = (lambda i, j: j <= i), (lambda i, j: j <= i)
    assert str(_compile(f).regions[0].intervals[0]) == "[0, i + 1)"


def test_helper_on_a_shared_line_is_read_from_its_own_code():
    # helpers inlined by the rule are identified the same way
    ns, _ = _exec("W = 3\nnear, far = (lambda i, j: i - 2 <= j), (lambda i, j: i - 20 <= j)\n"
                  "def sees(i, j):\n    return far(i, j) and j <= i\n")
    mask = _compile(ns["sees"])
    assert [str(iv) for iv in mask.regions[0].intervals] == ["[i - 20, i + 1)"]
    _assert_exact(mask)
