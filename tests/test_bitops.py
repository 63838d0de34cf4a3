"""Integer bit operations in rules and mask_mods: ``& | ^`` of integers, ``~`` of an integer,
``>> <<`` by constants. Shifts are exact quotients and products (intervals where the rule is
linear in them); ``& | ^`` reading ``j`` keep the rule a predicate, reading ``i`` only they are
row terms the preprocess evaluates. Every compiled mask equals brute force element by element
(the torch reference and TileLang's C target), and mask_mods equal ``create_mask``."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm


def _bits_spec():
    def even_rows(i):
        return (i & 1) == 0

    def even_sees(i, j):
        return j <= i and ((i ^ j) & 3) != 0

    def odd_rows(i):
        return (i & 1) == 1

    def odd_sees(i, j):
        return (j >> 2) <= (i >> 2) and j < (i | w)  # noqa: F821 - a param

    return cm.MaskSpec("bits", params=["w"], regions=[
        cm.Region("even_rows", when=even_rows, visible=even_sees),
        cm.Region("odd_rows", when=odd_rows, visible=odd_sees)])


def _brute(i, j, w):
    if (i & 1) == 0:
        return j <= i and ((i ^ j) & 3) != 0
    return (j >> 2) <= (i >> 2) and j < (i | w)


W = (0, 5, 64, 2**30)  # the largest value metadata may take


@pytest.mark.parametrize("S", [1, 37, 129, 200])
def test_rules_with_bit_operations_equal_brute_force(S):
    mask = cm.compile_mask(_bits_spec())
    assert not mask.regions[1].fallback  # the shifts and the row's | w are intervals
    assert mask.regions[0].fallback  # (i ^ j) & 3 is a predicate over [0, i]
    meta = {"w": torch.tensor(W)}
    dense = mask.preprocess(meta, S, batch_size=len(W), backend="torch").dense_mask()
    want = torch.tensor([[[_brute(i, j, w) for j in range(S)] for i in range(S)] for w in W])
    assert torch.equal(dense, want)


def test_bit_operations_on_tilelang_c_target():
    """The generated preprocess evaluates guards and endpoints with bit operations as the torch
    reference does, bit for bit."""
    pytest.importorskip("tilelang")
    mask = cm.compile_mask(_bits_spec())
    meta = {"w": torch.tensor(W)}
    for S in (1, 37, 200):
        got = mask.preprocess(meta, S, batch_size=len(W), backend="tilelang")
        ref = mask.preprocess(meta, S, batch_size=len(W), backend="torch")
        for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap"):
            assert torch.equal(getattr(got, f), getattr(ref, f)), (S, f)


@pytest.mark.slow  # a program of its own
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_bit_operations_compile_for_cuda():
    from compilemask.codegen.preprocess import tilelang_kernel
    from compilemask.contract.descriptor import DEFAULT_BWD_TILES, DEFAULT_FWD_TILES

    mask = cm.compile_mask(_bits_spec())
    src = tilelang_kernel(mask, DEFAULT_FWD_TILES, DEFAULT_BWD_TILES, "cuda").get_kernel_source()
    assert "__global__" in src and ("&" in src and "|" in src)


def _mask_mods():
    shift = 3

    def strided_blocks(b, h, q_idx, kv_idx):  # blocks of 8 by shifts, causal
        return ((kv_idx >> shift) <= (q_idx >> shift)) & (kv_idx <= q_idx)

    def low_bits(b, h, q_idx, kv_idx):  # keys sharing the row's two low bits, or ~ of a key
        return ((q_idx & 3) == (kv_idx & 3)) | ((~kv_idx & 7) == 0)

    def xor_window(b, h, q_idx, kv_idx):
        return (q_idx ^ kv_idx) < 4

    def or_mask(b, h, q_idx, kv_idx):
        return (kv_idx | (q_idx << 1)) >= 2 * q_idx + 1

    return [strided_blocks, low_bits, xor_window, or_mask]


@pytest.mark.parametrize("S", [1, 100, 129, 257])
def test_mask_mods_with_bit_operations_equal_create_mask(S):
    for mm in _mask_mods():
        spec, meta = cm.from_mask_mod(mm, batch_size=2)
        mask = cm.compile_mask(spec)
        dense = mask.preprocess(meta, S, batch_size=2).dense_mask()
        assert torch.equal(dense, create_mask(mm, 2, 1, S, S, device="cpu")[:, 0]), mm.__name__
        if mm.__name__ == "strided_blocks":
            assert not mask.has_fallback  # shifts are quotients: exact intervals


def test_bit_operation_errors_name_the_construct():
    def by_variable(b, h, q_idx, kv_idx):
        return (q_idx >> kv_idx) == 0

    with pytest.raises(NotImplementedError, match=r"shift by j: a constant in \[0, 62\]"):
        cm.from_mask_mod(by_variable)

    def mixed(b, h, q_idx, kv_idx):
        return (q_idx < kv_idx) & 3

    with pytest.raises(NotImplementedError, match=r"'&' of a boolean and an integer"):
        cm.from_mask_mod(mixed)

    def too_far(i, j):
        return j <= (i << 63)

    spec = cm.MaskSpec("too_far", params=[], regions=[
        cm.Region("all", when=lambda i: i >= 0, visible=too_far)])
    with pytest.raises(NotImplementedError, match=r"shift by 63"):
        cm.compile_mask(spec)


def test_bit_operations_evaluate_like_python_on_negatives():
    """Two's complement, as Python and torch compute: a rule over i - j (negative above the
    diagonal) agrees with Python's evaluation at every pair."""
    def sees(i, j):
        return ((i - j) & 7) == 0 or ((i - j) ^ -2) > 3

    spec = cm.MaskSpec("negatives", params=[], regions=[
        cm.Region("all", when=lambda i: i >= 0, visible=sees)])
    S = 40
    dense = cm.compile_mask(spec).preprocess(None, S, batch_size=1).dense_mask()[0]
    for i, j in itertools.product(range(S), repeat=2):
        assert bool(dense[i, j]) == (((i - j) & 7) == 0 or ((i - j) ^ -2) > 3), (i, j)
