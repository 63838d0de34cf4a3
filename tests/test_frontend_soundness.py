"""The front end reads the rule Python runs: a function's identity comes from its code object
(first line, instruction columns, constants, names), never from the first match on a line."""

import ast
import itertools
import linecache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compilemask as cm
from compilemask.dsl import frontend

from helpers import compile_in_range

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
        # (a compiled region's rule_source is that of the first spec of its canonical form)
        _, src, _ = frontend._func_source_node(fn)
        assert src == f"lambda i, j: i - {c} {op} j", (src, c)
        _assert_exact(_compile(fn), sq=50, sk=50)


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
    # -X no_debug_ranges strips instruction columns: two lambdas of one line whose texts differ
    # and whose code is the same (Python folds the constant) cannot be told apart, so the
    # reader refuses rather than guesses
    monkeypatch.setattr(frontend, "_code_positions", lambda code: set())
    _a, b = (lambda i, j: j < 2 + 1), (lambda i, j: j < 3)
    with pytest.raises(ValueError, match=r"Region 'all', visible function '<lambda>' "
                       r"\(.*:\d+\): 2 functions on this line match"):
        _compile(b)
    # the order of the operands tells them apart
    _a, b = (lambda i, j: j < i), (lambda i, j: i < j)
    assert str(_compile(b).regions[0].intervals[0]) == "[i + 1, seqlen_k)"
    # their operators tell them apart
    _g, h = (lambda i, j: j < i), (lambda i, j: j > i)
    assert str(_compile(h).regions[0].intervals[0]) == "[i + 1, seqlen_k)"
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


# ---- interval endpoints never contain j ------------------------------------------------------


def test_quotient_plus_j_is_solved_exactly():
    mask = _compile(lambda i, j: j // 7 + j <= i)
    (iv,) = mask.regions[0].intervals
    j = frontend.rule_symbols(())["j"]
    assert iv.exact and not iv.lower.has(j) and not iv.upper.has(j)
    _assert_exact(mask, sq=90, sk=90)
    for rule in (lambda i, j: j // 7 + j > i, lambda i, j: 2 * j - (j + 3) // 4 == i,
                 lambda i, j: i - 3 * j - j // 5 < 2):
        mask = _compile(rule)
        assert not mask.has_fallback
        _assert_exact(mask, sq=90, sk=90)


def test_non_monotone_quotient_mix_keeps_the_predicate():
    mask = _compile(lambda i, j: j - 2 * (j // 3) <= i)  # j - 2*(j // 3) steps back
    assert mask.has_fallback
    _assert_exact(mask, sq=60, sk=60)


_divs = st.sampled_from(["2", "3", "5", "7", "d"])
_shift = st.sampled_from(["", " + 1", " - 2", " + a", " - i"])
_term = st.one_of(
    st.just("j"),
    st.tuples(_shift, _divs).map(lambda t: f"((j{t[0]}) // {t[1]})"),
    st.tuples(_shift, _divs).map(lambda t: f"((j{t[0]}) % {t[1]})"),
)
_lin = st.lists(st.tuples(st.integers(-3, 3), _term), min_size=1, max_size=3).map(
    lambda ts: " + ".join(f"({k} * {t})" for k, t in ts))
_rhs = st.sampled_from(["i", "i + a", "2 * i - 5", "a", "i // 2", "3"])
_cmp = st.sampled_from(["<", "<=", ">", ">=", "==", "!="])
_atom = st.tuples(_lin, _cmp, _rhs).map(lambda t: f"{t[0]} {t[1]} {t[2]}")
_rule = st.recursive(_atom, lambda b: st.tuples(b, st.sampled_from(["and", "or"]), b).map(
    lambda t: f"({t[0]} {t[1]} {t[2]})"), max_leaves=3)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(rule=_rule, sq=st.integers(1, 40), sk=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_random_quotient_remainder_rules_match_brute_force(rule, sq, sk, seed):
    ns, _ = _exec(f"def visible(i, j):\n    return {rule}\n")
    mask = compile_in_range(cm.MaskSpec("m", params=["a", "d"], regions=[
        cm.Region("all", when=lambda i: True, visible=ns["visible"])]))
    j = frontend.rule_symbols(())["j"]
    for r in mask.regions:
        for iv in r.intervals:
            assert not iv.lower.has(j) and not iv.upper.has(j), (rule, str(iv))
    gen = torch.Generator().manual_seed(seed)
    meta = {"a": torch.randint(0, 30, (2,), generator=gen),
            "d": torch.randint(1, 6, (2,), generator=gen)}
    desc = mask.preprocess(meta, seqlen_q=sq, seqlen_k=sk, fwd_tiles=(8, 8), bwd_tiles=(4, 16))
    ref = mask.reference_mask(meta, seqlen_q=sq, seqlen_k=sk)
    assert torch.equal(desc.dense_mask(), ref), (rule, meta)


# ---- &, |, ~ on booleans -----------------------------------------------------------------------


def _grid(fn, sq, sk, **env):
    """The rule evaluated on broadcast torch grids: & | ~ are logical on bool tensors."""
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    return torch.broadcast_to(torch.as_tensor(fn(i, j)), (sq, sk))


def test_bitwise_operators_on_booleans_are_logical():
    mask = _compile(lambda i, j: (j <= i) & ~(j < i - 3) | (j == 5))
    assert not mask.has_fallback and mask.num_intervals == 2
    desc = mask.preprocess({}, seqlen_q=30, seqlen_k=30)
    want = _grid(lambda i, j: (j <= i) & ~(j < i - 3) | (j == 5), 30, 30)
    assert torch.equal(desc.dense_mask()[0], want)
    assert torch.equal(desc.dense_mask(), mask.reference_mask({}, seqlen_q=30))
    spec = cm.MaskSpec("g", params=["a"], regions=[
        cm.Region("lo", when=lambda i: ~(i >= a), visible=lambda i, j: (j <= i) ^ (j < 2)),  # noqa: F821
        cm.Region("hi", when=lambda i: (i >= a) | (i < 0), visible=lambda i, j: j >= a)])  # noqa: F821
    mask = cm.compile_mask(spec)
    for a in (0, 4, 30):
        _assert_exact(mask, {"a": a}, sq=20)


def test_bitwise_operators_on_integers_are_bit_operations():
    """On integers ``& | ^ ~`` are Python's bit operations and ``>> <<`` by constants shifts;
    a boolean mixed with an integer, or a shift by a variable, is an error naming it."""
    for rule in (lambda i, j: j < (i & 3), lambda i, j: (j | 1) < i, lambda i, j: j < ~i + 9,
                 lambda i, j: (j >> 1) == (i >> 1)):
        mask = _compile(rule)
        desc = mask.preprocess({}, seqlen_q=20, seqlen_k=20)
        assert torch.equal(desc.dense_mask()[0], _grid(rule, 20, 20))
    with pytest.raises(NotImplementedError, match=r"test_frontend_soundness.py:\d+\): "
                       r"unsupported '&' of a boolean and an integer"):
        _compile(lambda i, j: (j < i) & 1)
    with pytest.raises(NotImplementedError, match=r"shift by j: a constant in \[0, 62\]"):
        _compile(lambda i, j: (i >> j) == 0)


_int_term = st.sampled_from(["j", "(j & 5)", "(i ^ j)", "(j | i)", "(j >> 1)", "(j << 2)",
                             "(~j + 40)", "((i - j) & 7)"])
_int_atom = st.tuples(_int_term, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]),
                      st.sampled_from(["i", "a", "3", "(i & a)", "(i >> 2)"])).map(
    lambda t: f"({t[0]} {t[1]} {t[2]})")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rule=st.recursive(_int_atom, lambda b: st.tuples(b, st.sampled_from(["&", "|", "^"]), b)
                         .map(lambda t: f"({t[0]} {t[1]} {t[2]})"), max_leaves=3),
       sq=st.integers(1, 30), sk=st.integers(1, 30), a=st.integers(0, 30))
def test_random_integer_bit_rules_match_torch_semantics(rule, sq, sk, a):
    _rule_matches_torch(rule, sq, sk, a)


def _rule_matches_torch(rule, sq, sk, a):
    """The rule text compiled (param ``a``) equals torch's evaluation of the same text, by the
    descriptor and by the reference mask."""
    ns, _ = _exec(f"def visible(i, j):\n    return {rule}\n")
    mask = _compile(ns["visible"], params=["a"])
    desc = mask.preprocess({"a": a}, seqlen_q=sq, seqlen_k=sk)
    want = _grid(lambda i, j: eval(rule, {"a": a, "i": i, "j": j}), sq, sk)
    assert torch.equal(desc.dense_mask()[0], want), rule
    assert torch.equal(mask.reference_mask({"a": a}, seqlen_q=sq, seqlen_k=sk)[0], want), rule


_cmp_atom = st.tuples(st.sampled_from(["j", "j + 2", "2 * j", "j // 3"]), _cmp, _rhs).map(
    lambda t: f"({t[0]} {t[1]} {t[2]})")
_bit_rule = st.recursive(_cmp_atom, lambda b: st.one_of(
    st.tuples(b, st.sampled_from(["&", "|", "^"]), b).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
    b.map(lambda x: f"(~{x})")), max_leaves=4)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rule=_bit_rule, sq=st.integers(1, 30), sk=st.integers(1, 30), a=st.integers(0, 30))
def test_random_bitwise_rules_match_torch_semantics(rule, sq, sk, a):
    _rule_matches_torch(rule, sq, sk, a)


# Names Python would resolve otherwise than the rule language: refused, never guessed.
def test_a_variable_named_like_a_length_is_refused():
    ns, _ = _exec("seqlen_k = 4\n\ndef vis(i, j):\n    return j < seqlen_k\n")
    with pytest.raises(ValueError, match="'seqlen_k' is the sequence length.*rename the var"):
        _compile(ns["vis"])
    ns, _ = _exec("def vis(i, j):\n    return j < seqlen_k\n")  # no such variable: the length
    desc = _compile(ns["vis"]).preprocess({}, seqlen_q=5, seqlen_k=7)
    assert desc.dense_mask().all()


@pytest.mark.parametrize("body", [
    "    if i < 3:\n        w = 1\n    return i - w < j <= i\n",  # assigned on one path
    "    w += 1\n    return i - w < j <= i\n",  # augmented assignment of a global
    "    x = w\n    w = 2\n    return i - x < j <= i\n",  # read before its assignment
])
def test_a_local_read_before_assignment_is_refused(body):
    ns, _ = _exec("w = 10\n\ndef vis(i, j):\n" + body)
    with pytest.raises(ValueError, match="'w' is assigned in the function but read before"):
        _compile(ns["vis"])


def test_a_local_assigned_on_every_path_is_read():
    ns, _ = _exec("w = 10\n\ndef vis(i, j):\n    if i < 3:\n        w = 1\n    else:\n"
                  "        w = 2\n    return i - w < j <= i\n")
    mask = _compile(ns["vis"])
    desc = mask.preprocess({}, seqlen_q=9)
    assert torch.equal(desc.dense_mask(), mask.reference_mask({}, seqlen_q=9))
    assert int(desc.dense_mask()[0, 8].sum()) == 2  # w = 2 there, not the global 10


# ---- assignments, ~ of Python bools, and the reference's tensors --------------------------------


class _Rows:
    """A table param read as the rules read it, on Python values: False outside the table."""

    def __init__(self, entries):
        self.rows = entries.tolist()

    def __getitem__(self, rc):
        i, c = rc
        return 0 <= c < len(self.rows[i]) and bool(self.rows[i][c])


def _python_twin(source, **values):
    """The rules of ``source`` as plain Python computes them: ``~`` (applied to booleans only in
    these tests, where it means not) spelled ``not``, run on ints with the params as globals."""

    class _Not(ast.NodeTransformer):
        def visit_UnaryOp(self, node):
            self.generic_visit(node)
            return ast.UnaryOp(ast.Not(), node.operand) if isinstance(node.op, ast.Invert) else node

    tree = ast.fix_missing_locations(_Not().visit(ast.parse(source)))
    ns = dict(values)
    exec(compile(tree, "<twin>", "exec"), ns)
    return ns


def _python_mask(ns, sq, sk):
    """bool [Sq, Sk]: the first region (``when0``/``vis0``, ``when1``/``vis1``, ...) whose guard
    holds gives the row; a spec of one region may name them ``when``/``vis``."""
    names = [("when", "vis")] if "vis" in ns else [
        (f"when{k}", f"vis{k}") for k in range(10) if f"vis{k}" in ns]
    out = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for when, vis in names:
            if bool(ns[when](i)):
                out[i] = torch.tensor([bool(ns[vis](i, j)) for j in range(sk)])
                break
    return out


def _check_against_python(source, params=(), metas=({},), sizes=((12, 12), (9, 14))):
    """Compile the rules of ``source`` (``when``/``vis``, or numbered regions); the descriptor's
    dense mask and the reference mask equal plain Python's evaluation, element by element."""
    ns, _ = _exec(source)
    names = [("when", "vis")] if "vis" in ns else [
        (f"when{k}", f"vis{k}") for k in range(10) if f"vis{k}" in ns]
    mask = cm.compile_mask(cm.MaskSpec("m", params=list(params), regions=[
        cm.Region(f"r{k}", when=ns[w], visible=ns[v]) for k, (w, v) in enumerate(names)]))
    for full in metas:
        for sq, sk in sizes:
            meta = {p: v[:, :sq] if p in mask.array_params else v for p, v in full.items()}
            got = mask.preprocess(meta, seqlen_q=sq, seqlen_k=sk).dense_mask()
            ref = mask.reference_mask(meta, seqlen_q=sq, seqlen_k=sk)
            for b in range(got.shape[0]):  # a sequence's metadata as Python values
                values = {p: (_Rows(v[b]) if p in mask.table_params else
                              v[b].tolist() if p in mask.array_params else
                              int(v[b]) if isinstance(v, torch.Tensor) else v)
                          for p, v in meta.items()}
                ns = _python_twin(source, **values, seqlen_q=sq, seqlen_k=sk)
                want = _python_mask(ns, sq, sk)
                assert torch.equal(got[b], want), (source, meta, sq, sk, b)
                assert torch.equal(ref[b], want), (source, meta, sq, sk, b)
    return mask


_WHEN = "def when(i):\n    return True\n\n"


@pytest.mark.parametrize("body", [
    "    x = i\n    x = y = x + 1\n    return j < y\n",  # the value is read before x changes
    "    x = 1\n    x = y = z = x + i\n    return j < x + y + z - 2 * i\n",
    "    x = j\n    x = z = x - 2\n    return z <= i\n",
    "    x, y = i, j\n    x, y = y, x = x, y\n    return x <= y\n",  # left to right: y, x win
    "    a, b = c, d = j, i - 1\n    return a <= d and c >= b - 3\n",
    "    w = i\n    w = v = w // 2\n    w += 1\n    return v <= j < w + v\n",
])
def test_assignment_to_several_targets_binds_one_value(body):
    _check_against_python(_WHEN + "def vis(i, j):\n" + body)


def test_a_tuple_bound_to_a_name_is_refused():
    ns, name = _exec("def vis(i, j):\n    x = y = i, j\n    return j < i\n")
    with pytest.raises(NotImplementedError, match=rf"\({name}:2\): unsupported syntax 'Tuple'"):
        _compile(ns["vis"])


_W = torch.tensor([2, 0])
_ARR = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]] * 2)


@pytest.mark.parametrize("source,meta", [
    # a local sharing its tensor with a param, then augmented: the param keeps its value
    (_WHEN + "def vis(i, j):\n    x = w\n    x += 1\n    return ~(j > i) & (j > i - x)\n",
     {"w": _W}),
    # ... with the row index (max returns its argument itself), read again after
    (_WHEN + "def vis(i, j):\n    x = max(i, 5)\n    x -= 2\n    return ~(j > i) & "
             "(j >= i - 3) & (j >= x - 4)\n", {}),
    (_WHEN + "def vis(i, j):\n    y = x = i\n    x += 2\n    return ~(j > y) & (j < x - 3)\n",
     {}),
    # ... with a per-row array's entry
    (_WHEN + "def vis(i, j):\n    x = arr[i]\n    x += 3\n    return ~(j < arr[i]) & (j < x)\n",
     {"arr": _ARR}),
    # ... in a guard, which the visible rule then reads
    ("def when0(i):\n    x = w\n    x *= 3\n    return ~(i < x)\n\n"
     "def vis0(i, j):\n    return j <= i - w\n\n"
     "def when1(i):\n    return True\n\n"
     "def vis1(i, j):\n    x = i\n    x >>= 1\n    return ~(j < x) & (j <= i)\n", {"w": _W}),
])
def test_reference_calls_never_change_the_values_they_share(source, meta):
    # the reference runs rules that use ~ on tensors: every call must see Python's values
    _check_against_python(source, params=list(meta), metas=(meta,))
    assert torch.equal(_W, torch.tensor([2, 0]))  # the metadata are untouched


_CALLER = "FLAG = True\nW = 4\n\n\ndef not_j(i, j):\n    return not (j > i)\n\n\n" + _WHEN


@pytest.mark.parametrize("expr", [
    "~(not (j > i))",
    "~((j > i) or (0 < 1))",
    "~(3 > 2) & (j <= i)",
    "~FLAG & (j <= i)",
    "~(W > 3) | (j < 2)",
    "~(min(i, 5) > 3) & (j <= i)",  # min(i, 5) is the int 5 for i >= 5
    "~(j < 5 < W)",  # the value may be the pair (5 < W), a Python bool
    "~not_j(i, j)",
    "~((j > i) if i < 3 else False)",
])
def test_invert_of_a_python_bool_is_refused(expr):
    # on a Python bool ~ is bitwise (~True == -2, ~False == -1: both true), not logical
    ns, name = _exec(_CALLER + f"def vis(i, j):\n    return {expr}\n")
    line = _CALLER.count("\n") + 2
    with pytest.raises(NotImplementedError, match=rf"Region 'all', visible function 'vis' "
                       rf"\({name}:{line}\): unsupported '~' of .*Python bool.*write 'not \("):
        _compile(ns["vis"])


def test_invert_of_a_local_python_bool_is_refused():
    ns, name = _exec("def vis(i, j):\n    x = not (j > i)\n    if i > 2:\n        x = j > 1\n"
                     "    return ~x\n")
    with pytest.raises(NotImplementedError, match=rf"\({name}:5\): unsupported '~' of 'x'"):
        _compile(ns["vis"])
    ns, name = _exec("def when(i):\n    return ~(seqlen_q > 3 > 2)\n")  # the pair (3 > 2)
    with pytest.raises(NotImplementedError, match=rf"Region 'all', when function 'when' "
                       rf"\({name}:2\): unsupported '~'"):
        cm.compile_mask(cm.MaskSpec("m", regions=[
            cm.Region("all", when=ns["when"], visible=lambda i, j: j <= i)]))


@pytest.mark.parametrize("body", [
    "    return ~(j > i) & ~~(j >= i - 3)\n",
    "    ok = j > i\n    ok2 = ok\n    return ~ok2\n",
    "    return ~((j > i) & FLAG) & ~(W > j)\n",  # & of a tensor and a Python bool is a tensor
    "    return ~((j > i + 1) and (j < 9)) & ~(i < 2 < j)\n",  # each value is a tensor
    "    return ~(min(i, j) > 3) | ~(abs(i - j) < w)\n",
    "    return ~tensor_cmp(i, j) & (j <= i)\n",
    "    return ~(j > i) if i < W else ~((j < 2) ^ (i == j))\n",
    "    x = 1\n    x += w\n    return ~(j > i) & (j >= i - x)\n",  # int + tensor: a tensor
    "    return ~(j < seqlen_k - 3) | (j == i)\n",
])
def test_invert_of_a_tensor_boolean_is_not(body):
    src = ("FLAG = True\nW = 4\n\n\ndef tensor_cmp(a, b):\n    if a > 3:\n        return b > a\n"
           "    return a == b\n\n\n" + _WHEN + "def vis(i, j):\n" + body)
    _check_against_python(src, params=["w"], metas=({"w": 3}, {"w": 0}))


def test_invert_of_a_table_entry_is_not():
    gen = torch.Generator().manual_seed(0)
    anc = torch.rand(1, 12, 6, generator=gen) < 0.5
    src = _WHEN + ("def vis(i, j):\n    if ~anc[i, j]:\n        return ~~anc[i, j + 1] & (j <= i)\n"
                   "    return ~anc[i, j - 2] | (j == 0)\n")
    _check_against_python(src, params=["anc"], metas=({"anc": anc},), sizes=((12, 12),))


_inv_atom = st.sampled_from([
    "(j > i)", "(j <= a)", "(i < 3)", "(3 > 2)", "(W > j)", "FLAG", "True", "(min(i, 5) > 3)",
    "(max(j, W) == j)", "(i < j < W)", "(0 < 1 < j)", "(j != i + a)"])
_inv_rule = st.recursive(_inv_atom, lambda b: st.one_of(
    st.tuples(b, st.sampled_from(["&", "|", "^", "and", "or"]), b).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})"),
    b.map(lambda x: f"(~{x})"), b.map(lambda x: f"(not {x})"),
    st.tuples(b, b).map(lambda t: f"({t[0]} if (i < 4) else {t[1]})")), max_leaves=5)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(rule=_inv_rule, a=st.integers(0, 9))
def test_random_invert_rules_match_torch_or_are_refused(rule, a):
    """A rule mixing ``~`` with ``not``, ``and``/``or``, constants and globals is what Python
    computes on 0-d tensors (torch's ``~`` of a bool tensor, Python's of a bool), or refused."""
    ns, _ = _exec(f"W = 6\nFLAG = True\n\n\ndef vis(i, j):\n    return {rule}\n")
    try:
        mask = _compile(ns["vis"], params=["a"])
    except NotImplementedError as e:
        assert "'~' of" in str(e) and "write 'not (" in str(e), (rule, str(e))
        return
    sq = sk = 9
    t = torch.tensor
    want = torch.tensor([[bool(eval(rule, {"W": 6, "FLAG": True, "a": t(a), "i": t(i),  # noqa: S307
                                            "j": t(j)})) for j in range(sk)] for i in range(sq)])
    meta = {"a": a} if "a" in mask.scalar_params else {}
    desc = mask.preprocess(meta, seqlen_q=sq, seqlen_k=sk)
    assert torch.equal(desc.dense_mask()[0], want), rule
    assert torch.equal(mask.reference_mask(meta, seqlen_q=sq, seqlen_k=sk)[0], want), rule


_EDITED = """
import compilemask as cm
spec = cm.MaskSpec("edited", params=["w"], regions=[
    cm.Region("all", when=lambda i: i >= 0, visible=lambda i, j: (j {op} i - w) & (j >= 0))])
other = cm.MaskSpec("other", params=["w"], regions=[
    cm.Region("all", when=lambda i: i >= 0, visible=lambda i, j: (j {op} i + w) & (j >= 0))])
"""


def test_a_rule_file_edited_since_import_is_read_as_it_runs(tmp_path, monkeypatch):
    """The rules are read from their file: edited and reloaded, the new text is read (not a
    cached copy); edited and not reloaded, the text no longer matches the code that runs (an
    operator changed) and the reader refuses rather than translate the new text."""
    import importlib
    import os
    import sys

    path = tmp_path / "edited_rules.py"
    path.write_text(_EDITED.format(op=">="))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "edited_rules", raising=False)
    mod = importlib.import_module("edited_rules")
    first = cm.compile_mask(mod.spec)
    _assert_exact(first, {"w": 2})
    path.write_text(_EDITED.format(op="<="))
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))
    assert cm.compile_mask(mod.spec).key == first.key  # the code that runs, compiled before
    with pytest.raises(ValueError, match="does not match the function's code"):
        cm.compile_mask(mod.other)  # the old code object, the new text
    mod = importlib.reload(mod)
    second = cm.compile_mask(mod.spec)
    assert second.key != first.key
    _assert_exact(second, {"w": 2})
    _assert_exact(cm.compile_mask(mod.other), {"w": 2})


def _folded_divisor(i, j):
    return j <= i and (i // g) - (i // g) == 0  # noqa: F821


def test_a_divisor_sympy_cancels_is_still_checked():
    """``i // g`` cancelled by sympy leaves the rules equal to ``j <= i``, but Python raises
    at g = 0: the mask keeps g as a divisor (refused at 0) whatever compiled before it."""
    plain = cm.compile_mask(cm.MaskSpec("plain_g", params=["g"], regions=[
        cm.Region("r", when=lambda i: i >= 0, visible=lambda i, j: j <= i)]))
    folded = cm.compile_mask(cm.MaskSpec("folded_g", params=["g"], regions=[
        cm.Region("r", when=lambda i: i >= 0, visible=_folded_divisor)]))
    assert plain.key != folded.key and folded.divisor_params == ("g",)
    plain.preprocess({"g": 0}, seqlen_q=4, backend="torch")
    with pytest.raises(ValueError, match="g.*positive"):
        folded.preprocess({"g": 0}, seqlen_q=4, backend="torch")


def test_a_head_read_implicitly_has_no_column_view_whatever_compiled_first():
    """A spec declaring ``h`` and one reading the head index implicitly share their rules'
    compilation; the column view, which the per-head one does not have, is decided per mask."""
    def rule(i, j):
        return j <= i and j >= h  # noqa: F821

    explicit = cm.compile_mask(cm.MaskSpec("explicit_h", params=["h"], regions=[
        cm.Region("all", when=lambda i: i >= 0, visible=rule)]))
    implicit = cm.compile_mask(cm.MaskSpec("implicit_h", regions=[
        cm.Region("all", when=lambda i: i >= 0, visible=rule)]))
    assert explicit.column_view is not None
    assert implicit.head_param == "h" and implicit.column_view is None
    assert "head index" in implicit.column_view_reason
