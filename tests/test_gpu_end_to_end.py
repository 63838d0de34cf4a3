"""The product path on a GPU: TileLang preprocess, CuTe forward and backward via cm.attention."""

import pytest
import torch

import compilemask as cm
from compilemask import masks

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("name", ["hstu", "shared_prompt_rm", "clear"])
def test_attention_forward_backward_vs_float32_reference(name):
    spec = masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    B, S, H, Hkv, D = 2, 1000, 4, 2, 128
    gen = torch.Generator().manual_seed(7)
    meta = {k: v.cuda() for k, v in masks.random_meta(spec, B, S, gen).items()}
    desc = mask.preprocess(meta, seqlen_q=S, seqlen_k=S, batch_size=B)  # TileLang on CUDA
    ref_desc = mask.preprocess(meta, seqlen_q=S, seqlen_k=S, batch_size=B, backend="torch")
    assert torch.equal(desc.intervals, ref_desc.intervals)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    do = torch.randn_like(q)
    out = cm.attention(q, k, v, desc)
    out.backward(do)
    dense = desc.dense_mask()
    from compilemask.reference import attention_reference

    def ref(dtype):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        o = attention_reference(qq, kk, vv, dense)
        o.backward(do.to(dtype))
        return o, qq.grad, kk.grad, vv.grad

    def torch_bf16_attention():
        """PyTorch's own bf16 arithmetic (bf16 matmuls, softmax), empty rows made finite."""
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        kr, vr = (t.repeat_interleave(H // Hkv, dim=2).transpose(1, 2) for t in (kk, vv))
        s = torch.matmul(qq.transpose(1, 2), kr.transpose(-1, -2)) * D**-0.5
        m = dense.unsqueeze(1)
        empty_row = ~m.any(-1, keepdim=True)
        s = torch.where(m, s, float("-inf"))
        s = torch.where(empty_row, torch.zeros_like(s), s)
        p = torch.softmax(s, dim=-1) * (~empty_row)
        o = torch.matmul(p, vr).transpose(1, 2)
        o.backward(do)
        return o, qq.grad, kk.grad, vv.grad

    exact = ref(torch.float32)
    torch_bf16 = torch_bf16_attention()
    ours = (out, q.grad, k.grad, v.grad)
    for name_, o, e, t in zip(("out", "dq", "dk", "dv"), ours, exact, torch_bf16):
        assert torch.isfinite(o).all(), name_
        assert _rel(o, e) <= 2 * _rel(t, e) + 1e-4, (name_, _rel(o, e), _rel(t, e))
    empty = ~dense.any(-1)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
