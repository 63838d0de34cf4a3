"""q/k and v of different head dims (MLA: 192 for q and k, 128 for v) on the reference engine,
forward and backward against a float64 recomputation, eager and compiled; MLA's shape through
FA4's own kernels on the native engine; the other engines' refusals name the shapes."""

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
    """Which engine runs which (q/k, v) head dims: the native engine FA4's own kernels at
    (64, 64), (128, 128) and MLA's (192, 128) with a kv head per query head (FA4's sm90 GQA
    backward needs one head dim); the fa4 and cute engines one head dim (their tile lists and
    kernels). Each refusal names the dims and what runs them."""
    from compilemask.kernels.dispatch import head_dims_reason

    assert head_dims_reason("native", 192, 128) is None
    assert head_dims_reason("native", 128, 128, gqa=True) is None
    assert head_dims_reason("reference", 16, 8, gqa=True) is None
    assert head_dims_reason("fa4", 64, 64) is None
    assert "(192, 128)" in head_dims_reason("native", 96, 64)
    assert "GQA backward needs one head dim" in head_dims_reason("native", 192, 128, gqa=True)
    for engine in ("fa4", "cute"):
        why = head_dims_reason(engine, 192, 128)
        assert "v's head dim 128 differs from q and k's 192" in why and "native" in why
    assert "64 or 128" in head_dims_reason("fa4", 96, 96)
    desc = cm.compile_mask(masks.causal()).preprocess(None, 8)
    q, k, v = torch.randn(1, 8, 2, 192), torch.randn(1, 8, 2, 192), torch.randn(1, 8, 2, 128)
    with pytest.raises(ValueError, match="same shape but for the head dim"):
        cm.attention(q, k, v[:, :7], desc)


@pytest.mark.parametrize("name", ["causal", "sliding_window"])
def test_mla_head_dims_compile_in_fa4_native_kernels(name):
    """(192, 128) with a kv head per query head: FA4's own sm90 forward and backward compile
    through the native engine's calls (causal, a window), v's head dim kept."""
    pytest.importorskip("flash_attn.cute")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask.kernels import fa4

    from helpers import fake_on_cuda

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    B, S = 2, 300
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(0)) or None
    desc = mask.preprocess(meta, S, batch_size=B)
    assert desc.native is not None
    with FakeTensorMode():
        q = torch.empty(B, S, 4, 192, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(B, S, 4, 128, dtype=torch.bfloat16, device="cuda")
        fdesc, _, _ = fake_on_cuda(desc, {})
        out, lse = fa4.fwd(q, q, v, fdesc, 192**-0.5, "native")
        assert out.shape == (B, S, 4, 128)
        dq, dk, dv = fa4.bwd(out, q, q, v, out, lse, fdesc, 192**-0.5, "native")
        assert (dq.shape, dv.shape) == (q.shape, v.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "sliding_window", "packed_documents"])
def test_gpu_mla_head_dims_on_the_native_engine(name):
    """MLA's head dims (q and k 192, v 128, a kv head per query head) on FA4's own causal /
    window / varlen kernels through the native engine, forward and backward within twice
    PyTorch's bf16 error; with GQA the native engine refuses them, naming FA4's backward."""
    from helpers import check_attention_vs_reference

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    B, S, H = 2, 1000, 4
    meta = {k: v.cuda() for k, v in masks.random_meta(
        mask.spec, B, S, torch.Generator().manual_seed(1)).items()} or None
    desc = mask.preprocess(meta, S, batch_size=B, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, S, H, 192, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    v = torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    assert cm.api.api.select_engine(q, desc, head_dim_v=128, kv_heads=H) == "native"
    check_attention_vs_reference(desc, q, k, v, "native", desc.dense_mask())
    with pytest.raises(NotImplementedError, match="GQA backward needs one head dim"):
        cm.attention(q, k[:, :, :2], v[:, :, :2], desc, backend="native")
