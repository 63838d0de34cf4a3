"""Segment ids: ``ids[i] == ids[j]`` compiles to the run of equal ids around i (an exact slot)
and the span from the id's first to its last token (a slot under the equality as predicate),
exact against the brute-force oracle for any ids, with exact tile states for contiguous ones
(``tests/test_segment_ids.py`` has the scattered cases)."""

import pytest
import torch

import compilemask as cm

from helpers import dense_tile_states


def _mask(visible, params=("doc_id",)):
    return cm.compile_mask(cm.MaskSpec("seg", params=list(params), regions=[
        cm.Region("all", when=lambda i: True, visible=visible)]))


def _ids(gen, B, S, max_docs=5):
    """Contiguous ids per sequence, not sorted (a later document may reuse a smaller number
    only if that number was not used before)."""
    out = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        n = int(torch.randint(1, max_docs + 1, (1,), generator=gen))
        cuts = sorted(torch.randint(0, S, (n - 1,), generator=gen).tolist())
        labels = torch.randperm(3 * max_docs, generator=gen)[:n]
        pos = 0
        for k, c in enumerate(cuts + [S]):
            out[b, pos:c] = labels[k]
            pos = max(pos, c)
    return out


RULES = {
    "same_doc": (lambda i, j: doc_id[i] == doc_id[j], 2),  # noqa: F821
    "causal_doc": (lambda i, j: j <= i and doc_id[j] == doc_id[i]),  # noqa: F821
    "doc_window": (lambda i, j: (doc_id[i] == doc_id[j]) & (i - 4 <= j) & (j <= i)),  # noqa: F821
    "other_docs": (lambda i, j: doc_id[i] != doc_id[j], 4),  # noqa: F821
    "doc_or_prefix": (lambda i, j: doc_id[i] == doc_id[j] or j < 3),  # noqa: F821
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_run_intervals_equal_brute_force(name):
    rule = RULES[name]
    rule, k = rule if isinstance(rule, tuple) else (rule, None)
    mask = _mask(rule)
    # the equality is kept as the predicate of the over-approximating slots only
    assert any(iv.exact for r in mask.regions for iv in r.intervals), mask.explain()
    if k is not None:
        assert mask.num_intervals == k
    gen = torch.Generator().manual_seed(len(name))
    for sq, sk in ((40, 40), (37, 29), (1, 1), (64, 64)):
        for _ in range(4):
            meta = {"doc_id": _ids(gen, 3, sq)}
            desc = mask.preprocess(meta, seqlen_q=sq, seqlen_k=sk, fwd_tiles=(8, 8),
                                   bwd_tiles=(4, 16), check=True)
            ref = mask.reference_mask(meta, seqlen_q=sq, seqlen_k=sk)
            assert torch.equal(desc.dense_mask(), ref), (name, meta)
            # interval rows: the tile states are exact, full tiles skip the mask
            assert torch.equal(desc.tile_states(), dense_tile_states(ref, 8, 8))


def test_causal_doc_is_the_run_slot_and_the_span_slot():
    mask = _mask(RULES["causal_doc"])
    ivs = mask.regions[0].intervals
    assert str(ivs[0]) == "[doc_id_run_start[i], i + 1)" and ivs[0].exact
    assert not ivs[1].exact and "doc_id_span_start" in str(ivs[1])
    assert mask.array_params == ("doc_id", "doc_id_run_start", "doc_id_run_end",
                                 "doc_id_span_start", "doc_id_span_end")


def test_scattered_ids_are_exact_and_so_is_the_predicate_form():
    mask = _mask(RULES["causal_doc"])
    scattered = {"doc_id": torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2]])}
    desc = mask.preprocess(scattered, seqlen_q=8)
    assert torch.equal(desc.dense_mask(), mask.reference_mask(scattered, seqlen_q=8))
    pred = _mask(lambda i, j: j <= i and doc_id[i] <= doc_id[j] <= doc_id[i])  # noqa: F821
    assert pred.has_fallback
    desc = pred.preprocess(scattered, seqlen_q=8)
    assert torch.equal(desc.dense_mask(), pred.reference_mask(scattered, seqlen_q=8))


def test_different_arrays_or_shifted_rows_keep_the_predicate():
    mask = _mask(lambda i, j: a[i] == b[j], params=("a", "b"))  # noqa: F821
    assert mask.has_fallback
    mask = _mask(lambda i, j: doc_id[j] == doc_id[i] + 1)  # noqa: F821
    assert mask.has_fallback


def test_param_clashing_with_a_run_bound_is_an_error():
    with pytest.raises(ValueError, match=r"param\(s\) \['doc_id_run_start'\] clash"):
        cm.compile_mask(cm.MaskSpec("clash", params=["doc_id", "doc_id_run_start"], regions=[
            cm.Region("all", when=lambda i: i < doc_id_run_start,  # noqa: F821
                      visible=lambda i, j: doc_id[i] == doc_id[j])]))  # noqa: F821


def test_from_mask_mod_document_mask_runs_natively_on_contiguous_ids():
    doc_ids = torch.tensor([[0] * 10 + [1] * 20 + [2] * 2, [7] * 30 + [3] * 2])

    def document(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    from torch.nn.attention.flex_attention import create_mask

    spec, meta = cm.from_mask_mod(document)
    mask = cm.compile_mask(spec)
    assert mask.num_intervals == 2 and mask.native_pattern.kind == "segments"
    desc = mask.preprocess(meta, seqlen_q=32)
    assert desc.segments is not None  # contiguous ids: FA4's varlen path
    assert torch.equal(desc.dense_mask(), create_mask(document, 2, 1, 32, 32, "cpu")[:, 0])


@pytest.mark.slow  # two programs; derived arrays compile by default in test_segment_ids
def test_tilelang_preprocess_reads_the_derived_arrays():
    pytest.importorskip("tilelang")
    mask = _mask(RULES["doc_window"])
    gen = torch.Generator().manual_seed(5)
    meta = {"doc_id": _ids(gen, 2, 300)}
    ref = mask.preprocess(meta, 300, 290, backend="torch")
    out = mask.preprocess(meta, 300, 290, backend="tilelang")
    for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap", "row_params"):
        assert torch.equal(getattr(ref, f), getattr(out, f)), f
    pre = mask.preprocessor(300, 290, batch_size=2, device="cpu", check_values=False)
    _, inputs = pre._shapes_for(300, 290)  # what the direct launch takes at the bound lengths
    for dtype in (torch.int64, torch.int32):
        m = {"doc_id": meta["doc_id"].to(dtype).contiguous()}
        assert pre._matches(m, inputs) is dtype  # the direct launch, not the general path
        fast = pre(m)
        for f in ("intervals", "fwd_bitmap", "bwd_bitmap"):
            assert torch.equal(getattr(ref, f), getattr(fast, f)), (f, dtype)
