"""cm.attention's reference path: vs SDPA with the dense mask, empty rows, gradients."""

import torch

import compilemask as cm
from compilemask import masks


def _meta(B):
    return {"ctx_end": torch.tensor([5, 0][:B]), "hist_end": torch.tensor([40, 30][:B]),
            "seq_end": torch.tensor([70, 50][:B]), "group_size": torch.tensor([7, 4][:B])}


def test_matches_sdpa_and_empty_rows_are_zero():
    torch.manual_seed(0)
    mask = cm.compile_mask(masks.hstu())
    B, S, H, Hkv, D = 2, 80, 4, 2, 32
    desc = mask.preprocess(_meta(B), seqlen_q=S)
    q = torch.randn(B, S, H, D, dtype=torch.float64)
    k, v = (torch.randn(B, S, Hkv, D, dtype=torch.float64) for _ in range(2))
    out, lse = cm.attention(q, k, v, desc, return_lse=True, softmax_scale=0.3)
    dense = mask.reference_mask(_meta(B), seqlen_q=S)
    kr, vr = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), attn_mask=dense.unsqueeze(1),
        scale=0.3).transpose(1, 2)
    seen = dense.any(-1)  # rows past seq_end see nothing
    assert (~seen).any() and seen.any()
    torch.testing.assert_close(out[seen], ref[seen], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    assert not torch.isnan(out).any()
    assert torch.isinf(lse.transpose(1, 2)[~seen]).all()


def test_gradients_flow_and_are_finite():
    torch.manual_seed(1)
    mask = cm.compile_mask(masks.hstu())
    B, S, H, D = 2, 64, 2, 16
    desc = mask.preprocess(_meta(B), seqlen_q=S)
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = cm.attention(q, k, v, desc)
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    dense = desc.dense_mask()
    empty = ~dense.any(-1)
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))
    # float64 gradcheck on a small case (rows past seq_end included)
    small = mask.preprocess({"ctx_end": 2, "hist_end": 6, "seq_end": 10, "group_size": 3},
                            seqlen_q=12)
    args = [torch.randn(1, 12, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    assert torch.autograd.gradcheck(lambda q_, k_, v_: cm.attention(q_, k_, v_, small), args)


def test_bf16_error_within_twice_torch_bf16_error():
    torch.manual_seed(2)
    mask = cm.compile_mask(masks.causal())
    B, S, H, D = 1, 128, 2, 64
    desc = mask.preprocess({}, seqlen_q=S)
    q, k, v = (torch.randn(B, S, H, D) for _ in range(3))
    dense = desc.dense_mask()

    def sdpa(q_, k_, v_):
        return torch.nn.functional.scaled_dot_product_attention(
            q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
            attn_mask=dense.unsqueeze(1)).transpose(1, 2)

    ref = sdpa(q.double(), k.double(), v.double())
    bf = [t.bfloat16() for t in (q, k, v)]
    torch_err = (sdpa(*bf).double() - ref).abs().max()
    ours = (cm.attention(*bf, desc).double() - ref).abs().max()
    assert ours <= 2 * torch_err


def test_reference_path_is_announced_once(caplog):
    from compilemask.api import api

    api._SAID.clear()
    mask = cm.compile_mask(masks.causal())
    desc = mask.preprocess({}, seqlen_q=8)
    q = torch.randn(1, 8, 1, 16)
    with caplog.at_level("WARNING", logger="compilemask"):
        cm.attention(q, q, q, desc)
        cm.attention(q, q, q, desc)
    said = [r for r in caplog.records if "dense reference path" in r.getMessage()]
    assert len(said) == 1
