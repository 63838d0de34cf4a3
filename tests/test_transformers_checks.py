"""What a transformers model asks of its attention beyond the descriptor: a tokenizer's 2-D
padding ``attention_mask`` and the sliding window of a layer. Tiny random Llama, Qwen3, Qwen2 and
Mistral models against the same weights under SDPA (the model's own masks)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import compilemask as cm  # noqa: E402
from compilemask.integrations import transformers as cm_hf  # noqa: E402
from compilemask.masks import causal, hstu, packed_documents, sliding_window  # noqa: E402

B, S, VOCAB, W = 3, 29, 128, 9
TOL = dict(atol=2e-5, rtol=1e-4)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False,
            dtype=torch.float32)
FAMILIES = {
    "llama": lambda **kw: transformers.LlamaConfig(**BASE, **kw),
    "qwen3": lambda **kw: transformers.Qwen3Config(**BASE, **kw),
    "mistral": lambda **kw: transformers.MistralConfig(**{"sliding_window": None, **BASE, **kw}),
}
# keys of the real tokens: left padding (as for generation), right padding, none
PAD_LENGTHS = {"left": [(7, 0), (0, 0), (12, 0)], "right": [(0, 5), (0, 0), (0, 11)],
               "mixed": [(4, 0), (0, 9), (3, 3)]}


@pytest.fixture(scope="module")
def name():
    return cm_hf.register()


def _models(impl, config, ref_impl="sdpa"):
    """Two models with the same weights: ``ref_impl`` and ``impl`` (each gets its own config
    copy: from_config writes the implementation into it)."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                        attn_implementation=ref_impl)
    mod = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                        attn_implementation=impl)
    mod.load_state_dict(ref.state_dict())
    return ref, mod


def _ids(seed, batch=B, seqlen=S):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def _padding(side, seqlen=S):
    """int64 ``[B, S]`` 0/1, as a tokenizer returns it."""
    am = torch.ones(len(PAD_LENGTHS[side]), seqlen, dtype=torch.long)
    for b, (left, right) in enumerate(PAD_LENGTHS[side]):
        am[b, :left] = 0
        am[b, seqlen - right:] = 0
    return am


def _real_rows_run(model, ids, real, **kw):
    """Logits and gradients of the loss over the real tokens only: padded rows' outputs are
    whatever the attention gives a row that sees nothing, and no real row reads them."""
    model.zero_grad()
    logits = model(ids, **kw).logits
    labels = torch.where(real, ids.roll(-1, dims=1), -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    return logits.detach()[real], {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(ref_run, mod_run):
    (la, ga), (lb, gb) = ref_run, mod_run
    torch.testing.assert_close(lb, la, **TOL)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def _desc(spec, meta=None, batch=B, seqlen=S):
    return cm.compile_mask(spec).preprocess(meta or {}, seqlen_q=seqlen, batch_size=batch)


# ---- 2-D padding attention_mask ---------------------------------------------------------------

# every family and every side once by default (the diagonal), the other pairs under slow
@pytest.mark.parametrize("family,side", [
    (f, s) if sorted(FAMILIES).index(f) == sorted(PAD_LENGTHS).index(s) else
    pytest.param(f, s, marks=pytest.mark.slow)
    for f in sorted(FAMILIES) for s in sorted(PAD_LENGTHS)])
def test_padding_mask_with_causal_descriptor_matches_sdpa(name, family, side):
    """``model(**batch, compilemask_desc=d)``: the tokenizer's padding hides the padded keys from
    every real row, as SDPA does with the same 2-D mask."""
    ref, mod = _models(name, FAMILIES[family]())
    ids, am = _ids(1), _padding(side)
    real = am.bool()
    desc = _desc(causal())
    ref_run = _real_rows_run(ref, ids, real, attention_mask=am)
    _assert_same(ref_run, _real_rows_run(mod, ids, real, attention_mask=am,
                                         compilemask_desc=desc))
    if side != "right":  # keys before a real row: without the padding the real rows differ
        unpadded = mod(ids, compilemask_desc=desc).logits.detach()[real]
        assert not torch.allclose(unpadded, ref_run[0], **TOL)


def test_padding_mask_is_combined_with_the_descriptors_mask(name):
    """An HSTU descriptor and padding on both sides: the real rows see what both allow, as SDPA
    given the 4-D mask ``dense & padding``."""
    ref, mod = _models(name, FAMILIES["qwen3"]())
    meta = {"ctx_end": torch.tensor([5, 0, 2]), "hist_end": torch.tensor([20, 14, 25]),
            "seq_end": torch.tensor([29, 29, 27]), "group_size": torch.tensor([4, 7, 3])}
    desc = _desc(hstu(), meta)
    ids, am = _ids(2), _padding("mixed")
    real = am.bool()
    both = desc.dense_mask() & real[:, None, :]
    _assert_same(_real_rows_run(ref, ids, real, attention_mask=both[:, None]),
                 _real_rows_run(mod, ids, real, attention_mask=am, compilemask_desc=desc))


def test_all_ones_padding_mask_reaches_no_layer(name, monkeypatch):
    """No padding: the attention function gets no mask at all, and the logits are those of the
    call without ``attention_mask``, bit for bit."""
    seen = []
    real_forward = cm_hf._forward

    def spy(module, query, key, value, attention_mask, *args):
        seen.append(attention_mask)
        return real_forward(module, query, key, value, attention_mask, *args)

    monkeypatch.setattr(cm_hf, "_forward", spy)
    _, mod = _models(name, FAMILIES["llama"]())
    ids, desc = _ids(3), _desc(causal())
    with torch.no_grad():
        plain = mod(ids, compilemask_desc=desc).logits
        ones = mod(ids, attention_mask=torch.ones(B, S, dtype=torch.long),
                   compilemask_desc=desc).logits
    assert seen == [None] * 4
    assert torch.equal(ones, plain)


def test_padding_mask_under_torch_compile(name):
    """Traced, the padding cannot be looked at on the host: it reaches every layer and the
    reference path applies it (an all-ones mask then changes nothing either)."""
    torch._dynamo.reset()
    ref, mod = _models(name, FAMILIES["qwen3"]())
    ids, desc = _ids(4), _desc(causal())
    compiled = torch.compile(mod, backend="eager", fullgraph=True)
    for side in ("left", "right"):
        am = _padding(side)
        real = am.bool()
        with torch.no_grad():
            want = ref(ids, attention_mask=am).logits[real]
            got = compiled(ids, attention_mask=am, compilemask_desc=desc).logits[real]
        torch.testing.assert_close(got, want, **TOL)
    with torch.no_grad():
        ones = compiled(ids, attention_mask=torch.ones(B, S, dtype=torch.long),
                        compilemask_desc=desc).logits
        torch.testing.assert_close(ones, mod(ids, compilemask_desc=desc).logits, **TOL)


def test_padding_reaches_every_engine_in_the_descriptor(name, monkeypatch):
    """The GPU engines read the mask from the descriptor alone: the layers get the descriptor
    padded (made once per model call and shared by the layers), whose dense mask is the mask
    within each sequence's real tokens; a padding with a hole is refused naming
    attention_mask."""
    _, mod = _models(name, FAMILIES["llama"]())
    seen = []
    real_attention = cm_hf.attention

    def spy(q, k, v, desc, **kw):
        seen.append(desc)
        return real_attention(q, k, v, desc, **kw)

    monkeypatch.setattr(cm_hf, "attention", spy)
    ids, desc, am = _ids(5), _desc(causal()), _padding("mixed")
    with torch.no_grad():
        mod(ids, attention_mask=am, compilemask_desc=desc)
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0].q_offset == -1
    real = am.bool()
    assert torch.equal(seen[0].dense_mask(),
                       desc.dense_mask() & real[:, None, :] & real[:, :, None])
    holed = am.clone()
    holed[1, 10] = 0
    with pytest.raises(ValueError, match="attention_mask: .*one contiguous run"):
        mod(ids, attention_mask=holed, compilemask_desc=desc)


def test_padding_mask_with_context_parallelism_is_refused(name):
    from compilemask.api import distributed as cp

    _, mod = _models(name, FAMILIES["llama"]())
    mask = cm.compile_mask(causal())
    plan = cp.make_plan(mask, {}, S, 2, tile=16, batch_size=B)
    ids_l, pos_l = cm_hf.shard_inputs(_ids(6), plan, 0)
    desc = cp.shard_descriptor(mask, {}, plan, 0, batch_size=B)
    am = torch.ones(B, plan.local_len, dtype=torch.long)
    am[0, 0] = 0
    with pytest.raises(NotImplementedError, match="compilemask_cp.*attention_mask"):
        mod(ids_l, position_ids=pos_l, attention_mask=am, compilemask_desc=desc,
            compilemask_cp=(plan, None))


def test_malformed_masks_are_refused(name):
    _, mod = _models(name, FAMILIES["llama"]())
    ids, desc = _ids(7), _desc(causal())
    with pytest.raises(ValueError, match="attention_mask"):
        mod(ids, attention_mask=torch.ones(B, 1, S, S, dtype=torch.bool), compilemask_desc=desc)
    with pytest.raises(ValueError, match="attention_mask"):  # additive float masks: no 0/1 meaning
        mod(ids, attention_mask=torch.zeros(B, 1, 1, S), compilemask_desc=desc)


# ---- sliding-window layers --------------------------------------------------------------------

def _qwen2_sliding(**kw):
    # layers from max_window_layers on slide
    return transformers.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=W,
                                    max_window_layers=1, **kw)


def test_qwen2_layer_types_are_the_models(name):
    _, mod = _models(name, _qwen2_sliding())
    assert [cm_hf.layer_type(m.self_attn) for m in mod.model.layers] == \
        ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_causal_descriptor_on_a_sliding_layer_takes_the_layers_window(name, family):
    """A sliding layer given a mask not proven within its window runs the mask and its window
    combined (the descriptor made once per batch from the same metadata): the model's own
    sliding masks, logits and gradients, without restating the window."""
    config = {"mistral": lambda: FAMILIES["mistral"](sliding_window=W),
              "qwen2": _qwen2_sliding,
              "qwen3": lambda: FAMILIES["qwen3"](use_sliding_window=True, sliding_window=W,
                                                 max_window_layers=1)}[family]()
    ref, mod = _models(name, config)
    ids, desc = _ids(8), _desc(causal())
    real = torch.ones(B, S, dtype=torch.bool)
    _assert_same(_real_rows_run(ref, ids, real),
                 _real_rows_run(mod, ids, real, compilemask_desc=desc))
    windowed = cm_hf.windowed_descriptor(desc, W)
    assert windowed is cm_hf.windowed_descriptor(desc, W)  # once per descriptor and window
    assert cm_hf.within_window(windowed.mask, W, True)
    assert torch.equal(windowed.dense_mask(), _desc(sliding_window(W)).dense_mask())


def test_mistral_with_a_window_descriptor_matches_sdpa(name):
    """Mistral slides on every layer: one window descriptor for all of them, logits and
    gradients as the model's own sliding masks."""
    ref, mod = _models(name, FAMILIES["mistral"](sliding_window=W))
    ids = _ids(9)
    real = torch.ones(B, S, dtype=torch.bool)
    _assert_same(_real_rows_run(ref, ids, real),
                 _real_rows_run(mod, ids, real, compilemask_desc=_desc(sliding_window(W))))


def test_qwen2_sliding_layers_with_a_dict_match_sdpa(name):
    ref, mod = _models(name, _qwen2_sliding())
    ids = _ids(10)
    real = torch.ones(B, S, dtype=torch.bool)
    descs = {"full_attention": _desc(causal()), "sliding_attention": _desc(sliding_window(W))}
    _assert_same(_real_rows_run(ref, ids, real),
                 _real_rows_run(mod, ids, real, compilemask_desc=descs))


def test_window_and_padding_together_match_sdpa(name):
    ref, mod = _models(name, _qwen2_sliding())
    ids, am = _ids(11), _padding("left")
    real = am.bool()
    descs = {"full_attention": _desc(causal()), "sliding_attention": _desc(sliding_window(W))}
    _assert_same(_real_rows_run(ref, ids, real, attention_mask=am),
                 _real_rows_run(mod, ids, real, attention_mask=am, compilemask_desc=descs))


WINDOWED_DOCS = cm.MaskSpec("windowed_documents", params=["doc_start"], regions=[
    cm.Region("doc", when=lambda i: True,
              visible=lambda i, j: doc_start[i] <= j <= i and j > i - 6),  # noqa: F821
])
# two regions: no native pattern, the window is proven over the rules
TWO_WINDOWS = cm.MaskSpec("two_windows", params=["split"], regions=[
    cm.Region("head", when=lambda i: i < split, visible=lambda i, j: i - 5 < j <= i),  # noqa: F821
    cm.Region("tail", when=lambda i: True, visible=lambda i, j: i - W < j <= i + 2),
])


def test_masks_within_the_window_are_accepted(name):
    """A narrower window, windowed packed documents and a two-region mask stay within the
    layer's window: they run, as SDPA given the same dense mask."""
    ref, mod = _models(name, FAMILIES["mistral"](sliding_window=W))
    ids = _ids(12)
    real = torch.ones(B, S, dtype=torch.bool)
    starts = torch.tensor([0] * 11 + [11] * 18)
    docs = packed_documents()
    for spec, meta in ((sliding_window(5), {}),
                       (WINDOWED_DOCS, {"doc_start": starts.expand(B, S)}),
                       (TWO_WINDOWS, {"split": torch.tensor([0, 13, 29])})):
        desc = _desc(spec, meta)
        assert cm_hf.within_window(desc.mask, W, True)
        _assert_same(_real_rows_run(ref, ids, real, attention_mask=desc.dense_mask()[:, None]),
                     _real_rows_run(mod, ids, real, compilemask_desc=desc))
    # not windowed (sees the whole document): the documents within the window
    desc = _desc(docs, {"doc_start": starts.expand(B, S)})
    assert not cm_hf.within_window(desc.mask, W, True)
    dense = desc.dense_mask() & _desc(sliding_window(W)).dense_mask()
    _assert_same(_real_rows_run(ref, ids, real, attention_mask=dense[:, None]),
                 _real_rows_run(mod, ids, real, compilemask_desc=desc))


def test_masks_beyond_the_window_take_the_window(name):
    """A wider window and HSTU on a sliding layer: each mask within the layer's window, its
    metadata read back from the descriptor (params and per-row arrays)."""
    ref, mod = _models(name, FAMILIES["mistral"](sliding_window=W))
    ids = _ids(13)[:1]
    real = torch.ones(1, S, dtype=torch.bool)
    meta = {"ctx_end": torch.tensor([0]), "hist_end": torch.tensor([20]),
            "seq_end": torch.tensor([27]), "group_size": torch.tensor([4])}
    window = _desc(sliding_window(W), batch=1).dense_mask()
    for desc in (_desc(sliding_window(W + 1), batch=1), _desc(hstu(), meta, batch=1)):
        dense = desc.dense_mask() & window
        _assert_same(_real_rows_run(ref, ids, real, attention_mask=dense[:, None]),
                     _real_rows_run(mod, ids, real, compilemask_desc=desc))


def test_window_proofs():
    masks = {n: cm.compile_mask(f()) for n, f in
             (("causal", causal), ("sliding_5", lambda: sliding_window(5)), ("hstu", hstu),
              ("two", lambda: TWO_WINDOWS), ("docs", lambda: WINDOWED_DOCS))}
    within = {n: [w for w in range(1, 12) if cm_hf.within_window(m, w, True)]
              for n, m in masks.items()}
    assert within == {"causal": [], "hstu": [], "sliding_5": list(range(5, 12)),
                      "two": list(range(W, 12)), "docs": list(range(6, 12))}
    # the native window is proven top-left only: with a cache (queries aligned to the last keys)
    # it says nothing
    assert not cm_hf.within_window(masks["sliding_5"], 5, False)


def test_sliding_layers_under_torch_compile(name):
    """The window check traces (its proof runs once, while tracing): accepted descriptors run,
    the rest are refused."""
    torch._dynamo.reset()
    cm_hf._WITHIN.clear()  # as in a fresh process: the proofs run under the tracer
    ref, mod = _models(name, _qwen2_sliding())
    ids = _ids(15)
    descs = {"full_attention": _desc(causal()),
             "sliding_attention": _desc(TWO_WINDOWS, {"split": torch.tensor([5, 13, 29])})}
    compiled = torch.compile(mod, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, compilemask_desc=descs).logits,
                                   mod(ids, compilemask_desc=descs).logits, **TOL)
    with pytest.raises(Exception, match="sliding window of 9"):
        compiled(ids, compilemask_desc=descs["full_attention"])


def test_windows_longer_than_the_sequence_change_nothing(name):
    """Mistral's default window (4096) on short sequences: every mask is within it, so a causal
    descriptor is exact."""
    ref, mod = _models(name, FAMILIES["mistral"](sliding_window=S))
    ids = _ids(14)
    real = torch.ones(B, S, dtype=torch.bool)
    _assert_same(_real_rows_run(ref, ids, real),
                 _real_rows_run(mod, ids, real, compilemask_desc=_desc(causal())))


# ---- logit softcapping (Gemma 2) --------------------------------------------------------------

def test_gemma2_softcap_and_sliding_layers_match_eager(name):
    """Gemma 2: every layer softcaps its logits (``attn_logit_softcapping``, run as a score_mod
    on the reference engine) and every other layer slides; logits and gradients as the model's
    own eager attention."""
    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip("this transformers has no Gemma 2")
    config = transformers.Gemma2Config(
        **{**BASE, "head_dim": 16}, sliding_window=W, attn_logit_softcapping=20.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=16, attention_dropout=0.0)
    ref, mod = _models(name, config, "eager")
    assert {cm_hf.layer_type(m) for m in mod.modules() if hasattr(m, "sliding_window")} == {
        "full_attention", "sliding_attention"}
    ids = _ids(12)
    real = torch.ones(B, S, dtype=torch.bool)
    descs = {"full_attention": _desc(causal()), "sliding_attention": _desc(sliding_window(W))}
    _assert_same(_real_rows_run(ref, ids, real),
                 _real_rows_run(mod, ids, real, compilemask_desc=descs))
    # one causal descriptor: the sliding layers take their window from the model
    _assert_same(_real_rows_run(ref, ids, real),
                 _real_rows_run(mod, ids, real, compilemask_desc=descs["full_attention"]))


# ---- sinks (gpt-oss), Gemma 3's layers -------------------------------------------------------

def test_gpt_oss_sinks_and_sliding_layers_match_eager(name):
    """gpt-oss: per-head learnable sinks in every layer (``s_aux``, the reference engine's
    ``learnable_sink``; their gradients too) and alternating sliding layers, from one causal
    descriptor."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    config = transformers.GptOssConfig(
        **{**BASE, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=W, layer_types=["sliding_attention", "full_attention"],
        attention_dropout=0.0)
    ref, mod = _models(name, config, "eager")
    for m in (ref, mod):  # sinks of a trained model, not the initial zeros
        for layer in m.model.layers:
            layer.self_attn.sinks.data = torch.linspace(-1, 2, config.num_attention_heads)
    ids = _ids(16)
    real = torch.ones(B, S, dtype=torch.bool)
    got = _real_rows_run(mod, ids, real, compilemask_desc=_desc(causal()))
    _assert_same(_real_rows_run(ref, ids, real), got)
    assert got[1]["model.layers.0.self_attn.sinks"].abs().sum() > 0


def test_gemma3_sliding_and_full_layers_match_eager(name):
    """Gemma 3's pattern of sliding and full layers from one causal descriptor."""
    if not hasattr(transformers, "Gemma3TextConfig"):
        pytest.skip("this transformers has no Gemma 3")
    config = transformers.Gemma3TextConfig(
        **BASE, sliding_window=W, query_pre_attn_scalar=16, attention_dropout=0.0,
        layer_types=["sliding_attention", "full_attention"])
    ref, mod = _models(name, config, "eager")
    ids = _ids(17)
    real = torch.ones(B, S, dtype=torch.bool)
    _assert_same(_real_rows_run(ref, ids, real),
                 _real_rows_run(mod, ids, real, compilemask_desc=_desc(causal())))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_gpu_padded_training_batch_within_bf16_error_of_sdpa(name, family):
    """A padded training batch (left, right and both-sided padding) on the GPU in bf16: the
    real rows' logits and the parameters' gradients within twice SDPA-in-bf16's error of SDPA
    in float32, the same weights (head dim 64: the GPU engines' kernels run 64 and 128)."""
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[family]
    config = cls(**{**BASE, "head_dim": 64})
    ref, mod = _models(name, config)
    ids, am = _ids(3).cuda(), _padding("mixed").cuda()
    real = am.bool()
    desc = cm.compile_mask(causal()).preprocess({}, seqlen_q=S, batch_size=B, device="cuda")

    def flat(run):
        logits, grads = run
        return logits.float(), torch.cat([g.float().flatten() for g in grads.values()])

    exact = flat(_real_rows_run(copy.deepcopy(ref).cuda(), ids, real, attention_mask=am))
    bf16 = flat(_real_rows_run(copy.deepcopy(ref).cuda().bfloat16(), ids, real,
                               attention_mask=am))
    ours = flat(_real_rows_run(mod.cuda().bfloat16(), ids, real, attention_mask=am,
                               compilemask_desc=desc))
    for what, o, e, t in zip(("logits", "gradients"), ours, exact, bf16):
        err = ((o - e).norm() / e.norm()).item()
        ref_err = ((t - e).norm() / e.norm()).item()
        assert torch.isfinite(o).all() and err <= 2 * ref_err + 1e-4, (what, err, ref_err)
