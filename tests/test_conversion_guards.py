"""``from_mask_mod`` is exact or refuses: captured values of either sign, narrow integer dtypes,
table columns that torch counts from the end, in-place operators, tensors updated after the
conversion and the line named for an unsupported keyword; each against FlexAttention's
``create_mask`` on the same tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_mask

import compilemask as cm

S = 16


def _dense(mask_mod, B=1, Sq=S, Sk=None, **kw):
    spec, meta = cm.from_mask_mod(mask_mod, batch_size=B, **kw)
    Sk = Sq if Sk is None else Sk
    return cm.compile_mask(spec).preprocess(meta, seqlen_q=Sq, seqlen_k=Sk,
                                            batch_size=B).dense_mask()


def _exact(mask_mod, B=1, Sq=S, Sk=None, **kw):
    got = _dense(mask_mod, B, Sq, Sk, **kw)
    want = create_mask(mask_mod, B, 1, Sq, Sq if Sk is None else Sk, device="cpu")[:, 0]
    assert torch.equal(got, want)


# -- 1. captured values are not assumed non-negative --------------------------------------------

T_NEG = torch.tensor([-1, 2, -3, 4, 5, -6, 7, 8] * 2)  # -1, -3, -6: padding markers
SRC = torch.arange(S) * 10


def test_a_comparison_of_a_negative_value_is_not_folded_away():
    """``t[q_idx] >= 0`` keeps ``t`` a param: its negative entries are refused at preprocess
    (the rules read non-negative metadata) instead of the rule folding to causal."""
    def valid_rows(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (T_NEG[q_idx] >= 0)

    n = torch.tensor([-1, 3])

    def neg_flag(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (n[b] < 0)

    spec, _ = cm.from_mask_mod(valid_rows)
    assert "T_NEG" in spec.params
    with pytest.raises(ValueError, match="param 'T_NEG' must be non-negative; got min -6"):
        _dense(valid_rows)
    with pytest.raises(ValueError, match="param 'n' must be non-negative; got min -1"):
        _dense(neg_flag, B=2)
    ok = torch.tensor([0, 2, 3, 4, 5, 0, 7, 8] * 2)  # the same rule where the values allow it

    def valid_ok(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (ok[q_idx] >= 1)
    _exact(valid_ok)


@pytest.mark.parametrize("form", ["clamp", "maximum", "where", "wrap"])
def test_clamps_inside_a_gather_index_are_kept(form):
    """``src[t[q_idx].clamp(min=0)]`` with negative t: the clamp is computed (not dropped as a
    no-op); an unclamped negative index reads from the end as torch does."""
    index = {
        "clamp": lambda q: T_NEG[q].clamp(min=0),
        "maximum": lambda q: torch.maximum(T_NEG[q], q.new_zeros(())),
        "where": lambda q: torch.where(T_NEG[q] < 0, 0, T_NEG[q]),
        "wrap": lambda q: T_NEG[q],
    }[form]

    def gathered(b, h, q_idx, kv_idx):
        return kv_idx * 10 <= SRC[index(q_idx)]
    _exact(gathered)


def test_a_gather_index_past_the_end_is_refused():
    def past(b, h, q_idx, kv_idx):
        return kv_idx <= SRC[q_idx + 1]

    with pytest.raises(ValueError, match="index 16 is out of bounds"):
        cm.from_mask_mod(past, seqlen=S)


# -- 2. narrow integer dtypes -------------------------------------------------------------------

TOK = torch.tensor([0, 3, 1, 5] * 6, dtype=torch.uint8)
I8 = torch.tensor([100, 120] * 12, dtype=torch.int8)
N8 = torch.tensor([200], dtype=torch.uint8)

REFUSED = {
    "u8_minus_one": (lambda b, h, q, kv: kv > TOK[q] - 1, "'-' of a torch.uint8 value"),
    "u8_invert": (lambda b, h, q, kv: (~TOK[q]) > kv, "'~' of a torch.uint8 value"),
    "i8_add": (lambda b, h, q, kv: (I8[q] + 100) > kv, "'\\+' of a torch.int8 value"),
    "i8_abs": (lambda b, h, q, kv: abs(I8[q]) > kv, "'abs' of a torch.int8 value"),
    "u8_scalar_add": (lambda b, h, q, kv: kv <= N8[b] + 100, "'\\+' of a torch.uint8 value"),
    "torch_add": (lambda b, h, q, kv: kv <= torch.add(TOK[q], 1), "'\\+' of a torch.uint8"),
    "new_ones": (lambda b, h, q, kv: kv <= TOK[q] + TOK[q].new_ones(()), "'\\+' of a torch"),
    "to_uint8": (lambda b, h, q, kv: q.to(torch.uint8) >= kv.to(torch.uint8),
                 "\\.to\\(torch.uint8\\) of a torch.int64 value: torch truncates"),
    "u8_to_i8": (lambda b, h, q, kv: TOK[q].to(torch.int8) >= kv, "truncates"),
    "cmp_cast": (lambda b, h, q, kv: (TOK[q] > -1) & (kv <= q), "the constant -1 with a torch"),
    "where_cast": (lambda b, h, q, kv: kv <= torch.where(q < 4, TOK[q], -1), "the constant -1"),
    "u8_div_by_value": (lambda b, h, q, kv: kv <= TOK[q] // N8[b], "not a positive constant"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_wraps_in_a_narrow_dtype_is_refused(name):
    mask_mod, what = REFUSED[name]
    with pytest.raises(NotImplementedError, match=r"test_conversion_guards.py:\d+\): .*" + what):
        cm.from_mask_mod(mask_mod)


EXACT = {
    "promoted_by_q": lambda b, h, q, kv: kv <= TOK[q] + q,
    "converted": lambda b, h, q, kv: kv > TOK[q].long() - 1,
    "bit_and": lambda b, h, q, kv: (TOK[q] & 1) == (kv & 1),
    "compare": lambda b, h, q, kv: (TOK[q] > 2) | (kv <= q),
    "floor_div": lambda b, h, q, kv: kv // 2 <= TOK[q] // 2 + q,
    "scalar_plus_q": lambda b, h, q, kv: kv <= N8[b] + q,
    "bool_to_u8": lambda b, h, q, kv: (kv <= q).to(torch.uint8) == 1,
    "maximum": lambda b, h, q, kv: kv <= torch.maximum(TOK[q], q),
    "where": lambda b, h, q, kv: kv <= torch.where(q < 4, TOK[q], 7),
    "u8_abs": lambda b, h, q, kv: kv <= abs(TOK[q]) + q,
    "i8_compare": lambda b, h, q, kv: (I8[q] > 110) | (kv <= q),
    "widened": lambda b, h, q, kv: TOK[q].to(torch.int16) + q > kv,
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_what_promotes_exactly_converts(name):
    _exact(EXACT[name], Sq=24)


# -- 3. table columns -----------------------------------------------------------------------------

TBL = torch.rand(S, S, generator=torch.Generator().manual_seed(0)) < 0.5
START = torch.tensor([3, 5])


@pytest.mark.parametrize("form", ["shifted", "mirrored", "where_unguarded"])
def test_a_table_column_torch_counts_from_the_end_is_refused(form):
    mask_mod = {
        "shifted": lambda b, h, q_idx, kv_idx: TBL[q_idx, kv_idx - 3],
        "mirrored": lambda b, h, q_idx, kv_idx: TBL[q_idx, -kv_idx],
        "where_unguarded": lambda b, h, q_idx, kv_idx: torch.where(
            q_idx < 3, kv_idx <= q_idx, TBL[q_idx, kv_idx - 3]),
    }[form]
    with pytest.raises(NotImplementedError, match=r"test_conversion_guards.py:\d+\): table "
                       r"'TBL' read at column .*, which may be negative"):
        cm.from_mask_mod(mask_mod)


@pytest.mark.parametrize("form", ["ge", "gt", "where", "or", "clamp", "scalar", "plain"])
def test_guarded_and_in_range_table_reads_convert(form):
    """docs/flex-migration.md's ``anc[q_idx, kv_idx - p]`` guarded by ``kv_idx >= p`` (the read's
    value does not matter where its column is negative), spelled several ways."""
    p = 3
    mask_mod = {
        "ge": lambda b, h, q_idx, kv_idx: (kv_idx >= p) & TBL[q_idx, kv_idx - p],
        "gt": lambda b, h, q_idx, kv_idx: (kv_idx > p - 1) & TBL[q_idx, kv_idx - p],
        "where": lambda b, h, q_idx, kv_idx: torch.where(kv_idx < p, kv_idx <= q_idx,
                                                         TBL[q_idx, kv_idx - p]),
        "or": lambda b, h, q_idx, kv_idx: (kv_idx < p) | TBL[q_idx, kv_idx - p],
        "clamp": lambda b, h, q_idx, kv_idx: TBL[q_idx, (kv_idx - p).clamp(min=0)],
        "scalar": lambda b, h, q_idx, kv_idx: (kv_idx >= START[b]) & TBL[q_idx,
                                                                           kv_idx - START[b]],
        "plain": lambda b, h, q_idx, kv_idx: TBL[q_idx, kv_idx],
    }[form]
    _exact(mask_mod, B=2 if form == "scalar" else 1)


# -- 4. in-place operators ------------------------------------------------------------------------

def test_in_place_operators_on_traced_values_are_refused():
    def alias(b, h, q_idx, kv_idx):
        x = q_idx
        x += 2  # torch: q_idx is now q + 2 too
        return kv_idx <= q_idx

    def shifts(b, h, q_idx, kv_idx):
        q_idx += 4  # torch: the next mask_mod of and_masks sees it
        return kv_idx >= 0

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def masked(b, h, q_idx, kv_idx):
        v = TOK[q_idx]
        v &= 1
        return kv_idx <= v

    for mm in (alias, and_masks(shifts, causal), masked):
        with pytest.raises(NotImplementedError, match=r"test_conversion_guards.py:\d+\): an "
                           "in-place operator"):
            cm.from_mask_mod(mm)


# -- 5. tensors updated after the conversion ------------------------------------------------------

def test_tensors_updated_in_place_after_the_conversion_are_read_as_they_are():
    """Arrays read directly (views) and gathered ones (``offsets[doc[q_idx]]``, a table's rows)
    both follow an in-place update of the captured tensors at the next preprocess."""
    doc = torch.tensor([0] * 5 + [1] * 6 + [2] * 5)
    offsets = torch.tensor([0, 5, 11, 16])
    tbl = torch.zeros(S, S, dtype=torch.bool)

    def docs(b, h, q_idx, kv_idx):
        return ((doc[q_idx] == doc[kv_idx]) & (kv_idx >= offsets[doc[q_idx]])
                & (kv_idx <= q_idx) | tbl[q_idx, kv_idx])

    spec, meta = cm.from_mask_mod(docs)
    mask = cm.compile_mask(spec)
    before = create_mask(docs, 1, 1, S, S, device="cpu")[:, 0]
    assert torch.equal(mask.preprocess(meta, seqlen_q=S).dense_mask(), before)
    doc.copy_(torch.tensor([0] * 5 + [1] * 3 + [2] * 8))
    offsets[2] = 8
    tbl[3, 12] = True
    after = create_mask(docs, 1, 1, S, S, device="cpu")[:, 0]
    assert not torch.equal(after, before)
    assert torch.equal(mask.preprocess(meta, seqlen_q=S).dense_mask(), after)
    assert torch.equal(mask.preprocess(dict(meta), seqlen_q=S).dense_mask(), after)
    snapshot = copy.deepcopy(meta)  # a plain dict of the values as they are now
    assert type(snapshot) is dict and snapshot.keys() == meta.keys()
    offsets.resize_(5)
    with pytest.raises(ValueError, match="changed shape from \\[4\\] to \\[5\\] after "
                       "from_mask_mod; call from_mask_mod again"):
        mask.preprocess(meta, seqlen_q=S)


def test_metadata_without_gathers_is_a_plain_dict_of_views():
    doc = torch.tensor([0] * 8 + [1] * 8)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    _, meta = cm.from_mask_mod(same_doc)
    assert type(meta) is dict and meta["doc"].data_ptr() == doc.data_ptr()


# -- the user's line for an unsupported keyword ---------------------------------------------------

def test_an_unsupported_keyword_names_the_users_line():
    def scaled(b, h, q_idx, kv_idx):
        return torch.add(q_idx, kv_idx, alpha=2) > 10

    with pytest.raises(NotImplementedError, match=r"test_conversion_guards.py:\d+\): torch "
                       "function 'add' with these arguments \\(got an unexpected keyword "
                       "argument 'alpha'\\)"):
        cm.from_mask_mod(scaled)
