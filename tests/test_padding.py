"""Padded batches in the descriptor (``preprocess(..., padding=)``, ``rows_descriptor(...,
padding=)``, ``compilemask.pipeline.padding``): every row sees the mask within its sequence's
real tokens, padded rows see nothing; positions are the tensor's. Example masks (fallback
regions included) under random left / right paddings, a sequence without real tokens, lengths
that are not a multiple of the tiles."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.compiler.reference import attention_reference
from compilemask.contract.descriptor import DEFAULT_BWD_TILES, DEFAULT_FWD_TILES

from helpers import dense_tile_states

# fallback regions: dilated_causal; native patterns: causal, sliding_window, packed_documents
NAMES = ["causal", "sliding_window", "prefix_lm", "packed_documents", "hstu", "dilated_causal",
         "tree_verify", "sink_window", "block_causal"]


def _paddings(B, S, seed):
    """int64 0/1 ``[B, S]``: left, right, both-sided, none and (for B > 4) no real token."""
    g = torch.Generator().manual_seed(seed)
    am = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        kind = b % 5
        lo = int(torch.randint(1, S, (1,), generator=g)) if kind in (0, 2) else 0
        hi = S - int(torch.randint(1, S - lo, (1,), generator=g)) if kind in (1, 2) else S
        if kind == 4:
            lo = hi = 0
        am[b, lo:hi] = 1
    return am


def _brute(mask, meta, S, B, am):
    real = am.bool()
    return mask.reference_mask(meta, S, batch_size=B) & real[:, None, :] & real[:, :, None]


def _check_bitmaps(desc, dense):
    fwd, bwd = desc.fwd_tiles, desc.bwd_tiles
    assert torch.equal(desc.tile_states(), dense_tile_states(dense, fwd.tile_m, fwd.tile_n))
    want = dense_tile_states(dense, bwd.tile_m, bwd.tile_n).transpose(1, 2)
    assert torch.equal(desc.tile_states(backward=True), want)


@pytest.mark.parametrize("name", NAMES)
def test_padded_descriptor_equals_brute_force(name):
    mask = cm.compile_mask(masks.EXAMPLES[name]())
    B, S = 5, 203  # not a multiple of 128 (nor of 64)
    for seed in (0, 1):
        meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(seed)) or None
        am = _paddings(B, S, seed)
        assert (am.sum(1) == 0).any()  # a sequence with no real token
        desc = mask.preprocess(meta, S, batch_size=B, padding=am)
        want = _brute(mask, meta, S, B, am)
        assert torch.equal(desc.dense_mask(), want), (name, seed)
        # tiles with padded keys are never full: the bitmaps are the padded mask's
        _check_bitmaps(desc, want)
        assert desc.q_offset == -1 and not desc.native_applies()
        empty = ~am.bool()
        assert (desc.row_region[empty] == -1).all()
        assert (desc.intervals[empty] == 0).all()


def test_padding_bool_and_int_agree_and_torch_equals_tilelang_c():
    """A bool and a 0/1 mask give one descriptor; the torch and the TileLang (C target)
    preprocess agree after padding (the program's table is clipped in torch after it)."""
    pytest.importorskip("tilelang")
    mask = cm.compile_mask(masks.prefix_lm())
    B, S = 3, 70
    meta = {"prefix_len": torch.tensor([5, 30, 69])}
    am = _paddings(B, S, 3)
    a = mask.preprocess(meta, S, batch_size=B, padding=am, backend="torch")
    b = mask.preprocess(meta, S, batch_size=B, padding=am.bool(), backend="torch")
    try:
        c = mask.preprocess(meta, S, batch_size=B, padding=am, backend="tilelang")
    except Exception as e:  # no C compiler here: the torch reference is the check
        pytest.skip(f"TileLang C target unavailable: {e}")
    for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap", "params", "row_params"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
        assert torch.equal(getattr(a, f), getattr(c, f)), f


def test_attention_on_a_padded_descriptor_equals_the_reference():
    """``cm.attention`` through the padded descriptor: padded keys hidden, padded query rows
    exactly 0 (never NaN), the real rows as a float32 softmax over their real keys."""
    mask = cm.compile_mask(masks.EXAMPLES["dilated_causal"]())  # fallback regions
    B, S, H, D = 5, 150, 2, 16
    am = _paddings(B, S, 4)
    desc = mask.preprocess(None, S, batch_size=B, padding=am)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g, requires_grad=True) for _ in range(3))
    out = cm.attention(q, k, v, desc)
    real = am.bool()
    dense = _brute(mask, None, S, B, am)
    # independent reference: scores of real keys only, softmax in float64
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * D**-0.5
    s = s.masked_fill(~dense[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    want = torch.einsum("bhqk,bkhd->bqhd", p, v.double())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # padded keys get no gradient: nobody sees them
    assert torch.equal(k.grad[~real], torch.zeros_like(k.grad[~real]))
    assert torch.equal(v.grad[~real], torch.zeros_like(v.grad[~real]))
    ref = attention_reference(q.detach(), k.detach(), v.detach(), dense)
    torch.testing.assert_close(out.detach(), ref)


def test_score_mods_on_a_padded_batch_read_the_padded_positions():
    """A score_mod on a padded batch (a T5 bias, ALiBi with its LSE) reads ``q_idx`` and
    ``kv_idx`` as positions of the padded tensor, as FlexAttention does: the same output and
    LSE as the unpadded mask with the score_mod on the real rows; padded decode rows (the last
    rows of left-padded sequences) read theirs too. The GPU engines get the rows' start
    (``row_start``), which the reference reads the same way."""
    from compilemask.api.api import _row_positions
    from compilemask.api.serving import query_descriptor
    from compilemask.dsl import score_mods
    from compilemask.pipeline.pipeline import padded

    mask = cm.compile_mask(masks.causal())
    B, S, H, D = 4, 40, 2, 8
    am = _paddings(B, S, 5)
    real = am.bool()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    desc = mask.preprocess(None, S, batch_size=B, padding=am)
    assert desc.q_offset == -1 and _row_positions(desc, 1, B)[1].tolist() == [0] * B
    dense = _brute(mask, None, S, B, am)
    t5 = score_mods.t5_bias(torch.randn(32, H, generator=g, dtype=torch.float64), 16)
    alibi = score_mods.alibi(score_mods.alibi_slopes(H).double())
    for fn in (t5, alibi):
        out, lse = cm.attention(q, k, v, desc, score_mod=fn, return_lse=True)
        want, want_lse = attention_reference(q, k, v, dense, score_mod=fn, return_lse=True)
        torch.testing.assert_close(out[real], want[real])
        torch.testing.assert_close(lse.transpose(1, 2)[real], want_lse.transpose(1, 2)[real])
        assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    # the last 3 rows of each padded sequence: the rows' start is S - 3 in every sequence
    last = padded(query_descriptor(mask, None, S, 3, batch_size=B), am)
    assert _row_positions(last, 1, B)[1].tolist() == [S - 3] * B
    got = cm.attention(q[:, -3:], k, v, last, score_mod=t5)
    want = attention_reference(q, k, v, dense, score_mod=t5)[:, -3:]
    keep = real[:, -3:]
    torch.testing.assert_close(got[keep], want[keep])


def test_non_contiguous_padding_is_refused_naming_the_argument():
    mask = cm.compile_mask(masks.causal())
    am = torch.ones(2, 20, dtype=torch.long)
    am[1, 5] = 0  # a hole between real tokens
    with pytest.raises(ValueError, match=r"padding: .*one contiguous run.*sequence 1"):
        mask.preprocess(None, 20, batch_size=2, padding=am)
    with pytest.raises(ValueError, match=r"padding must be \[B, S\] = \[2, 20\]"):
        mask.preprocess(None, 20, batch_size=2, padding=am[:, :10])
    with pytest.raises(TypeError, match="padding must be a bool or 0/1 int"):
        mask.preprocess(None, 20, batch_size=2, padding=am.float())


def test_rows_descriptor_padding_equals_the_square_rows():
    """Context-parallel shards and served last rows with padding: the padded square mask's rows
    at those positions (padding rows past the sequence see nothing)."""
    from compilemask.api import distributed as cp
    from compilemask.pipeline.rows import rows_descriptor

    mask = cm.compile_mask(masks.hstu())
    B, S = 5, 90
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(5))
    am = _paddings(B, S, 5)
    square = _brute(mask, meta, S, B, am)
    plan = cp.make_plan(mask, meta, S, 3, tile=16, batch_size=B)
    for rank in range(3):
        d = cp.shard_descriptor(mask, meta, plan, rank, batch_size=B, padding=am)
        rows = plan.rows[rank]
        want = torch.zeros(B, rows.numel(), S, dtype=torch.bool)
        inside = rows < S
        want[:, inside] = square[:, rows[inside]]
        assert torch.equal(d.dense_mask(), want), rank
        assert d.q_offset == -1
    last = torch.arange(S - 7, S)
    d = rows_descriptor(mask, meta, S, last, batch_size=B, padding=am, q_offset=S - 7)
    assert torch.equal(d.dense_mask(), square[:, S - 7:]) and d.q_offset == -1


def test_padding_an_existing_descriptor():
    """``pipeline.padded``: a made descriptor (square, or a served one's last rows) padded
    afterwards equals the one made with ``padding=``; one already padded is refused there."""
    from compilemask.api.serving import query_descriptor
    from compilemask.pipeline.pipeline import padded

    mask = cm.compile_mask(masks.prefix_lm())
    B, S = 5, 40
    meta = {"prefix_len": torch.tensor([3, 9, 0, 40, 17])}
    am = _paddings(B, S, 6)
    made = mask.preprocess(meta, S, batch_size=B, padding=am)
    after = padded(mask.preprocess(meta, S, batch_size=B), am)
    for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap"):
        assert torch.equal(getattr(made, f), getattr(after, f)), f
    served = padded(query_descriptor(mask, meta, S, 3, batch_size=B), am)
    assert torch.equal(served.dense_mask(), made.dense_mask()[:, S - 3:])
    with pytest.raises(ValueError, match="q_offset -1"):
        padded(made, am)


def test_with_fields_sets_only_post_construction_fields():
    from compilemask.contract.descriptor import with_fields

    d = cm.compile_mask(masks.causal()).preprocess(None, 8)
    e = with_fields(d, q_offset=-1, meta_max=64)
    assert (e.q_offset, e.meta_max, e.intervals is d.intervals) == (-1, 64, True)
    assert with_fields(d) is d
    with pytest.raises(TypeError, match="not fields set after construction"):
        with_fields(d, intervals=d.intervals)
    assert (d.fwd_tiles, d.bwd_tiles) == (DEFAULT_FWD_TILES, DEFAULT_BWD_TILES)


# ---------------------------------------------------------------------------------------------
# GPU: a padded training batch on the fa4 engine
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "hstu", "dilated_causal", "sliding_window"])
def test_gpu_padded_batch_fa4_fwd_bwd_vs_float32_reference(name):
    """A padded batch on the fa4 engine (bf16, forward and backward) within twice PyTorch's
    bf16 error of the float32 reference on the padded mask; padded rows exactly 0. The padded
    descriptor is made on the GPU with no host synchronization."""
    from helpers import check_attention_vs_reference

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    B, S, H, Hkv, D = 5, 1000, 4, 2, 128
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(2)) or None
    am = _paddings(B, S, 2)
    dense = _brute(mask, meta, S, B, am)
    meta_gpu = {k: v.cuda() for k, v in (meta or {}).items()}
    desc = mask.preprocess(meta_gpu, S, batch_size=B, device="cuda", padding=am.cuda())
    assert desc.q_offset == -1 and torch.equal(desc.dense_mask().cpu(), dense)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    assert cm.api.api.select_engine(q, desc) == "fa4"  # never the native kernels
    check_attention_vs_reference(desc, q, k, v, "fa4", dense)
    if name == "causal":  # a score_mod reading q_idx: the padded tensor's positions
        from compilemask.dsl import score_mods

        t5 = score_mods.t5_bias(torch.randn(32, H, generator=g, device="cuda"), 128)
        check_attention_vs_reference(desc, q, k, v, "fa4", dense, score_mod=t5)
