"""q/k and v of different head dims (MLA: 192 for q and k, 128 for v) on the reference engine,
forward and backward against a float64 recomputation, eager and compiled; the GPU engines'
refusals name the shapes."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask import masks


def _plain(q, k, v, dense, scale):
    """Softmax attention written out in float64, GQA by repeating k and v."""
    G = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(G, 1), vf.repeat_interleave(G, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~dense[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2)


@pytest.mark.parametrize("dims", [(192, 128), (64, 96), (16, 8)])
def test_v_head_dim_differs_on_the_reference(dims):
    D, Dv = dims
    B, S, H, Hkv = 2, 37, 4, 2
    mask = cm.compile_mask(masks.prefix_lm())
    desc = mask.preprocess({"prefix_len": torch.tensor([5, 40])}, S)
    g = torch.Generator().manual_seed(D)
    q = torch.randn(B, S, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(B, S, Hkv, Dv, generator=g, requires_grad=True)
    out = cm.attention(q, k, v, desc)
    assert out.shape == (B, S, H, Dv)
    want = _plain(q, k, v, desc.dense_mask(), D**-0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout.double())
    for name, a, b in zip("qkv", got, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"d{n}: {m}")
    compiled = torch.compile(lambda q, k, v: cm.attention(q, k, v, desc), backend="eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), out)


def test_head_dim_rules_name_the_shapes_and_what_runs_them():
    """Which engine runs which (q/k, v) head dims: the GPU engines one head dim, 64 or 128
    (their tile lists and FA4 calls); MLA's (192, 128) only the reference engine. Each refusal
    names both dims and the reference engine."""
    from compilemask.kernels.dispatch import head_dims_reason

    assert head_dims_reason("native", 128, 128) is None
    assert head_dims_reason("reference", 192, 128) is None
    assert head_dims_reason("fa4", 64, 64) is None
    assert "(64, 64), (128, 128)" in head_dims_reason("native", 192, 128)
    for engine in ("fa4", "cute"):
        why = head_dims_reason(engine, 192, 128)
        assert "v's head dim 128 differs from q and k's 192" in why and "reference" in why
    assert "64 or 128" in head_dims_reason("fa4", 96, 96)
    desc = cm.compile_mask(masks.causal()).preprocess(None, 8)
    q, k, v = torch.randn(1, 8, 2, 192), torch.randn(1, 8, 2, 192), torch.randn(1, 8, 2, 128)
    with pytest.raises(ValueError, match="same shape but for the head dim"):
        cm.attention(q, k, v[:, :7], desc)
