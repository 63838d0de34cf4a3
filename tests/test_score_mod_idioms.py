"""FlexAttention score_mod idioms as published code writes them: T5's relative-position bucket
exactly as transformers computes it (every bucket of a full grid), ``torch.where(cond, score,
-inf)`` (a masked score: its condition joins the mask), and the reference engine calling a
score_mod per element where the broadcast call cannot (FlexAttention's own semantics)."""

import math
import warnings

import pytest
import torch

import compilemask as cm
from compilemask.dsl import score_mods

T5Attention = pytest.importorskip("transformers.models.t5.modeling_t5").T5Attention


def _index_grid(H, Sq, Sk):
    return (torch.zeros((), dtype=torch.long), torch.arange(H).view(1, H, 1, 1),
            torch.arange(Sq).view(1, 1, Sq, 1), torch.arange(Sk).view(1, 1, 1, Sk))


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance",
                         [(True, 32, 128), (False, 32, 128), (True, 64, 256), (False, 16, 64),
                          (True, 32, 100)])
def test_t5_bucket_as_transformers_writes_it(bidirectional, num_buckets, max_distance):
    H = 2
    # table[bucket, h] = bucket * H + h: the score_mod's value says which bucket it read
    table = torch.arange(num_buckets * H, dtype=torch.float32).view(num_buckets, H)

    def t5_bias(score, b, h, q_idx, kv_idx):
        bucket = T5Attention._relative_position_bucket(
            kv_idx - q_idx, bidirectional=bidirectional, num_buckets=num_buckets,
            max_distance=max_distance)
        return score + table[bucket, h]

    sm, tensors = cm.compile_score_mod(t5_bias)
    L = 1200  # every relative position in [-L, L], far past max_distance
    b, h, _, _ = _index_grid(H, 1, 1)
    q = torch.full((1, 1, 1, 1), L)
    kv = torch.arange(2 * L + 1).view(1, 1, 1, -1)
    s = torch.zeros(1, H, 1, 2 * L + 1)
    got = sm.evaluate(s, b, h, q, kv, tensors)
    want = t5_bias(s, b, h, q, kv)
    assert torch.equal(got, want)
    # every bucket is reached (bidirectional: all but "kv_idx after q_idx by 0"), so the grid
    # covers every case of the bucket function
    assert len(torch.unique(want[0, 0])) == num_buckets - bidirectional


def test_min_reduction_refused():
    def sm(score, b, h, q_idx, kv_idx):
        return score + torch.min(kv_idx - q_idx, 0).values
    with pytest.raises(NotImplementedError, match="reduction"):
        cm.compile_score_mod(sm)


# ---- torch.where(cond, score, -inf): a masked score, its condition joins the mask -----------

DOC = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3])
SLOPES = torch.tensor([0.5, 0.25])


def same_doc_alibi(score, b, h, q_idx, kv_idx):
    return torch.where(DOC[q_idx] == DOC[kv_idx], score + SLOPES[h] * (kv_idx - q_idx),
                       -float("inf"))


def window_bias(score, b, h, q_idx, kv_idx):
    bias = torch.where(q_idx - kv_idx < 5, 0.0, -math.inf)
    return score * 0.5 + bias


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex(q, k, v, mask_mod, score_mod):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, S, _ = q.shape
    bm = create_block_mask(mask_mod, B, H, S, S, device="cpu")
    with warnings.catch_warnings():  # eager (unfused) Flex: the reference semantics here
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)


@pytest.mark.parametrize("score_mod", [same_doc_alibi, window_bias])
def test_minus_inf_score_joins_the_mask(score_mod):
    from torch.nn.attention.flex_attention import create_mask

    from compilemask.api.api import _check_masked_scores
    from compilemask.dsl.score_mod import score_mod_mask

    B, H, S, D = 1, 2, 16, 8
    sm, _ = score_mod_mask(score_mod)
    assert sm.mask is not None and "-inf" in sm.explain()
    spec, meta = cm.from_mask_mod(causal, score_mod=score_mod)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=B)

    def finite(b, h, q_idx, kv_idx):  # where the score_mod is finite, in FlexAttention
        s = score_mod(torch.zeros(()), b, h, q_idx, kv_idx)
        return s > -float("inf")
    want = create_mask(causal, B, 1, S, S, device="cpu")[:, 0] & create_mask(
        finite, B, 1, S, S, device="cpu")[:, 0]
    assert torch.equal(desc.dense_mask(), want)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=gen) for _ in range(3))
    ref = _flex(*(t.transpose(1, 2) for t in (q, k, v)), causal, score_mod).transpose(1, 2)
    out = cm.attention(q, k, v, desc, score_mod=score_mod, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the GPU engines run its finite value on this mask, and refuse it on a mask without it
    assert _check_masked_scores(score_mod.__name__, sm.key, str(desc.mask.key))
    plain = cm.compile_mask(cm.from_mask_mod(causal)[0])
    with pytest.raises(NotImplementedError, match="from_mask_mod.mask_mod, score_mod="):
        _check_masked_scores(score_mod.__name__, sm.key, str(plain.key))
    # what the kernels compute (the finite value, -inf where masked) is the score_mod's value
    b_, h_, i_, j_ = _index_grid(H, S, S)
    s = torch.randn(1, H, S, S, generator=gen)
    got = sm.evaluate(s, b_, h_, i_, j_, cm.compile_score_mod(score_mod)[1],
                      mask_tensors=score_mod_mask(score_mod)[1])
    assert torch.equal(got, score_mod(s, b_, h_, i_, j_))


def test_masked_score_check_is_a_constant_of_strings_under_compile():
    """The check ``cm.attention`` makes for the GPU engines, as ``torch.compile(fullgraph=True)``
    traces it: strings in (the score_mod's name and key, the mask's registry key), held or
    refused as in eager."""
    from compilemask.api.api import _check_masked_scores
    from compilemask.dsl.score_mod import score_mod_mask

    key = score_mod_mask(window_bias)[0].key
    spec, meta = cm.from_mask_mod(causal, score_mod=window_bias)
    masks_alive = [cm.compile_mask(spec), cm.compile_mask(cm.from_mask_mod(causal)[0])]
    held, plain = (str(m.key) for m in masks_alive)  # the registry holds masks weakly

    def f(x, mask_key):
        _check_masked_scores("window_bias", key, mask_key)
        return x + 1

    x = torch.zeros(2)
    assert torch.equal(torch.compile(lambda x: f(x, held), fullgraph=True)(x), x + 1)
    with pytest.raises(Exception, match="from_mask_mod.mask_mod, score_mod="):
        torch.compile(lambda x: f(x, plain), fullgraph=True)(x)


def test_minus_inf_masks_of_one_condition_keep_their_own_score_mods():
    """Two score_mods with one -inf condition convert to equal rules: each descriptor's mask
    still names its own score_mod as held (the engines read it from ``desc.mask.spec``)."""
    from compilemask.api.api import _check_masked_scores
    from compilemask.dsl.score_mod import score_mod_mask

    def halved(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx < 5, score * 0.5, -math.inf)

    def shifted(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx < 5, score - 1.0, -math.inf)

    for fn in (halved, shifted):
        spec, meta = cm.from_mask_mod(causal, score_mod=fn)
        desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=16, batch_size=1)
        key = score_mod_mask(fn)[0].key
        assert desc.mask.spec.masked_scores == {key}
        assert _check_masked_scores(fn.__name__, key, str(desc.mask.key))


@pytest.mark.parametrize("body,what", [
    ("-torch.where(q_idx >= kv_idx, score, -float('inf'))", "'-' of a value that may be -inf"),
    ("torch.exp(torch.where(q_idx >= kv_idx, score, -math.inf))", "may be -inf in"),
    ("score + float('inf')", "the constant inf"),
    ("torch.where(q_idx >= kv_idx, score, -math.inf) * (kv_idx - q_idx)", "of unknown sign"),
])
def test_minus_inf_refused_where_not_a_mask(body, what):
    ns = {"torch": torch, "math": math}
    exec(f"def sm(score, b, h, q_idx, kv_idx):\n    return {body}\n", ns)
    with pytest.raises(NotImplementedError, match=what) as err:
        cm.compile_score_mod(ns["sm"])
    assert "torch.where(cond, score_expr, -float('inf'))" in str(err.value) or "inf" in what


def test_minus_inf_condition_on_floats_refused_as_a_mask():
    temps = torch.tensor([1.0, -1.0])

    def by_temperature(score, b, h, q_idx, kv_idx):
        return torch.where(temps[h] * (kv_idx - q_idx) > 0.5, score, -float("inf"))
    with pytest.raises(NotImplementedError, match="by_temperature.*floats"):
        cm.from_mask_mod_heads(causal, 2, score_mod=by_temperature)


# ---- the reference engine calls a score_mod as FlexAttention does: per score ----------------


def _mla_rope(query_rope, key_rope, num_heads, scale):
    # attention-gym's MLA-RoPE score_mod: rows of query_rope / key_rope read at q_idx, kv_idx
    def mla_rope_score_mod(score, b, h, q_idx, kv_idx):
        return score + scale * torch.dot(query_rope[b, h, q_idx], key_rope[b, h // num_heads,
                                                                            kv_idx])
    return mla_rope_score_mod


def test_per_element_score_mod_runs_as_flex():
    B, H, S, D, R = 2, 4, 12, 8, 4
    gen = torch.Generator().manual_seed(1)
    qr = torch.randn(B, H, S, R, generator=gen, requires_grad=True)
    kr = torch.randn(B, 1, S, R, generator=gen)
    sm = _mla_rope(qr, kr, H, 0.5)
    q, k, v = (torch.randn(B, S, H, D, generator=gen, requires_grad=True) for _ in range(3))
    spec, meta = cm.from_mask_mod(causal)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=B)
    with pytest.warns(cm.GpuRefusalWarning, match=r"test_score_mod_idioms.py:\d+.*indexed by"):
        out = cm.attention(q, k, v, desc, score_mod=sm, backend="reference")
    with torch.no_grad():
        ref = _flex(*(t.detach().transpose(1, 2) for t in (q, k, v)), causal, sm).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # gradients reach the captured rows through the per-score call, as a dense computation's
    out.square().sum().backward()
    g = qr.grad.clone()
    qr.grad = None
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5 + 0.5 * torch.einsum(
        "bhqr,bhkr->bhqk", qr, kr.expand(B, H, S, R))
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -float("inf"))
    torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).square().sum().backward()
    torch.testing.assert_close(g, qr.grad, rtol=1e-4, atol=1e-5)
    # said once per function
    with warnings.catch_warnings():
        warnings.simplefilter("error", cm.GpuRefusalWarning)
        cm.attention(q, k, v, desc, score_mod=_mla_rope(qr, kr, H, 0.25), backend="reference")


def test_data_dependent_if_names_the_line():
    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return score
        return score * 2
    S = 8
    spec, meta = cm.from_mask_mod(causal)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=1)
    q = torch.randn(1, S, 2, 8)
    with pytest.raises(RuntimeError, match=r"'branchy' \(.*test_score_mod_idioms.py:\d+\): "
                                           r"data-dependent.*torch.where"):
        cm.attention(q, q, q, desc, score_mod=branchy, backend="reference")


@pytest.mark.parametrize("body,reason", [
    ("torch.nn.functional.gelu(score)", "'gelu'"),
    ("torch.nn.functional.gelu(score, approximate='tanh')", "'gelu'"),
    ("score + HALF[h]", "float16"),
    ("score + torch.full_like(score, 1.0).sum()", "'.sum'"),
])
def test_gpu_refusal_said_once_on_the_cpu(body, reason):
    ns = {"torch": torch, "HALF": torch.ones(2, dtype=torch.float16)}
    exec(f"def refused(score, b, h, q_idx, kv_idx):\n    return {body}\n", ns)
    S = 8
    spec, meta = cm.from_mask_mod(causal)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=1)
    q = torch.randn(1, S, 2, 8)
    with pytest.warns(cm.GpuRefusalWarning, match=reason):
        out = cm.attention(q, q, q, desc, score_mod=ns["refused"], backend="reference")
    with warnings.catch_warnings():  # once per function; silenced by the warnings filter
        warnings.simplefilter("error", cm.GpuRefusalWarning)
        again = cm.attention(q, q, q, desc, score_mod=ns["refused"], backend="reference")
    assert torch.equal(out, again)
    with torch.no_grad():
        ref = _flex(*(t.transpose(1, 2) for t in (q, q, q)), causal, ns["refused"])
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_no_warning_for_what_the_gpu_runs():
    S = 8
    spec, meta = cm.from_mask_mod(causal, score_mod=window_bias)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=1)
    q = torch.randn(1, S, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", cm.GpuRefusalWarning)
        for sm in (window_bias, same_doc_alibi, score_mods.softcap(20.0)):
            cm.attention(q, q, q, desc, score_mod=sm, backend="reference")


def test_deterministic_call_the_gpu_refuses_is_said_on_the_cpu():
    """On CUDA, deterministic=True picks the cute engine only, which has no score_mod or
    learnable sink: the CPU says so (once, at the user's line) and still runs the call."""
    S = 8
    spec, meta = cm.from_mask_mod(causal)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=1)
    q = torch.randn(1, S, 2, 8)
    table = torch.randn(32, 2, requires_grad=True)
    with pytest.warns(cm.GpuRefusalWarning,
                      match=r"deterministic=True.*cute.*no score_mod") as said:
        out = cm.attention(q, q, q, desc, score_mod=score_mods.t5_bias(table, 16),
                           deterministic=True)
    assert said[0].filename == __file__
    out.sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    with warnings.catch_warnings():  # said once; what the cute engine runs is not said at all
        warnings.simplefilter("error", cm.GpuRefusalWarning)
        cm.attention(q, q, q, desc, score_mod=score_mods.t5_bias(table, 16), deterministic=True)
        cm.attention(q, q, q, desc, deterministic=True)
        cm.attention(q, q, q, desc, score_mod=score_mods.t5_bias(table, 16))
