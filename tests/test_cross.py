"""Cross-attention shapes: queries and keys of different sequences, each per-token array at its
own length (key-indexed ``seqlen_k``, query-indexed ``seqlen_q``), against the rules evaluated at
every (i, j)."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask.api.cross import cross_descriptor
from compilemask.dsl import MaskSpec, Region
from compilemask.dsl.flex import from_mask_mod


def _images(B, Sq, Sk, gen):
    """Flamingo's layout: key j belongs to image k_img[j] (1..; an image's keys contiguous),
    text token i attends the last image before it, q_img[i] (0: none yet)."""
    n_img = 3
    k_img = torch.sort(torch.randint(1, n_img + 1, (B, Sk), generator=gen), dim=1).values
    q_img = torch.sort(torch.randint(0, n_img + 1, (B, Sq), generator=gen), dim=1).values
    return q_img, k_img


@pytest.mark.parametrize("Sq,Sk", [(37, 20), (130, 129), (20, 20), (20, 37), (1, 150),
                                   (129, 300)])
def test_flamingo_mask_mod_at_its_own_lengths(Sq, Sk):
    """A FlexAttention mask_mod reading a [B, Sq] query array and a [B, Sk] key array converts
    and preprocesses with the arrays as captured (no padding by hand), equal to the mask_mod
    at every (b, q_idx, kv_idx), and attention equals the reference on that dense mask."""
    B = 2
    q_img, k_img = _images(B, Sq, Sk, torch.Generator().manual_seed(Sq))

    def flamingo(b, h, q_idx, kv_idx):
        return q_img[b, q_idx] == k_img[b, kv_idx]

    spec, meta = from_mask_mod(flamingo)
    assert meta["q_img"].shape == (B, Sq) and meta["k_img"].shape == (B, Sk)
    desc = cross_descriptor(cm.compile_mask(spec), meta, Sq, Sk)
    b, i, j = (torch.arange(n).view(*s) for n, s in ((B, (B, 1, 1)), (Sq, (1, Sq, 1)),
                                                       (Sk, (1, 1, Sk))))
    want = flamingo(b, 0, i, j)
    assert want.any() and not want.all()
    assert torch.equal(desc.dense_mask(), want)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Sq, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Sk, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    from compilemask.compiler.reference import attention_reference

    torch.testing.assert_close(cm.attention(q, k, v, desc), attention_reference(q, k, v, want))
    if Sq < Sk:  # rows 0.. of the keys' sequence: arrays at the keys read there
        assert desc.q_offset == 0 and desc.positions is not None


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,Sk", [(300, 1000), (1000, 300)])
def test_gpu_flamingo_cross_attention_vs_float32_reference(Sq, Sk):
    """Text queries attending image keys of another length (more keys than queries, and
    fewer) on the fa4 engine, forward and backward, within twice PyTorch's bf16 error."""
    from helpers import check_attention_vs_reference

    B = 2
    q_img, k_img = _images(B, Sq, Sk, torch.Generator().manual_seed(7))

    def flamingo(b, h, q_idx, kv_idx):
        return q_img[b, q_idx] == k_img[b, kv_idx]

    spec, meta = from_mask_mod(flamingo)
    desc = cross_descriptor(cm.compile_mask(spec), {k: v.cuda() for k, v in meta.items()},
                            Sq, Sk)
    b, i, j = (torch.arange(n).view(*s) for n, s in ((B, (B, 1, 1)), (Sq, (1, Sq, 1)),
                                                       (Sk, (1, 1, Sk))))
    want = flamingo(b, 0, i, j)
    assert torch.equal(desc.dense_mask().cpu(), want)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Sq, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Sk, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    check_attention_vs_reference(desc, q, k, v, "fa4", want)


# a key is visible once the text reaches its time (audio frames to text, say): read at j
TIMED = MaskSpec("timed", params=["q_t", "k_t"], regions=[
    Region("all", when=lambda i: True, visible=lambda i, j: k_t[j] <= q_t[i])])  # noqa: F821
# the keys of row i's image as a range: arrays read at i only
RANGES = MaskSpec("image_ranges", params=["img_start", "img_end"], regions=[
    Region("all", when=lambda i: True,
           visible=lambda i, j: (img_start[i] <= j) & (j < img_end[i]))])  # noqa: F821


@pytest.mark.parametrize("Sq,Sk", [(40, 17), (64, 64), (33, 1), (17, 40), (1, 130)])
def test_dsl_key_and_query_arrays_at_their_lengths(Sq, Sk):
    B = 3
    g = torch.Generator().manual_seed(Sk)
    q_t = torch.randint(0, 50, (B, Sq), generator=g)
    k_t = torch.randint(0, 50, (B, Sk), generator=g)
    mask = cm.compile_mask(TIMED)
    assert mask.key_indexed_arrays == ("k_t",)
    desc = cross_descriptor(mask, {"q_t": q_t, "k_t": k_t}, Sq, Sk)
    assert torch.equal(desc.dense_mask(), k_t[:, None, :] <= q_t[:, :, None])
    # longer arrays (every position a stream reaches) are read at their first entries
    longer = {"q_t": torch.cat([q_t, q_t], 1), "k_t": torch.cat([k_t, k_t], 1)}
    assert torch.equal(cross_descriptor(mask, longer, Sq, Sk).dense_mask(), desc.dense_mask())


@pytest.mark.parametrize("Sq,Sk", [(12, 70), (70, 12)])
def test_key_ranges_per_row_at_any_lengths(Sq, Sk):
    """Flamingo written as each row's range of image keys reads arrays at i only: it runs with
    fewer queries than keys too, equal to the rule at every (i, j)."""
    B = 2
    q_img, k_img = _images(B, Sq, Sk, torch.Generator().manual_seed(3))
    first = torch.stack([torch.searchsorted(k_img[b], q_img[b]) for b in range(B)])
    end = torch.stack([torch.searchsorted(k_img[b], q_img[b], right=True) for b in range(B)])
    desc = cross_descriptor(cm.compile_mask(RANGES), {"img_start": first, "img_end": end}, Sq, Sk)
    assert torch.equal(desc.dense_mask(), q_img[:, :, None] == k_img[:, None, :])


def test_refusals_name_the_argument():
    mask = cm.compile_mask(TIMED)
    q_t, k_t = torch.zeros(1, 10, dtype=torch.long), torch.zeros(1, 30, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'k_t' is read at the key j \(seqlen_k = 8\) and "
                                         "covers 5 tokens"):
        cross_descriptor(mask, {"q_t": torch.zeros(1, 12, dtype=torch.long),
                                "k_t": k_t[:, :5]}, 12, 8)
    with pytest.raises(ValueError, match=r"'q_t' is read at the row i \(seqlen_q = 12\)"):
        cross_descriptor(mask, {"q_t": q_t, "k_t": k_t}, 12, 8)
