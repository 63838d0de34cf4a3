"""from_mask_mod: captured tensors read at an index computed from q_idx or kv_idx become gathered
per-token arrays (``t[kv_idx // n]``, ``s[t[q_idx] + 1]``, nested ``s[u[t[q_idx]]]``, per-sequence
offsets in the index), equal to FlexAttention's ``create_mask`` element by element."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm

LENGTHS = (1, 100, 129, 257)


def _compare(mask_mod, B, S, **kw):
    spec, meta = cm.from_mask_mod(mask_mod, batch_size=B, **kw)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=B)
    want = create_mask(mask_mod, B, 1, S, S, device="cpu")[:, 0]
    assert torch.equal(desc.dense_mask(), want), (S, spec.params)
    return spec, meta


def _doc_ids(gen, B, S, ndocs):
    """Contiguous document ids per sequence; ndocs - 1 random cuts (repeats allowed: empty
    documents)."""
    out = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        for c in torch.randint(0, S, (ndocs - 1,), generator=gen).tolist():
            out[b, c:] += 1
    return out


@pytest.mark.parametrize("S", LENGTHS)
def test_index_from_kv_idx_alone_needs_the_length(S):
    """``sizes[kv_idx // n]`` (a padded-tile mask): the index says nothing of the length, so
    ``seqlen`` does; tiles whose real-token count is 0, n or between."""
    n = 16
    gen = torch.Generator().manual_seed(S)
    sizes = torch.randint(0, n + 1, (-(-S // n),), generator=gen)
    sizes[0] = 0

    def padded(b, h, q_idx, kv_idx):
        return (kv_idx % n < sizes[kv_idx // n]) & (kv_idx <= q_idx)

    with pytest.raises(ValueError, match=r"seqlen=S"):
        cm.from_mask_mod(padded)
    spec, meta = _compare(padded, 2, S, seqlen=S)
    assert [p for p in spec.params] == ["sizes_at_index"] and meta["sizes_at_index"].shape == (2, S)


@pytest.mark.parametrize("S", LENGTHS)
def test_nested_and_shifted_gathers(S):
    """Shared prefixes of packed documents: ``offsets[doc[q_idx]]``, the prefix document's
    ``offsets[prefix[doc[q_idx]]]`` and its end ``offsets[prefix[doc[q_idx]] + 1]``; inner
    gathers are computed before the gathers whose index reads them."""
    gen = torch.Generator().manual_seed(S)
    ndocs = min(6, S)
    lengths = torch.zeros(ndocs, dtype=torch.int64)
    for _ in range(S):
        lengths[torch.randint(0, ndocs, (1,), generator=gen)] += 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    doc = torch.repeat_interleave(torch.arange(ndocs), lengths)
    prefix = torch.tensor([d - d % 3 for d in range(ndocs)])

    def shared_prefix(b, h, q_idx, kv_idx):
        q_doc = doc[q_idx]
        q_prefix = prefix[q_doc]
        own = (kv_idx >= offsets[q_doc]) & (kv_idx <= q_idx)
        pre = (q_doc != q_prefix) & (kv_idx >= offsets[q_prefix]) & (kv_idx < offsets[q_prefix + 1])
        return own | pre

    spec, meta = _compare(shared_prefix, 2, S)
    assert "offsets_at_prefix_at_doc" in spec.params  # a gather of a gather
    assert len(spec.params) == len(set(spec.params)) == len(meta)


@pytest.mark.parametrize("S", LENGTHS)
def test_per_sequence_values_in_the_index(S):
    """``t[b, q_idx - off[b]]`` (a per-sequence shift, with wrap-around for negative indices
    as torch indexes) and ``start[b, ids[b, q_idx] + 1]`` of 2-D tensors."""
    B = 3
    gen = torch.Generator().manual_seed(S)
    t = torch.randint(0, S + 1, (B, S), generator=gen)
    off = torch.randint(0, S, (B,), generator=gen)
    ids = _doc_ids(gen, B, S, 4)
    starts = torch.randint(0, S, (B, 5), generator=gen)  # ids + 1 <= 4

    def shifted(b, h, q_idx, kv_idx):
        return (kv_idx < t[b, q_idx - off[b]]) | (kv_idx == starts[b, ids[b, q_idx] + 1])

    spec, meta = _compare(shifted, B, S)
    assert "off" not in spec.params and "ids" not in spec.params


def test_gather_errors_name_the_read():
    sizes = torch.arange(4)

    def out_of_range(b, h, q_idx, kv_idx):
        return kv_idx < sizes[q_idx + 2]

    with pytest.raises(ValueError, match=r"shape \(4,\) at \(i \+ 2\)"):
        cm.from_mask_mod(out_of_range, seqlen=4)
    short, full = torch.zeros(5, dtype=torch.int64), torch.zeros(7, dtype=torch.int64)

    def two_lengths(b, h, q_idx, kv_idx):
        return kv_idx < sizes[short[q_idx] + full[q_idx]]

    with pytest.raises(ValueError, match=r"different lengths \[5, 7\]"):
        cm.from_mask_mod(two_lengths)

    def both(b, h, q_idx, kv_idx):
        return kv_idx < sizes[q_idx - kv_idx]

    with pytest.raises(NotImplementedError, match=r"one of them"):
        cm.from_mask_mod(both)


def test_rebuilt_mask_mod_gathers_the_new_tensors():
    """The conversion is cached by code: a rebuilt mask_mod with new tensors gathers those."""
    def make(sizes):
        def padded(b, h, q_idx, kv_idx):
            return kv_idx % 4 < sizes[kv_idx // 4]
        return padded

    for seed in range(3):
        sizes = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(seed))
        _compare(make(sizes), 1, 32, seqlen=32)
