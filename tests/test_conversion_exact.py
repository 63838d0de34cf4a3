"""Conversions and compiled masks read the values as they are now: a mask_mod converted again
after a value it reads changed (a closure cell, a global, an attribute of an object or an
nn.Module, a default, a captured tensor) equals FlexAttention's ``create_mask`` of it, element by
element; metadata and layouts at the edges of the contract are accepted or refused exactly."""

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import and_masks, create_mask, noop_mask, or_masks

import compilemask as cm
from compilemask import masks
from compilemask.compiler.reference import attention_reference

# ---- helpers -----------------------------------------------------------------------------------


def _converted(mask_mod, S, B=1):
    """The dense mask of the converted mask_mod."""
    spec, meta = cm.from_mask_mod(mask_mod, batch_size=B)
    return cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=B).dense_mask()


def _flex(mask_mod, S, B=1):
    return create_mask(mask_mod, B, 1, S, S, device="cpu")[:, 0]


def _assert_exact(mask_mod, S, B=1, reference=None):
    got, want = _converted(mask_mod, S, B), _flex(reference or mask_mod, S, B)
    assert got.shape == want.shape
    diff = (got != want).nonzero().tolist()
    assert not diff, f"{len(diff)} entries differ from create_mask, first {diff[:4]}"


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# ---- values a mask_mod reads, each a way to change it -----------------------------------------


GLOBAL_WINDOW = 4
CONFIG = types.ModuleType("mask_config")  # a module whose attribute the mask_mod reads
CONFIG.WINDOW = 4


def _global_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= GLOBAL_WINDOW) & (q_idx >= kv_idx)


def _module_global_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= CONFIG.WINDOW) & (q_idx >= kv_idx)


class _Window:
    def __init__(self, window):
        self.window = window


class _Nested:
    def __init__(self, window):
        self.cfg = _Window(window)

    def allowed(self, q_idx, kv_idx):
        return q_idx - kv_idx <= self.cfg.window


class _ClassWindow:
    window = 4


class _ModuleWindow(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.window = window
        self.inner = torch.nn.Module()
        self.inner.lo = 0

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= self.window) & (q_idx >= kv_idx) & self.above(kv_idx)

    def above(self, kv_idx):
        return kv_idx >= self.inner.lo


def _closure_int(w):
    state = {"w": w}

    def make():
        window = state["w"]

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)

        def set_window(new):
            nonlocal window
            window = new

        return sliding, set_window

    return make()


def _case(kind, w0):
    """(mask_mod, set(new window), reference mask_mod for create_mask or None)."""
    if kind == "closure int":
        return (*_closure_int(w0), None)
    if kind == "global int":
        globals()["GLOBAL_WINDOW"] = w0
        return _global_window, lambda w: globals().__setitem__("GLOBAL_WINDOW", w), None
    if kind == "module attribute":
        CONFIG.WINDOW = w0
        return _module_global_window, lambda w: setattr(CONFIG, "WINDOW", w), None
    if kind == "object attribute":
        obj = _Window(w0)

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= obj.window) & (q_idx >= kv_idx)

        return sliding, lambda w: setattr(obj, "window", w), None
    if kind == "nested attribute via a method":
        obj = _Nested(w0)

        def sliding(b, h, q_idx, kv_idx):
            return obj.allowed(q_idx, kv_idx) & (q_idx >= kv_idx)

        return sliding, lambda w: setattr(obj.cfg, "window", w), None
    if kind == "class attribute":
        _ClassWindow.window = w0
        obj = _ClassWindow()

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= obj.window) & (q_idx >= kv_idx)

        return sliding, lambda w: setattr(_ClassWindow, "window", w), None
    if kind == "nn.Module attribute":
        mod = _ModuleWindow(w0)

        def sliding(b, h, q_idx, kv_idx):
            return mod.mask_mod(b, h, q_idx, kv_idx)

        return sliding, lambda w: setattr(mod, "window", w), None
    if kind == "nn.Module submodule attribute (bound method)":
        mod = _ModuleWindow(20)
        mod.inner.lo = w0
        return (mod.mask_mod, lambda w: setattr(mod.inner, "lo", w),
                lambda b, h, q_idx, kv_idx: mod.mask_mod(b, h, q_idx, kv_idx))
    if kind == "keyword-only default":
        def sliding(b, h, q_idx, kv_idx, *, w=w0):
            return (q_idx - kv_idx <= w) & (q_idx >= kv_idx)

        return sliding, lambda w: setattr(sliding, "__kwdefaults__", {"w": w}), None
    if kind == "positional default":
        def sliding(b, h, q_idx, kv_idx, w=w0):
            return (q_idx - kv_idx <= w) & (q_idx >= kv_idx)

        return sliding, lambda w: setattr(sliding, "__defaults__", (w,)), None
    if kind == "list element":
        ws = [w0]

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= ws[0]) & (q_idx >= kv_idx)

        return sliding, lambda w: ws.__setitem__(0, w), None
    if kind == "captured tensor":
        wt = torch.tensor([w0, w0])

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= wt[b]) & (q_idx >= kv_idx)

        return sliding, lambda w: wt.fill_(w), None
    if kind == "tensor attribute read as an int":
        mod = torch.nn.Module()
        mod.register_buffer("lim", torch.tensor(w0))

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= int(mod.lim)) & (q_idx >= kv_idx)

        return sliding, lambda w: mod.lim.fill_(w), None
    if kind == "object passed to a helper":
        obj = _Window(w0)

        def helper(o, q_idx, kv_idx):
            return q_idx - kv_idx <= o.window

        def sliding(b, h, q_idx, kv_idx):
            return helper(obj, q_idx, kv_idx) & (q_idx >= kv_idx)

        return sliding, lambda w: setattr(obj, "window", w), None
    raise AssertionError(kind)


KINDS = ["closure int", "global int", "module attribute", "object attribute",
         "nested attribute via a method", "class attribute", "nn.Module attribute",
         "nn.Module submodule attribute (bound method)", "keyword-only default",
         "positional default", "list element", "captured tensor",
         "tensor attribute read as an int", "object passed to a helper"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(KINDS), w0=st.integers(0, 9), w1=st.integers(0, 9),
       S=st.sampled_from([16, 24]))
def test_conversion_reads_the_value_as_it_is_now(kind, w0, w1, S):
    mm, set_value, ref = _case(kind, w0)
    B = 2
    _assert_exact(mm, S, B, ref)
    set_value(w1)
    _assert_exact(mm, S, B, ref)
    set_value(w0)  # and back: an earlier conversion is not served for the later value either
    _assert_exact(mm, S, B, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_value_after_a_change(kind):
    """Every kind once: the change moves row 20's first visible key, and the conversion moves
    with it."""
    mm, set_value, ref = _case(kind, 3)
    before = _converted(mm, 32, 2)
    _assert_exact(mm, 32, 2, ref)
    set_value(11)
    after = _converted(mm, 32, 2)
    assert not torch.equal(before[:, 20], after[:, 20])
    _assert_exact(mm, 32, 2, ref)


def test_module_window_row_40_sees_the_new_window():
    mod = _ModuleWindow(4)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= mod.window) & (q_idx >= kv_idx)

    assert _converted(sliding, 64)[0, 40].sum().item() == 5
    mod.window = 16
    assert _converted(sliding, 64)[0, 40].sum().item() == 17
    _assert_exact(sliding, 64)


def test_unchanged_values_still_hit_the_cache():
    """Keying by the values read keeps the cache: the same values give the same spec, an equal
    object gives it too, and only a changed value converts again."""
    a, b = _Window(5), _Window(5)

    def make(obj):
        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= obj.window) & (q_idx >= kv_idx)
        return sliding

    spec_a, _ = cm.from_mask_mod(make(a))
    assert cm.from_mask_mod(make(a))[0] is spec_a
    assert cm.from_mask_mod(make(b))[0] is spec_a
    b.window = 6
    assert cm.from_mask_mod(make(b))[0] is not spec_a
    mod = _ModuleWindow(5)
    first, _ = cm.from_mask_mod(mod.mask_mod)
    assert cm.from_mask_mod(mod.mask_mod)[0] is first

    def kw(b, h, q_idx, kv_idx, *, w=5):
        return q_idx - kv_idx <= w

    first, _ = cm.from_mask_mod(kw)
    assert cm.from_mask_mod(kw)[0] is first


class _Computed:
    def __init__(self, w):
        self.w = w

    @property
    def window(self):  # computed: read again on every conversion
        return self.w


def test_values_that_cannot_be_keyed_convert_again():
    obj = _Computed(3)

    def by_property(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= obj.window) & (q_idx >= kv_idx)

    objs = [_Window(3)]

    def through_a_list(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= objs[0].window) & (q_idx >= kv_idx)

    name = "window"

    def by_getattr(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= getattr(objs[0], name)) & (q_idx >= kv_idx)

    for mm in (by_property, through_a_list, by_getattr):
        _assert_exact(mm, 24)
    obj.w, objs[0].window = 9, 9
    for mm in (by_property, through_a_list, by_getattr):
        _assert_exact(mm, 24)
        assert _converted(mm, 24)[0, 20].sum().item() == 10


def test_captured_tensor_in_a_default_is_metadata():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])

    def same_doc(b, h, q_idx, kv_idx, doc=doc):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    def same_doc_kw(b, h, q_idx, kv_idx, *, doc=doc):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    for mm in (same_doc, same_doc_kw):
        spec, meta = cm.from_mask_mod(mm)
        assert list(meta) == ["doc"] and meta["doc"] is doc
        _assert_exact(mm, 8, 2)
    doc[1] = torch.tensor([0, 0, 1, 1, 1, 1, 1, 2])
    _assert_exact(same_doc, 8, 2)


DOC_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])


class _DocMask:
    def __init__(self, window):
        self.window = window

    def mask_mod(self, b, h, q_idx, kv_idx):
        near = q_idx - kv_idx <= self.window
        return (DOC_IDS[b, q_idx] == DOC_IDS[b, kv_idx]) & near & (q_idx >= kv_idx)


def test_bound_method_reads_globals_as_metadata_and_attributes_as_constants():
    obj = _DocMask(1)

    def ref(b, h, q_idx, kv_idx):
        return obj.mask_mod(b, h, q_idx, kv_idx)

    spec, meta = cm.from_mask_mod(obj.mask_mod)
    assert list(meta) == ["DOC_IDS"] and meta["DOC_IDS"] is DOC_IDS
    _assert_exact(obj.mask_mod, 8, 2, ref)
    obj.window = 3
    _assert_exact(obj.mask_mod, 8, 2, ref)


def test_spec_name_follows_the_mask_mods_name():
    first, second = and_masks(_causal), and_masks(_causal)
    first.__name__, second.__name__ = "first", "second"
    assert cm.from_mask_mod(first)[0].name == "flex_first"
    assert cm.from_mask_mod(second)[0].name == "flex_second"


def test_signature_refusal_names_what_to_change():
    def three(b, h, q_idx):
        return q_idx >= 0

    with pytest.raises(TypeError, match=r"mask_mod 'three' must take \(b, h, q_idx, kv_idx\) "
                       r"\(further arguments need defaults\), takes 3 positional"):
        cm.from_mask_mod(three)

    def kw_required(b, h, q_idx, kv_idx, *, w):
        return q_idx - kv_idx <= w

    with pytest.raises(TypeError, match=r"keyword-only argument\(s\) \['w'\] without defaults"):
        cm.from_mask_mod(kw_required)


# ---- FlexAttention's own mask_mods and its tensor spellings ------------------------------------


def test_noop_mask_converts_to_full_attention():
    spec, meta = cm.from_mask_mod(noop_mask)
    assert meta == {}
    dense = _converted(noop_mask, 24, 2)
    assert bool(dense.all())
    _assert_exact(noop_mask, 24, 2)
    _assert_exact(and_masks(noop_mask, _causal), 24)
    _assert_exact(or_masks(_causal, noop_mask), 24)


def test_device_of_a_traced_value_is_passed_on_not_guessed():
    def passes_it_on(b, h, q_idx, kv_idx):
        return q_idx.new_ones((), dtype=torch.bool, device=kv_idx.device) & (q_idx >= kv_idx)

    _assert_exact(passes_it_on, 16)

    def reads_it(b, h, q_idx, kv_idx):
        return torch.where(torch.tensor(q_idx.device.type == "cpu"), q_idx >= kv_idx,
                           q_idx <= kv_idx)

    with pytest.raises(NotImplementedError, match=r"mask_mod 'reads_it' \(.*"
                       r"test_conversion_exact\.py:\d+\): the device of a traced value read"):
        cm.from_mask_mod(reads_it)


def test_constants_take_the_dtype_torch_gives_them():
    """``ones_like``/``new_*``/``.to(other)`` without a dtype keep their tensor's dtype: a bool
    mask stays a bool mask, an index stays an integer."""
    def ones_like_bool(b, h, q_idx, kv_idx):
        return torch.ones_like(q_idx >= kv_idx) & (kv_idx < 9)

    def zeros_like_bool(b, h, q_idx, kv_idx):
        return torch.zeros_like(q_idx >= kv_idx) | (q_idx >= kv_idx)

    def new_full_bool(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        return causal.new_full((), 1) & causal

    def new_full_int(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx.new_full((), True) + q_idx

    def to_other(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).to(q_idx >= kv_idx) & (kv_idx <= q_idx)

    for mm in (ones_like_bool, zeros_like_bool, new_full_bool, new_full_int, to_other):
        _assert_exact(mm, 16)


# ---- compile_mask's cache of MaskSpec rule functions --------------------------------------------

RULE_WINDOW = 3


def _window_spec(visible, name="window"):
    return cm.MaskSpec(name, params=[], regions=[cm.Region("all", lambda i: True, visible)])


def _brute(visible, S):
    return torch.tensor([[bool(visible(i, j)) for j in range(S)] for i in range(S)])


def test_compiled_rules_read_globals_closures_and_helpers_as_they_are_now():
    def helper(i, j):
        return i - j <= RULE_WINDOW

    def by_global(i, j):
        return j <= i and i - j <= RULE_WINDOW

    def by_helper(i, j):
        return j <= i and helper(i, j)

    w = 3

    def by_closure(i, j):
        return j <= i and i - j <= w

    for value in (3, 7, 3):
        globals()["RULE_WINDOW"] = value
        w = value
        for rule in (by_global, by_helper, by_closure):
            mask = cm.compile_mask(_window_spec(rule))
            dense = mask.preprocess({}, seqlen_q=20).dense_mask()[0]
            assert torch.equal(dense, _brute(rule, 20)), (rule.__name__, value)
            assert dense[15].sum().item() == value + 1
    globals()["RULE_WINDOW"] = 3


def test_compiled_rules_reading_attributes_or_defaults_are_refused_every_time():
    obj = _Window(3)

    def by_attribute(i, j):
        return i - j <= obj.window

    def by_default(i, j, w=3):
        return i - j <= w

    def by_kw_default(i, j, *, w=3):
        return i - j <= w

    for _ in range(2):
        with pytest.raises(NotImplementedError, match="unsupported syntax 'Attribute'"):
            cm.compile_mask(_window_spec(by_attribute))
        with pytest.raises(TypeError, match="visible must take 2 argument"):
            cm.compile_mask(_window_spec(by_default))
        with pytest.raises(NotImplementedError, match="unsupported signature"):
            cm.compile_mask(_window_spec(by_kw_default))
        obj.window, by_kw_default.__kwdefaults__ = 9, {"w": 9}


# ---- metadata at the edges of the contract ----------------------------------------------------


def _limit_visible(i, j):
    # rows below `lim` see a window of `w`, the others only themselves; `lim` may be 2**30
    return j <= i and (i < lim and i - j <= w or j + lim >= i + lim)  # noqa: F821


def _limit_spec():
    return cm.MaskSpec("limit", params=["lim", "w"],
                       regions=[cm.Region("all", lambda i: True, _limit_visible)])


def _limit_brute(lim, w, S):
    return torch.tensor([[j <= i and (i < lim and i - j <= w or j + lim >= i + lim)
                          for j in range(S)] for i in range(S)])


def test_metadata_up_to_2_pow_30_is_accepted():
    mask = cm.compile_mask(_limit_spec())
    S = 24
    for lim in (2**30, torch.tensor([2**30, 5]), torch.tensor(2**30)):
        desc = mask.preprocess({"lim": lim, "w": 3}, seqlen_q=S, batch_size=2)
        dense = desc.dense_mask()
        lims = lim.expand(2).tolist() if isinstance(lim, torch.Tensor) else [lim, lim]
        for b in range(2):
            assert torch.equal(dense[b], _limit_brute(lims[b], 3, S)), (lim, b)
        assert torch.equal(dense, mask.reference_mask({"lim": lim, "w": 3}, seqlen_q=S,
                                                      batch_size=2))


def test_metadata_past_2_pow_30_is_refused_naming_param_and_limit():
    mask = cm.compile_mask(_limit_spec())
    for lim in (2**30 + 1, torch.tensor([5, 2**30 + 1]), torch.tensor(2**30 + 1), 2**70):
        with pytest.raises(ValueError, match=r"param 'lim' .*2\*\*30 \(1073741824\); pass "
                           r"(a value|values) <= 2\*\*30"):
            mask.preprocess({"lim": lim, "w": 3}, seqlen_q=8, batch_size=2)
    # a Python int is a host value: checked without the device checks too
    with pytest.raises(ValueError, match="param 'w' must be non-negative"):
        mask.normalize_meta({"lim": 4, "w": -1}, 8, 8, check_values=False)
    with pytest.raises(ValueError, match=r"param 'lim' is 1073741825, past .*2\*\*30"):
        mask.normalize_meta({"lim": 2**30 + 1, "w": 1}, 8, 8, check_values=False)


def _square_visible(i, j):
    # fits int64 for lim < 2**30 only: lim * lim * 8 reaches 2**63 at lim = 2**30
    return j + 1 <= lim * lim * 8 - i  # noqa: F821


def test_a_rule_that_wraps_at_2_pow_30_is_refused_or_exact():
    spec = cm.MaskSpec("square", params=["lim"],
                       regions=[cm.Region("all", lambda i: True, _square_visible)])
    try:
        mask = cm.compile_mask(spec)
    except ValueError as e:  # refused for its integer range: the sound answer
        assert "Region 'all'" in str(e)
        return
    meta = {"lim": 2**30}
    assert torch.equal(mask.preprocess(meta, seqlen_q=8).dense_mask(),
                       mask.reference_mask(meta, seqlen_q=8))


def test_zero_d_tensor_is_one_value_for_every_sequence():
    mask = cm.compile_mask(_limit_spec())
    S = 16
    lim = torch.tensor([3, 12])
    as_int = mask.preprocess({"lim": lim, "w": 2}, seqlen_q=S)
    as_0d = mask.preprocess({"lim": lim, "w": torch.tensor(2, dtype=torch.int32)}, seqlen_q=S)
    assert as_0d.batch_size == 2
    assert torch.equal(as_0d.dense_mask(), as_int.dense_mask())
    for b in range(2):
        assert torch.equal(as_0d.dense_mask()[b], _limit_brute(int(lim[b]), 2, S))
    only_0d = mask.preprocess({"lim": torch.tensor(6), "w": torch.tensor(1)}, seqlen_q=S,
                              batch_size=3)
    assert only_0d.batch_size == 3
    for b in range(3):
        assert torch.equal(only_0d.dense_mask()[b], _limit_brute(6, 1, S))
    with pytest.raises(ValueError, match=r"param 'w': dtype must be an integer type"):
        mask.preprocess({"lim": lim, "w": torch.tensor(2.0)}, seqlen_q=S)
    with pytest.raises(ValueError, match=r"param 'w': expected shape \[B\] \(or 0-d\)"):
        mask.preprocess({"lim": lim, "w": torch.zeros(2, 2, dtype=torch.int64)}, seqlen_q=S)


# ---- layout -------------------------------------------------------------------------------------


def test_heads_first_tensors_are_named_as_a_layout_error():
    mask = cm.compile_mask(masks.causal())
    B, H, S, D = 2, 4, 40, 16
    desc = mask.preprocess({}, seqlen_q=S, batch_size=B)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))  # SDPA / FlexAttention layout
    with pytest.raises(ValueError, match=r"cm\.attention takes \[B, S, H, D\] tensors "
                       r"\(FlashAttention layout\), and q \[2, 4, 40, 16\] has desc's seqlen_q "
                       r"\(40\) at axis 2.*pass q\.transpose\(1, 2\), k\.transpose\(1, 2\), "
                       r"v\.transpose\(1, 2\)"):
        cm.attention(q, k, v, desc)
    with pytest.raises(ValueError, match=r"and k \[2, 4, 40, 16\].*; pass k\.transpose\(1, 2\), "
                       r"v\.transpose\(1, 2\) "):
        cm.attention(q.transpose(1, 2), k, v, desc)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = cm.attention(qt, kt, vt, desc)
    want = attention_reference(qt, kt, vt, mask.reference_mask({}, seqlen_q=S, batch_size=B))
    assert torch.allclose(out.float(), want.float(), atol=1e-5)
