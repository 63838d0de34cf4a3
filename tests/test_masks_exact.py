"""Every example mask: the descriptor encodes exactly the user's rules (brute force oracle)."""

import pytest
import torch

import compilemask as cm
from compilemask.contract.descriptor import TILE_MASKED, TILE_VISIBLE
from compilemask.masks import EXAMPLES, random_meta

from helpers import dense_tile_states

# (seqlen_q, seqlen_k, fwd tiles, bwd tiles): multiples of the tiles and not, Sq != Sk both ways
SHAPES = [(32, 32, (16, 16), (8, 32)), (45, 45, (16, 16), (8, 32)), (37, 53, (8, 16), (16, 8)),
          (61, 29, (16, 8), (8, 16)), (1, 1, (16, 16), (8, 16))]
DRAWS = 50


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_descriptor_equals_brute_force(name):
    spec = EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    seen_visible = seen_masked = 0
    for d in range(DRAWS):
        Sq, Sk, ft, bt = SHAPES[d % len(SHAPES)]
        if name == "packed_documents" and Sk > Sq:
            Sk = Sq
        meta = random_meta(spec, 2, Sq, gen)
        desc = mask.preprocess(meta, seqlen_q=Sq, seqlen_k=Sk, fwd_tiles=ft, bwd_tiles=bt,
                               batch_size=2, check=True)
        ref = mask.reference_mask(meta, seqlen_q=Sq, seqlen_k=Sk, batch_size=2)
        dense = desc.dense_mask()
        assert dense.shape == ref.shape == (2, Sq, Sk)
        assert torch.equal(dense, ref), f"{name} draw {d}: {meta}"
        seen_visible += int(ref.sum())
        seen_masked += int((~ref).sum())
        # Bitmaps against tiles of the brute-force mask: exact for interval regions, sound
        # (never claims empty or full wrongly) for fallback regions.
        for backward, tiles in ((False, ft), (True, bt)):
            got = desc.tile_states(backward=backward)
            want = dense_tile_states(ref, *tiles)
            if backward:
                got = got.transpose(1, 2)
            if mask.has_fallback:
                assert torch.all((want & TILE_VISIBLE) <= (got & TILE_VISIBLE))
                assert torch.all(((want & TILE_MASKED) > 0) <= ((got & TILE_MASKED) > 0))
                assert not torch.any(got == TILE_MASKED)
            else:
                assert torch.equal(got, want), f"{name} draw {d} bwd={backward}"
        # interval table invariants: clipped, empty slots are (0, 0)
        iv = desc.intervals
        assert iv.dtype == torch.int32 and iv.shape == (2, Sq, mask.num_intervals, 2)
        s, n = iv[..., 0], iv[..., 1]
        assert torch.all((n >= 0) & (s >= 0) & (s + n <= Sk))
        assert torch.all(s[n == 0] == 0)
    assert seen_visible > 0 and seen_masked > 0  # the draws exercised both outcomes


def test_minimal_k_for_the_papers_masks():
    from compilemask import masks

    assert cm.compile_mask(masks.causal()).num_intervals == 1
    assert cm.compile_mask(masks.hstu()).num_intervals == 2
    assert cm.compile_mask(masks.shared_prompt_rm()).num_intervals == 2
    # CLEAR: 1 text interval + one per image row of the (2R+1)-row window: 2R + 2
    for radius in (1, 2):
        assert cm.compile_mask(masks.clear(radius, 8)).num_intervals == 2 * radius + 2
    assert cm.compile_mask(masks.prefix_lm()).num_intervals == 1  # two intervals merged
    assert cm.compile_mask(masks.packed_documents()).num_intervals == 1


def test_hstu_explain_shows_two_target_slots():
    from compilemask import masks

    mask = cm.compile_mask(masks.hstu())
    target = mask.regions[2]
    assert target.name == "target" and target.num_intervals == 2
    text = mask.explain()
    assert "K = 2" in text
    assert "slot 0: [0, hist_end)" in text
    assert "slot 1: [hist_end + (group_size * ((i - hist_end) // group_size)), i + 1)" in text


def test_response1_merge_is_proved():
    from compilemask import masks

    mask = cm.compile_mask(masks.shared_prompt_rm())
    r1 = mask.regions[1]
    assert r1.num_intervals == 1 and any("merged" in p for p in r1.proofs)


def test_fallback_is_kept_and_explained(caplog):
    from compilemask import masks

    mask = cm.compile_mask(masks.dilated_causal(2))
    assert mask.has_fallback
    assert "FALLBACK" in mask.explain(show_code=False)
    desc = mask.preprocess({}, seqlen_q=20, seqlen_k=20)
    d = desc.dense_mask()[0]
    i, j = torch.meshgrid(torch.arange(20), torch.arange(20), indexing="ij")
    assert torch.equal(d, (j <= i) & ((i - j) % 2 == 0))


def test_rows_under_no_guard_see_nothing():
    spec = cm.MaskSpec("gap", params=["a"], regions=[
        cm.Region("low", when=lambda i: i < a, visible=lambda i, j: j <= i),  # noqa: F821
    ])
    mask = cm.compile_mask(spec)
    desc = mask.preprocess({"a": 5}, seqlen_q=12, seqlen_k=12)
    assert torch.all(desc.row_region[0, 5:] == -1)
    assert not desc.dense_mask()[0, 5:].any()
    assert torch.equal(desc.dense_mask(), mask.reference_mask({"a": 5}, seqlen_q=12))


def test_per_row_array_subscripted_by_j_is_a_fallback():
    # (doc_id[j] == doc_id[i] alone compiles to the run of equal ids: tests/test_segments.py)
    spec = cm.MaskSpec("same_doc", params=["doc_id"], regions=[
        cm.Region("all", when=lambda i: True,
                  visible=lambda i, j: j <= i and doc_id[j] <= doc_id[i]),  # noqa: F821
    ])
    mask = cm.compile_mask(spec)
    assert mask.has_fallback and "subscripted by j" in mask.explain(show_code=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        doc_id = torch.sort(torch.randint(0, 4, (2, 30), generator=gen), dim=1).values
        meta = {"doc_id": doc_id}
        desc = mask.preprocess(meta, seqlen_q=30, seqlen_k=25)
        assert torch.equal(desc.dense_mask(), mask.reference_mask(meta, seqlen_q=30, seqlen_k=25))
    import pytest

    with pytest.raises(ValueError, match="subscripted by j, so seqlen_k"):
        mask.preprocess(meta, seqlen_q=30, seqlen_k=31)


def test_nonlinear_rule_falls_back_with_reason():
    spec = cm.MaskSpec("quadratic", params=["a"], regions=[
        cm.Region("all", when=lambda i: True,
                  visible=lambda i, j: j * j <= i + a and j <= i),  # noqa: F821
    ])
    mask = cm.compile_mask(spec)
    assert mask.has_fallback
    assert any("nonlinear in j" in why for why in mask.regions[0].fallback_reasons)
    assert [str(iv.upper) for iv in mask.regions[0].intervals] == ["i + 1"]  # sound cover kept
    for a in (0, 5, 40):
        desc = mask.preprocess({"a": a}, seqlen_q=33, seqlen_k=20)
        assert torch.equal(desc.dense_mask(), mask.reference_mask({"a": a}, seqlen_q=33,
                                                                   seqlen_k=20))
