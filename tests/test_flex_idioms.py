"""FlexAttention idioms as published code writes them convert, and equal FlexAttention's own
dense mask (``create_mask``) element by element: BD3-LM's block-diffusion mask_mod (a boolean
compared with ``==``, passed as a ``functools.partial``), per-head block sizes, NumPy scalar
constants."""

import functools

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm


def _equal_create_mask(mask_mod, S, B=1):
    spec, meta = cm.from_mask_mod(mask_mod)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=B)
    want = create_mask(mask_mod, B, 1, S, S, device="cpu")[:, 0]
    assert torch.equal(desc.dense_mask(), want)
    return spec


# BD3-LM's mask_mod (kuleshov-group/bd3lms, models/dit.py), as its model calls it: a partial
def block_diff_mask(b, h, q_idx, kv_idx, block_size=None, n=None):
    x0_flag_q = (q_idx >= n)
    x0_flag_kv = (kv_idx >= n)
    block_q = torch.where(x0_flag_q == 1, (q_idx - n) // block_size, q_idx // block_size)
    block_kv = torch.where(x0_flag_kv == 1, (kv_idx - n) // block_size, kv_idx // block_size)
    block_diagonal = (block_q == block_kv) & (x0_flag_q == x0_flag_kv)
    offset_block_causal = ((block_q > block_kv) & (x0_flag_kv == 1) & (x0_flag_q == 0))
    block_causal = (block_q >= block_kv) & (x0_flag_kv == 1) & (x0_flag_q == 1)
    return block_diagonal | offset_block_causal | block_causal


@pytest.mark.parametrize("block_size,n", [(4, 32), (8, 32), (1, 16)])
def test_bd3lm_partial_converts_and_equals_create_mask(block_size, n):
    mm = functools.partial(block_diff_mask, block_size=block_size, n=n)
    spec = _equal_create_mask(mm, 2 * n)
    assert "block_diff_mask" in spec.name
    # a changed bound value converts again (the partial's arguments are part of the key)
    other = functools.partial(block_diff_mask, block_size=block_size * 2, n=n)
    _equal_create_mask(other, 2 * n)


def test_boolean_compared_with_integers():
    def mm(b, h, q_idx, kv_idx):
        big = kv_idx >= 5
        return ((big == 0) & (q_idx >= kv_idx)) | ((big > 0) & (big != 2)
                                                   & ((q_idx < 9) >= big))
    _equal_create_mask(mm, 16)


def test_partial_signature_checked():
    with pytest.raises(TypeError, match="functools.partial"):
        cm.from_mask_mod(functools.partial(block_diff_mask, 0, 0, block_size=2, n=4))


def test_per_head_block_sizes_convert_per_head():
    def per_head_blocks(b, h, q_idx, kv_idx):
        return (q_idx // (h + 1) == kv_idx // (h + 1)) & (q_idx >= kv_idx)

    H, S = 4, 24
    # a mask_mod reading h: refused by from_mask_mod with the rewrite ...
    with pytest.raises(NotImplementedError, match=r"test_flex_idioms.py:\d+.*from_mask_mod_heads"):
        cm.from_mask_mod(per_head_blocks)
    # ... which converts it exactly, one spec per head
    specs, metas = cm.from_mask_mod_heads(per_head_blocks, num_heads=H)
    groups = cm.preprocess_heads([cm.compile_mask(s) for s in specs], metas, S, batch_size=1)
    want = create_mask(per_head_blocks, 1, H, S, S, device="cpu")
    for h in range(H):
        desc = cm.compile_mask(specs[h]).preprocess(metas[h], seqlen_q=S, batch_size=1)
        assert torch.equal(desc.dense_mask(), want[:, h])
    assert groups.num_heads == H


@pytest.mark.parametrize("const", [np.int64(6), np.int32(6), np.uint8(6)])
def test_numpy_integer_constants(const):
    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < const) & (q_idx >= kv_idx)
    _equal_create_mask(window, 20)


def test_numpy_bool_constant():
    flag = np.bool_(True)

    def mm(b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, flag, kv_idx < 3)
    spec, meta = cm.from_mask_mod(mm)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=8, batch_size=1)
    i, j = torch.arange(8).view(8, 1), torch.arange(8).view(1, 8)
    assert torch.equal(desc.dense_mask()[0], (i >= j) | (j < 3))


def test_numpy_scalar_in_a_score_mod():
    scale = np.int64(3)
    half = np.float32(0.5)

    def sm(score, b, h, q_idx, kv_idx):
        return score * half + (kv_idx - q_idx) * scale
    compiled, _ = cm.compile_score_mod(sm)
    s = torch.randn(1, 1, 5, 5)
    i, j = torch.arange(5).view(1, 1, 5, 1), torch.arange(5).view(1, 1, 1, 5)
    got = compiled.evaluate(s, torch.zeros(()), torch.zeros(()), i, j, [])
    torch.testing.assert_close(got, sm(s, 0, 0, i, j), rtol=0, atol=0)
