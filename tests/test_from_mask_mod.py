"""cm.from_mask_mod: FlexAttention mask_mods as written (the attention-gym catalogue) compile to
descriptors that equal FlexAttention's own dense mask of the same mask_mod, element by element."""

import itertools
import linecache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import and_masks, create_mask, or_masks

import compilemask as cm

# ---- the attention-gym catalogue, as attention-gym writes it -----------------------------------


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window_size):
    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window_size

    sliding_window_mask = and_masks(sliding_window, causal_mask)
    sliding_window_mask.__name__ = f"sliding_window_{window_size}"
    return sliding_window_mask


def generate_prefix_lm_mask(prefix_length):
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    prefix_lm_causal_mask = or_masks(prefix_mask, causal_mask)
    prefix_lm_causal_mask.__name__ = f"prefix_lm_causal_mask_{prefix_length}"
    return prefix_lm_causal_mask


def _offsets_to_doc_ids_tensor(offsets):
    device = offsets.device
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(
        torch.arange(len(counts), device=device, dtype=torch.int32), counts)


def length_to_offsets(lengths, device):
    offsets = [0]
    offsets.extend(lengths)
    offsets = torch.tensor(offsets, device=device, dtype=torch.int32)
    offsets = torch.cumsum(offsets, dim=-1)
    return offsets


def generate_doc_mask_mod(mask_mod, offsets):
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask

    doc_mask_mod.__name__ = f"document_masking_{mask_mod.__name__}"
    return doc_mask_mod


def generate_natten(canvas_w, canvas_h, kernel_w, kernel_h):
    def get_x_y(idx):
        return idx // canvas_w, idx % canvas_w

    def natten_mask_mod(b, h, q_idx, kv_idx):
        q_x, q_y = get_x_y(q_idx)
        kv_x, kv_y = get_x_y(kv_idx)
        # kernel nominally attempts to center itself on the query, but kernel center
        # is clamped to a fixed distance (kernel half-length) from the canvas edge
        kernel_x = q_x.clamp(kernel_w // 2, (canvas_w - 1) - kernel_w // 2)
        kernel_y = q_y.clamp(kernel_h // 2, (canvas_h - 1) - kernel_h // 2)
        hori_mask = (kernel_x - kv_x).abs() <= kernel_w // 2
        vert_mask = (kernel_y - kv_y).abs() <= kernel_h // 2
        return hori_mask & vert_mask

    natten_mask_mod.__name__ = f"natten_c{canvas_w}x{canvas_h}_k{kernel_w}x{kernel_h}"
    return natten_mask_mod


def generate_dilated_sliding_window(window_size, dilation):
    def dilated_sliding_window(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        in_window = diff <= window_size
        is_dilated = (diff % dilation) == 0
        return in_window & is_dilated

    dilated_sliding_window.__name__ = f"dilated_sliding_window_{window_size}_dilation_{dilation}"
    return dilated_sliding_window


# ---- per-sequence metadata (b-indexed tensors) -------------------------------------------------


def generate_hstu(hist_end, seq_end, group):
    """HSTU-like: history rows causal, target rows see the history and their own group
    causally, padding sees nothing (per-sequence lengths)."""

    def hstu_mask_mod(b, h, q_idx, kv_idx):
        hist = hist_end[b]
        causal = kv_idx <= q_idx
        group_start = hist + (q_idx - hist) // group * group
        target = (kv_idx < hist) | ((kv_idx >= group_start) & causal)
        valid = (q_idx < seq_end[b]) & (kv_idx < seq_end[b])
        return torch.where(q_idx < hist, causal, target) & valid

    return hstu_mask_mod


def generate_batched_docs(doc_ids):
    def batched_doc_mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & causal_mask(b, h, q_idx, kv_idx)

    return batched_doc_mask


def generate_prefix_lengths(prefix_lengths):
    def prefix_lengths_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_lengths[b]) | (q_idx >= kv_idx)

    return prefix_lengths_mask


def generate_global_tokens(is_global, window):
    """Global tokens (a per-token bool tensor) plus a clamped window."""

    def global_mask(b, h, q_idx, kv_idx):
        lo = torch.maximum(q_idx - window, kv_idx.new_zeros(()))
        near = (kv_idx >= lo) & (kv_idx <= torch.minimum(q_idx + window, q_idx + q_idx))
        return near | is_global[kv_idx] | is_global[q_idx]

    return global_mask


def _docs(gen, B, S, ndocs):
    out = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        cuts = sorted(torch.randint(1, S, (ndocs - 1,), generator=gen).tolist())
        for c in cuts:
            out[b, c:] += 1
    return out


def _catalogue(S, B, gen):
    lengths = [5, S - 5 - 11, 11]
    hist = torch.randint(0, S, (B,), generator=gen)
    seq = torch.clamp(hist + torch.randint(0, S, (B,), generator=gen), max=S)
    return [
        ("causal", causal_mask, 1),
        ("sliding_window", generate_sliding_window(7), 1),
        ("prefix_lm", generate_prefix_lm_mask(9), 1),
        ("document", generate_doc_mask_mod(causal_mask, length_to_offsets(lengths, "cpu")), 1),
        ("document_sliding", generate_doc_mask_mod(generate_sliding_window(3),
                                                   length_to_offsets(lengths, "cpu")), 2),
        ("natten", generate_natten(8, S // 8, 3, 3), 1),
        ("dilated", generate_dilated_sliding_window(6, 2), 1),
        ("hstu", generate_hstu(hist, seq, 4), B),
        ("batched_docs", generate_batched_docs(_docs(gen, B, S, 3)), B),
        ("prefix_lengths", generate_prefix_lengths(torch.randint(0, S, (B,), generator=gen)), B),
        ("global_tokens", generate_global_tokens(torch.rand(S, generator=gen) < 0.1, 3), B),
    ]


def _compare(mask_mod, B, S, batch_size=None):
    spec, meta = cm.from_mask_mod(mask_mod, batch_size=batch_size)
    mask = cm.compile_mask(spec)
    desc = mask.preprocess(meta, seqlen_q=S, batch_size=batch_size or B)
    want = create_mask(mask_mod, B, 1, S, S, device="cpu")[:, 0]
    got = desc.dense_mask()
    assert got.shape == want.shape
    assert torch.equal(got, want), (spec, mask.regions[0].rule_source)
    return mask, meta


@pytest.mark.parametrize("S", [48, 64])
def test_attention_gym_catalogue_equals_create_mask(S):
    gen = torch.Generator().manual_seed(S)
    for name, mm, B in _catalogue(S, 3, gen):
        mask, _ = _compare(mm, B, S, batch_size=B)
        if name in ("causal", "sliding_window", "prefix_lm", "natten", "hstu",
                    "prefix_lengths"):
            assert not mask.has_fallback, name  # pure intervals
        if name == "natten":
            assert mask.num_intervals == 3  # one interval per kernel row
        if name == "hstu":  # split on the row conditions: history rows, target rows
            assert mask.num_intervals == 2 and len(mask.regions) == 2


def test_translated_rules_read_like_the_mask_mod():
    mask, meta = _compare(generate_sliding_window(7), 1, 32)
    assert "def visible(i, j)" in mask.regions[0].rule_source
    assert [str(iv) for iv in mask.regions[0].intervals] == ["[i - 7, i + 1)"]
    assert meta == {}
    mask, meta = _compare(generate_prefix_lengths(torch.tensor([3, 0, 40])), 3, 32)
    assert mask.spec.params == ("prefix_lengths",) and mask.num_intervals == 1


def test_one_d_tensors_are_expanded_to_the_batch():
    offsets = length_to_offsets([10, 6, 16], "cpu")
    mm = generate_doc_mask_mod(causal_mask, offsets)
    spec, meta = cm.from_mask_mod(mm, batch_size=4)
    assert set(spec.params) == {"document_id", "offsets_at_document_id"}
    assert meta["document_id"].shape == (4, 32) and meta["document_id"].stride(0) == 0
    assert torch.equal(meta["offsets_at_document_id"][2], offsets[:-1].repeat_interleave(
        torch.tensor([10, 6, 16])))
    _compare(mm, 4, 32, batch_size=4)
    _, meta1 = cm.from_mask_mod(mm)
    assert meta1["document_id"].shape == (1, 32)


def test_same_code_other_constants_do_not_share_a_spec():
    a, b = generate_sliding_window(4), generate_sliding_window(9)
    spec_a, _ = cm.from_mask_mod(a)
    spec_b, _ = cm.from_mask_mod(b)
    assert spec_a is not spec_b
    assert cm.from_mask_mod(generate_sliding_window(4))[0] is spec_a
    _compare(a, 1, 40)
    _compare(b, 1, 40)
    ivs = [str(iv) for iv in cm.compile_mask(spec_b).regions[0].intervals]
    assert ivs == ["[i - 9, i + 1)"]


def test_rebuilt_mask_mod_reads_the_new_tensors():
    x = generate_batched_docs(torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]]))
    y = generate_batched_docs(torch.tensor([[0, 1, 1, 1, 1, 1, 1, 2]]))
    (sx, mx), (sy, my) = cm.from_mask_mod(x), cm.from_mask_mod(y)
    assert sx is sy and not torch.equal(mx["doc_ids"], my["doc_ids"])
    _compare(x, 1, 8)
    _compare(y, 1, 8)


def test_repeat_call_does_not_convert_again(monkeypatch):
    """A mask_mod rebuilt per batch from the same code and values is served from the cache: the
    conversion (trace, sympy, DNF) runs once; the repeat cost is a key walk (bench, not here)."""
    from compilemask.dsl import flex
    offsets = length_to_offsets([100, 200, 212], "cpu")
    cm.from_mask_mod(generate_doc_mask_mod(causal_mask, offsets))  # converts once
    hstu = [generate_hstu(torch.tensor([10, 20]), torch.tensor([50, 60]), 4) for _ in range(2)]
    cm.from_mask_mod(hstu[0])
    calls = []
    real = flex._convert_mask_mod
    monkeypatch.setattr(flex, "_convert_mask_mod", lambda *a, **k: calls.append(a) or real(*a, **k))
    for n in range(20):
        mm = generate_doc_mask_mod(causal_mask, offsets)  # rebuilt: new closure, same code
        cm.from_mask_mod(mm)
        cm.from_mask_mod(hstu[n % 2])
    assert calls == []
    cm.from_mask_mod(generate_hstu(torch.tensor([10, 20]), torch.tensor([50, 60]), 5))
    assert len(calls) == 1  # a changed constant is a new key


# ---- what the rule language lacks -------------------------------------------------------------


def test_unsupported_constructs_name_the_construct_and_line():
    def per_head(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (h == 0)

    with pytest.raises(NotImplementedError, match=r"mask_mod 'per_head' \(.*test_from_mask_mod"
                       r"\.py:\d+\): the head index h"):
        cm.from_mask_mod(per_head)

    def branchy(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return q_idx > 3
        return kv_idx > 3

    with pytest.raises(NotImplementedError, match=r"test_from_mask_mod\.py:\d+\): data-dependent"):
        cm.from_mask_mod(branchy)
    table = torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) < 0.5

    def lookup(b, h, q_idx, kv_idx):
        return table[q_idx // 4, kv_idx // 4]

    # a bool table read at a token pair is a table param (tests/test_tables.py); its rows are
    # gathered at q_idx // 4, whose number of tokens is asked
    with pytest.raises(ValueError, match=r"seqlen=S"):
        cm.from_mask_mod(lookup)
    spec, meta = cm.from_mask_mod(lookup, seqlen=32)
    got = cm.compile_mask(spec).preprocess(meta, seqlen_q=32).dense_mask()
    assert torch.equal(got, create_mask(lookup, 1, 1, 32, 32, device="cpu")[:, 0])

    def mixed(b, h, q_idx, kv_idx):
        return table[q_idx // 4, (kv_idx + q_idx) // 8]

    with pytest.raises(NotImplementedError, match=r"row from q_idx and its column from kv_idx"):
        cm.from_mask_mod(mixed)
    counts = torch.randint(0, 3, (8, 8), generator=torch.Generator().manual_seed(1))

    def counted(b, h, q_idx, kv_idx):
        return (counts[q_idx // 4, kv_idx // 4] + 1) > 1

    with pytest.raises(NotImplementedError, match=r"arithmetic on a table of numbers"):
        cm.from_mask_mod(counted, seqlen=32)
    offs = torch.arange(8)

    def shifted(b, h, q_idx, kv_idx):
        return kv_idx <= offs[q_idx - 1]

    # an index computed from q_idx alone converts (test_computed_indices); its length is asked
    with pytest.raises(ValueError, match=r"offs|seqlen=S"):
        cm.from_mask_mod(shifted)

    def bitwise(b, h, q_idx, kv_idx):
        return (q_idx & 3) == 0

    _compare(bitwise, 1, 20)  # integer bit operations convert (test_bitops.py)

    def method(b, h, q_idx, kv_idx):
        return q_idx.sin() > 0

    with pytest.raises(NotImplementedError, match=r"tensor method or attribute '\.sin'"):
        cm.from_mask_mod(method)

    def func(b, h, q_idx, kv_idx):
        return torch.sin(q_idx) > kv_idx

    with pytest.raises(NotImplementedError, match=r"torch function 'sin'"):
        cm.from_mask_mod(func)

    def made_inside(b, h, q_idx, kv_idx):
        return kv_idx < torch.arange(4)[q_idx]

    with pytest.raises(NotImplementedError, match="not captured by the mask_mod"):
        cm.from_mask_mod(made_inside)
    with pytest.raises(TypeError, match=r"must take \(b, h, q_idx, kv_idx\)"):
        cm.from_mask_mod(lambda q, kv: q >= kv)


# ---- random mask_mods in torch syntax ----------------------------------------------------------

_ints = st.sampled_from([
    "q_idx", "kv_idx", "n[b]", "3", "(q_idx // 4)", "(kv_idx % 5)", "(kv_idx // 3)",
    "torch.minimum(q_idx, n[b])", "torch.maximum(kv_idx - 2, q_idx // 2)", "(q_idx - kv_idx).abs()",
    "tok[q_idx]", "(q_idx + 2 * kv_idx)", "q_idx.clamp(2, 20)", "torch.where(q_idx < n[b], 1, 7)",
])
# (3 < 3 would be a Python bool, which torch.where and ~ do not take as a tensor)
_atoms = st.tuples(_ints, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), _ints).filter(
    lambda t: "3" not in (t[0], t[2])).map(lambda t: f"({t[0]} {t[1]} {t[2]})")
_mods = st.recursive(_atoms, lambda r: st.one_of(
    st.tuples(r, st.sampled_from(["&", "|", "^"]), r).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
    r.map(lambda x: f"(~{x})"),
    st.tuples(_atoms, r, r).map(lambda t: f"torch.where({t[0]}, {t[1]}, {t[2]})")),
    max_leaves=4)
_counter = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_mods, seed=st.integers(0, 2**31 - 1))
def test_random_mask_mods_equal_create_mask(body, seed):
    name = f"<random-mask-mod-{next(_counter)}>"
    source = ("import torch\n\n\ndef make(n, tok):\n"
              f"    def mask_mod(b, h, q_idx, kv_idx):\n        return {body}\n\n"
              "    return mask_mod\n")
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    ns = {}
    exec(compile(source, name, "exec"), ns)
    gen = torch.Generator().manual_seed(seed)
    S = 24
    mm = ns["make"](torch.randint(0, S, (2,), generator=gen),
                    torch.randint(0, 6, (S,), generator=gen))
    _compare(mm, 2, S, batch_size=2)


def _logical_and(b, h, q_idx, kv_idx):
    return torch.logical_and(q_idx >= kv_idx, kv_idx < 20)


def _logical_or_xor(b, h, q_idx, kv_idx):
    near = torch.logical_or(q_idx - kv_idx < 4, kv_idx == 0)
    return torch.logical_xor(near, (q_idx + kv_idx) % 3 == 0).logical_and(kv_idx <= q_idx + 2)


def _logical_methods(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx).logical_or(kv_idx > 40).logical_and((kv_idx < 30).logical_not())


@pytest.mark.parametrize("mm", [_logical_and, _logical_or_xor, _logical_methods])
def test_torch_logical_functions_and_methods(mm):
    _compare(mm, 1, 48)


def test_batch_of_a_tensor_read_only_as_a_gather_index():
    """doc [B, S] is read only inside start[doc[b, q]]: it still gives the batch to the 0-d
    window w."""
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 2, 2, 2]])
    start = torch.tensor([0, 3, 6])
    w = torch.tensor(2)

    def mm(b, h, q_idx, kv_idx):
        return (kv_idx >= start[doc[b, q_idx]]) & (kv_idx <= q_idx) & (q_idx - kv_idx <= w)

    _, meta = cm.from_mask_mod(mm)
    assert {p: t.shape[0] for p, t in meta.items()} == {p: 2 for p in meta}
    _compare(mm, 2, 8)
