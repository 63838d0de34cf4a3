"""Integer ranges: rules whose terms may not fit the generated code's integers are refused with
the region and the term named (Python's rule is exact; the code would wrap)."""

import pytest
import sympy as sp
import torch

import compilemask as cm
from compilemask.compiler.bounds import INT32_MAX, META_MAX, check_kernel_predicates, magnitude
from compilemask.masks import EXAMPLES


def _spec(visible, params=("a", "b", "c")):
    return cm.MaskSpec(f"ranges_{abs(hash(visible.__code__.co_consts))}", params=list(params),
                       regions=[cm.Region("r", when=lambda i: True, visible=visible)])


def test_magnitude_of_simple_terms():
    i, j, a = sp.Symbol("i"), sp.Symbol("j"), sp.Symbol("a")
    assert magnitude(i + a) == INT32_MAX + META_MAX
    assert magnitude(i - j, index_max=100) == 200  # |i| + |j|: no sign analysis
    assert magnitude(3 * a * a, meta_max=10) == 300
    assert magnitude(sp.floor((i - a) / 4), index_max=100, meta_max=10) == 111
    assert magnitude(sp.Mod(i + a, 7), index_max=100, meta_max=10) == 110  # the numerator too


@pytest.mark.parametrize("visible,what", [
    (lambda i, j: j < a * b * c, "interval 0 end"),  # noqa: F821 (params)
    (lambda i, j: j >= a * 10000000000000, "interval 0 start"),  # noqa: F821
    (lambda i, j: j * j * j * a > b, "rule"),  # noqa: F821 (a fallback predicate)
])
def test_terms_past_int64_are_refused_at_compile_time(visible, what):
    with pytest.raises(ValueError, match=rf"Region 'r', {what}: .* past the 64-bit"):
        cm.compile_mask(_spec(visible))


def test_products_that_fit_int64_compile_and_match_brute_force():
    mask = cm.compile_mask(_spec(lambda i, j: j < a * b))  # noqa: F821 (2**60 fits)
    meta = {"a": torch.tensor([2**20, 3]), "b": torch.tensor([2**20, 2]),
            "c": torch.tensor([0, 0])}
    desc = mask.preprocess(meta, seqlen_q=9)
    assert torch.equal(desc.dense_mask(), mask.reference_mask(meta, seqlen_q=9))


def test_every_example_fits_both_ranges_at_32k():
    for make in EXAMPLES.values():
        check_kernel_predicates(cm.compile_mask(make()), 32768)  # raises if not


def test_kernel_predicates_are_checked_at_the_call_length():
    dilated = cm.compile_mask(EXAMPLES["dilated_causal"]())
    check_kernel_predicates(dilated, 2**20)  # |i - j| fits int32
    with pytest.raises(ValueError, match="Region .*, rule .*GPU kernels.*32-bit"):
        check_kernel_predicates(dilated, INT32_MAX)  # i - j + ... of two int32 indices
    sq = cm.compile_mask(_spec(lambda i, j: j * j + a <= i, params=("a",)))  # noqa: F821
    check_kernel_predicates(sq, 1024)
    with pytest.raises(ValueError, match="Region 'r', rule"):
        check_kernel_predicates(sq, 50000)  # j * j passes 2**31


def test_longest_fit_is_the_check_s_boundary():
    """The longest length found once per mask is where the per-length check starts to refuse."""
    from compilemask.compiler.bounds import kernel_predicates, longest_fit

    sq = cm.compile_mask(_spec(lambda i, j: j * j + a <= i, params=("a",)))  # noqa: F821
    n = longest_fit(e for _, _, e in kernel_predicates(sq))
    assert 1024 < n < 50000
    check_kernel_predicates(sq, n)
    with pytest.raises(ValueError, match="Region 'r', rule"):
        check_kernel_predicates(sq, n + 1)
    assert longest_fit([]) == INT32_MAX


@pytest.mark.parametrize("engine", ["fa4", "cute"])
def test_the_kernel_engines_check_their_predicates_before_running(engine, monkeypatch):
    """In the op (eager even inside a compiled graph), before any kernel is built."""
    from compilemask.kernels import autograd, fa4

    mask = cm.compile_mask(_spec(lambda i, j: j * j + a <= i, params=("a",)))  # noqa: F821
    S = 50000
    desc = mask.preprocess({"a": torch.tensor([5])}, seqlen_q=S)
    q = torch.zeros(1, S, 1, 8)
    ran = []
    monkeypatch.setattr(fa4, "fwd", lambda *a, **kw: ran.append(1))
    monkeypatch.setattr(autograd, "_cuda_fwd", lambda *a, **kw: ran.append(1))
    with pytest.raises(ValueError, match="Region 'r', rule .*GPU kernels"):
        autograd.attention_op(q, q, q, desc, engine=engine)
    assert not ran
    short = mask.preprocess({"a": torch.tensor([5])}, seqlen_q=64)  # fits at 64 keys
    assert torch.equal(autograd.attention_op(q[:, :64], q[:, :64], q[:, :64], short,
                                             engine="reference"),
                       torch.zeros(1, 64, 1, 8))


@pytest.mark.parametrize("rule", [
    "(j if i < a else a) * 2 <= i * j",  # an integer conditional in a predicate
    "j * seqlen_q <= i * seqlen_k",  # the lengths in a predicate
])
def test_predicates_the_gpu_code_cannot_evaluate_are_refused_by_region(rule, monkeypatch):
    import linecache

    from compilemask.kernels import autograd, fa4

    src = f"def vis(i, j):\n    return {rule}\n"
    name = f"<gpu-predicate-{abs(hash(rule))}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    ns: dict = {}
    exec(compile(src, name, "exec"), ns)
    mask = cm.compile_mask(cm.MaskSpec(f"gpu_pred_{abs(hash(rule))}", params=["a"], regions=[
        cm.Region("odd", when=lambda i: True, visible=ns["vis"])]))
    assert mask.has_fallback
    desc = mask.preprocess({"a": torch.tensor([3])}, seqlen_q=64)
    q = torch.zeros(1, 64, 1, 8)
    monkeypatch.setattr(fa4, "fwd", lambda *a, **kw: pytest.fail("a kernel ran"))
    with pytest.raises(NotImplementedError, match="Region 'odd', rule .*backend='reference'"):
        autograd.attention_op(q, q, q, desc, engine="fa4")
