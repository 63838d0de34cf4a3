"""The generated fallback predicates mean what their sympy expressions mean, and the generated
interval mask_mods equal the reference mask.

The ``@cute.jit`` source is executed with Python ints and bools standing in for CUTLASS's Int32
and Boolean (``cute.jit`` an identity), on a grid of rows, columns and params that includes
negative differences: the predicate must agree with sympy's evaluation everywhere, with Python's
rounding of ``//`` and ``%`` and with the DSL's (``%`` keeps the dividend's sign): the emitter
relies on neither.
"""

from __future__ import annotations

import itertools
import types

import pytest
import sympy

from compilemask.codegen.cute_predicate import predicate_source
from compilemask.dsl.frontend import BitAnd, BitOr, BitXor

i, j, p = sympy.symbols("i j p", integer=True)

EXPRS = [
    sympy.Eq(sympy.Mod(i - j, 2), 0),  # power-of-two divisor: a bit test
    sympy.Ne(sympy.Mod(i - j, 4), 0),
    sympy.Eq(sympy.Mod(i - j, 3), 0),  # other constants: a remainder test
    sympy.Eq(0, sympy.Mod(j - 2 * i, 6)),
    sympy.Eq(sympy.Mod(j - i, p), 0),  # a param divisor
    sympy.Eq(sympy.Mod(i - j, 3), 1),  # not a divisibility test: the floor remainder
    sympy.And(j <= i, sympy.Eq(sympy.Mod(i - j, 2), 0)),
    sympy.Or(j < p, sympy.floor((i - j) / p) >= 1),
    sympy.Eq(BitAnd(i - j, 3), 0),  # integer bit operations, negative operands included
    sympy.Lt(BitXor(i, j), p),
    sympy.And(j <= i, sympy.Ge(BitOr(i, 2 * j), 5)),
]


class _DslInt(int):
    """An Int32 with the CuTe DSL's signed rounding: ``//`` floors (``arith.floordivsi``), ``%``
    keeps the dividend's sign (``arith.remsi``), unlike Python's floor remainder."""

    def __mod__(self, o):
        r = abs(int(self)) % abs(int(o))
        return _DslInt(-r if self < 0 else r)

    def __rmod__(self, o):
        return _DslInt(o).__mod__(self)


def _dsl_op(name):
    op = getattr(int, name)
    return lambda a, b: _DslInt(op(int(a), int(b)))


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__floordiv__", "__rfloordiv__", "__and__", "__rand__", "__or__", "__ror__",
              "__xor__", "__rxor__", "__lshift__", "__rshift__"):
    setattr(_DslInt, _name, _dsl_op(_name))
_DslInt.__neg__ = lambda a: _DslInt(-int(a))


def _load(src: str, name: str, dsl_rounding: bool = False):
    num = _DslInt if dsl_rounding else int
    int32 = type("Int32", (), {"__new__": lambda cls, v: num(v)})
    boolean = type("Boolean", (), {"__new__": lambda cls, v: bool(v)})
    cutlass = types.SimpleNamespace(Int32=int32, Boolean=boolean, min=min, max=max)
    cute = types.SimpleNamespace(jit=lambda f: f)
    src = src.replace("import cutlass.cute as cute\n", "").replace("import cutlass\n", "")
    env = {"cutlass": cutlass, "cute": cute}
    exec(compile(src, f"<{name}>", "exec"), env)  # noqa: S102 - generated test source
    return env[name]


@pytest.mark.parametrize("dsl_rounding", [False, True])
@pytest.mark.parametrize("expr", EXPRS, ids=[str(e) for e in EXPRS])
def test_predicate_equals_sympy(expr, dsl_rounding):
    """Python's rounding and the DSL's (a remainder with the dividend's sign) alike."""
    params = ["p"] if p in expr.free_symbols else []
    src = predicate_source(expr, params, name="pred")
    fn = _load(src, "pred", dsl_rounding)
    num = _DslInt if dsl_rounding else int
    for ii, jj, pp in itertools.product(range(-3, 9), range(-3, 9), (1, 2, 3, 5)):
        want = bool(expr.subs({i: ii, j: jj, p: pp}))
        args = [num(ii), num(jj)] + ([num(pp)] if params else []) + [None, 0, 0]
        assert fn(*args) == want, (expr, ii, jj, pp, src)
    if isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Mod) and expr.rhs == 0 \
            and expr.lhs.args[1] == 2:
        assert "& cutlass.Int32(1)" in src and "%" not in src



def test_whole_mask_predicate_equals_the_dense_mask():
    """A mask whose every region is a fallback: the one predicate the mask_mod evaluates (first
    guard that holds, its rule; no guard: nothing) equals the reference mask element by
    element, rows under no guard included; a mask with interval regions keeps the table."""
    import torch

    import compilemask as cm
    from compilemask import masks
    from compilemask.codegen.cute_mask_mod import (
        aux_tensors,
        mask_mod_source,
        whole_mask_predicate,
    )

    def when_even(i):
        return i < split  # noqa: F821

    def even_sees(i, j):
        return j <= i and (i - j) % 2 == 0

    def when_third(i):
        return split <= i < stop  # noqa: F821

    def third_sees(i, j):
        return j <= i and (i - j) % 3 == 0

    spec = cm.MaskSpec("two_strides", params=["split", "stop"], regions=[
        cm.Region("even", when=when_even, visible=even_sees),
        cm.Region("third", when=when_third, visible=third_sees)])
    mask = cm.compile_mask(spec)
    expr = whole_mask_predicate(mask)
    assert expr is not None and "every region is a predicate" in mask_mod_source(mask)
    fn = _load(predicate_source(expr, mask.scalar_params, name="pred"), "pred")
    S = 40
    for split, stop in ((0, 0), (13, 29), (40, 40), (25, 20)):
        meta = {"split": torch.tensor([split]), "stop": torch.tensor([stop])}
        dense = mask.preprocess(meta, S, backend="torch", batch_size=1).dense_mask()[0]
        vals = {"split": split, "stop": stop}
        got = torch.tensor([[fn(a, b, *[vals[n] for n in mask.scalar_params], None, 0, S - 1)
                             for b in range(S)] for a in range(S)])
        assert torch.equal(got, dense), (split, stop)
        # the mask_mod reads params as aux_tensors[0]; no Interval Table, no row_region
        (aux,) = aux_tensors(mask.preprocess(meta, S, backend="torch", batch_size=1))
        assert aux.shape == (1, 2) and aux.tolist() == [[split, stop]]
    assert "params = aux_tensors[0]" in mask_mod_source(mask)
    dilated = cm.compile_mask(masks.dilated_causal())
    assert aux_tensors(dilated.preprocess({}, S, backend="torch")) is None
    assert "aux_tensors[" not in mask_mod_source(dilated)
    hstu = cm.compile_mask(masks.hstu())
    assert whole_mask_predicate(hstu) is None
    assert "intervals = aux_tensors[0]" in mask_mod_source(hstu)


RULES_VARIANT = ["sink_window", "chunked_causal", "block_causal", "prefix_lm", "hstu",
                 "shared_prompt_rm", "clear", "causal"]


# the masks whose rules cost more than the interval test (engine.md: HSTU and RM measured so)
INTERVALS_BY_DEFAULT = ("hstu", "shared_prompt_rm", "clear")


def test_mask_mod_variant_follows_the_measurements():
    import compilemask as cm
    from compilemask import masks
    from compilemask.codegen.cute_mask_mod import mask_mod_variant

    for spec, want in ((masks.sink_window(4096, 4), "rules"), (masks.hstu(), "intervals"),
                       (masks.shared_prompt_rm(), "intervals"), (masks.clear(2, 64), "rules"),
                       (masks.dilated_causal(), "predicate"),
                       (masks.packed_documents(), "intervals")):
        assert mask_mod_variant(cm.compile_mask(spec)) == want, spec.name


@pytest.mark.parametrize("name", RULES_VARIANT)
def test_rules_mask_mod_equals_the_dense_mask(name):
    """The ``rules`` mask_mod (the regions' rules as one predicate, no Interval Table) equals the
    reference mask element by element on random metadata; only masks that read constants, i and
    j take it by default."""
    import torch

    import compilemask as cm
    from compilemask import masks
    from compilemask.codegen.cute_mask_mod import (
        aux_tensors,
        mask_mod_source,
        mask_mod_variant,
        whole_mask_predicate,
    )

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    expr = whole_mask_predicate(mask, any_region=True)
    fn = _load(predicate_source(expr, mask.scalar_params, name="pred"), "pred")
    assert "its rules" in mask_mod_source(mask, "rules")
    assert mask_mod_variant(mask) == ("intervals" if name in INTERVALS_BY_DEFAULT else "rules")
    gen = torch.Generator().manual_seed(len(name))
    for S in (1, 37, 130):
        meta = masks.random_meta(mask.spec, 3, S, gen)
        desc = mask.preprocess(meta or None, S, batch_size=3, backend="torch")
        dense = desc.dense_mask()
        aux = aux_tensors(desc, "rules")
        for b in range(3):
            vals = aux[0][b].tolist() if aux else []
            got = torch.tensor([[fn(a, c, *vals, None, b, S - 1) for c in range(S)]
                                for a in range(S)])
            assert torch.equal(got, dense[b]), (name, S, b)


def _squared_param(i, j):
    return (j < 4) | ((j <= i) & (j >= p * p // 100000))  # noqa: F821


def test_rules_give_way_to_the_table_where_they_may_wrap():
    """The rules mask_mod computes in int32: at a length where a term may pass that range
    (metadata up to the length, as for the kernels' predicates) a call runs the Interval
    Table test (int64 endpoints) instead, and asking for the rules by name there raises; the
    example masks keep their measured variants to 128K."""
    import compilemask as cm
    from compilemask import masks
    from compilemask.codegen.cute_mask_mod import (
        call_variant,
        forward_variant,
        mask_mod_variant,
        rules_fit,
    )

    mask = cm.compile_mask(cm.MaskSpec("squared_param", params=["p"], regions=[
        cm.Region("all", when=lambda i: True, visible=_squared_param)]))
    # p * p at p = 60000 is 3.6e9, past int32; at p = 1000 it is 1e6
    assert call_variant(mask, None, 1000) == "rules" and rules_fit(mask, 1000)
    assert call_variant(mask, None, 60000) == "intervals" and not rules_fit(mask, 60000)
    assert forward_variant(mask, None, backward=True, length=60000) == "intervals"
    assert forward_variant(mask, "rows", backward=True, length=60000) == "intervals"
    assert forward_variant(mask, None, backward=False, length=60000) == "rows"
    with pytest.raises(ValueError, match="squared_param.*int32.*60000"):
        call_variant(mask, "rules", 60000)
    for spec in [masks.EXAMPLES[n]() for n in RULES_VARIANT] + [masks.clear(2, 64)]:
        m = cm.compile_mask(spec)
        for length in (8192, 32768, 131072):
            assert call_variant(m, None, length) == mask_mod_variant(m), (spec.name, length)


class _Wrap32(int):
    """An int that wraps to int32 after every arithmetic operation, as the GPU computes."""

    def __new__(cls, v):
        return int.__new__(cls, (int(v) + 2**31) % 2**32 - 2**31)


for _op in ("add", "sub", "mul", "floordiv", "mod"):
    for _name in (f"__{_op}__", f"__r{_op}__"):
        setattr(_Wrap32, _name, (lambda f: lambda a, b: _Wrap32(f(int(a), int(b))))(
            getattr(int, _name)))
_Wrap32.__neg__ = lambda a: _Wrap32(-int(a))


def test_rules_give_way_to_the_table_where_host_metadata_reach_past_the_length():
    """Metadata given on the host past the sequence (CLEAR's image rows 2**25 at 512 tokens)
    may wrap the rules' int32 arithmetic where metadata up to the length would not: the
    descriptor records how far they reach, the call then reads the table, and asking for
    the rules by name raises; the wrapped rules are really wrong there."""
    import torch

    import compilemask as cm
    from compilemask import masks
    from compilemask.codegen.cute_mask_mod import (
        call_variant,
        forward_variant,
        metadata_matters,
        whole_mask_predicate,
    )
    from compilemask.contract.descriptor import DescriptorArgs

    mask = cm.compile_mask(masks.clear(2, 64))
    assert metadata_matters(mask)
    S = 512
    for meta in ({"text_end": 100, "img_rows": 2**25},
                 {"text_end": torch.tensor([100]), "img_rows": torch.tensor([2**25 - 3])}):
        desc = mask.preprocess(meta, S, backend="torch")
        assert desc.meta_max == 2**25
        assert DescriptorArgs.of(desc).descriptor(mask).meta_max == 2**25  # through the ops
        assert call_variant(mask, None, S, desc.meta_max) == "intervals"
        assert forward_variant(mask, None, True, length=S, meta_max=desc.meta_max) == "intervals"
        with pytest.raises(ValueError, match="clear_r2_w64.*int32.*metadata up to 33554432"):
            call_variant(mask, "rules", S, desc.meta_max)
    # the rules computed in int32: 64 * 2**25 wraps to -2**31, and rows see no key
    expr = whole_mask_predicate(mask, any_region=True)
    src = predicate_source(expr, mask.scalar_params, name="pred")
    int32 = type("Int32", (), {"__new__": lambda cls, v: _Wrap32(v)})
    env = {"cutlass": types.SimpleNamespace(Int32=int32, min=min, max=max),
           "cute": types.SimpleNamespace(jit=lambda f: f)}
    exec(compile(src.replace("import cutlass.cute as cute\n", "").replace(  # noqa: S102
        "import cutlass\n", ""), "<pred>", "exec"), env)
    dense = desc.dense_mask()[0]
    wrapped = torch.tensor([[bool(env["pred"](_Wrap32(r), _Wrap32(c), _Wrap32(100),
                                              _Wrap32(2**25), None, 0, S - 1))
                             for c in range(0, S, 7)] for r in range(0, S, 7)])
    assert not torch.equal(wrapped, dense[::7, ::7])
    # metadata up to the length, or on masks whose int32 code no metadata value wraps: 0
    assert mask.preprocess({"text_end": 100, "img_rows": 6}, S, backend="torch").meta_max == 0
    window = cm.compile_mask(masks.sink_window(4096, 4))
    assert not metadata_matters(window)


def test_kernel_predicates_are_checked_against_host_metadata_past_the_length():
    """A fallback predicate that fits int32 with metadata up to the length but not with the
    batch's metadata given on the host: the op's check raises, naming the region and the term,
    before any kernel is built; metadata within the length pass."""
    import compilemask as cm
    from compilemask.kernels.autograd import _check_predicates

    def rule(i, j):
        return (j <= i) & ((i * w - j * w) % 1000 < 500)  # noqa: F821

    mask = cm.compile_mask(cm.MaskSpec("scaled_stripes", params=["w"], regions=[
        cm.Region("stripes", when=lambda i: True, visible=rule)]))
    assert mask.has_fallback
    small = mask.preprocess({"w": 3}, 1000, backend="torch")
    assert small.meta_max == 0
    _check_predicates(mask, 1000, small.meta_max)
    big = mask.preprocess({"w": 2**24}, 1000, backend="torch")
    assert big.meta_max == 2**24
    with pytest.raises(ValueError, match="stripes.*int32|stripes.*32-bit"):
        _check_predicates(mask, 1000, big.meta_max)


def test_mask_mod_variant_errors_name_the_mask():
    import compilemask as cm
    from compilemask import masks
    from compilemask.codegen.cute_mask_mod import mask_mod_source

    def bottom_right(i, j):
        return j <= i + seqlen_k - seqlen_q  # noqa: F821

    br = cm.compile_mask(cm.MaskSpec("bottom_right", params=[], regions=[
        cm.Region("all", when=lambda i: True, visible=bottom_right)]))
    with pytest.raises(ValueError, match="bottom_right.*seqlen_q"):
        mask_mod_source(br, "rules")
    docs = cm.compile_mask(masks.packed_documents())
    assert "row_params[b, row, 0]" in mask_mod_source(docs, "rules")
    with pytest.raises(ValueError, match="variant must be one of"):
        mask_mod_source(docs, "true")
    with pytest.raises(ValueError, match="mask_mod must be one of"):
        cm.KernelOptions(mask_mod="table")


def _load_mask_mod(src: str, dsl_rounding: bool):
    """The generated mask_mod with CuTe's types as Python stand-ins: Int32 (the DSL's signed
    rounding where asked), Uint32 as a 32-bit wrap, a one-element Boolean fragment."""
    num = _DslInt if dsl_rounding else int
    int32 = type("Int32", (), {"__new__": lambda cls, v: num(int(v))})
    uint32 = type("Uint32", (), {"__new__": lambda cls, v: int(v) & 0xFFFFFFFF})
    boolean = type("Boolean", (), {"__new__": lambda cls, v: bool(v)})
    cutlass = types.SimpleNamespace(Int32=int32, Uint32=uint32, Boolean=boolean, min=min,
                                    max=max)

    class Frag(list):
        def load(self):
            return self

    cute = types.SimpleNamespace(jit=lambda f: f,
                                 make_rmem_tensor=lambda n, dtype: Frag([False] * n))
    src = "\n".join(ln for ln in src.splitlines() if not ln.startswith(("import", "from")))
    env = {"cutlass": cutlass, "cute": cute, "Int32": int32, "Uint32": uint32}
    exec(compile(src, "<mask_mod>", "exec"), env)  # noqa: S102 - generated test source
    return env["mask_mod"], num


@pytest.mark.parametrize("variant", ["intervals", "rows", "rules"])
@pytest.mark.parametrize("name", ["prefix_lm", "packed_documents", "packed_prefix_lm", "hstu",
                                  "shared_prompt_rm", "clear", "dilated_causal", "chunked_causal",
                                  "sink_window", "tree_verify"])
def test_generated_mask_mod_equals_the_dense_mask(name, variant):
    """The whole generated mask_mod (the Interval Table test, the fallback regions' predicates
    on top, the row clamp; or the rules as one predicate over the per-sequence params), run with
    Python stand-ins for CuTe's types, equals the
    reference mask element by element on random metadata, at lengths that are not tile
    multiples, under both integer roundings; rows past seqlen_q read the last row, no index of
    an edge tile's padding reads past a table, and the interval test sees no key past the
    sequence."""
    import numpy as np
    import torch

    import compilemask as cm
    from compilemask import masks
    from compilemask.codegen.cute_mask_mod import aux_tensors, mask_mod_source

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    try:
        mask_mod_source(mask, variant)
    except ValueError as e:  # rows: interval masks only; rules: no per-row arrays
        pytest.skip(str(e))
    gen = torch.Generator().manual_seed(len(name))
    for dsl_rounding, S in ((False, 37), (True, 70)):
        fn, num = _load_mask_mod(mask_mod_source(mask, variant), dsl_rounding)
        meta = masks.random_meta(mask.spec, 2, S, gen)
        desc = mask.preprocess(meta or None, S, batch_size=2, backend="torch")
        dense = desc.dense_mask()
        aux = [np.asarray(t) for t in aux_tensors(desc, variant) or []]
        info = types.SimpleNamespace(seqlen_q=num(S), seqlen_k=num(S))
        for b in range(2):
            got = torch.tensor([[bool(fn([num(b)], [num(0)], [num(r)], [num(c)], info, aux)[0])
                                 for c in range(S)] for r in range(S)])
            assert torch.equal(got, dense[b]), (name, variant, S, b)
        pad = fn([num(0)], [num(0)], [num(S + 5)], [num(0)], info, aux)[0]
        assert bool(pad) == bool(dense[0, S - 1, 0])
        # FA4 passes the padded rows and columns of edge tiles unwrapped (UNWRAPPED): no read
        # leaves the tables (numpy raises on one past the end); the mask_mod is False past
        # the keys, where the backward then skips FA4's seqlen test
        for r in (S - 1, S, S + 63, S + 127):
            for c in (S - 1, S, S + 63, S + 127):
                vis = fn([num(1)], [num(0)], [num(r)], [num(c)], info, aux)[0]
                assert not (c >= S and vis), (name, variant, r, c)
    assert "\nUNWRAPPED = True\n" in mask_mod_source(mask, variant)
    assert "\nUNWRAPPED = True\n" in mask_mod_source(mask, variant)


def test_whole_mask_mod_masks_keys_past_the_sequence():
    """A rule that sees keys past seqlen_k (a two-sided window) is False there in the
    whole-mask forms, as the interval test is, so FA4's backward can skip its keys' test."""
    import torch

    import compilemask as cm
    from compilemask.codegen.cute_mask_mod import aux_tensors, mask_mod_source

    band = cm.compile_mask(cm.MaskSpec("band", params=("w",), regions=[cm.Region(
        "all", lambda i: True, lambda i, j: (j > i - w) & (j < i + w))]))  # noqa: F821
    S, w = 40, 9
    desc = band.preprocess({"w": torch.tensor([w])}, S)
    for variant in ("rules", "intervals"):
        fn, num = _load_mask_mod(mask_mod_source(band, variant), False)
        aux = [t.numpy() for t in aux_tensors(desc, variant) or []]
        info = types.SimpleNamespace(seqlen_q=num(S), seqlen_k=num(S))
        row = [bool(fn([num(0)], [num(0)], [num(S - 1)], [num(c)], info, aux)[0])
               for c in range(S - w, S + w)]
        assert row == [True] * w + [False] * w, variant


def test_generated_mask_mod_of_folded_heads_equals_the_dense_mask():
    """Heads folded into the batch (``preprocess(..., num_heads=H)``): the generated mask_mod
    reads row ``b * H + h`` of the Interval Table; run with Python stand-ins for CuTe's types,
    it equals the per-head dense mask element by element."""
    import numpy as np
    import torch

    import compilemask as cm
    from compilemask.codegen.cute_mask_mod import aux_tensors, mask_mod_source

    B, H, S = 2, 3, 29
    g = torch.Generator().manual_seed(11)
    win = cm.compile_mask(cm.MaskSpec("w_per_head", params=("w",), regions=[cm.Region(
        "all", lambda i: True, lambda i, j: (j <= i) & (j > i - w))]))  # noqa: F821
    groups = win.preprocess({"w": torch.randint(1, S, (B, H), generator=g)}, S, num_heads=H)
    assert groups.folded
    desc = groups.groups[0][0]
    dense = groups.dense_mask()
    for variant in ("intervals", "rows"):
        fn, num = _load_mask_mod(mask_mod_source(desc.mask, variant, heads=H), True)
        aux = [np.asarray(t) for t in aux_tensors(desc, variant)]
        info = types.SimpleNamespace(seqlen_q=num(S), seqlen_k=num(S))
        for b, h in itertools.product(range(B), range(H)):
            got = torch.tensor([[bool(fn([num(b)], [num(h)], [num(r)], [num(c)], info, aux)[0])
                                 for c in range(S)] for r in range(S)])
            assert torch.equal(got, dense[b, h]), (variant, b, h)
