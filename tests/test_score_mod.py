"""FlexAttention score_mods on the reference engine: ALiBi, softcap 50, a T5 bucketed relative
bias table and per-head temperature, each with a compiled mask, equal an independent float64
computation (forward and gradients, into captured tensors too); a GPU call with a score_mod
raises unless the reference is asked for."""

from __future__ import annotations

import dataclasses
import math
import re
import types

import numpy as np
import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.dsl import score_mods

B, H, D = 2, 4, 16


def _t5_bucket(rel):
    return score_mods.t5_bucket(rel, num_buckets=16, max_distance=64)


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
        assert torch.autograd.gradcheck(  # fast mode: random projections of each Jacobian
            lambda *xs: cm.attention(xs[0], xs[1], xs[2], desc, score_mod=fn), inputs,
            fast_mode=True)
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


# ---------------------------------------------------------------------------------------------
# compiled score_mods (the fa4 / native engines' form)
# ---------------------------------------------------------------------------------------------
def _more_cases():
    g = torch.Generator().manual_seed(8)
    rel_bias = torch.randn(64, generator=g)
    per_seq = torch.rand(B, generator=g) + 0.5
    ids = torch.randint(0, 3, (B, 40), generator=g)
    gate = torch.rand(H, generator=g) > 0.5
    zero_d = torch.tensor(0.25)
    return {
        "negative_index_from_the_end": lambda s, b, h, i, j: s + rel_bias[(j - i) % 64 - 32],
        "per_sequence_scale": lambda s, b, h, i, j: s * per_seq[b],
        "int_table_and_where": lambda s, b, h, i, j: torch.where(
            ids[b, i] == ids[b, j], s, s - 2.0),
        "bool_table": lambda s, b, h, i, j: torch.where(gate[h], s * 0.5, s),
        "zero_d_tensor": lambda s, b, h, i, j: s * zero_d + 1,
        "sigmoid_abs_min_max": lambda s, b, h, i, j: torch.maximum(
            torch.sigmoid(s) * 3, torch.minimum(abs(s), s * 0 + 2.0)),
        "exp_log_clamp_pow": lambda s, b, h, i, j: torch.log(torch.exp(s).clamp(min=0.1)) +
        (s / 4) ** 2 - torch.sqrt((j - i).abs().float() + 1),
        "float_to_int": lambda s, b, h, i, j: s + ((j - i).float() / 3).long() * 0.5,
        "floor_div_mod": lambda s, b, h, i, j: s - ((j - i) // 5) % 3,
    }


def _grid(Sq=40, Sk=40, seed=9):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, Sq, Sk, generator=g, dtype=torch.float64) * 6
    idx = [torch.arange(n).view(shape) for n, shape in (
        (B, (B, 1, 1, 1)), (H, (1, H, 1, 1)), (Sq, (1, 1, Sq, 1)), (Sk, (1, 1, 1, Sk)))]
    return s, idx


def _all_score_mods():
    out = {name: c[0] for name, c in _cases().items()}
    out.update(_more_cases())
    return out


@pytest.mark.parametrize("name", sorted(_all_score_mods()))
def test_compiled_score_mod_equals_the_score_mod(name):
    """The expression the kernels evaluate equals the score_mod as written, score by score, and
    its derivative equals autograd's (float32, the kernels' arithmetic)."""
    from compilemask.dsl.score_mod import compile_score_mod

    fn = _all_score_mods()[name]
    sm, tables = compile_score_mod(fn)
    s, idx = _grid()
    s = s.float()
    tables = [t.float() if t.dtype == torch.float64 else t for t in tables]
    x = s.clone().requires_grad_()
    want = torch.broadcast_to(fn(x, *idx), s.shape)
    torch.testing.assert_close(torch.broadcast_to(sm.evaluate(s, *idx, tables), s.shape),
                               want.float(), rtol=1e-5, atol=1e-5)
    want.sum().backward()
    grad = torch.broadcast_to(sm.evaluate(s, *idx, tables, grad=True), s.shape)
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-5)


def test_score_mod_softcap_recognized_and_cache():
    from compilemask.dsl.score_mod import compile_score_mod

    assert compile_score_mod(_cases()["softcap_sliding_window"][0])[0].softcap == 50.0
    assert compile_score_mod(lambda s, b, h, i, j: 50 * torch.tanh(s / 40))[0].softcap is None
    assert compile_score_mod(lambda s, b, h, i, j: 30 * torch.tanh(s / 30) + 1)[0].softcap \
        is None

    def make(c, t):
        def mod(score, b, h, q_idx, kv_idx):
            return score * c + t[h]
        return mod

    t1, t2 = torch.ones(H), torch.zeros(H)
    a, ta = compile_score_mod(make(2.0, t1))
    b, tb = compile_score_mod(make(2.0, t2))
    c, _ = compile_score_mod(make(3.0, t1))
    assert a is b and ta[0] is t1 and tb[0] is t2  # same code and constants: new tensors only
    assert c.key != a.key  # a changed constant is another score_mod
    assert "tab0_t(h)" in a.explain()


def test_score_mod_refusals_name_the_construct():
    from compilemask.dsl.score_mod import compile_score_mod

    t = torch.ones(4, 4)

    def branch(score, b, h, q_idx, kv_idx):
        return score if q_idx > 3 else score * 2

    def made_inside(score, b, h, q_idx, kv_idx):
        return score + torch.ones(4)[h]

    def by_score(score, b, h, q_idx, kv_idx):
        return t[score.long(), h]

    def sliced(score, b, h, q_idx, kv_idx):
        return score + t[h]

    for fn, what in ((branch, "control flow"), (made_inside, "made inside"),
                     (by_score, "indexed by the score"), (sliced, "indexed by 1 index")):
        with pytest.raises(NotImplementedError, match=what):
            compile_score_mod(fn)
    with pytest.raises(TypeError, match="must take"):
        compile_score_mod(lambda s, b: s)
    with pytest.raises(TypeError, match="modified score"):
        compile_score_mod(lambda s, b, h, i, j: s > 0)


def test_score_mod_tables_as_the_kernels_read_them():
    from compilemask.dsl.score_mod import compile_score_mod

    slopes = torch.rand(H, dtype=torch.float64, requires_grad=True)
    ids = torch.arange(6)

    def mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * ids[q_idx]

    sm, tables = compile_score_mod(mod)
    names = [t.name.split("_", 1)[1] for t in sm.tables]
    assert sorted(names) == ["ids", "slopes"]

    def ordered(**by_name):
        return [by_name[n] for n in names]

    trained = dict(zip(names, sm.aux_tensors(tables, torch.device("cpu"))))
    assert trained["slopes"].requires_grad  # a trained table: converted through autograd
    trained["slopes"].sum().backward()
    torch.testing.assert_close(slopes.grad, torch.ones_like(slopes))
    with torch.no_grad():
        aux = dict(zip(names, sm.aux_tensors(tables, torch.device("cpu"))))
    assert (aux["slopes"].dtype, aux["ids"].dtype) == (torch.float32, torch.int32)
    again = dict(zip(names, sm.aux_tensors(ordered(slopes=slopes.detach(), ids=ids),
                                           torch.device("cpu"))))
    assert again["ids"] is aux["ids"]  # converted once per tensor version
    with pytest.raises(ValueError, match="outside int32"):
        sm.aux_tensors(ordered(slopes=slopes.detach(), ids=ids + 2**40), torch.device("cpu"))
    with pytest.raises(ValueError, match="is on cpu"):
        sm.aux_tensors(ordered(slopes=slopes.detach(), ids=ids), torch.device("meta"))


def _pow_log2(score, b, h, q_idx, kv_idx):
    d = (kv_idx - q_idx).abs()
    return (score - (kv_idx - q_idx).float() ** 2.0 * 1e-9 + (-0.5) ** (d % 4)
            + score ** ((d % 3).float() * 0.5) * 1e-3 + torch.log2(d.float() + 1).long())


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
@pytest.mark.parametrize("name,engine", [
    pytest.param("pow_log2", "fa4", marks=pytest.mark.slow),
    ("t5_prefix_lm", "fa4"),
    pytest.param("alibi_causal", "native", marks=pytest.mark.slow),
    pytest.param("temperature_hstu", "fa4", marks=pytest.mark.slow)])
def test_score_mod_compiles_in_fa4_forward_and_backward(name, engine):
    """The generated score_mod and score_mod_bwd compile inside FA4's sm90 kernels (gathers,
    precise log, Int32 floor arithmetic for T5; the tables after the mask's aux tensors)."""
    pytest.importorskip("flash_attn.cute")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask.codegen.cute_score_mod import score_mod_source
    from compilemask.dsl.score_mod import compile_score_mod
    from compilemask.kernels import fa4

    from helpers import fake_on_cuda

    fn, _, spec, _ = _cases()[name] if name != "pow_log2" else (
        _pow_log2, None, masks.prefix_lm(), None)
    mask = cm.compile_mask(spec)
    Bf, S, D = 2, 300, 128
    meta = masks.random_meta(mask.spec, Bf, S, torch.Generator().manual_seed(0))
    desc = mask.preprocess(meta or None, seqlen_q=S, batch_size=Bf)
    lists = {k: desc.block_sparse(k) for k in ("fwd", "bwd64")}
    sm, tables = compile_score_mod(fn)
    # the default score_index: index expressions converted by bits (S is below INDEX_BOUND)
    sm = dataclasses.replace(sm, index_bits=True, key="")
    assert name != "alibi_causal" or "_i2f(" in score_mod_source(sm, index_bits=True)
    tables = [t.float() for t in tables]
    with FakeTensorMode():
        q = torch.empty(Bf, S, H, D, dtype=torch.bfloat16, device="cuda")
        fdesc, flists, fake = fake_on_cuda(desc, lists)
        score = (sm, [fake(t) for t in tables])
        out, lse = fa4.fwd(q, q, q, fdesc, D**-0.5, engine, lists=flists["fwd"], score=score)
        assert out.shape == q.shape and lse.shape == (Bf, H, S)
        dq, dk, dv = fa4.bwd(q, q, q, q, out, lse, fdesc, D**-0.5, engine,
                             lists=flists["bwd64"], score=score)
        assert dq.shape == q.shape


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_cases()))
@pytest.mark.parametrize("engine", ["fa4", "native"])
def test_gpu_score_mod_vs_float32_reference(name, engine):
    """ALiBi + causal, softcap 50 + sliding window, T5 bias + prefix-LM, per-head temperature +
    HSTU through FA4 (block-sparse and, where the mask is native, native), forward and backward,
    within twice PyTorch's bf16 error; the score_mod's tables on the GPU."""
    from helpers import check_attention_vs_reference

    fn, _, spec, captured = _cases()[name]
    mask = cm.compile_mask(spec)
    Bg, S, Hg, D = 2, 1000, H, 128
    meta = {k: v.cuda() for k, v in masks.random_meta(
        mask.spec, Bg, S, torch.Generator().manual_seed(7)).items()}
    desc = mask.preprocess(meta or None, seqlen_q=S, batch_size=Bg, device="cuda")
    if engine == "native" and desc.native is None:
        pytest.skip("not a native mask")
    gpu_fn = fn
    if captured is not None:
        dev = captured.float().cuda()
        gpu_fn = _on_device(fn, captured, dev)
    q = torch.randn(Bg, S, Hg, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(Bg, S, 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_attention_vs_reference(desc, q, k, v, engine, desc.dense_mask(), score_mod=gpu_fn)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["fa4", "native"])
def test_gpu_softcap_as_fa4s_own_vs_float32_reference(engine):
    """``KernelOptions(softcap="fa4")``: the softcap runs as FA4's own ``softcap`` instead of the
    generated score_mod (the default), forward and backward within twice PyTorch's bf16 error."""
    from helpers import check_attention_vs_reference

    fn, _, spec, _ = _cases()["softcap_sliding_window"]
    desc = cm.compile_mask(spec).preprocess(None, seqlen_q=1000, batch_size=2, device="cuda")
    q = torch.randn(2, 1000, H, 128, device="cuda", dtype=torch.bfloat16) * 4
    k, v = (torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_attention_vs_reference(desc, q, k, v, engine, desc.dense_mask(), score_mod=fn,
                                 options=cm.KernelOptions(softcap="fa4"))


def test_softcap_option_runs_the_generated_score_mod():
    """By default (and with ``softcap="score_mod"``) the recognized softcap is dropped for the
    call (a new key: never FA4's softcap kernel's entry) and runs as the generated tanh and its
    derivative; ``softcap="fa4"`` keeps FA4's own."""
    from compilemask.codegen.cute_score_mod import score_mod_source
    from compilemask.dsl.score_mod import compile_score_mod
    from compilemask.kernels import autograd
    from compilemask.kernels.contract import OpSettings

    sm, tables = compile_score_mod(_cases()["softcap_sliding_window"][0])
    call = OpSettings("k", 1.0, False, "native", "softcap=score_mod", sm.key, 1)
    got, _ = autograd._score_of(call, [])
    assert sm.softcap == 50.0 and got.softcap is None and got.key != sm.key
    assert got.expr == sm.expr and "cute.math.tanh" in score_mod_source(got)
    default, _ = autograd._score_of(call._replace(options=""), [])
    assert default.softcap is None and default.key == got.key
    own, _ = autograd._score_of(call._replace(options="softcap=fa4"), [])
    assert own.softcap == 50.0 and own.key == sm.key
    with pytest.raises(ValueError, match="softcap"):
        cm.KernelOptions(softcap="precise")


def _on_device(fn, old, new):
    """``fn`` with its captured tensor ``old`` replaced by ``new`` (closure cells)."""
    import types

    cells = tuple(types.CellType(new if c.cell_contents is old else c.cell_contents)
                  for c in fn.__closure__)
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)


def test_fa4_backward_packs_score_mod_indices_as_relied_on():
    """FA4's sm90 backward runs GQA unpacked yet hands score_mods packed indices (the generated
    backward functions undo it, ``codegen.cute_score_mod``): fail loudly if the pinned FA4
    changes either side."""
    pytest.importorskip("flash_attn.cute")
    import inspect

    from flash_attn.cute import config, flash_bwd_sm90, interface

    # unpacked: the query-head fold (pack_factor) is SM100's and must stay 1 on sm90
    assert config._SM100_ONLY_NEUTRAL_FIELDS["pack_factor"] == 1
    assert "capacity not in (10, 11) and sm100_only" in inspect.getsource(config)
    # ... yet built with the GQA ratio, which the score_mod hooks pack indices by
    bwd = inspect.getsource(interface._flash_attn_bwd)
    assert re.search(r"FlashAttentionBackwardSm90\(\s*dtype,\s*head_dim,\s*head_dim_v,\s*"
                     r"qhead_per_kvhead,", bwd)
    for hook in ("apply_score_mod", "apply_score_mod_bwd"):
        src = inspect.getsource(getattr(flash_bwd_sm90.FlashAttentionBackwardSm90, hook))
        assert "qhead_per_kvhead=self.qhead_per_kvhead" in src, hook


@pytest.mark.gpu
def test_gpu_score_mod_errors_before_any_kernel():
    desc = cm.compile_mask(masks.causal()).preprocess(None, 64, batch_size=1, device="cuda")
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    slopes = torch.ones(2)  # on the CPU

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    with pytest.raises(ValueError, match="captured tensor 'slopes' is on cpu"):
        cm.attention(q, q, q, desc, score_mod=alibi)
    with pytest.raises(NotImplementedError, match="cute engine has no score_mod"):
        cm.attention(q, q, q, desc, score_mod=alibi, backend="cute")


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
    assert torch.autograd.gradcheck(  # fast mode: random projections (the full Jacobian of
        # 5,000 inputs took minutes of reference calls)
        lambda *xs: cm.attention(*xs[:3], desc, learnable_sink=xs[3]), (q, k, v, sink),
        fast_mode=True)
    with pytest.raises(ValueError, match=r"learnable_sink must be \[H\]"):
        cm.attention(q, k, v, desc, learnable_sink=torch.zeros(H + 1, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["alibi_causal", "t5_prefix_lm"])
def test_gpu_score_mod_without_gqa(name):
    """One kv head per query head: the backward's indices are not packed."""
    from helpers import check_attention_vs_reference

    fn, _, spec, captured = _cases()[name]
    desc = cm.compile_mask(spec).preprocess(
        {k: v.cuda() for k, v in masks.random_meta(
            spec, 1, 700, torch.Generator().manual_seed(3)).items()} or None,
        seqlen_q=700, batch_size=1, device="cuda")
    fn = _on_device(fn, captured, captured.float().cuda())
    q, k, v = (torch.randn(1, 700, H, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    check_attention_vs_reference(desc, q, k, v, "fa4", desc.dense_mask(), score_mod=fn)


@pytest.mark.parametrize("name", ["alibi_causal", "t5_prefix_lm", "temperature_hstu"])
def test_score_mod_tables_reach_a_compiled_graph(name):
    """Under torch.compile (fullgraph) the GPU engines' score_mod arguments come from a
    conversion outside the graph (its key and the paths to the captured tensors) and reads the
    graph records: the same tables as eager, read again when a captured tensor is rebound."""
    from compilemask.dsl.score_mod import compile_score_mod, static_score_args, traced_score_args

    fn = _cases()[name][0]

    def args(f):
        return traced_score_args(f)[1]

    compiled = torch.compile(args, fullgraph=True, backend="eager")
    sm, tables = compile_score_mod(fn)
    got = compiled(fn)
    assert [t.dtype for t in got] == [torch.float32 if t.is_float else torch.int32
                                      for t in sm.tables]
    for a, b in zip(got, tables):
        torch.testing.assert_close(a, b.to(a.dtype).reshape(a.shape))
    assert static_score_args(fn)[0] == sm.key


SCALE = 1.0


def test_score_mod_values_read_are_guarded_in_a_compiled_graph():
    """The score_mod's key is a constant of the compiled graph; the graph's guards cover the
    Python values the score_mod reads (a global, a closure's constant), so a changed value
    compiles again and the call runs the score_mod as it is now, never the old one."""
    global SCALE
    from compilemask.dsl.score_mod import SCORE, compile_score_mod, traced_score_args

    def make():
        shift = [0.5]

        def scaled(score, b, h, q_idx, kv_idx):
            return score * SCALE + shift[0]

        return scaled, shift

    fn, shift = make()

    def key_of(f, x):
        return x + 1, traced_score_args(f)[0]

    compiled = torch.compile(key_of, fullgraph=True, backend="eager")
    x = torch.zeros(2)
    try:
        for scale, s in ((1.0, 0.5), (3.0, 0.5), (3.0, -2.0)):
            SCALE, shift[0] = scale, s
            sm = compile_score_mod(fn)[0]
            assert compiled(fn, x)[1] == sm.key
            assert float(sm.expr.subs(SCORE, 2)) == 2 * scale + s
    finally:
        SCALE = 1.0


def test_score_mod_made_inside_a_compiled_graph_is_refused_saying_so():
    """A score_mod whose closure is made inside the compiled region cannot be read by the
    graph (fullgraph); the error says to make it once outside, which then compiles."""
    from compilemask.dsl.score_mod import traced_score_args

    def inside(x, cap):
        return x + 1, traced_score_args(score_mods.softcap(cap))[0]

    with pytest.raises(Exception, match="made inside the compiled region"):
        torch.compile(inside, fullgraph=True, backend="eager")(torch.zeros(2), 30.0)
    outside = score_mods.softcap(30.0)
    f = torch.compile(lambda x: (x + 1, traced_score_args(outside)[0]), fullgraph=True,
                      backend="eager")
    assert f(torch.zeros(2))[1] == traced_score_args(outside)[0]


def test_score_mod_trained_tables_reach_the_op_in_a_compiled_graph():
    """A captured tensor that requires grad reaches the op in a compiled graph through
    autograd (its float32 conversion recorded), so its gradient flows back as in eager; the op
    refuses it deterministically, naming the reference engine."""
    from compilemask.dsl.score_mod import traced_score_args

    slopes = torch.nn.Parameter(torch.rand(4, dtype=torch.float64))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    f = torch.compile(lambda x: (x + 1, traced_score_args(alibi)[1]), fullgraph=True,
                      backend="eager")
    (table,) = f(torch.zeros(2))[1]
    assert table.dtype == torch.float32 and table.requires_grad
    (table * 2).sum().backward()
    torch.testing.assert_close(slopes.grad, torch.full_like(slopes, 2.0))
    from compilemask.kernels.autograd import attention_op

    desc = cm.compile_mask(masks.causal()).preprocess(None, 8)
    q = torch.randn(1, 8, 4, 64)
    with pytest.raises(NotImplementedError, match="not deterministically.*reference"):
        attention_op(q, q, q, desc, engine="fa4", deterministic=True,
                     score=(traced_score_args(alibi)[0], [table]))


def test_score_mod_tensors_read_as_attributes_are_refused():
    """A tensor read through an object's attribute is not a captured table (its reads cannot
    be keyed or followed by a compiled graph): refused, naming it."""
    from compilemask.dsl.score_mod import static_score_args

    class Holder:
        slopes = torch.ones(4)

    holder = Holder()

    def alibi(score, b, h, q_idx, kv_idx):
        return score + holder.slopes[h] * (kv_idx - q_idx)

    with pytest.raises(NotImplementedError, match="read as an attribute"):
        static_score_args(alibi)


@pytest.mark.gpu
def test_gpu_score_mod_under_torch_compile_fullgraph():
    """A score_mod inside a compiled region (fullgraph): the conversion runs outside the graph,
    the tables are graph inputs, the result equals eager; a rebound table is read again."""
    desc = cm.compile_mask(masks.causal()).preprocess(None, 512, batch_size=2, device="cuda")
    q, k, v = (torch.randn(2, 512, 4, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    slopes = torch.rand(4, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    f = torch.compile(lambda a, b_, c: cm.attention(a, b_, c, desc, score_mod=alibi),
                      fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(f(q, k, v), cm.attention(q, k, v, desc, score_mod=alibi),
                                   rtol=0, atol=0)
        slopes = torch.rand(4, device="cuda") * 4  # rebound: the next call reads it
    global SCALE

    def scaled(score, b, h, q_idx, kv_idx):
        return score * SCALE

    g = torch.compile(lambda a, b_, c: cm.attention(a, b_, c, desc, score_mod=scaled),
                      fullgraph=True)
    try:
        for scale in (1.0, 0.25):  # a changed global: the graph compiles again
            SCALE = scale
            torch.testing.assert_close(g(q, k, v),
                                       cm.attention(q, k, v, desc, score_mod=scaled),
                                       rtol=0, atol=0)
    finally:
        SCALE = 1.0


@pytest.mark.gpu
def test_gpu_score_mod_on_a_segments_mask_runs_the_lists():
    """Packed documents are native as FA4 varlen, whose indices restart per document: a
    score_mod reading b, q_idx, kv_idx runs on the lists instead, exact."""
    from helpers import check_attention_vs_reference

    mask = cm.compile_mask(masks.packed_documents())
    meta = {k: v.cuda() for k, v in masks.random_meta(
        mask.spec, 2, 1000, torch.Generator().manual_seed(4)).items()}
    desc = mask.preprocess(meta, seqlen_q=1000, batch_size=2, device="cuda")
    per_seq = torch.tensor([0.5, -0.25], device="cuda")

    def absolute(score, b, h, q_idx, kv_idx):
        return score + per_seq[b] * q_idx / 1000 - kv_idx / 2000

    q = torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_attention_vs_reference(desc, q, k, v, "auto", desc.dense_mask(), score_mod=absolute)
    with pytest.raises(NotImplementedError, match="varlen segments"):
        cm.attention(q, k, v, desc, backend="native", score_mod=absolute)


@pytest.mark.gpu
@pytest.mark.parametrize("name,engine", [("sliding_window", "native"), ("hstu", "fa4"),
                                         ("causal", "fa4")])
def test_gpu_learnable_sink_vs_float32_reference(name, engine):
    """gpt-oss's sinks on FA4 (its learnable_sink): output, dq, dk, dv and dsink within twice
    PyTorch's own bf16 error of the float32 reference; dsink's from the bf16 output, as a flash
    backward forms it (FA4's, PyTorch's flash SDPA's: rowsum(dO * O) over the stored O)."""
    from compilemask.compiler.reference import attention_reference

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    meta = {k: v.cuda() for k, v in masks.random_meta(
        mask.spec, 2, 1000, torch.Generator().manual_seed(3)).items()} or None
    desc = mask.preprocess(meta, seqlen_q=1000, batch_size=2, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    sink = torch.randn(4, device="cuda", generator=g)
    # from the test's generator: dsink is a sum dominated by the first rows, so its error moves
    # with dO, and a draw from the global RNG changed with the tests run before this one
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    dense = desc.dense_mask()

    def run(kind):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        s_ = sink.detach().clone().requires_grad_()
        if kind == "ours":
            o = cm.attention(*xs, desc, backend=engine, learnable_sink=s_)
        elif kind == "exact":
            xs = [x.detach().float().requires_grad_() for x in xs]
            o = attention_reference(*xs, dense, learnable_sink=s_)
        else:  # PyTorch in bf16: the scores and the softmax over [scores, sink] in bf16
            kk, vv = (t.repeat_interleave(2, dim=2) for t in xs[1:])
            s = torch.einsum("bqhd,bkhd->bhqk", xs[0], kk) * 128**-0.5
            s = s.masked_fill(~dense.unsqueeze(1), float("-inf"))
            col = s_.to(s.dtype).view(1, 4, 1, 1).expand(2, 4, 1000, 1)
            p = torch.cat([s, col], dim=-1).softmax(-1)[..., :-1]
            o = torch.einsum("bhqk,bkhd->bqhd", p, vv)
            # dsink as a flash backward forms it, from the output it stored in bf16:
            # -sum over rows of exp(sink - lse) * rowsum(dO * O)
            lse = torch.cat([s, col], dim=-1).float().logsumexp(-1)  # [B, H, Sq]
            dpsum = (do.float() * o.detach().float()).sum(-1).transpose(1, 2)
            flash_dsink = -(torch.exp(s_.detach().view(1, 4, 1) - lse) * dpsum).sum((0, 2))
        o.backward(do.to(o.dtype))
        if kind == "bf16":
            return [o] + [x.grad for x in xs] + [flash_dsink]
        return [o] + [x.grad for x in xs] + [s_.grad]

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    ours, exact, bf16 = run("ours"), run("exact"), run("bf16")
    for what, a, e, t in zip(("out", "dq", "dk", "dv", "dsink"), ours, exact, bf16):
        assert rel(a, e) <= 2 * rel(t, e) + 1e-4, (what, rel(a, e), rel(t, e))


@pytest.mark.slow  # kernels of their own
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
def test_learnable_sink_compiles_in_fa4_forward_and_backward():
    """FA4's learnable_sink with the block-sparse lists and the mask_mod (sm90, fake tensors):
    the backward returns the sink's gradient."""
    pytest.importorskip("flash_attn.cute")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask.kernels import fa4

    from helpers import fake_on_cuda

    mask = cm.compile_mask(masks.hstu())
    Bf, S, D = 2, 300, 128
    meta = masks.random_meta(mask.spec, Bf, S, torch.Generator().manual_seed(0))
    desc = mask.preprocess(meta, seqlen_q=S, batch_size=Bf)
    lists = {k: desc.block_sparse(k) for k in ("fwd", "bwd64")}
    with FakeTensorMode():
        q = torch.empty(Bf, S, H, D, dtype=torch.bfloat16, device="cuda")
        fdesc, flists, _ = fake_on_cuda(desc, lists)
        sink = torch.empty(H, dtype=torch.float32, device="cuda")
        out, lse = fa4.fwd(q, q, q, fdesc, D**-0.5, "fa4", lists=flists["fwd"], sink=sink)
        grads = fa4.bwd(q, q, q, q, out, lse, fdesc, D**-0.5, "fa4", lists=flists["bwd64"],
                        sink=sink)
        assert len(grads) == 4 and grads[3].shape == (H,)


def test_index_to_float_by_bits_is_exact_where_chosen():
    """``score_index="bits"``: float(x) as the bits of 0x4B400000 + x less 1.5 * 2**23 equals
    the conversion for every |x| < 2**22 (edges and a sweep), and only expressions linear in
    q_idx / kv_idx whose reach stays below 2**22 at INDEX_BOUND take it."""
    import sympy as sp

    from compilemask.codegen.cute_score_mod import INDEX_BOUND, _bits_convertible

    lim = 1 << 22
    x = torch.cat([torch.arange(-lim, lim, 997, dtype=torch.int32),
                   torch.tensor([-lim, -lim + 1, -1, 0, 1, lim - 2, lim - 1], dtype=torch.int32)])
    got = (x + 0x4B400000).view(torch.float32) - 12582912.0
    assert torch.equal(got, x.float())
    assert not torch.equal((torch.tensor([lim + 1], dtype=torch.int32) + 0x4B400000).view(
        torch.float32) - 12582912.0, torch.tensor([float(lim + 1)]))  # the bound is real
    i, j, b, h = (sp.Symbol(n, integer=True) for n in "ijbh")
    assert _bits_convertible(j - i) and _bits_convertible(i - j + 5) and _bits_convertible(2 * j)
    assert not _bits_convertible(4 * (j - i))  # reach 8 * INDEX_BOUND
    assert not _bits_convertible(j - i + 3 * INDEX_BOUND)
    assert not _bits_convertible(j * i) and not _bits_convertible(h - i)
    assert not _bits_convertible(b) and not _bits_convertible(sp.Abs(j - i))
    assert not _bits_convertible(sp.Integer(3))


def test_score_index_option_reaches_the_generated_code():
    """The default converts ALiBi's ``kv_idx - q_idx`` by bits (a new key, its own kernels);
    ``score_index="cvt"`` keeps I2F; lengths past INDEX_BOUND fall back to I2F."""
    from compilemask.codegen.cute_score_mod import score_mod_source
    from compilemask.dsl.score_mod import compile_score_mod
    from compilemask.kernels import autograd
    from compilemask.kernels.contract import OpSettings

    sm, _ = compile_score_mod(_cases()["alibi_causal"][0])
    call = OpSettings("k", 1.0, False, "native", "", sm.key, 1)
    bits, _ = autograd._score_of(call, [])
    cvt, _ = autograd._score_of(call._replace(options="score_index=cvt"), [])
    assert bits.index_bits and not cvt.index_bits and bits.key != cvt.key == sm.key
    assert "_i2f(" in score_mod_source(bits, index_bits=True)
    assert "_i2f(" not in score_mod_source(cvt) and ".to(Float32)" in score_mod_source(cvt)
    with pytest.raises(ValueError, match="score_index"):
        cm.KernelOptions(score_index="fast")


def test_index_bits_reach_both_passes_below_the_bound(monkeypatch):
    """The bit conversion goes to FA4's forward and backward (with the index wrap gone, the
    backward no longer spills with it), and to neither past INDEX_BOUND."""
    from compilemask.codegen.cute_score_mod import INDEX_BOUND
    from compilemask.dsl.score_mod import compile_score_mod
    from compilemask.kernels import fa4

    sm, tables = compile_score_mod(_cases()["alibi_causal"][0])
    sm = dataclasses.replace(sm, index_bits=True, key="")
    seen = []
    monkeypatch.setattr(fa4, "score_mod_fns",
                        lambda sm, offset, gqa, bits, train=(), relative=False:
                        seen.append(bits) or (None, None))
    monkeypatch.setattr(fa4, "patches", lambda: ())
    for S in (64, INDEX_BOUND - 256, INDEX_BOUND - 255):
        desc = types.SimpleNamespace(seqlen_q=S, seqlen_k=S)  # what the native engine reads
        fa4._mods(desc, "native", None, (sm, tables), backward=False)
        fa4._mods(desc, "native", None, (sm, tables), backward=True)
    assert seen == [True, True, True, True, False, False]


def test_generated_score_mod_works_on_whole_vectors():
    """Arithmetic on FA4's vectors (TensorSSA), not a loop of scalar operations (which made
    ptxas spill in FA4's backward); only a table read walks the vector's elements."""
    from compilemask.codegen.cute_score_mod import score_mod_source
    from compilemask.dsl.score_mod import compile_score_mod

    for name in ("alibi_causal", "t5_prefix_lm", "softcap_sliding_window"):
        sm, _ = compile_score_mod(_cases()[name][0])
        src = score_mod_source(sm)
        loops = [ln for ln in src.splitlines() if "range_constexpr" in ln]
        reads = [ln for ln in src.splitlines() if "] = aux_tensors[" in ln]
        assert len(loops) == len(reads), name
        assert "res[e]" not in src and "score[e]" not in src, name


def test_uniform_divisor_is_one_reciprocal():
    """``score / temps[h]``: the divisor is the same for a whole tile, so the generated code
    takes its reciprocal once and multiplies per score (forward and derivative); a divisor that
    reads q_idx / kv_idx keeps the IEEE division, and so does exact (rounded) arithmetic."""
    from compilemask.codegen.cute_score_mod import score_mod_source
    from compilemask.dsl.score_mod import compile_score_mod

    temps = torch.linspace(0.5, 1.5, H)
    sm, _ = compile_score_mod(score_mods.temperature(temps))
    divs = [ln.split("=", 1)[1].strip() for ln in score_mod_source(sm).splitlines()
            if " / " in ln and not ln.lstrip().startswith("#")]
    assert divs and all(d.startswith("Float32(1.0) / ") for d in divs)

    def by_distance(score, b, h, q_idx, kv_idx):
        return score / (1 + (q_idx - kv_idx).abs())

    sm, _ = compile_score_mod(by_distance)
    src = score_mod_source(sm)
    assert any(" / " in ln and "Float32(1.0) / " not in ln for ln in src.splitlines()
               if not ln.lstrip().startswith("#"))


# ---------------------------------------------------------------------------------------------
# the generated CuTe code, run on the CPU by a model of the DSL's vector operations
# ---------------------------------------------------------------------------------------------
class _Vec(np.ndarray):
    """A TensorSSA as the CuTe DSL computes it: signed ``//`` floors (``arith.floordivsi``),
    ``%`` keeps the dividend's sign (``arith.remsi`` / ``remf``), ``.to(Int32)`` truncates."""

    python_rounding = False  # the other convention (floor remainder): the code must not care

    def __mod__(self, o):
        mod = np.mod if _Vec.python_rounding else np.fmod
        return mod(np.asarray(self), np.asarray(o)).view(_Vec)

    def __rmod__(self, o):
        mod = np.mod if _Vec.python_rounding else np.fmod
        return mod(np.asarray(o), np.asarray(self)).view(_Vec)

    def to(self, dtype):
        a = np.asarray(self)
        if dtype is np.int32 and a.dtype.kind == "f":
            a = np.trunc(a)
        return a.astype(dtype).view(_Vec)


class _Frag:
    def __init__(self, n, dtype):
        self.a = np.zeros(n, dtype=dtype)

    def __getitem__(self, i):
        return self.a[i]

    def __setitem__(self, i, v):
        self.a[i] = v

    def store(self, v):
        self.a[:] = np.asarray(v)

    def load(self):
        return self.a.copy().view(_Vec)


def _fake_cute():
    import types

    cute = types.SimpleNamespace()
    cute.jit = lambda f: f
    cute.size = lambda x: int(np.prod(x)) if isinstance(x, tuple) else int(x)
    cute.full_like = lambda x, v: np.full_like(np.asarray(x), v).view(_Vec)
    cute.where = lambda c, a, b: np.where(np.asarray(c), a, b).astype(
        np.result_type(np.asarray(a), np.asarray(b))).view(_Vec)
    cute.make_rmem_tensor = lambda n, dtype: _Frag(n if isinstance(n, int) else n[0], dtype)
    cute.make_layout = lambda *a, **k: None

    def recast(frag, dtype):
        out = _Frag(len(frag.a), dtype)
        out.a = frag.a.view(dtype)
        return out
    cute.recast_tensor = recast

    def f32(fn):
        return lambda x, fastmath=True: fn(np.asarray(x, dtype=np.float32)).astype(
            np.float32).view(_Vec)
    cute.math = types.SimpleNamespace(
        exp=f32(np.exp), log=f32(np.log), tanh=f32(np.tanh), sin=f32(np.sin), cos=f32(np.cos),
        exp2=f32(np.exp2), log2=f32(np.log2), sqrt=f32(np.sqrt), floor=f32(np.floor),
        rsqrt=f32(lambda x: 1 / np.sqrt(x)))
    cutlass = types.SimpleNamespace(cute=cute, range_constexpr=range)
    return {"cute": cute, "cutlass": cutlass, "Float32": np.float32, "Int32": np.int32}


def _run_generated(src, fn_name, score, b, h, q, kv, tables, grad=None):
    ns = _fake_cute()
    exec("\n".join(ln for ln in src.splitlines() if not ln.startswith(("import", "from"))),
         ns)
    vec = [np.asarray([x], dtype=d).view(_Vec) for x, d in
           ((score, np.float32), (b, np.int32), (h, np.int32), (q, np.int32), (kv, np.int32))]
    aux = [np.asarray(t) for t in tables]
    if grad is None:
        return float(ns[fn_name](*vec, None, aux)[0])
    g = np.asarray([grad], dtype=np.float32).view(_Vec)
    return float(ns[fn_name](g, *vec, None, aux)[0])


@pytest.mark.parametrize("name", ["alibi_causal", "softcap_sliding_window", "temperature_hstu",
                                  "t5_prefix_lm",
                                  "negative_index_from_the_end", "per_sequence_scale",
                                  "int_table_and_where", "bool_table", "zero_d_tensor",
                                  "sigmoid_abs_min_max", "float_to_int", "floor_div_mod"])
@pytest.mark.parametrize("index_bits", [False, True])
@pytest.mark.parametrize("python_rounding", [False, True])
@pytest.mark.parametrize("relative", [False, True])
def test_generated_code_equals_the_score_mod(name, index_bits, python_rounding, relative,
                                             monkeypatch):
    """The generated ``score_mod`` / ``score_mod_bwd`` source, run by a CPU model of the CuTe
    DSL's vector semantics (signed ``//`` floors, ``%`` keeps the dividend's sign, float to int
    truncates; and with a floor remainder), equals the score_mod as written, with negative index
    differences; ``relative``: relative indices read from their tables (reach 64, past the
    indices' 40)."""
    monkeypatch.setattr(_Vec, "python_rounding", python_rounding)
    from compilemask.codegen.cute_score_mod import score_mod_source
    from compilemask.dsl.score_mod import compile_score_mod, kernel_table

    fn = _all_score_mods()[name]
    sm, tables = compile_score_mod(fn)
    tables = [kernel_table(t, spec.is_float) for t, spec in zip(tables, sm.tables)]
    if relative:
        if not sm.relative:
            pytest.skip("no relative index")
        tables += [sm.relative_table(n, 64, "cpu") for n in range(len(sm.relative))]
    src = score_mod_source(sm, index_bits=index_bits, relative=relative)
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        s = float(torch.randn((), generator=g)) * 6
        b, h = int(torch.randint(0, B, (), generator=g)), int(torch.randint(0, H, (), generator=g))
        i, j = (int(x) for x in torch.randint(0, 40, (2,), generator=g))
        x = torch.tensor(s, dtype=torch.float32, requires_grad=True)
        want = fn(x, torch.tensor(b), torch.tensor(h), torch.tensor(i), torch.tensor(j))
        want.backward()
        want = want.detach()
        got = _run_generated(src, "score_mod", s, b, h, i, j, tables)
        assert got == pytest.approx(float(want), rel=1e-5, abs=1e-5), (name, s, b, h, i, j)
        dgot = _run_generated(src, "score_mod_bwd", s, b, h, i, j, tables, grad=1.0)
        assert dgot == pytest.approx(float(x.grad), rel=1e-5, abs=1e-5), (name, i, j)


def _run_vectors(fn, score, b, h, q_idx, kv_idx, grad: bool = False):
    """The generated score_mod (or its derivative) of ``fn`` on 1-D inputs, by the CPU model
    above (float32 / int32 numpy vectors: int32 arithmetic wraps, float32 rounds)."""
    import warnings

    from compilemask.codegen.cute_score_mod import score_mod_source
    from compilemask.dsl.score_mod import compile_score_mod, kernel_table

    sm, tables = compile_score_mod(fn)
    aux = [np.asarray(kernel_table(t.detach(), spec.is_float))
           for t, spec in zip(tables, sm.tables)]
    ns = _fake_cute()
    exec("\n".join(ln for ln in score_mod_source(sm).splitlines()  # noqa: S102 - generated
                   if not ln.startswith(("import", "from"))), ns)
    vec = [np.asarray(x, dtype=d).reshape(-1).view(_Vec) for x, d in
           ((score, np.float32), (b, np.int32), (h, np.int32), (q_idx, np.int32),
            (kv_idx, np.int32))]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        if grad:
            out = ns["score_mod_bwd"](np.ones_like(vec[0]).view(_Vec), *vec, None, aux)
        else:
            out = ns["score_mod"](*vec, None, aux)
    return np.asarray(out, dtype=np.float32)


def _run_eager(fn, score, b, h, q_idx, kv_idx, grad: bool = False):
    """``fn`` as written, on int32 indices (FlexAttention's), float32 scores."""
    x = torch.as_tensor(np.asarray(score, dtype=np.float32)).clone().requires_grad_(grad)
    idx = [torch.as_tensor(np.asarray(v, dtype=np.int32)) for v in (b, h, q_idx, kv_idx)]
    out = torch.broadcast_to(fn(x, *idx), x.shape)
    if grad:
        out.float().sum().backward()
        return x.grad.numpy()
    return out.detach().to(torch.float32).numpy()


_INDEX_TOTAL = {"alibi_causal", "bool_table", "per_sequence_scale", "sigmoid_abs_min_max",
                "softcap_sliding_window", "temperature_hstu", "zero_d_tensor"}


@pytest.mark.parametrize("name", sorted(_all_score_mods()))
def test_index_total_score_mods_are_finite_past_the_sequence(name):
    """A score_mod whose indices FA4 need not wrap (``index_total``) is finite on the padded
    rows and columns of edge tiles: the generated code at indices past the sequence, up to the
    bound the kernels allow, with finite scores and tables; the source says which it is."""
    from compilemask.codegen.cute_score_mod import INDEX_BOUND, index_total, score_mod_source
    from compilemask.dsl.score_mod import compile_score_mod, kernel_table

    fn = _all_score_mods()[name]
    sm, tables = compile_score_mod(fn)
    assert index_total(sm) == (name in _INDEX_TOTAL)
    src = score_mod_source(sm)
    assert f"UNWRAPPED = {name in _INDEX_TOTAL}" in src
    if name not in _INDEX_TOTAL:
        return
    tables = [kernel_table(t, spec.is_float) for t, spec in zip(tables, sm.tables)]
    far = [0, 39, 40, 40 + 127, INDEX_BOUND - 1]  # 40 rows; then the padding; then the bound
    with np.errstate(over="ignore"):  # a select's discarded side may overflow (sigmoid's exp)
        for i in far:
            for j in far:
                for s in (-30.0, 0.0, 30.0):
                    assert math.isfinite(_run_generated(src, "score_mod", s, 1, 2, i, j, tables))
                    assert math.isfinite(_run_generated(src, "score_mod_bwd", s, 1, 2, i, j,
                                                        tables, grad=1.0))


def test_index_total_refuses_what_can_overflow():
    from compilemask.codegen.cute_score_mod import index_total
    from compilemask.dsl.score_mod import compile_score_mod

    slopes = torch.rand(H)

    def square(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx) ** 2

    def reciprocal(score, b, h, q_idx, kv_idx):
        return score + 1.0 / (kv_idx - q_idx + 1)

    def decay(score, b, h, q_idx, kv_idx):
        return score * torch.exp(slopes[h] * (kv_idx - q_idx))

    assert index_total(compile_score_mod(square)[0])
    assert not index_total(compile_score_mod(reciprocal)[0])
    assert not index_total(compile_score_mod(decay)[0])


# ---------------------------------------------------------------------------------------------
# the generated code against the score_mod as written (numpy stand-ins for FA4's vectors)
# ---------------------------------------------------------------------------------------------
def _as_written_cases():
    gate = torch.tensor([True, False, True, True])

    def gauss(s, b, h, q, kv):
        return s - (kv - q).float() ** 2.0 * 1e-9

    return {
        "bool_plus_bool_is_or": lambda s, b, h, q, kv: s - 2 * ((kv > q) + (kv > q - 3)),
        "bool_times_bool_is_and": lambda s, b, h, q, kv: s - 2 * ((kv > q) * gate[h]),
        "bool_table_plus_itself": lambda s, b, h, q, kv: s + (gate[h] + gate[h]),
        "integral_float_power_of_a_negative": lambda s, b, h, q, kv: s ** 2.0,
        "pow_with_float_two": lambda s, b, h, q, kv: torch.pow(s, 2.0),
        "squared_distance_in_float": gauss,
        "negative_base_integer_exponent": lambda s, b, h, q, kv: s + (-0.5) ** (kv - q).abs(),
        "negative_base_any_power": lambda s, b, h, q, kv: (s - 1.0) ** ((kv - q) % 3 + 0.5),
        "log2_at_powers_of_two": lambda s, b, h, q, kv: s + torch.log2(
            (kv - q).abs().float() + 1).long(),
    }


@pytest.mark.parametrize("name", sorted(_as_written_cases()))
def test_generated_score_mod_equals_the_score_mod_as_written(name):
    """The generated CuTe score_mod and its derivative, run on float32 / int32 stand-ins,
    equal the score_mod in torch (int32 indices, as FlexAttention's) on random scores and on
    distances up to 2**17 (squares past int32 after .float(), log2 at powers of two), NaN
    where torch gives NaN."""
    fn = _as_written_cases()[name]
    g = np.random.default_rng(len(name))
    n = 3000
    q = g.integers(0, 2**17, n)
    kv = np.concatenate([g.integers(0, 2**17, n - 40), q[-40:] + 2 ** g.integers(0, 14, 40) - 1])
    s = np.concatenate([(g.standard_normal(n - 4) * 4), [-3.0, 0.0, 2.0, -0.5]])
    args = (s, g.integers(0, B, n), g.integers(0, H, n), q, kv)
    for grad in (False, True):
        got, want = _run_vectors(fn, *args, grad=grad), _run_eager(fn, *args, grad=grad)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, equal_nan=True,
                                   err_msg=f"{name} grad={grad}")


def test_narrow_integer_arithmetic_and_bool_negation_are_refused():
    """Arithmetic that keeps an int8 / uint8 / int16 dtype in torch wraps there (the kernels
    compute in int32); a conversion to one wraps; ``-`` of a boolean raises in torch. Each is
    refused naming the tensor or the operation; a narrow table compared, or added to an index,
    reads exactly."""
    from compilemask.dsl.score_mod import compile_score_mod

    u8 = torch.tensor([0, 200, 3, 9], dtype=torch.uint8)
    i8 = torch.tensor([100, 120, -3, 1], dtype=torch.int8)
    for fn, what in (
            (lambda s, b, h, q, kv: s + (u8[h] - 1), "'u8'.*uint8"),
            (lambda s, b, h, q, kv: s + (i8[h] + i8[h]), "'i8'.*int8"),
            (lambda s, b, h, q, kv: s + (q - kv).to(torch.uint8), "conversion to torch.uint8"),
            (lambda s, b, h, q, kv: s + (-(kv > q)), "'-' of a boolean"),
            (lambda s, b, h, q, kv: s + ((kv > q) - (q > kv)), "'-' with a boolean"),
            (lambda s, b, h, q, kv: s - (kv > q), "'-' with a boolean")):
        with pytest.raises(NotImplementedError, match=what):
            compile_score_mod(fn)
    def fine(s, b, h, q, kv):
        return s + (u8[h] + kv) * 0.01 + (i8[h] > 50)

    args = (np.linspace(-2, 2, 64), np.zeros(64), np.arange(64) % H, np.arange(64),
            np.arange(64)[::-1])
    np.testing.assert_allclose(_run_vectors(fine, *args), _run_eager(fine, *args), rtol=1e-6)


def test_unsupported_score_mods_are_refused_with_the_construct_named():
    """A rounding mode the kernels do not reproduce, and a comparison sympy cannot fold, are
    refused naming what to write instead (not an operator '?' or a RecursionError)."""
    from compilemask.dsl.score_mod import compile_score_mod

    with pytest.raises(NotImplementedError, match="rounding_mode='trunc'.*floor division"):
        compile_score_mod(lambda s, b, h, q, kv: s + torch.div(kv - q, 3, rounding_mode="trunc"))
    with pytest.raises(NotImplementedError, match="compare their difference with a constant"):
        compile_score_mod(lambda s, b, h, q, kv: s + ((kv * 2 - q) > (q - kv)).float())
    compile_score_mod(lambda s, b, h, q, kv: s + (3 * kv - 2 * q > 0).float())


def test_relative_indices_read_from_tables_equal_the_reference():
    """Index expressions that read q_idx and kv_idx only through their difference and round a
    float (T5's buckets, both directions; a true division truncated) become tables over the
    difference, equal to the reference's evaluation at every (q_idx, kv_idx) of a 301-long
    sequence; linear indices, indices that read the head or one index alone do not; the
    engine's tables are shared by lengths of one 4096 class and bounded."""
    from compilemask.dsl.score_mod import _I, _J, _torch_eval, compile_score_mod
    from compilemask.kernels.fa4 import _RELATIVE, relative_tables

    table = torch.randn(32, H)

    def causal_t5(score, b, h, q_idx, kv_idx):  # transformers' unidirectional bucket
        n = (q_idx - kv_idx).clamp(min=0)
        large = 16 + (torch.log(n.float() / 16) / math.log(128 / 16) * 16).to(torch.long)
        return score + table[torch.where(n < 16, n, large.clamp(max=31)), h]

    def thirds(score, b, h, q_idx, kv_idx):
        return score + table[((q_idx - kv_idx) / 3).long().clamp(-31, 31), h]

    def linear(score, b, h, q_idx, kv_idx):
        return score + table[(q_idx - kv_idx).clamp(0, 31), h]

    def per_head(score, b, h, q_idx, kv_idx):
        return score + table[score_mods.t5_bucket((kv_idx - q_idx) * (h + 1)), h]

    def one_index(score, b, h, q_idx, kv_idx):
        return score + table[score_mods.t5_bucket(q_idx), h]

    S, reach = 301, 512
    i, j = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    for fn in (score_mods.t5_bias(table, 128), causal_t5, thirds):
        sm, _ = compile_score_mod(fn)
        assert len(sm.relative) == 1, fn
        lut = sm.relative_table(0, reach, "cpu")
        assert lut.dtype == torch.int32 and lut.shape == (2 * reach - 1,)
        want = _torch_eval(sm.relative[0][0], {_I: i, _J: j}, {}, torch.float32).long()
        assert torch.equal(lut[i - j + reach - 1].long(), want), fn
    for fn in (linear, per_head, one_index, score_mods.alibi(torch.rand(H))):
        assert compile_score_mod(fn)[0].relative == (), fn
    sm, _ = compile_score_mod(score_mods.t5_bias(table, 128))
    a, = relative_tables(sm, 1000, "cpu")
    b, = relative_tables(sm, 4096, "cpu")
    c, = relative_tables(sm, 4097, "cpu")
    assert a is b and a.shape == (2 * 4096 - 1,) and c.shape == (2 * 8192 - 1,)
    assert _RELATIVE.maxsize == 64
