"""Batched generation with left padding through the padded descriptor: transformers'
``generate`` with ``compilemask_mask`` and a tokenizer's ``attention_mask`` gives SDPA's
tokens (tiny random models, same weights; greedy)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import compilemask as cm  # noqa: E402
from compilemask import masks  # noqa: E402
from compilemask.integrations import transformers as cm_hf  # noqa: E402

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _config(family, dtype, **kw):
    kw = {**BASE, **kw}  # a GPU test's head dim replaces BASE's
    if family == "qwen3":
        return transformers.Qwen3Config(dtype=dtype, **kw)
    if family == "llama":
        return transformers.LlamaConfig(dtype=dtype, **kw)
    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip("this transformers has no Gemma 2")
    # its sliding layers' window past every position generated (a decode step's cache would
    # otherwise hold only the window); softcapping as a score_mod
    return transformers.Gemma2Config(dtype=dtype, sliding_window=4096,
                                     attn_logit_softcapping=20.0, final_logit_softcapping=30.0,
                                     query_pre_attn_scalar=16, attention_dropout=0.0, **kw)


def _models(family, device="cpu", dtype=torch.float32, ref_impl="sdpa", **kw):
    """``kw``: config entries (a wider ``initializer_range`` keeps bf16 logits' greedy choices
    apart)."""
    name = cm_hf.register()
    torch.manual_seed(0)
    cfg = _config(family, dtype, **kw)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation=ref_impl)
    mod = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation=name)
    mod.load_state_dict(ref.state_dict())
    return ref.to(device).eval(), mod.to(device).eval()


def _left_padded(B, P, seed, device="cpu"):
    """Prompts of different lengths, left-padded (as a tokenizer pads for generation); the
    last one has a single real token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, P), generator=g)
    am = torch.ones(B, P, dtype=torch.long)
    for b, pad in enumerate([0, 5, 9, P - 1][:B]):
        am[b, :pad] = 0
        ids[b, :pad] = 0
    return ids.to(device), am.to(device)


def _generate_both(ref, mod, ids, am, n):
    kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, attention_mask=am)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = mod.generate(ids, compilemask_mask=cm.compile_mask(masks.causal()), **kw)
    return got, want


def test_left_padded_generate_equals_sdpa():
    ref, mod = _models("qwen3")
    ids, am = _left_padded(4, 13, 1)
    got, want = _generate_both(ref, mod, ids, am, 6)
    assert torch.equal(got, want), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_left_padded_generate_equals_sdpa_more_families(family):
    ref, mod = _models(family, ref_impl="eager" if family == "gemma2" else "sdpa")
    ids, am = _left_padded(3, 11, 2)
    got, want = _generate_both(ref, mod, ids, am, 5)
    assert torch.equal(got, want), (got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma2"])
def test_gpu_left_padded_generate_equals_sdpa(family, monkeypatch):
    """On CUDA the padded descriptors (prefill, then every decode step) run on the GPU
    engines (the block-sparse fa4: no native kernel takes a key start), not the reference."""
    import compilemask.api.api as api_mod

    # head dim 64: the GPU engines' kernels run 64 and 128
    ref, mod = _models(family, "cuda", torch.bfloat16,
                       ref_impl="eager" if family == "gemma2" else "sdpa", initializer_range=0.3,
                       head_dim=64)
    engines = []
    real_select = api_mod.select_engine

    def spy(q, desc, *a, **k):
        engines.append(real_select(q, desc, *a, **k))
        return engines[-1]

    monkeypatch.setattr(api_mod, "select_engine", spy)
    ids, am = _left_padded(4, 40, 3, "cuda")
    got, want = _generate_both(ref, mod, ids, am, 8)
    assert engines and set(engines) == {"fa4"}, set(engines)
    assert torch.equal(got, want), (got, want)


def test_per_head_groups_are_padded_group_by_group():
    """Per-head masks (``HeadGroups`` kept as groups): each group's descriptor padded, the
    heads' dense mask the groups' within the real tokens; folded heads are refused."""
    B, S, H = 3, 37, 4
    heads = [cm.compile_mask(masks.causal())] * 2 + [cm.compile_mask(masks.sliding_window(5))] * 2
    groups = cm.preprocess_heads(heads, [None] * H, seqlen_q=S, batch_size=B, fold=False)
    am = torch.ones(B, S, dtype=torch.long)
    am[0, :6] = 0
    am[2, 30:] = 0
    got = cm_hf._padded_descriptor(groups, am)
    real = am.bool()
    want = groups.dense_mask() & real[:, None, None, :] & real[:, None, :, None]
    assert torch.equal(got.dense_mask(), want)
    assert cm_hf._padded_descriptor(groups, am) is not got  # groups are made anew; each
    assert got.groups[0][0] is cm_hf._padded_descriptor(groups, am).groups[0][0]  # desc kept
    prefix = cm.compile_mask(masks.prefix_lm())  # one mask, metadata per head: folded
    folded = cm.preprocess_heads([prefix] * H, [{"prefix_len": torch.full((B,), h)}
                                                for h in range(H)], seqlen_q=S, batch_size=B)
    assert folded.folded
    with pytest.raises(NotImplementedError, match="folded"):
        cm_hf._padded_descriptor(folded, am)
