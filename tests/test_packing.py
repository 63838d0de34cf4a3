"""Packed inputs: cu_seqlens / position_ids and per-sequence metadata -> per-row arrays, and the
packed HSTU mask against the block-diagonal composition of each sequence's own HSTU mask."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask.compiler import native
from compilemask.dsl import packing
from compilemask.masks import hstu, packed_documents, packed_prefix_lm, random_meta

HSTU = cm.compile_mask(hstu())
PACKED = cm.compile_mask(packing.packed_hstu_spec())


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())


def _block_diagonal(lens, metas, S):
    """The expected packed mask: each sequence's brute-force HSTU mask on the diagonal."""
    out = torch.zeros(1, S, S, dtype=torch.bool)
    start = 0
    for L, meta in zip(lens, metas):
        if L:
            out[0, start:start + L, start:start + L] = HSTU.reference_mask(meta, seqlen_q=L)[0]
        start += L
    return out


def test_packed_hstu_is_interval_compiled():
    assert PACKED.num_intervals == 2 and not PACKED.has_fallback
    assert set(PACKED.array_params) == {"seq_start", "ctx_end", "hist_end", "seq_end",
                                        "group_start"}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_seq_end", [False, True])
def test_packed_hstu_equals_block_diagonal(seed, with_seq_end):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 6, (1,), generator=gen))
    lens = torch.randint(0, 40, (n,), generator=gen).tolist()  # zero-length sequences too
    pad = int(torch.randint(0, 9, (1,), generator=gen))
    S = max(sum(lens) + pad, 1)
    # each sequence's metadata as masks.hstu draws it, past-the-end values included
    metas = [random_meta(hstu(), 1, max(L, 1), gen) for L in lens]
    if not with_seq_end:
        metas = [{**m, "seq_end": torch.tensor([max(L, 1)])} for m, L in zip(metas, lens)]
    per_seq = {k: torch.cat([m[k] for m in metas]) for k in ("ctx_end", "hist_end", "group_size")}
    if with_seq_end:
        per_seq["seq_end"] = torch.cat([m["seq_end"] for m in metas])
    meta = packing.packed_hstu_meta(cu_seqlens=_cu(lens), seqlen=S, **per_seq)
    assert all(v.shape == (1, S) and v.dtype == torch.int64 for v in meta.values())
    desc = PACKED.preprocess(meta, seqlen_q=S, fwd_tiles=(16, 16), bwd_tiles=(16, 16), check=True)
    expected = _block_diagonal(lens, metas, S)
    assert torch.equal(desc.dense_mask(), expected)
    assert torch.equal(PACKED.reference_mask(meta, seqlen_q=S), expected)  # the rules themselves


def test_position_ids_agree_with_cu_seqlens():
    lens = [7, 1, 12, 5]
    cu = _cu(lens)
    pos = torch.cat([torch.arange(n) for n in lens])
    per_seq = {"hist_end": torch.tensor([4, 1, 20, 0]), "group_size": torch.tensor([2, 1, 3, 9]),
               "ctx_end": torch.tensor([1, 0, 2, 0])}
    a = packing.packed_hstu_meta(cu_seqlens=cu.to(torch.int32), seqlen=sum(lens), **per_seq)
    for p in (pos, pos.unsqueeze(0)):
        b = packing.packed_hstu_meta(position_ids=p, **per_seq)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    seq_id, start, end = packing.sequence_bounds(position_ids=pos)
    assert seq_id.tolist() == [[0] * 7 + [1] + [2] * 12 + [3] * 5]
    assert start.tolist() == [[0] * 7 + [7] + [8] * 12 + [20] * 5]
    assert end.tolist() == [[7] * 7 + [8] + [20] * 12 + [25] * 5]


def test_position_ids_batch_rows_index_one_metadata_list():
    # two packed rows: sequences 0, 1 in the first, 2, 3, 4 in the second
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 0, 1, 2, 3]])
    out = packing.packed_meta({"prefix": torch.tensor([1, 9, 0, 1, 2]),
                               "width": torch.tensor([10, 11, 12, 13, 14])},
                              positions=["prefix"], values=["width"], position_ids=pos)
    assert out["seq_start"].tolist() == [[0, 0, 0, 3, 3, 3, 3], [0, 0, 2, 3, 3, 3, 3]]
    assert out["seq_end"].tolist() == [[3, 3, 3, 7, 7, 7, 7], [2, 2, 3, 7, 7, 7, 7]]
    # prefix 9 of sequence 1 stops at its end (7), never in the next sequence
    assert out["prefix"].tolist() == [[1, 1, 1, 7, 7, 7, 7], [0, 0, 3, 5, 5, 5, 5]]
    assert out["width"].tolist() == [[10, 10, 10, 11, 11, 11, 11], [12, 12, 13, 14, 14, 14, 14]]


def test_padding_rows_see_nothing_and_ints_broadcast():
    cu = torch.tensor([0, 5, 9])
    meta = packing.packed_hstu_meta(cu_seqlens=cu, seqlen=13, hist_end=2, group_size=3)
    desc = PACKED.preprocess(meta, seqlen_q=13, check=True)
    dense = desc.dense_mask()[0]
    assert not dense[9:].any() and (desc.row_region[0, 9:] == -1).all()
    assert dense[:9].any(-1).all()
    assert meta["seq_start"][0].tolist() == [0] * 5 + [5] * 4 + [9] * 4


def test_packed_documents_from_seq_start():
    lens = [3, 6, 4]
    meta = packing.packed_meta(cu_seqlens=_cu(lens), seqlen=13)
    mask = cm.compile_mask(packed_documents())
    got = mask.preprocess({"doc_start": meta["seq_start"]}, seqlen_q=13).dense_mask()
    expected = torch.block_diag(*(torch.ones(n, n).tril() for n in lens)).bool()
    assert torch.equal(got[0], expected)


def test_padding_rows_of_masks_without_an_end_are_one_more_document():
    """packed_documents and packed_prefix_lm have no end bound: the padding rows are one more
    document, causal over the padding keys; real rows never see them, and the batch stays a
    segmentation (FA4's varlen path), which a padding row seeing nothing would not be."""
    lens, S = [3, 0, 6], 13
    meta = packing.packed_meta({"prefix_end": torch.tensor([2, 1, 9])}, positions=["prefix_end"],
                               cu_seqlens=_cu(lens), seqlen=S)
    docs = cm.compile_mask(packed_documents())
    desc = docs.preprocess({"doc_start": meta["seq_start"]}, seqlen_q=S)
    tail = S - sum(lens)
    expected = torch.block_diag(*(torch.ones(n, n).tril() for n in lens + [tail])).bool()
    assert torch.equal(desc.dense_mask()[0], expected)
    assert native.segments(docs, desc)[0][:4].tolist() == [0, 3, 9, S]
    prefix = cm.compile_mask(packed_prefix_lm())
    got = prefix.preprocess({"doc_start": meta["seq_start"], "prefix_end": meta["prefix_end"]},
                            seqlen_q=S).dense_mask()[0]
    assert not got[:9, 9:].any() and not got[9:, :9].any()
    assert torch.equal(got[9:, 9:], torch.ones(tail, tail).tril().bool())


def test_cu_seqlens_are_checked_on_the_host():
    for cu, msg in (([1, 4, 9], r"start at 0, got cu_seqlens\[0\] = 1"),
                    ([0, 5, 3, 9], r"non-decreasing: cu_seqlens\[2\] = 3 < cu_seqlens\[1\] = 5"),
                    ([0, 4, 14], r"cu_seqlens\[-1\] = 14 exceeds seqlen \(13\)")):
        with pytest.raises(ValueError, match=msg):
            packing.packed_meta(cu_seqlens=torch.tensor(cu), seqlen=13)
        with pytest.raises(ValueError, match=msg):
            packing.packed_hstu_meta(hist_end=1, group_size=1, cu_seqlens=torch.tensor(cu),
                                     seqlen=13)
    # empty sequences, a padding tail and a full row are packings
    for cu in ([0, 0, 4, 4, 9], [0, 13], [0, 0]):
        packing.sequence_bounds(cu_seqlens=torch.tensor(cu, dtype=torch.int32), seqlen=13)


def test_no_host_sync():
    """One graph under torch.compile(fullgraph=True): no .item(), .tolist() or data-dependent
    Python control flow (each would be a graph break)."""
    lens = [7, 0, 12, 5]
    per_seq = {"hist_end": torch.tensor([4, 1, 20, 0]), "group_size": torch.tensor([2, 1, 3, 9]),
               "ctx_end": torch.tensor([1, 0, 2, 0]), "seq_end": torch.tensor([6, 0, 12, 2])}

    def from_cu(cu, **kw):
        return packing.packed_hstu_meta(cu_seqlens=cu, seqlen=30, **kw)

    def from_pos(pos, **kw):
        return packing.packed_hstu_meta(position_ids=pos, **kw)

    cu = _cu(lens)
    eager = from_cu(cu, **per_seq)
    compiled = torch.compile(from_cu, backend="eager", fullgraph=True)(cu, **per_seq)
    assert all(torch.equal(eager[k], compiled[k]) for k in eager)
    pos = torch.cat([torch.arange(n) for n in lens if n]).unsqueeze(0)
    nz = {k: v[torch.tensor(lens) > 0] for k, v in per_seq.items()}
    compiled = torch.compile(from_pos, backend="eager", fullgraph=True)(pos, **nz)
    assert all(torch.equal(eager[k][:, :24], compiled[k]) for k in compiled)


def test_errors():
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="exactly one"):
        packing.sequence_bounds()
    with pytest.raises(ValueError, match="seqlen"):
        packing.sequence_bounds(cu_seqlens=cu)
    with pytest.raises(ValueError, match="positions"):
        packing.packed_meta({"hist_end": torch.tensor([1])}, cu_seqlens=cu, seqlen=4)
    with pytest.raises(ValueError, match="come from the packing"):
        packing.packed_meta({"seq_end": 1}, values=["seq_end"], cu_seqlens=cu, seqlen=4)
    with pytest.raises(ValueError, match=r"\[N\]"):
        packing.packed_meta({"w": torch.ones(1, 1, dtype=torch.long)}, values=["w"],
                            cu_seqlens=cu, seqlen=4)
    with pytest.raises(ValueError, match="w: 2 per-sequence values, cu_seqlens has 1 sequences"):
        packing.packed_meta({"w": torch.tensor([1, 2])}, values=["w"], cu_seqlens=cu, seqlen=4)
