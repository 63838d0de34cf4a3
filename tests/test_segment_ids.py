"""``ids[i] == ids[j]`` over ids that recur non-contiguously: exact against the brute-force
oracle and FlexAttention's ``create_mask`` on both preprocess backends, with sound tile states
(only exact slots make a tile full) and, for contiguous ids, the tiles of the run alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import compilemask as cm
from compilemask.compiler.segments import derive_run_arrays, run_bounds, span_bounds
from compilemask.compiler.tiles import bitmaps, unpack_bitmap, visibility_only_slots
from compilemask.contract.descriptor import TileConfig

from helpers import dense_tile_states

FWD, BWD = (16, 16), (8, 16)  # small tiles: many full, partial and empty ones at S <= 257


def _mask(name, visible, params=("doc_id",)):
    return cm.compile_mask(cm.MaskSpec(name, params=list(params), regions=[
        cm.Region("all", when=lambda i: True, visible=visible)]))


RULES = {
    "same_doc": lambda i, j: doc_id[i] == doc_id[j],  # noqa: F821
    "causal_doc": lambda i, j: j <= i and doc_id[j] == doc_id[i],  # noqa: F821
    "doc_window": lambda i, j: (doc_id[i] == doc_id[j]) & (i - 4 <= j) & (j <= i),  # noqa: F821
    "other_docs": lambda i, j: doc_id[i] != doc_id[j],  # noqa: F821
    "doc_or_prefix": lambda i, j: doc_id[i] == doc_id[j] or j < 3,  # noqa: F821
}
# what the TileLang C target compiles (one program each): equality, inequality, two regions
TILELANG_RULES = ("causal_doc", "other_docs")


def _two_regions():
    """A fallback region with exact slots (ids) after one without any (a stride predicate)."""
    return cm.compile_mask(cm.MaskSpec("ids_two_regions", params=["doc_id", "n"], regions=[
        cm.Region("strided", when=lambda i: i < n,  # noqa: F821
                  visible=lambda i, j: j <= i and (i - j) % 3 == 0),
        cm.Region("docs", when=lambda i: True,
                  visible=lambda i, j: doc_id[i] == doc_id[j] and j <= i + 2),  # noqa: F821
    ]))


def _interleaved(gen, B, S, n_ids=4, max_run=40):
    """Runs of random length with ids drawn from a few values: ids recur after other ids."""
    out = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        pos = 0
        while pos < S:
            run = int(torch.randint(1, max_run, (1,), generator=gen))
            out[b, pos:pos + run] = int(torch.randint(0, n_ids, (1,), generator=gen))
            pos += run
    return out


def _contiguous(gen, B, S, max_docs=6):
    """Each id one run (zero-length documents from repeated cuts), labels not sorted."""
    out = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        n = int(torch.randint(1, max_docs + 1, (1,), generator=gen))
        cuts = sorted(torch.randint(0, S, (n - 1,), generator=gen).tolist())
        labels = torch.randperm(5 * max_docs, generator=gen)[:n]
        pos = 0
        for k, c in enumerate(cuts + [S]):
            out[b, pos:c] = labels[k]
            pos = max(pos, c)
    return out


def _edge_ids(S):
    """One id everywhere, all ids distinct, two ids alternating every token."""
    ar = torch.arange(S)
    return torch.stack([torch.zeros(S, dtype=torch.int64), ar, ar % 2])


def _metas(gen, S):
    metas = [{"doc_id": _interleaved(gen, 3, S)}, {"doc_id": _edge_ids(S)}]
    return metas + [{"doc_id": _contiguous(gen, 3, S)}]


def _per_slot_bitmaps(mask, meta, sq, sk, extra=None):
    """The torch reference's bitmaps with per-slot coverage (``visibility_only_slots``)."""
    arrs = {a: meta[a] for a in meta if a in mask.array_params}
    arrs.update(derive_run_arrays(mask.derived_arrays, arrs))
    B = next(iter(arrs.values())).shape[0]
    scal = [torch.as_tensor(meta[p]).reshape(-1, 1).expand(B, 1) for p in mask.scalar_params]
    i = torch.arange(sq, dtype=torch.int64).unsqueeze(0)
    starts, lens, region = mask.torch_function("interval_table")(
        i, sq, sk, *scal, *[arrs[a] for a in mask.array_params], batch_size=B)
    return bitmaps(starts, lens, visibility_only_slots(mask, region), TileConfig(*FWD),
                   TileConfig(*BWD), sq, sk)


def _check_states(desc, ref, what, exact: bool):
    """Full tiles are full and empty tiles empty in the brute-force mask (a full tile runs with
    no test at all); with ``exact`` the states equal the mask's own."""
    got, want = desc.tile_states(), dense_tile_states(ref, *FWD)
    assert not ((got == 1) & (want != 1)).any(), f"{what}: a full tile is not full"
    assert not ((got == 0) & (want != 0)).any(), f"{what}: an empty tile is not empty"
    if exact:
        assert torch.equal(got, want), f"{what}: tile states differ from the mask's"


# ---- compiled form -------------------------------------------------------------------------------


def test_equality_is_the_run_exactly_and_the_span_under_the_predicate():
    mask = _mask("ids_causal", RULES["causal_doc"])
    assert mask.has_fallback and mask.num_intervals == 2
    assert [str(iv) for iv in mask.regions[0].intervals] == [
        "[doc_id_run_start[i], i + 1)", "[doc_id_span_start[i], i + 1)  (over-approximation)"]
    assert [iv.exact for iv in mask.regions[0].intervals] == [True, False]
    assert mask.array_params == ("doc_id", "doc_id_run_start", "doc_id_run_end",
                                 "doc_id_span_start", "doc_id_span_end")
    assert "may recur outside the run" in mask.regions[0].fallback_reasons[0]
    # causal within segments only where the ids are contiguous, which each batch checks
    pat = mask.native_pattern
    assert pat.kind == "segments" and pat.contiguous_ids == ("doc_id",)


def test_inequality_is_exact_outside_the_span_and_predicated_in_its_gaps():
    mask = _mask("ids_other", RULES["other_docs"])
    ivs = mask.regions[0].intervals
    assert mask.num_intervals == 4 and sorted(iv.exact for iv in ivs) == [False, False, True, True]
    got = {str(iv) for iv in ivs}
    assert got == {"[0, doc_id_span_start[i])", "[doc_id_span_end[i], seqlen_k)",
                   "[doc_id_span_start[i], doc_id_run_start[i])  (over-approximation)",
                   "[doc_id_run_end[i], doc_id_span_end[i])  (over-approximation)"}


def test_packed_documents_by_start_keep_their_native_path():
    from compilemask.masks import packed_documents

    pat = cm.compile_mask(packed_documents()).native_pattern
    assert pat is not None and pat.kind == "segments" and pat.segment_param == "doc_start"


# ---- derived arrays ------------------------------------------------------------------------------


def _brute_bounds(row):
    S = len(row)
    run_s, run_e, span_s, span_e = [], [], [], []
    for p in range(S):
        a = p
        while a > 0 and row[a - 1] == row[p]:
            a -= 1
        e = p + 1
        while e < S and row[e] == row[p]:
            e += 1
        same = [q for q in range(S) if row[q] == row[p]]
        run_s.append(a), run_e.append(e), span_s.append(same[0]), span_e.append(same[-1] + 1)
    return run_s, run_e, span_s, span_e


@pytest.mark.parametrize("S", [1, 2, 37, 100])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_run_and_span_bounds_equal_brute_force(S, dtype):
    gen = torch.Generator().manual_seed(S)
    for meta in _metas(gen, S):
        ids = meta["doc_id"].to(dtype)
        rs, re_ = run_bounds(ids)
        ss, se = span_bounds(ids)
        assert all(t.dtype == dtype for t in (rs, re_, ss, se))
        for b in range(ids.shape[0]):
            want = _brute_bounds(ids[b].tolist())
            got = [t[b].tolist() for t in (rs, re_, ss, se)]
            assert got == list(want), (ids[b].tolist(), got, want)


class _HostReads(TorchDispatchMode):
    """Records the ops that read tensor values on the host or size outputs by the data."""

    SYNCING = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "item")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(s in name for s in self.SYNCING):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_derived_arrays_read_no_value_on_the_host():
    mask = _mask("ids_same", RULES["same_doc"])
    ids = _interleaved(torch.Generator().manual_seed(1), 4, 300)
    with _HostReads() as mode:
        out = derive_run_arrays(mask.derived_arrays, {"doc_id": ids}, True)
    assert set(out) == {"doc_id_run_start", "doc_id_run_end", "doc_id_span_start",
                        "doc_id_span_end"}
    assert mode.seen == []


# ---- exact masks and sound tiles -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RULES))
def test_torch_reference_equals_brute_force(name):
    mask = _mask(f"ids_{name}", RULES[name])
    gen = torch.Generator().manual_seed(len(name))
    for sq, sk in ((1, 1), (100, 100), (129, 129), (257, 257), (37, 29)):
        for n, meta in enumerate(_metas(gen, sq)):
            desc = mask.preprocess(meta, sq, sk, fwd_tiles=FWD, bwd_tiles=BWD, backend="torch",
                                   check=True)
            ref = mask.reference_mask(meta, seqlen_q=sq, seqlen_k=sk)
            assert torch.equal(desc.dense_mask(), ref), (name, sq, sk, meta)
            _check_states(desc, ref, f"{name} {sq}x{sk} torch", exact=False)
            # per-slot coverage: the tiles of the mask itself where ids are contiguous
            f, _ = _per_slot_bitmaps(mask, meta, sq, sk)
            got, want = unpack_bitmap(f, -(-sk // FWD[1])), dense_tile_states(ref, *FWD)
            assert not ((got == 1) & (want != 1)).any(), (name, sq, sk, "full")
            assert not ((got == 0) & (want != 0)).any(), (name, sq, sk, "empty")
            if n == 2:
                assert torch.equal(got, want), (name, sq, sk, "contiguous ids")


# causal_doc's program by default (the derived arrays' kind); inequality and two regions: slow
@pytest.mark.parametrize("name", [n if n == "causal_doc" else
                                  pytest.param(n, marks=pytest.mark.slow)
                                  for n in TILELANG_RULES])
def test_tilelang_c_target_equals_brute_force(name):
    pytest.importorskip("tilelang")
    mask = _mask(f"ids_{name}", RULES[name])
    gen = torch.Generator().manual_seed(17 + len(name))
    for sq, sk in ((1, 1), (100, 100), (129, 129), (257, 257), (37, 29)):
        for n, meta in enumerate(_metas(gen, sq)):
            kw = dict(fwd_tiles=FWD, bwd_tiles=BWD)
            out = mask.preprocess(meta, sq, sk, backend="tilelang", **kw)
            ref = mask.reference_mask(meta, seqlen_q=sq, seqlen_k=sk)
            what = f"{name} {sq}x{sk} ids {meta['doc_id'].tolist()}"
            assert torch.equal(out.dense_mask(), ref), what
            # contiguous ids (n == 2): the states of the run intervals, exact as before
            _check_states(out, ref, what, exact=n == 2)
            f, b = _per_slot_bitmaps(mask, meta, sq, sk)
            assert torch.equal(out.fwd_bitmap, f) and torch.equal(out.bwd_bitmap, b), what
            tref = mask.preprocess(meta, sq, sk, backend="torch", **kw)
            for field in ("intervals", "row_region", "row_params"):
                assert torch.equal(getattr(out, field), getattr(tref, field)), (what, field)


@pytest.mark.slow  # a program of its own
def test_tilelang_two_regions_with_and_without_exact_slots():
    pytest.importorskip("tilelang")
    mask = _two_regions()
    assert [r.fallback for r in mask.regions] == [True, True]
    assert [[iv.exact for iv in r.intervals] for r in mask.regions] == [[False], [True, False]]
    gen = torch.Generator().manual_seed(3)
    for S in (1, 100, 257):
        for meta in _metas(gen, S):
            meta = {**meta, "n": torch.randint(0, S + 1, (3,), generator=gen)}
            out = mask.preprocess(meta, S, fwd_tiles=FWD, bwd_tiles=BWD, backend="tilelang")
            ref = mask.reference_mask(meta, seqlen_q=S)
            assert torch.equal(out.dense_mask(), ref), (S, meta)
            _check_states(out, ref, f"two regions S={S}", exact=False)
            f, b = _per_slot_bitmaps(mask, meta, S, S)
            assert torch.equal(out.fwd_bitmap, f) and torch.equal(out.bwd_bitmap, b), (S, meta)
            # the rows of the ids region make full tiles; the strided rows never do
            rows = (out.row_region == 0).view(3, -1)
            full = out.tile_states() == 1
            tm = FWD[0]
            for bi in range(3):
                for m_tile in range(full.shape[1]):
                    if full[bi, m_tile].any():
                        assert not rows[bi, m_tile * tm:(m_tile + 1) * tm].any()


# ---- FlexAttention -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", pytest.param("tilelang", marks=pytest.mark.slow)])
def test_flex_document_mask_over_recurring_ids_equals_create_mask(backend):
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    from torch.nn.attention.flex_attention import create_mask

    def document(ids):
        def document_causal(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)
        return document_causal

    gen = torch.Generator().manual_seed(11)
    for S in (1, 100, 129):
        ids = _interleaved(gen, 2, S, n_ids=3)
        document_causal = document(ids)
        spec, meta = cm.from_mask_mod(document_causal)
        mask = cm.compile_mask(spec)
        desc = mask.preprocess(meta, seqlen_q=S, backend=backend, fwd_tiles=FWD, bwd_tiles=BWD)
        want = create_mask(document_causal, 2, 1, S, S, device="cpu")[:, 0]
        assert torch.equal(desc.dense_mask(), want), ids


def test_contiguous_ids_run_natively_and_scattered_ones_on_the_lists():
    """FlexAttention's document mask: proved causal within segments when the ids are
    contiguous (checked per batch), so a batch of contiguous ids gets cu_seqlens; scattered
    ids, or no host synchronization (``max_segments``), leave it to the block-sparse engine."""
    from torch.nn.attention.flex_attention import and_masks, create_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    for ids, native in ((torch.tensor([[0] * 5 + [1] * 7, [3] * 12]), True),
                        (torch.tensor([[0] * 3 + [1] * 4 + [0] * 5, [1] * 6 + [2] * 6]), False)):
        def same_doc(b, h, q_idx, kv_idx, ids=ids):
            return ids[b, q_idx] == ids[b, kv_idx]

        mm = and_masks(same_doc, causal)
        spec, meta = cm.from_mask_mod(mm)
        mask = cm.compile_mask(spec)
        assert mask.native_pattern.kind == "segments" and mask.native_pattern.contiguous_ids
        d = mask.preprocess(meta, 12)
        assert torch.equal(d.dense_mask(), create_mask(mm, 2, 1, 12, 12, device="cpu")[:, 0])
        assert (d.segments is not None) == native
        if native:
            assert d.segments[0][:4].tolist() == [0, 5, 12, 24]
        assert mask.preprocess(meta, 12, max_segments=8).segments is None
