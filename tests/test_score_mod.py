"""FlexAttention score_mods on the reference engine: ALiBi, softcap 50, a T5 bucketed relative
bias table and per-head temperature, each with a compiled mask, equal an independent float64
computation (forward and gradients, into captured tensors too); a GPU call with a score_mod
raises unless the reference is asked for."""

from __future__ import annotations

import math

import pytest
import torch

import compilemask as cm
from compilemask import masks

B, H, D = 2, 4, 16


def _t5_bucket(rel, num_buckets=16, max_distance=64):
    """T5's bidirectional relative-position bucket of ``rel = kv_idx - q_idx`` (torch ops)."""
    half = num_buckets // 2
    ret = (rel > 0).long() * half
    n = rel.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp(min=1) / exact)
                     / math.log(max_distance / exact) * (half - exact)).long()
    return ret + torch.where(n < exact, n, torch.clamp(large, max=half - 1))


def _cases():
    g = torch.Generator().manual_seed(0)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
    table = torch.randn(16, H, generator=g, dtype=torch.float64)
    temp = torch.rand(H, generator=g, dtype=torch.float64) + 0.5

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 50 * torch.tanh(score / 50)

    def t5(score, b, h, q_idx, kv_idx):
        return score + table[_t5_bucket(kv_idx - q_idx), h]

    def temperature(score, b, h, q_idx, kv_idx):
        return score / temp[h]

    # the same transformation written independently, per score (python floats)
    def alibi_ref(s, b, h, i, j):
        return s + float(slopes[h]) * (j - i)

    def softcap_ref(s, b, h, i, j):
        return 50 * math.tanh(s / 50)

    def t5_ref(s, b, h, i, j):
        return s + float(table[int(_t5_bucket(torch.tensor(j - i))), h])

    def temperature_ref(s, b, h, i, j):
        return s / float(temp[h])

    return {
        "alibi_causal": (alibi, alibi_ref, masks.causal(), slopes),
        "softcap_sliding_window": (softcap, softcap_ref, masks.sliding_window(9), None),
        "t5_prefix_lm": (t5, t5_ref, masks.prefix_lm(), table),
        "temperature_hstu": (temperature, temperature_ref, masks.hstu(), temp),
    }


def _reference(q, k, v, dense, ref_mod, scale):
    """float64, score by score: softmax over the visible keys of the modified scores."""
    Bq, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    out = torch.zeros(Bq, Sq, Hq, v.shape[-1], dtype=torch.float64)
    for b in range(Bq):
        for h in range(Hq):
            s = (q[b, :, h] @ k[b, :, h].T) * scale
            mod = torch.tensor([[ref_mod(float(s[i, j]), b, h, i, j) for j in range(Sk)]
                                for i in range(Sq)], dtype=torch.float64)
            mod = mod.masked_fill(~dense[b], float("-inf"))
            for i in range(Sq):
                if dense[b, i].any():
                    out[b, i, h] = torch.softmax(mod[i], dim=-1) @ v[b, :, h]
    return out


@pytest.mark.parametrize("name", sorted(_cases()))
def test_score_mod_equals_float64_reference(name):
    fn, ref_mod, spec, _ = _cases()[name]
    S = 23
    mask = cm.compile_mask(spec)
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(1))
    desc = mask.preprocess(meta, S, batch_size=B)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    out = cm.attention(q, k, v, desc, score_mod=fn)
    want = _reference(q, k, v, desc.dense_mask(), ref_mod, D**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    # a row that sees nothing is 0, never NaN
    assert not out.isnan().any()


@pytest.mark.parametrize("name", sorted(_cases()))
def test_score_mod_gradients(name):
    """Gradients of q, k, v and of the captured table / slopes / temperatures match finite
    differences (float64)."""
    fn, _, spec, captured = _cases()[name]
    S = 9
    mask = cm.compile_mask(spec)
    meta = masks.random_meta(mask.spec, 1, S, torch.Generator().manual_seed(3))
    desc = mask.preprocess(meta, S, batch_size=1)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    inputs = (q, k, v)
    if captured is not None:
        captured.requires_grad_(True)
        inputs += (captured,)
    try:
        assert torch.autograd.gradcheck(
            lambda *xs: cm.attention(xs[0], xs[1], xs[2], desc, score_mod=fn), inputs)
        if captured is not None:
            cm.attention(q, k, v, desc, score_mod=fn).sum().backward()
            assert captured.grad is not None and captured.grad.abs().sum() > 0
    finally:
        if captured is not None:
            captured.requires_grad_(False)


def test_score_mod_with_lse_and_gqa():
    """GQA (the score_mod sees the query head) and the log-sum-exp of the modified scores."""
    S = 17
    desc = cm.compile_mask(masks.causal()).preprocess(None, S, batch_size=B)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, S, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.arange(H, dtype=torch.float64)

    def per_head(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    out, lse = cm.attention(q, k, v, desc, score_mod=per_head, return_lse=True)
    kk, vv = (t.repeat_interleave(H // 2, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * D**-0.5 + bias.view(1, H, 1, 1)
    s = s.masked_fill(~desc.dense_mask().unsqueeze(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv))


def test_score_mod_errors():
    desc = cm.compile_mask(masks.causal()).preprocess(None, 8, batch_size=1)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="score_mod must be a callable"):
        cm.attention(q, q, q, desc, score_mod=3)
    with pytest.raises(TypeError, match="score_mod must return a tensor"):
        cm.attention(q, q, q, desc, score_mod=lambda s, b, h, i, j: 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_score_mod_raises_unless_reference():
    desc = cm.compile_mask(masks.causal()).preprocess(None, 64, batch_size=1, device="cuda")
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)

    def softcap(score, b, h, q_idx, kv_idx):
        return 50 * torch.tanh(score / 50)

    with pytest.raises(NotImplementedError, match="score_mod runs on the reference engine"):
        cm.attention(q, q, q, desc, score_mod=softcap)
    out = cm.attention(q, q, q, desc, score_mod=softcap, backend="reference")
    assert out.shape == q.shape and not out.isnan().any()


def test_learnable_sink_equals_float64_reference():
    """A per-head sink logit in every row's softmax (gpt-oss): the output, the LSE (sink
    included) and the gradients into the sinks, against the softmax over [scores, sink]."""
    S = 13
    desc = cm.compile_mask(masks.sliding_window(5)).preprocess(None, S, batch_size=B)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    sink = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    out, lse = cm.attention(q, k, v, desc, learnable_sink=sink, return_lse=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
    s = s.masked_fill(~desc.dense_mask().unsqueeze(1), float("-inf"))
    full = torch.cat([s, sink.view(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    p = full.softmax(-1)[..., :-1]
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", p, v))
    torch.testing.assert_close(lse, torch.logsumexp(full, -1))
    assert torch.autograd.gradcheck(
        lambda *xs: cm.attention(*xs[:3], desc, learnable_sink=xs[3]), (q, k, v, sink))
    with pytest.raises(ValueError, match=r"learnable_sink must be \[H\]"):
        cm.attention(q, k, v, desc, learnable_sink=torch.zeros(H + 1, dtype=torch.float64))
