"""The compilemask::attention_fwd / attention_bwd custom ops (CPU reference implementations):
gradients vs autograd through the dense reference, torch.compile, activation checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import compilemask as cm
from compilemask import masks
from compilemask.compiler.reference import attention_reference
from compilemask.kernels.autograd import attention_op


def _desc(spec, B, S, seed=0):
    mask = cm.compile_mask(spec)
    meta = masks.random_meta(spec, B, S, gen=torch.Generator().manual_seed(seed))
    return mask.preprocess(meta, seqlen_q=S, backend="torch")


def _qkv(B, S, H, Hkv, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


def _grads(fn, q, k, v, seed=1, with_lse=False):
    for t in (q, k, v):
        t.grad = None
    res = fn(q, k, v)
    g = torch.Generator().manual_seed(seed)
    if with_lse:
        out, lse = res
        w = torch.randn(out.shape, generator=g, dtype=out.dtype)
        wl = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
        loss = (out * w).sum() + torch.where(torch.isfinite(lse), lse * wl, 0.0).sum()
    else:
        out = res
        loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    loss.backward()
    return out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


@pytest.mark.parametrize("name,H,Hkv", [("causal", 2, 2), ("hstu", 4, 2),
                                        ("shared_prompt_rm", 3, 1), ("dilated_causal", 2, 1)])
def test_op_matches_reference_autograd(name, H, Hkv):
    spec = {"causal": masks.causal, "hstu": masks.hstu, "shared_prompt_rm": masks.shared_prompt_rm,
            "dilated_causal": masks.dilated_causal}[name]()
    B, S, D = 2, 37, 16
    desc = _desc(spec, B, S)
    dense = desc.dense_mask()
    q, k, v = _qkv(B, S, H, Hkv, D, dtype=torch.float64)
    ref = _grads(lambda q, k, v: attention_reference(q, k, v, dense, softmax_scale=0.3), q, k, v)
    got = _grads(lambda q, k, v: attention_op(q, k, v, desc, 0.3), q, k, v)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    empty = ~dense.any(-1)  # rows that see nothing: zero output and zero dq
    if empty.any():
        assert torch.equal(got[1][empty], torch.zeros_like(got[1][empty]))
    assert all(torch.isfinite(t).all() for t in got)


def test_op_lse_gradient():
    spec = masks.hstu()
    B, S, H, D = 2, 29, 2, 8
    desc = _desc(spec, B, S, seed=3)
    dense = desc.dense_mask()
    q, k, v = _qkv(B, S, H, H, D, dtype=torch.float64)
    ref = _grads(lambda q, k, v: attention_reference(q, k, v, dense, 0.5, return_lse=True), q, k,
                 v, with_lse=True)
    got = _grads(lambda q, k, v: attention_op(q, k, v, desc, 0.5, return_lse=True), q, k, v,
                 with_lse=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_gradcheck_float64():
    spec = masks.hstu()
    desc = _desc(spec, 1, 9, seed=5)
    q, k, v = _qkv(1, 9, 2, 1, 4, dtype=torch.float64, seed=2)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_op(q, k, v, desc, 0.7), (q, k, v))


class _Block(torch.nn.Module):
    def __init__(self, desc, D=16, H=4, Hkv=2, use_ckpt=False):
        super().__init__()
        self.desc, self.H, self.Hkv, self.D, self.use_ckpt = desc, H, Hkv, D, use_ckpt
        self.qkv = torch.nn.Linear(D * 2, (H + 2 * Hkv) * D, dtype=torch.float64)
        self.o = torch.nn.Linear(H * D, D * 2, dtype=torch.float64)

    def _attn(self, x):
        B, S, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv.split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], -1)
        q = q.view(B, S, self.H, self.D)
        k = k.view(B, S, self.Hkv, self.D)
        v = v.view(B, S, self.Hkv, self.D)
        return self.o(attention_op(q, k, v, self.desc).reshape(B, S, -1))

    def forward(self, x):
        if self.use_ckpt:
            return x + checkpoint(self._attn, x, use_reentrant=False)
        return x + self._attn(x)


def _module_grads(model, x):
    model.zero_grad()
    x = x.clone().requires_grad_()
    model(x).square().mean().backward()
    return [x.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile_same_gradients(backend):
    torch._dynamo.reset()
    desc = _desc(masks.hstu(), 2, 33, seed=7)
    torch.manual_seed(0)
    model = _Block(desc)
    x = torch.randn(2, 33, 32, dtype=torch.float64)
    eager = _module_grads(model, x)
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: no graph break
    got = _module_grads(compiled, x)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_checkpoint_recomputes():
    desc = _desc(masks.shared_prompt_rm(), 2, 40, seed=11)
    torch.manual_seed(0)
    model = _Block(desc)
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    plain = _module_grads(model, x)
    model.use_ckpt = True
    calls = []
    orig = torch.ops.compilemask.attention_fwd.default

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is orig:
                calls.append(1)
            return func(*args, **(kwargs or {}))

    with Count():
        ck = _module_grads(model, x)
    assert len(calls) == 2  # the forward ran again during backward
    for a, b in zip(ck, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fake_shapes_and_opcheck():
    desc = _desc(masks.hstu(), 2, 21, seed=4)
    q, k, v = _qkv(2, 21, 4, 2, 8)
    out, lse = attention_op(q, k, v, desc, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 21) and lse.dtype == torch.float32
    from compilemask.contract.descriptor import DescriptorArgs
    from compilemask.kernels.autograd import register_mask
    from compilemask.kernels.contract import OpSettings, OpSlots, op_args

    def settings(mask, heads):
        return OpSettings(register_mask(mask), 0.25, False, "reference", "", "", heads)

    args = (q.detach(), k.detach(), v.detach(),
            *op_args(DescriptorArgs.of(desc), OpSlots(), settings(desc.mask, 1)))
    torch.library.opcheck(torch.ops.compilemask.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    # folded heads: a descriptor of batch x heads sequences, the head count an op argument
    import compilemask as cm

    w = torch.tensor([1, 3, 5, 9])

    def mm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w[h])

    specs, metas = cm.from_mask_mod_heads(mm, num_heads=4, batch_size=2)
    folded = cm.preprocess_heads([cm.compile_mask(s) for s in specs], metas, 21, batch_size=2,
                                 fold=True).groups[0][0]
    args = (q.detach(), k.detach(), v.detach(),
            *op_args(DescriptorArgs.of(folded), OpSlots(), settings(folded.mask, 4)))
    torch.library.opcheck(torch.ops.compilemask.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_learnable_sink_through_the_op():
    """The ops carry a learnable sink (the fa4 and native engines' path): on the reference
    implementation the output, LSE and every gradient, the sink's too, equal the dense
    reference's autograd (float64), with the LSE's gradient and on rows that see nothing."""
    from compilemask.compiler.reference import attention_reference

    desc = _desc(masks.hstu(), 2, 21, seed=4)
    q, k, v = (t.double().detach().requires_grad_() for t in _qkv(2, 21, 4, 2, 8))
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse = attention_op(q, k, v, desc, return_lse=True, engine="reference", sink=sink)
    ref_out, ref_lse = attention_reference(q, k, v, desc.dense_mask(), return_lse=True,
                                           learnable_sink=sink)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    g = torch.Generator().manual_seed(1)
    do, dl = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(
        lse.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * do).sum() + (lse * dl).sum(), (q, k, v, sink))
    want = torch.autograd.grad((ref_out * do).sum() + (ref_lse * dl).sum(), (q, k, v, sink))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_calls_without_gradients_skip_the_op_with_the_same_result(monkeypatch):
    """An eager call that needs no gradient runs the op's body directly (no dispatch: a decode
    step is host-bound); one that needs them, or runs under a dispatch mode, goes through the
    op. Both give the same bits."""
    import compilemask.kernels.autograd as ag

    desc = _desc(masks.hstu(), 2, 37)
    q, k, v = _qkv(2, 37, 4, 2, 8)
    calls = []
    real = torch.ops.compilemask.attention_fwd

    class Spy:
        def __call__(self, *a):
            calls.append(1)
            return real(*a)

        def __getattr__(self, name):  # torch's dispatch looks ``.default`` up by the op's name
            return getattr(real, name)

    monkeypatch.setattr(torch.ops.compilemask, "attention_fwd", Spy())
    with torch.no_grad():
        direct = ag.attention_op(q, k, v, desc, engine="reference", return_lse=True)
    assert not calls
    through = ag.attention_op(q, k, v, desc, engine="reference", return_lse=True)
    assert calls and through[0].requires_grad
    for a, b in zip(direct, through):
        assert torch.equal(a, b.detach())
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls.clear()
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        ag.attention_op(q, k, v, desc, engine="reference")
    assert calls
