"""The ``"rows"`` mask_mod variant: FA4's sm90 forward reads the Interval Table a row at a time
(``kernels/fa4_rowmask.py``). CPU: the FA4 internals it relies on, the variant's key and
refusals, a fake compile; GPU: every interval mask, rectangular shapes and folded heads against
the float32 reference."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_fa4_engine import _gpu_case

import compilemask as cm
from compilemask import masks
from compilemask.codegen.cute_mask_mod import (
    ROWS_ATTR,
    forward_variant,
    mask_mod,
    mask_mod_source,
    mask_mod_variant,
)

from helpers import check_attention_vs_reference


def _fa4():
    return pytest.importorskip("flash_attn.cute.flash_fwd_sm90")


def test_fa4_internals_the_row_mask_relies_on():
    """Fails when the pinned flash-attn-4 changes what ``RowIntervalMask`` overrides or calls:
    the forward module's ``AttentionMask`` global (the class it builds its masks from), the
    ``apply_mask`` parameters, the R2P helpers and their 32-column chunks."""
    fwd_mod = _fa4()
    from flash_attn.cute import mask as fa4_mask

    from compilemask.kernels import fa4_lib, fa4_rowmask
    from compilemask.kernels.fa4_rowmask import RowIntervalMask

    assert fwd_mod.AttentionMask is fa4_mask.AttentionMask  # FA4's own outside our calls
    assert "AttentionMaskCls = partial(\n            AttentionMask," in inspect.getsource(
        fwd_mod.FlashAttentionForwardSm90)
    params = list(inspect.signature(fa4_mask.AttentionMask.apply_mask).parameters)
    assert params == list(inspect.signature(RowIntervalMask.apply_mask).parameters)
    assert fa4_mask.MASK_R2P_CHUNK_SIZE == 32
    for name in ("mask_r2p_lambda", "r2p_bitmask_above", "r2p_bitmask_below",
                 "sm90_col_to_r2p_idx"):
        assert callable(getattr(fa4_mask, name)), name
    with fa4_lib.patched(fa4_rowmask.PATCHES):
        assert fwd_mod.AttentionMask is RowIntervalMask
    assert fwd_mod.AttentionMask is fa4_mask.AttentionMask


def test_rows_variant_key_marker_and_refusals():
    """A kernel key of its own (code, not a comment, differs from "intervals"), the (K, heads)
    marker the forward reads, a refusal naming the regions that keep a predicate, and the
    backward's default in its place."""
    mask = cm.compile_mask(masks.shared_prompt_rm())
    rows, intervals = mask_mod(mask, "rows"), mask_mod(mask, "intervals")
    assert rows.__cute_hash__ != intervals.__cute_hash__
    assert getattr(rows, ROWS_ATTR) == (2, 1) and not hasattr(intervals, ROWS_ATTR)
    assert getattr(mask_mod(mask, "rows", heads=4), ROWS_ATTR) == (2, 4)
    assert "ROWS = (2, 1)" in mask_mod_source(mask, "rows")
    assert forward_variant(mask, "rows", backward=False) == "rows"
    assert forward_variant(mask, "rows", backward=True) == mask_mod_variant(mask)
    assert forward_variant(mask, None, backward=False) == "rows"  # the forward's default
    assert forward_variant(mask, None, backward=True) == mask_mod_variant(mask)
    assert forward_variant(mask, "rules", backward=True) == "rules"
    dilated = cm.compile_mask(masks.dilated_causal())  # fallback regions: their predicate
    assert forward_variant(dilated, None, backward=False) == "predicate"
    with pytest.raises(ValueError, match="'rows' mask_mod needs every region to be intervals"):
        mask_mod_source(dilated, "rows")
    assert cm.KernelOptions(mask_mod="rows").mask_mod == "rows"


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
def test_rows_forward_compiles_in_fa4():
    """FA4's sm90 forward with the row mask, and the backward it pairs with (the mask's default
    per-score test), compile for a K = 2 mask (fake tensors; no GPU)."""
    from test_fa4_engine import _compiles_in_fa4

    mask = cm.compile_mask(masks.shared_prompt_rm())
    _compiles_in_fa4(mask, masks.random_meta(mask.spec, 2, 300, torch.Generator().manual_seed(0)),
                     128, variant="rows")


ROWS = cm.KernelOptions(mask_mod="rows")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(masks.EXAMPLES))
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_rows_vs_float32_reference(name, D):
    """Every example mask without fallback regions (random metadata with empty segments and
    rows that see nothing; 1000 rows, not a multiple of the tile), forward and backward."""
    if cm.compile_mask(masks.EXAMPLES[name]()).has_fallback:
        pytest.skip("fallback regions keep a predicate: no row mask")
    _, desc, q, k, v = _gpu_case(name, 2, 1000, 4, 2, D, seed=13)
    check_attention_vs_reference(desc, q, k, v, "fa4", desc.dense_mask(), options=ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hstu", "clear", "causal", "tree_verify"])
def test_gpu_rows_rectangular_and_mha(name):
    # Sq != Sk: the last kv tile's seqlen limit clips the row's intervals
    _, desc, q, k, v = _gpu_case(name, 1, 700, 2, 2, 128, seed=3, Sk=900)
    check_attention_vs_reference(desc, q, k, v, "fa4", desc.dense_mask(), options=ROWS)


@pytest.mark.gpu
def test_gpu_rows_folded_heads():
    """Per-head windows folded into one launch: the row mask reads row ``b * H + h``."""
    H, B, S = 4, 2, 1000
    w = torch.tensor([16, 64, 300, 1000])

    def mm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w[h])

    specs, metas = cm.from_mask_mod_heads(mm, num_heads=H, batch_size=B)
    groups = cm.preprocess_heads([cm.compile_mask(s) for s in specs], metas, S, batch_size=B,
                                 fold=True, device="cuda")
    assert groups.folded
    q = torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_attention_vs_reference(groups, q, k, v, "fa4", groups.dense_mask(), options=ROWS)


def test_row_keep_mask_equals_the_interval_test():
    """The row mask's arithmetic (kernels/fa4_rowmask.py) modelled on the CPU: a thread of FA4's
    sm90 forward holds columns ``offset + 8 * k + {0, 1}`` of a 128-column tile (offset 0, 2, 4
    or 6); the slot clipped to the tile relative to the offset, turned into R2P element indices
    (FA4's ``sm90_col_to_r2p_idx``) and 32-bit masks (``r2p_bitmask_below / above``, shifts of
    32 or more give 0), keeps exactly the columns with ``start <= kv_idx < start + len``, for
    slots before, across, inside and past the tile and a seqlen limit inside it."""
    tile_n, chunk = 128, 32

    def idx(col):  # sm90_col_to_r2p_idx, for 0 <= col <= tile_n
        return col // 8 * 2 + min(col % 8, 2)

    def shift(val, n, left):
        return 0 if n >= 32 else ((val << n) if left else (val >> n)) & 0xFFFFFFFF

    def keep_bits(lo_r, hi_r, s):
        below = shift(0xFFFFFFFF, max((s + 1) * chunk - hi_r, 0), left=False)
        above = shift(0xFFFFFFFF, max(lo_r - s * chunk, 0), left=True)
        return below & above

    n_block, seqlen_k = 3, 3 * 128 + 77
    edges = [-500, -1, 0, 1, 7, 8, 9, 63, 64, 100, 127, 128, 129, 300]
    base_tile = n_block * tile_n
    for offset in (0, 2, 4, 6):
        cols = [offset + 8 * (e // 2) + e % 2 for e in range(tile_n // 4)]
        col_base = base_tile + offset
        for mask_seqlen in (False, True):
            for a in edges:
                for length in (0, 1, 2, 7, 9, 64, 200, 1000):
                    start = max(base_tile + a, 0)  # the contract: 0 <= start, len < 2^31
                    lo = start - col_base
                    hi = lo + length
                    if mask_seqlen:
                        hi = min(hi, seqlen_k - col_base)
                    lo_r = idx(min(max(lo, 0), tile_n))
                    hi_r = idx(min(max(hi, 0), tile_n))
                    for e, c in enumerate(cols):
                        kv = base_tile + c
                        want = start <= kv < start + length and (not mask_seqlen or kv < seqlen_k)
                        got = bool(keep_bits(lo_r, hi_r, e // chunk) >> (e % chunk) & 1)
                        assert got == want, (offset, mask_seqlen, start, length, kv)
