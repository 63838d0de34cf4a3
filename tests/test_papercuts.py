"""Small API edges: clear errors where a call would fail later, and compile_mask's cache."""


import pytest
import torch

import compilemask as cm
from compilemask import masks

WIDTH = 3
SHIFT = 1


def test_batch_of_a_param_free_descriptor_is_named():
    mask = cm.compile_mask(masks.causal())
    q = torch.randn(3, 16, 2, 8)
    desc = mask.preprocess({}, seqlen_q=16)
    with pytest.raises(ValueError, match=r"desc was made for batch 1.*q/k give batch 3.*"
                       r"preprocess\(\.\.\., batch_size=3\)"):
        cm.attention(q, q, q, desc)
    out = cm.attention(q, q, q, mask.preprocess({}, seqlen_q=16, batch_size=3))
    assert out.shape == q.shape


def test_integer_qkv_is_a_type_error():
    mask = cm.compile_mask(masks.causal())
    desc = mask.preprocess({}, seqlen_q=8)
    q = torch.randint(0, 5, (1, 8, 2, 8))
    with pytest.raises(TypeError, match="q must be a floating-point tensor, got torch.int64"):
        cm.attention(q, q, q, desc)
    f = torch.randn(1, 8, 2, 8)
    with pytest.raises(TypeError, match="v must be a floating-point tensor, got torch.int32"):
        cm.attention(f, f, q.to(torch.int32), desc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_preprocessor_on_a_cpu_machine():
    mask = cm.compile_mask(masks.hstu())
    with pytest.raises(ValueError, match="preprocessor: device 'cuda' but CUDA is not available"):
        mask.preprocessor(64, batch_size=2, device="cuda")
    pytest.importorskip("tilelang")
    pre = mask.preprocessor(64, batch_size=2)  # the CPU: TileLang's C target
    meta = masks.random_meta(mask.spec, 2, 64, torch.Generator().manual_seed(0))
    ref = mask.preprocess(meta, seqlen_q=64, backend="torch")
    assert torch.equal(pre(meta).intervals, ref.intervals)


def _window(w):
    return cm.MaskSpec("win", params=[], regions=[
        cm.Region("all", when=lambda i: True, visible=lambda i, j: i - w < j <= i)])


def _global_width():
    return cm.MaskSpec("gw", params=[], regions=[
        cm.Region("all", when=lambda i: True, visible=lambda i, j: i - WIDTH < j <= i)])


def _slot(mask):
    return [str(iv) for iv in mask.regions[0].intervals]


def test_compile_cache_never_shares_across_constants():
    assert _slot(cm.compile_mask(_window(4))) == ["[i - 3, i + 1)"]
    assert _slot(cm.compile_mask(_window(9))) == ["[i - 8, i + 1)"]
    assert _slot(cm.compile_mask(_window(4))) == ["[i - 3, i + 1)"]
    global WIDTH
    try:
        assert _slot(cm.compile_mask(_global_width())) == ["[i - 2, i + 1)"]
        WIDTH = 6
        assert _slot(cm.compile_mask(_global_width())) == ["[i - 5, i + 1)"]
    finally:
        WIDTH = 3

    def helper_spec(k):
        def near(i, j):
            return i - k <= j

        return cm.MaskSpec("h", params=[], regions=[
            cm.Region("all", when=lambda i: True, visible=lambda i, j: near(i, j) and j <= i)])

    assert _slot(cm.compile_mask(helper_spec(2))) == ["[i - 2, i + 1)"]
    assert _slot(cm.compile_mask(helper_spec(5))) == ["[i - 5, i + 1)"]
    # True and 1 read differently (a boolean, an int): they are different keys
    global SHIFT
    spec = cm.MaskSpec("b", params=[], regions=[cm.Region(
        "all", when=lambda i: True, visible=lambda i, j: j <= i + SHIFT)])
    try:
        SHIFT = 1
        assert _slot(cm.compile_mask(spec)) == ["[0, i + 2)"]
        SHIFT = True
        with pytest.raises(NotImplementedError, match="boolean used in arithmetic"):
            cm.compile_mask(spec)
    finally:
        SHIFT = 1


def test_compile_cache_serves_a_rebuilt_spec(monkeypatch):
    """A spec rebuilt from the same code and constants skips the symbolic compile entirely."""
    from compilemask.pipeline import compiled
    calls = []
    real = compiled._compile_spec
    monkeypatch.setattr(compiled, "_compile_spec", lambda spec: calls.append(spec) or real(spec))
    for factory in (masks.hstu, masks.shared_prompt_rm, lambda: masks.clear(1, 8)):
        first = cm.compile_mask(factory())
        calls.clear()
        for _ in range(20):
            spec = factory()  # new Region objects and lambdas, same code and constants
            mask = cm.compile_mask(spec)
        assert mask.spec is spec and mask.key == first.key
        assert calls == [], first.name
    cm.compile_mask(masks.clear(1, 9))
    assert len(calls) == 1  # a changed constant compiles


# ---- overlapping guards: a row belongs to the first region whose guard holds -------------------
def _overlap_spec():
    return cm.MaskSpec("overlap", params=["a"], regions=[
        cm.Region("lo", when=lambda i: i < a + 2, visible=lambda i, j: j <= i),  # noqa: F821
        cm.Region("hi", when=lambda i: i >= a, visible=lambda i, j: j >= i),  # noqa: F821
    ])


def test_check_mode_accepts_overlapping_guards():
    mask = cm.compile_mask(_overlap_spec())
    meta = {"a": torch.tensor([3, 0])}
    plain = mask.preprocess(meta, seqlen_q=8)
    checked = mask.preprocess(meta, seqlen_q=8, check=True)
    assert torch.equal(checked.intervals, plain.intervals)
    assert torch.equal(checked.fwd_bitmap, plain.fwd_bitmap)
    # rows 3 and 4 of sequence 0 are under both guards: the first region, 'lo', takes them
    assert checked.row_region[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert torch.equal(checked.dense_mask(), mask.reference_mask(meta, seqlen_q=8))
    with pytest.raises(ValueError, match="param 'a' must be non-negative"):  # still validated
        mask.preprocess({"a": torch.tensor([-1, 0])}, seqlen_q=8, check=True)


def test_check_mode_accepts_overlapping_guards_tilelang():
    pytest.importorskip("tilelang")
    mask = cm.compile_mask(_overlap_spec())
    meta = {"a": torch.tensor([3, 0])}
    desc = mask.preprocess(meta, seqlen_q=8, check=True, backend="tilelang")
    assert torch.equal(desc.dense_mask(), mask.reference_mask(meta, seqlen_q=8))


def test_explain_states_the_first_region_rule_where_guards_may_overlap():
    rule = "rows belong to the first region whose guard holds"
    assert rule in cm.compile_mask(_overlap_spec()).explain()
    exclusive = cm.MaskSpec("split", params=["a"], regions=[
        cm.Region("lo", when=lambda i: i < a, visible=lambda i, j: j <= i),  # noqa: F821
        cm.Region("hi", when=lambda i: i >= a, visible=lambda i, j: j >= i),  # noqa: F821
    ])
    mask = cm.compile_mask(exclusive)
    assert mask.regions[1].exclusive_with == {"lo": True}
    assert rule not in mask.explain()
    assert rule not in cm.compile_mask(masks.causal()).explain()


def test_demo_accepts_overlapping_guards(monkeypatch, capsys):
    """The demo's HSTU with the history guard written ``i < hist_end``: it overlaps the context
    guard, and the first region wins, so the mask is HSTU's."""
    from compilemask.__main__ import demo

    stock = masks.hstu

    def overlapping_hstu():
        spec = stock()
        history = cm.Region("history", when=lambda i: i < hist_end,  # noqa: F821
                            visible=spec.regions[1].visible)
        return cm.MaskSpec("hstu", params=list(spec.params),
                           regions=[spec.regions[0], history, spec.regions[2]])

    monkeypatch.setattr(masks, "hstu", overlapping_hstu)
    assert demo([]) == 0
    out = capsys.readouterr().out
    assert "rows belong to the first region whose guard holds" in out
    assert "descriptor mask == brute-force mask of the Python rules: True" in out


# ---- per-row arrays read at anything but i or j: the error names region, rule and line ---------
def test_array_subscript_other_than_i_or_j_names_region_rule_and_line():
    import inspect

    def ahead(i, j):
        return j < nxt[i + 1]  # noqa: F821

    line = inspect.getsourcelines(ahead)[1] + 1
    spec = cm.MaskSpec("ahead", params=["nxt"], regions=[
        cm.Region("r", when=lambda i: True, visible=ahead)])
    with pytest.raises(NotImplementedError, match=(
            rf"Region 'r', visible function 'ahead' \(.*test_papercuts.py:{line}\): "
            r"unsupported subscript 'nxt\[i \+ 1\]': a per-row array is read at i or j only")):
        cm.compile_mask(spec)
    guard = cm.MaskSpec("g", params=["nxt"], regions=[
        cm.Region("r", when=lambda i: nxt[i // 2] > 0, visible=lambda i, j: j <= i)])  # noqa: F821
    with pytest.raises(NotImplementedError, match=r"Region 'r', when function '<lambda>' "
                       r"\(.*test_papercuts.py:\d+\): unsupported subscript 'nxt\[i // 2\]'"):
        cm.compile_mask(guard)
    for bad in (lambda i, j: nxt[3] < j, lambda i, j: j < nxt[nxt[i]]):  # noqa: F821
        with pytest.raises(NotImplementedError, match="Region 'r', visible function"):
            cm.compile_mask(cm.MaskSpec("b", params=["nxt"], regions=[
                cm.Region("r", when=lambda i: True, visible=bad)]))


# ---- a float (or bool) param: one ValueError, tensor or Python value ---------------------------
@pytest.mark.parametrize("value", [2.0, torch.tensor([2.0]), True, torch.tensor([True])],
                         ids=["float", "float-tensor", "bool", "bool-tensor"])
def test_float_param_is_one_value_error(value):
    mask = cm.compile_mask(masks.prefix_lm())
    with pytest.raises(ValueError, match=r"param 'prefix_len': .*metadata are non-negative ints"):
        mask.preprocess({"prefix_len": value}, seqlen_q=8)


# ---- explain: generated code on request; to_string: the legend once ----------------------------
def test_explain_shows_generated_code_only_on_request():
    mask = cm.compile_mask(masks.hstu())
    short, full = mask.explain(), mask.explain(show_code=True)
    assert "generated" not in short and "K = 2" in short
    assert "generated TileLang preprocess" in full and "generated torch reference" in full
    assert full.startswith(short)
    assert len(short.splitlines()) < 100


def test_to_string_prints_the_legend_once():
    desc = cm.compile_mask(masks.causal()).preprocess({}, seqlen_q=256, fwd_tiles=(64, 64))
    text = desc.to_string()
    assert text.count("'#' full, '~' partial, '.' empty") == 1
    assert text.splitlines()[0].endswith("  ['#' full, '~' partial, '.' empty]")
    blocks = desc.to_string(max_size=2)
    assert blocks.count("'#' all full, '~' mixed, '.' all empty") == 1
    assert "'#' full," not in desc.to_string(legend=False)


def test_transformers_integration_refuses_a_hidden_kernels_package(tmp_path):
    """``python -m ...`` at the checkout's root puts the root first on sys.path, where this
    project's folder kernels/ hides the PyPI package ``kernels`` that transformers imports: the
    integration refuses, saying what to do; started in another folder, it finds the package."""
    import importlib.metadata
    import os
    import subprocess
    import sys

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the PyPI package kernels is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hidden = subprocess.run(
        [sys.executable, "-c", "import compilemask.integrations.transformers"], cwd=root,
        capture_output=True, text=True)
    assert hidden.returncode != 0
    assert "ImportError" in hidden.stderr and "python -P" in hidden.stderr, hidden.stderr
    code = ("import importlib.util as u, compilemask.integrations.transformers, "
            "compilemask.kernels as ck; "
            f"print(u.find_spec('kernels').origin.startswith({root!r}), "
            f"ck.__file__.startswith({root!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout.split()
    # the installed package under the name, and compilemask.kernels still this folder
    assert out == ["False", "True"], out
