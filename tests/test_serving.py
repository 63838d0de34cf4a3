"""Serving with the training mask: descriptors of the last rows of a sequence (prefill, chunked
prefill, decode steps) equal the square mask's rows, and transformers' ``generate`` with
``compilemask_mask`` / ``compilemask_meta`` gives greedy decoding's tokens by full
recomputation under SDPA with the same dense mask (causal, prefix-LM, a draft tree)."""

from __future__ import annotations

import copy

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.api.serving import DecodeState, query_descriptor

from helpers import assert_lists_equal

SERVED = ["causal", "prefix_lm", "hstu", "shared_prompt_rm", "clear", "sliding_window",
          "packed_documents", "packed_prefix_lm", "tree_verify", "sink_window", "chunked_causal"]


@pytest.mark.parametrize("name", SERVED)
def test_query_rows_equal_the_square_mask(name):
    mask = cm.compile_mask(masks.EXAMPLES[name]())
    assert not mask.has_fallback
    S, Bq = 130, 2
    meta = masks.random_meta(mask.spec, Bq, S, torch.Generator().manual_seed(1))
    for Sk in (1, 7, 64, 129, 130):
        cut = {k: (v[:, :Sk] if v.dim() >= 2 else v) for k, v in (meta or {}).items()} or None
        square = mask.preprocess(cut, seqlen_q=Sk, batch_size=Bq).dense_mask()
        for Sq in {1, 3, Sk}:
            if Sq > Sk:
                continue
            d = query_descriptor(mask, meta, Sk, Sq, batch_size=Bq)
            assert (d.seqlen_q, d.seqlen_k) == (Sq, Sk)
            assert torch.equal(d.dense_mask(), square[:, Sk - Sq:]), (Sk, Sq)


def test_query_descriptor_errors_name_the_argument():
    mask = cm.compile_mask(masks.prefix_lm())
    meta = {"prefix_len": torch.tensor([3])}
    with pytest.raises(ValueError, match="seqlen_q .5. > seqlen_k .4."):
        query_descriptor(mask, meta, 4, 5)
    with pytest.raises(ValueError, match="seqlen_k must be a positive int"):
        query_descriptor(mask, meta, 0, 1)
    docs = cm.compile_mask(masks.packed_documents())
    short = masks.random_meta(docs.spec, 1, 8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="covers 8 positions, the keys are 9"):
        query_descriptor(docs, short, 9, 1)
    dilated = cm.compile_mask(masks.dilated_causal())  # fallback regions are served
    assert query_descriptor(dilated, None, 9, 1).positions.tolist() == [[8]]
    with pytest.raises(TypeError, match="compile_mask"):
        DecodeState(masks.causal())


def test_decode_state_makes_one_descriptor_per_step_shape():
    state = DecodeState(cm.compile_mask(masks.causal()), None, batch_size=1)
    a = state.descriptor(1, 10)
    assert state.descriptor(1, 10) is a and state.descriptor(1, 11) is not a
    meta = {"prefix_len": torch.tensor([2])}
    state = DecodeState(cm.compile_mask(masks.prefix_lm()), meta, batch_size=1)
    a = state.descriptor(10, 10)
    meta["prefix_len"].fill_(9)  # written in place: not the same descriptor any more
    b = state.descriptor(10, 10)
    assert b is not a and b.dense_mask()[0, 0, :9].all() and not a.dense_mask()[0, 0, 3]


def test_decode_state_sees_every_metadata_change():
    """The kept descriptor serves only the metadata it was made from: a tensor replaced (a new
    one at version 0, perhaps at the freed one's address) or written in place, a changed int, an
    added or removed entry each make a fresh one, equal to one made from scratch."""
    mask = cm.compile_mask(masks.prefix_lm())
    meta = {"prefix_len": torch.tensor([2])}
    state = DecodeState(mask, meta, batch_size=1)
    made = [state.descriptor(4, 10)]
    assert state.descriptor(4, 10) is made[0]  # unchanged: the same descriptor
    # each change shows rows 6..9 other keys than the one before it
    changes = [lambda: meta.__setitem__("prefix_len", torch.tensor([9])),
               lambda: meta["prefix_len"].fill_(8),
               lambda: meta.__setitem__("prefix_len", 10),
               lambda: meta.__setitem__("prefix_len", 7)]
    for change in changes:
        change()
        d = state.descriptor(4, 10)
        want = query_descriptor(mask, meta, 10, 4, batch_size=1).dense_mask()
        assert torch.equal(d.dense_mask(), want)
        assert not torch.equal(want, made[-1].dense_mask())
        assert all(d is not old for old in made) and state.descriptor(4, 10) is d
        made.append(d)
    meta["other"] = 1  # an added entry is read too: refused, as from scratch
    with pytest.raises(ValueError, match="unknown param"):
        state.descriptor(4, 10)
    del meta["other"]
    assert state.descriptor(4, 10) is made[-1]
    del meta["prefix_len"]
    with pytest.raises(ValueError, match="missing param"):
        state.descriptor(4, 10)


def test_decode_state_with_inference_tensors():
    """Tensors made under torch.inference_mode count no writes: each call makes its descriptor,
    so a write in place still shows."""
    mask = cm.compile_mask(masks.prefix_lm())
    with torch.inference_mode():
        meta = {"prefix_len": torch.tensor([2])}
        state = DecodeState(mask, meta, batch_size=1)
        a = state.descriptor(4, 10)
        meta["prefix_len"].fill_(9)
        b = state.descriptor(4, 10)
        want = query_descriptor(mask, meta, 10, 4, batch_size=1).dense_mask()
    assert torch.equal(b.dense_mask(), want) and not torch.equal(a.dense_mask(), want)


def test_request_counts_are_checked_on_the_host():
    mask = cm.compile_mask(masks.causal())
    for used, msg in (([45, 40], r"seqused_k\[0\] = 45 is outside \[0, seqlen_k\] = \[0, 40\]"),
                      (torch.tensor([40, -3]), r"seqused_k\[1\] = -3 is outside"),
                      (torch.tensor([40, 41], dtype=torch.int32), r"seqused_k\[1\] = 41")):
        with pytest.raises(ValueError, match=msg):
            query_descriptor(mask, None, 40, 4, seqused_k=used)
    with pytest.raises(TypeError, match="seqused_k must be an int tensor"):
        query_descriptor(mask, None, 40, 4, seqused_k=torch.tensor([4.0, 40.0]))
    with pytest.raises(ValueError, match=r"seqused_q\[1\] = 5 is outside \[0, seqlen_q\]"):
        query_descriptor(mask, None, 40, 4, seqused_k=torch.tensor([40, 40]),
                         seqused_q=torch.tensor([4, 5]))
    with pytest.raises(ValueError, match=r"seqused_q \[4, 4\] exceeds seqused_k \[40, 3\]"):
        query_descriptor(mask, None, 40, 4, seqused_k=torch.tensor([40, 3]),
                         seqused_q=torch.tensor([4, 4]))
    # the bounds are requests: an empty slot (its rows see nothing) and a full buffer
    dense = query_descriptor(mask, None, 40, 4, seqused_k=torch.tensor([0, 40])).dense_mask()
    assert not dense[0].any() and dense[1].any(-1).all()
    dense = query_descriptor(mask, None, 40, 4, seqused_k=torch.tensor([40, 9]),
                             seqused_q=torch.tensor([0, 4])).dense_mask()
    assert not dense[0].any() and dense[1].any(-1).all()


@pytest.mark.gpu
def test_gpu_host_request_counts_are_checked_before_the_device():
    mask = cm.compile_mask(masks.causal())
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 45"):
        query_descriptor(mask, None, 40, 4, seqused_k=torch.tensor([45, 40]), device="cuda")
    d = query_descriptor(mask, None, 40, 4, seqused_k=torch.tensor([40, 9]), device="cuda")
    assert d.seqused_k.is_cuda and d.seqused_k.tolist() == [40, 9]


def test_tree_meta_from_parents():
    # prefix of 3, drafts 0..4 at positions 3..7: 0 and 1 roots, 2 under 0, 3 under 2, 4 under 1
    meta = masks.tree_meta(3, [-1, -1, 0, 2, 1], 8, depth=3)
    d = cm.compile_mask(masks.tree_verify(3)).preprocess(meta, 8, batch_size=1).dense_mask()[0]
    sees = {i: [j for j in range(8) if d[i, j]] for i in range(8)}
    assert sees[2] == [0, 1, 2]  # causal prefix
    assert sees[6] == [0, 1, 2, 3, 5, 6] and sees[7] == [0, 1, 2, 4, 7]
    with pytest.raises(ValueError, match="ancestors, depth is 1"):
        masks.tree_meta(3, [-1, 0, 1], 8, depth=1)


# ---------------------------------------------------------------------------------------------
# transformers generate
# ---------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")
VOCAB = 97


def _models():
    from compilemask.integrations import transformers as cm_hf

    name = cm_hf.register()
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation="sdpa")
    mod = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation=name)
    mod.load_state_dict(ref.state_dict())
    return ref.eval(), mod.eval()


def _greedy_by_recomputation(model, ids, n, dense):
    """Greedy tokens, every step the whole sequence again under SDPA with the dense mask's
    square block."""
    for _ in range(n):
        S = ids.shape[1]
        with torch.no_grad():
            logits = model(ids, attention_mask=dense[:, None, :S, :S], use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("case", ["causal", "prefix_lm", "tree_verify"])
def test_generate_equals_greedy_by_recomputation(case):
    ref, mod = _models()
    Bq, P, N = 2, 11, 6
    total = P + N
    g = torch.Generator().manual_seed(2)
    if case == "causal":
        mask, meta = cm.compile_mask(masks.causal()), None
    elif case == "prefix_lm":
        mask = cm.compile_mask(masks.prefix_lm())
        meta = {"prefix_len": torch.tensor([5, 9])}
    else:  # the prompt's last 4 tokens and every generated one are drafts of a tree
        mask = cm.compile_mask(masks.tree_verify(3))
        parts = [masks.tree_meta(P - 4, [-1, 0, 0, 1, 2, -1, 5, 6, -1, 8], total, 3),
                 masks.tree_meta(P - 4, [-1, -1, 1, 2, 0, 4, 5, -1, 7, 8], total, 3)]
        meta = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    ids = torch.randint(0, VOCAB, (Bq, P), generator=g)
    dense = mask.preprocess(meta, total, batch_size=Bq).dense_mask()
    want = _greedy_by_recomputation(ref, ids, N, dense)
    got = mod.generate(ids, max_new_tokens=N, do_sample=False, compilemask_mask=mask,
                       compilemask_meta=meta, attention_mask=torch.ones_like(ids),
                       pad_token_id=0)
    assert torch.equal(got, want), (got, want)


def test_model_calls_with_one_meta_dict_see_its_changes():
    """transformers keeps a generation's DecodeState while compilemask_meta is the same dict: a
    call after an entry of the dict changed gives that metadata's logits, not the last call's."""
    _, mod = _models()
    mask = cm.compile_mask(masks.prefix_lm())
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    meta = {"prefix_len": torch.tensor([2])}
    with torch.no_grad():
        first = mod(ids, compilemask_meta=meta, compilemask_mask=mask).logits
        meta["prefix_len"] = torch.tensor([10])
        again = mod(ids, compilemask_meta=meta, compilemask_mask=mask).logits
        alone = mod(ids, compilemask_meta={"prefix_len": torch.tensor([10])},
                    compilemask_mask=mask).logits
    assert torch.equal(again, alone) and not torch.allclose(again, first)


def test_native_patterns_apply_to_queries_at_the_end():
    """A mask proven causal / windowed / full runs FA4's own bottom-right kernels for the last
    rows; segments (varlen) and rows elsewhere do not."""
    for spec, expect in ((masks.causal(), True), (masks.sliding_window(7), True),
                         (masks.packed_documents(), False)):
        mask = cm.compile_mask(spec)
        meta = masks.random_meta(mask.spec, 1, 40, torch.Generator().manual_seed(0)) or None
        d = query_descriptor(mask, meta, 40, 3, batch_size=1)
        assert d.q_offset == 37 and d.native_applies() is expect, spec.name
        full = query_descriptor(mask, meta, 40, 40, batch_size=1)
        assert full.q_offset == 0 and full.native_applies() is (mask.native_pattern is not None)
    from compilemask.contract.descriptor import DescriptorArgs

    d = query_descriptor(cm.compile_mask(masks.causal()), None, 40, 3, batch_size=1)
    back = DescriptorArgs.of(d).descriptor(d.mask)
    assert back.q_offset == 37 and back.native_applies()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "tree_verify"])
def test_gpu_decode_and_chunked_prefill_vs_float32_reference(name):
    """The last rows of a sequence (a decode step, a chunk of prefill) on the GPU engine the
    call selects (FA4's own bottom-right causal / window for native masks, the lists
    otherwise), forward and backward within twice PyTorch's bf16 error."""
    from helpers import check_attention_vs_reference

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    Sk = 1000
    meta = {k: v.cuda() for k, v in masks.random_meta(
        mask.spec, 2, Sk, torch.Generator().manual_seed(5)).items()} or None
    for Sq in (1, 77):
        d = query_descriptor(mask, meta, Sk, Sq, batch_size=2, device="cuda")
        q = torch.randn(2, Sq, 4, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, Sk, 2, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        engine = cm.api.api.select_engine(q, d)
        assert engine == ("native" if mask.native_pattern is not None else "fa4"), engine
        check_attention_vs_reference(d, q, k, v, engine, d.dense_mask())


def test_docs_generate_lines_run():
    """The generate line of docs/serving.md, as written, on a tiny Qwen3."""
    import re
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    code = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    ref, mod = _models()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    env = {"model": mod, "input_ids": ids, "n": 3, "cm": cm, "prefix_lm": masks.prefix_lm,
           "prefix": torch.tensor([4, 9])}
    exec(compile(code, "docs/serving.md", "exec"), env)
    dense = cm.compile_mask(masks.prefix_lm()).preprocess(
        {"prefix_len": env["prefix"]}, 12, batch_size=2).dense_mask()
    assert torch.equal(env["out"], _greedy_by_recomputation(ref, ids, 3, dense))


def _gemma2(window):
    """A tiny Gemma 2 (sliding and full layers alternate, logits softcapped) under eager and
    under compilemask, the same weights."""
    from compilemask.integrations import transformers as cm_hf

    name = cm_hf.register()
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, sliding_window=window,
                                    dtype=torch.float32)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation="eager")
    mod = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation=name)
    mod.load_state_dict(ref.state_dict())
    return ref.eval(), mod.eval()


def _dense_eager(dense, window):
    """Gemma 2's eager attention (its softcap) given ``dense``'s rows of the whole sequence,
    within ``window`` on sliding layers: for recomputation without a cache (keys = positions)."""
    from transformers import AttentionInterface
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    def forward(module, query, key, value, attention_mask, **kw):
        S = key.shape[2]
        rows = dense[:, :S, :S]
        if kw.get("sliding_window"):
            i = torch.arange(S)
            rows = rows & (i.view(-1, 1) - i.view(1, -1) < window)
        bias = torch.zeros(rows.shape).masked_fill(~rows, torch.finfo(torch.float32).min)
        return eager_attention_forward(module, query, key, value, bias[:, None], **kw)

    AttentionInterface.register("dense_eager_test", forward)
    return "dense_eager_test"


@pytest.mark.parametrize("case", ["causal", "prefix_lm", "sliding_window"])
def test_generate_past_a_sliding_window_equals_recomputation(case):
    """A sliding layer's cache keeps the last window - 1 keys: generating three windows past it
    gives greedy decoding's tokens by full recomputation with the mask (and the window on the
    sliding layers), and for causal those of transformers' own sliding cache under eager."""
    W, P, N = 8, 10, 16
    ref, mod = _gemma2(W)
    mask = cm.compile_mask({"causal": masks.causal, "prefix_lm": masks.prefix_lm,
                            "sliding_window": lambda: masks.sliding_window(5)}[case]())
    meta = {"prefix_len": torch.tensor([3, 10])} if case == "prefix_lm" else None
    ids = torch.randint(0, VOCAB, (2, P), generator=torch.Generator().manual_seed(7))
    got = mod.generate(ids, max_new_tokens=N, do_sample=False, compilemask_mask=mask,
                       compilemask_meta=meta, pad_token_id=0)
    dense = mask.preprocess(meta, P + N, batch_size=2).dense_mask()
    ref.set_attn_implementation(_dense_eager(dense, W))
    want = ids
    for _ in range(N):
        with torch.no_grad():
            logits = ref(want, use_cache=False).logits
        want = torch.cat([want, logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, want), (got, want)
    if case == "causal":
        ref.set_attn_implementation("eager")
        assert torch.equal(got, ref.generate(ids, max_new_tokens=N, do_sample=False,
                                             pad_token_id=0))


def test_mistral_generates_past_its_window_as_its_sliding_cache():
    """Mistral slides on every layer and passes position_ids per sequence ([B, Sq]): greedy
    tokens past the window equal transformers' own sliding cache under eager."""
    from compilemask.integrations import transformers as cm_hf

    name = cm_hf.register()
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, sliding_window=8,
                                     dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation="eager").eval()
    mod = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation=name).eval()
    mod.load_state_dict(ref.state_dict())
    ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = mod.generate(ids, compilemask_mask=cm.compile_mask(masks.causal()), **kw)
    assert got.shape == (2, 24) and torch.equal(got, ref.generate(ids, **kw))


def test_generate_past_a_sliding_window_needs_the_positions():
    """Where the call does not say the keys' positions (no position_ids, or left padding), a
    sliding layer past its window is refused, naming the fix, not run at wrong positions."""
    from compilemask.integrations import transformers as cm_hf

    class Attn(torch.nn.Module):
        sliding_window, layer_idx = 8, 0

    q, k = torch.zeros(2, 4, 1, 16), torch.zeros(2, 2, 8, 16)
    kw = {cm_hf.MASK_KWARG: cm.compile_mask(masks.causal())}
    assert cm_hf._generation_descriptor(Attn(), kw, q, k[:, :, :7])[1] == 0  # all kept
    with pytest.raises(NotImplementedError, match="window of 8 keys.*position_ids"):
        cm_hf._generation_descriptor(Attn(), kw, q, k)
    with pytest.raises(NotImplementedError, match="different positions.*left padding"):
        cm_hf._generation_descriptor(Attn(), {**kw, "position_ids": torch.tensor([[9], [8]])},
                                     q, k)
    desc, dropped = cm_hf._generation_descriptor(
        Attn(), {**kw, "position_ids": torch.tensor([[11], [11]])}, q, k)
    assert dropped == 4 and (desc.seqlen_q, desc.seqlen_k) == (1, 12)


@pytest.mark.parametrize("name", ["causal", "prefix_lm", "hstu", "packed_documents",
                                  "tree_verify", "sliding_window"])
def test_batch_of_requests_with_their_own_lengths(name):
    """One KV buffer of seqlen_k keys, request b holding seqused_k[b]: each request's rows are
    its own last positions (``query_descriptor`` of that request alone), keys past its length
    never show, and rows before a short request's first position see nothing."""
    mask = cm.compile_mask(masks.EXAMPLES[name]())
    Sk, Bq = 50, 4
    meta = masks.random_meta(mask.spec, Bq, Sk, torch.Generator().manual_seed(2))
    used = torch.tensor([50, 31, 3, 1])
    for Sq in (1, 4):
        d = query_descriptor(mask, meta, Sk, Sq, batch_size=Bq, seqused_k=used)
        dense = d.dense_mask()
        assert dense.shape == (Bq, Sq, Sk) and d.q_offset == -1
        for b in range(Bq):
            u = int(used[b])
            one = {k: v[b:b + 1] for k, v in (meta or {}).items()} or None
            n = min(Sq, u)
            alone = query_descriptor(mask, one, u, n, batch_size=1).dense_mask()[0]
            assert torch.equal(dense[b, Sq - n:, :u], alone), (b, Sq)
            assert not dense[b, :, u:].any() and not dense[b, :Sq - n].any()
    assert query_descriptor(mask, meta, Sk, 1, device="cpu", batch_size=Bq).device.type == "cpu"
    with pytest.raises(ValueError, match="seqused_k has 4 entries, the batch 2"):
        query_descriptor(mask, meta, Sk, 1, batch_size=2, seqused_k=used)


@pytest.mark.gpu
def test_gpu_batch_of_requests_vs_float32_reference():
    """Requests of their own lengths in one KV buffer (``seqused_k``) on FA4's lists, a decode
    step and a chunk, within twice PyTorch's bf16 error; rows of a too-short request are 0."""
    from helpers import check_attention_vs_reference

    mask = cm.compile_mask(masks.prefix_lm())
    meta = {"prefix_len": torch.tensor([100, 0, 5, 700], device="cuda")}
    used = torch.tensor([1000, 517, 3, 900], device="cuda")
    for Sq in (1, 64):
        d = query_descriptor(mask, meta, 1000, Sq, batch_size=4, seqused_k=used)
        q = torch.randn(4, Sq, 4, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(4, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        assert cm.api.api.select_engine(q, d) == "fa4"
        check_attention_vs_reference(d, q, k, v, "fa4", d.dense_mask())


@pytest.mark.parametrize("name", SERVED)
def test_step_descriptor_copies_nothing_between_devices(name):
    """A step's descriptor is made on its device from device metadata without a host copy or
    read (on ``meta`` tensors, where a read raises): what a CUDA-graph capture needs; the
    generated interval table makes its constants with fills, not host tensors."""
    from helpers import HostCopies

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    meta = masks.random_meta(mask.spec, 3, 200, torch.Generator().manual_seed(1))
    meta = {k: v.to("meta") for k, v in (meta or {}).items()} or None
    used = torch.tensor([200, 150, 7]).to("meta")
    for kw in ({}, {"seqused_k": used}):
        with HostCopies() as w:
            d = query_descriptor(mask, meta, 200, 4, batch_size=3, device="meta", **kw)
        assert d.device.type == "meta" and not w.found, w.found[:1]


@pytest.mark.parametrize("name", ["hstu", "tree_verify"])
def test_row_descriptor_program_equals_the_reference(name):
    """The preprocess program's rows variant (TileLang's C target here; CUDA on the GPU) writes
    the torch reference's descriptor field by field: the last rows, random positions with
    padding on both sides, leading rows, with and without per-request key limits."""
    pytest.importorskip("tilelang")
    from compilemask.api.distributed import rows_descriptor

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    S, B = 700, 3
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    for rows in (torch.arange(S - 5, S), torch.randint(-3, S + 4, (B, 9), generator=gen),
                 torch.arange(0, 300)):
        for limit in (None, torch.tensor([S, 400, 3])):
            want, got = (rows_descriptor(mask, meta, S, rows, key_limit=limit, batch_size=B,
                                         backend=b) for b in ("torch", "tilelang"))
            for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap", "params",
                      "row_params"):
                assert torch.equal(getattr(got, f), getattr(want, f)), (f, rows.shape, limit)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "hstu", "tree_verify", "packed_documents"])
def test_gpu_row_descriptor_program_equals_the_reference(name):
    """On CUDA the rows program (``backend="tilelang"``) equals the torch reference, the lists
    too; and a query descriptor made by it serves a decode step as the reference's does."""
    from compilemask.api.distributed import rows_descriptor

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    S, B = 2000, 4
    meta = {k: v.cuda() for k, v in masks.random_meta(
        mask.spec, B, S, torch.Generator().manual_seed(3)).items()}
    used = torch.tensor([2000, 1500, 7, 640], device="cuda")
    rows = used.view(-1, 1) - 4 + torch.arange(4, device="cuda").view(1, -1)
    want, got = (rows_descriptor(mask, meta, S, rows, key_limit=used, batch_size=B,
                                 device="cuda", backend=b) for b in ("torch", "tilelang"))
    for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap", "params", "row_params"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    for kind in ("fwd", "bwd64"):
        assert_lists_equal(want.block_sparse(kind), got.block_sparse(kind), kind)
    q = torch.randn(B, 4, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    outs = [cm.attention(q, k, v, query_descriptor(mask, meta, S, 4, batch_size=B,
                                                   seqused_k=used, backend=b))
            for b in ("torch", "tilelang")]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_decode_step_captures_in_a_cuda_graph():
    """A decode step over fixed buffers (the KV buffer, the requests' lengths as a device
    tensor written in place) captures in one CUDA graph, descriptor included, and its replay
    after the lengths change equals the eager step."""
    mask = cm.compile_mask(masks.causal())
    Sk, Bq = 1024, 4
    q = torch.randn(Bq, 1, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(Bq, Sk, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    used = torch.tensor([1024, 600, 17, 300], device="cuda")

    def step():
        d = query_descriptor(mask, None, Sk, 1, batch_size=Bq, seqused_k=used)
        assert d.device == q.device  # made where it runs: nothing copied per step
        return cm.attention(q, k, v, d)

    step()  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    used.copy_(torch.tensor([5, 1000, 64, 2], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, step(), rtol=0, atol=0)


def test_score_mods_on_served_rows():
    """A score_mod on the last rows of a sequence reads their positions as q_idx: any score_mod
    (a T5 bucket of kv_idx - q_idx, ALiBi with its LSE or next to a learnable sink, a softcap)
    gives the whole sequence's last rows. Rows whose positions the descriptor does not record
    (a context-parallel shard of an interval mask) run only a score_mod that a moved q_idx
    shifts by a per-row constant (output only), and the refusal says why."""
    import dataclasses

    from compilemask.api.api import _check_rows
    from compilemask.dsl import score_mods

    mask = cm.compile_mask(masks.causal())
    Sk, Sq = 40, 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 4, 8, generator=g, dtype=torch.float64) for n in (Sk, Sk, Sk))
    full = mask.preprocess(None, Sk, batch_size=1)
    last = query_descriptor(mask, None, Sk, Sq, batch_size=1)
    sink = torch.randn(4, generator=g, dtype=torch.float64) + 2
    t5 = score_mods.t5_bias(torch.randn(32, 4, generator=g, dtype=torch.float64), 16)
    alibi = score_mods.alibi(score_mods.alibi_slopes(4).double())
    for fn in (t5, alibi, score_mods.softcap(5)):
        for kw in ({}, {"learnable_sink": sink}):
            want, want_lse = cm.attention(q, k, v, full, score_mod=fn, return_lse=True, **kw)
            got, lse = cm.attention(q[:, -Sq:], k, v, last, score_mod=fn, return_lse=True, **kw)
            torch.testing.assert_close(got, want[:, -Sq:])
            torch.testing.assert_close(lse, want_lse[..., -Sq:])
            torch.testing.assert_close(cm.attention(q[:, -Sq:], k, v, last, score_mod=fn, **kw),
                                       want[:, -Sq:])
    # the rows' positions matter: at local rows the T5 bias is another one
    local = cm.attention(q[:, -Sq:], k, v, mask.preprocess(None, Sq, Sk, batch_size=1),
                         score_mod=t5)
    assert not torch.allclose(local, want[:, -Sq:])
    shard = dataclasses.replace(last, q_offset=-1)  # rows elsewhere, positions not recorded
    with pytest.raises(NotImplementedError, match="not record their positions.*per-row"):
        _check_rows(shard, "any", False, False)
    with pytest.raises(NotImplementedError, match="return_lse"):
        _check_rows(shard, "row", True, False)
    with pytest.raises(NotImplementedError, match="learnable_sink"):
        _check_rows(shard, "row", False, True)
    _check_rows(shard, "row", False, False)
    _check_rows(shard, "none", True, True)


@pytest.mark.parametrize("kind", ["last_rows", "requests", "fallback_rows"])
def test_score_mod_at_row_positions_is_the_score_mod_there(kind):
    """What the GPU engines run on rows elsewhere in their sequences (``at_rows``: the
    score_mod reading ``q_idx`` from a table of the rows' positions, passed after its own),
    evaluated as the kernels do, equals the score_mod at those positions: the last rows of a
    sequence (one offset), requests of their own lengths (an offset per sequence) and the
    chosen rows of a mask with fallback regions (a position per row)."""
    from compilemask.api.api import _row_positions
    from compilemask.dsl import score_mods
    from compilemask.dsl.score_mod import at_rows, score_mod_for_key
    from compilemask.pipeline.rows import rows_descriptor

    g = torch.Generator().manual_seed(3)
    if kind == "fallback_rows":
        mask = cm.compile_mask(masks.dilated_causal())  # j % 2 == i % 2: a fallback rule
        Sk, Sq, B = 24, 5, 2
        meta = None
        rows = torch.tensor([[3, 9, 10, 17, 23], [0, 1, 2, 20, 21]])
        desc = rows_descriptor(mask, meta, Sk, rows, batch_size=B)
        want_pos = rows
    else:
        mask = cm.compile_mask(masks.causal())
        Sk, Sq, B = 24, 5, 2
        used = torch.tensor([24, 11]) if kind == "requests" else None
        desc = query_descriptor(mask, None, Sk, Sq, batch_size=B, seqused_k=used)
        used = torch.tensor([Sk, Sk]) if used is None else used
        want_pos = (used - Sq).view(B, 1) + torch.arange(Sq)
    rows = _row_positions(desc, 1, B)
    assert rows is not None and rows[0] == (kind == "fallback_rows")
    table = rows[1].contiguous()
    t5 = score_mods.t5_bias(torch.randn(32, 3, generator=g), 16)
    alibi = score_mods.alibi(score_mods.alibi_slopes(3))
    for fn in (t5, alibi):
        sm, tabs = cm.compile_score_mod(fn)
        moved = score_mod_for_key(at_rows(sm.key, rows[0]))
        assert moved.key != sm.key and moved.row_shift == "none"
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.arange(3).view(1, 3, 1, 1)
        i = torch.arange(Sq).view(1, 1, Sq, 1)
        j = torch.arange(Sk).view(1, 1, 1, Sk)
        score = torch.randn(B, 3, Sq, Sk, generator=g)
        got = moved.evaluate(score, b, h, i, j, [*tabs, table])
        want = sm.evaluate(score, b, h, want_pos.view(B, 1, Sq, 1), j, tabs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert at_rows(sm.key, rows[0]) == moved.key  # one key per (score_mod, kind)
    none = cm.compile_score_mod(score_mods.softcap(5))[0]
    assert at_rows(none.key, rows[0]) == none.key  # reads no q_idx: unchanged


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["last_rows", "requests", "fallback_rows"])
def test_gpu_score_mods_at_the_rows_positions(kind):
    """A T5 bias and ALiBi on rows elsewhere in their sequences (a decode step and a chunk of
    prefill, requests of their own lengths, chosen rows of a mask with fallback regions) on the
    fa4 engine, forward and backward, within twice PyTorch's bf16 error of the float32
    reference at the rows' positions."""
    from compilemask.api.api import _at_positions, _row_positions
    from compilemask.dsl import score_mods
    from compilemask.pipeline.rows import rows_descriptor

    from helpers import check_attention_vs_reference

    g = torch.Generator().manual_seed(4)
    Sk, B = 700, 2
    for Sq in (1, 77):
        if kind == "fallback_rows":
            mask = cm.compile_mask(masks.dilated_causal())
            rows = torch.stack([torch.randperm(Sk, generator=g)[:Sq].sort().values
                                for _ in range(B)])
            d = rows_descriptor(mask, None, Sk, rows.cuda(), batch_size=B, device="cuda")
        else:
            mask = cm.compile_mask(masks.causal())
            used = torch.tensor([Sk, 300], device="cuda") if kind == "requests" else None
            d = query_descriptor(mask, None, Sk, Sq, batch_size=B, seqused_k=used,
                                 device="cuda")
        q = torch.randn(B, Sq, 4, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Sk, 2, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        t5 = score_mods.t5_bias(torch.randn(32, 4, generator=g).cuda(), 128)
        alibi = score_mods.alibi(score_mods.alibi_slopes(4).cuda())
        for fn in (t5, alibi):
            check_attention_vs_reference(d, q, k, v, "fa4", d.dense_mask(), score_mod=fn,
                                         ref_score_mod=_at_positions(fn, _row_positions(d, 1, B)))


def test_t5_bias_on_a_batch_of_requests_and_a_packed_batch():
    """Requests of their own lengths (seqused_k) and a packed batch (seqused_q): each row's
    T5 bias is at its own position, as each request computed alone."""
    from compilemask.dsl import score_mods

    mask = cm.compile_mask(masks.causal())
    g = torch.Generator().manual_seed(1)
    t5 = score_mods.t5_bias(torch.randn(32, 2, generator=g, dtype=torch.float64), 16)
    used_k, used_q, Sk, Sq = [30, 9], [3, 2], 30, 3
    ks = [torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for n in used_k]
    vs = [torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for n in used_k]
    qs = [torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for n in used_k]
    alone = [cm.attention(qq, kk, vv, mask.preprocess(None, n), score_mod=t5)[:, -m:]
             for qq, kk, vv, n, m in zip(qs, ks, vs, used_k, used_q)]
    k = torch.zeros(2, Sk, 2, 8, dtype=torch.float64)
    v, q = k.clone(), torch.zeros(2, Sq, 2, 8, dtype=torch.float64)
    for b, n in enumerate(used_k):
        k[b, :n], v[b, :n] = ks[b][0], vs[b][0]
        q[b] = qs[b][0, n - Sq:]
    d = query_descriptor(mask, None, Sk, Sq, batch_size=2, seqused_k=torch.tensor(used_k))
    out = cm.attention(q, k, v, d, score_mod=t5)
    for b, m in enumerate(used_q):
        torch.testing.assert_close(out[b, -m:], alone[b][0])
    # packed: request b's queries are local rows 0.. (the rest padding, seeing nothing)
    packed = query_descriptor(mask, None, Sk, Sq, seqused_k=torch.tensor(used_k),
                              seqused_q=torch.tensor(used_q))
    qp = torch.zeros_like(q)
    for b, m in enumerate(used_q):
        qp[b, :m] = qs[b][0, -m:]
    out = cm.attention(qp, k, v, packed, score_mod=t5)
    for b, m in enumerate(used_q):
        torch.testing.assert_close(out[b, :m], alone[b][0])
        assert not out[b, m:].any()


def test_request_batches_never_run_native():
    used = torch.tensor([40, 7])
    d = query_descriptor(cm.compile_mask(masks.causal()), None, 40, 40, batch_size=2,
                         seqused_k=used)
    assert d.q_offset == -1 and not d.native_applies()


@pytest.mark.parametrize("seqused", [False, True])
def test_rows_elsewhere_read_the_table_on_fa4(seqused):
    """A mask whose FA4 mask_mod is its rules at ``q_idx`` (prefix-LM) reads the Interval Table
    instead on rows that are not 0.. of the sequence (served rows, request batches, context-
    parallel shards): the rules would take the local row for the position."""
    pytest.importorskip("cutlass")
    from compilemask.api import distributed as cp
    from compilemask.codegen.cute_mask_mod import mask_mod, mask_mod_variant
    from compilemask.kernels import fa4

    mask = cm.compile_mask(masks.prefix_lm())
    assert mask_mod_variant(mask) == "rules"
    meta = {"prefix_len": torch.tensor([100, 5])}
    d = query_descriptor(mask, meta, 300, 7, batch_size=2,
                         seqused_k=torch.tensor([300, 200]) if seqused else None)
    shard = cp.shard_descriptor(mask, meta, cp.make_plan(mask, meta, 300, 2), 1, batch_size=2)
    for desc in (d, shard):
        assert desc.q_offset != 0
        kw = fa4._mods(desc, "fa4", None, None, backward=False)
        assert kw["mask_mod"] is mask_mod(mask, "intervals")
        assert kw["aux_tensors"][0].data_ptr() == desc.intervals.data_ptr()
        with pytest.raises(ValueError, match="only 'intervals'"):
            fa4._mods(desc, "fa4", "rules", None, backward=False)
    square = mask.preprocess(meta, 300, batch_size=2)
    # rows 0..: the forward reads the table a row at a time, the backward runs the rules
    assert fa4._mods(square, "fa4", None, None, backward=False)["mask_mod"] is \
        mask_mod(mask, "rows")
    assert fa4._mods(square, "fa4", None, None, backward=True)["mask_mod"] is mask_mod(mask)



def _paged(kv, page_size: int, gen):
    """Each of ``kv`` ([B, Sk, Hkv, D]) scattered into a shuffled page pool with two spare pages
    of noise, and the one page table they share."""
    B, Sk, *rest = kv[0].shape
    per = (Sk + page_size - 1) // page_size
    table = torch.randperm(B * per + 2, generator=gen)[:B * per].view(B, per)
    pools = []
    for t in kv:
        pool = torch.randn(B * per + 2, page_size, *rest, generator=gen).to(t.dtype)
        padded = torch.zeros(B, per * page_size, *rest, dtype=t.dtype, device=t.device)
        padded[:, :Sk] = t
        pool = pool.to(t.device)
        pool[table.view(-1).to(t.device)] = padded.view(B * per, page_size, *rest)
        pools.append(pool)
    return (*pools, table.to(torch.int32).to(kv[0].device))


@pytest.mark.parametrize("name", ["causal", "prefix_lm", "tree_verify", "hstu"])
def test_paged_kv_equals_contiguous_keys(name):
    """Keys and values read through a shuffled page table give the contiguous call's output, for
    decode steps and chunks, with and without per-request lengths."""
    from compilemask.api.serving import paged_attention

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    gen = torch.Generator().manual_seed(3)
    Sk, Bq = 300, 3
    meta = masks.random_meta(mask.spec, Bq, Sk, gen)
    for page_size in (16, 64, 128):
        k, v = (torch.randn(Bq, Sk, 2, 32, generator=gen) for _ in range(2))
        k_cache, v_cache, table = _paged((k, v), page_size, gen)
        for Sq, used in ((1, None), (6, None), (1, torch.tensor([300, 17, 1])),
                         (6, torch.tensor([2, 300, 150]))):
            d = query_descriptor(mask, meta, Sk, Sq, batch_size=Bq, seqused_k=used)
            q = torch.randn(Bq, Sq, 4, 32, generator=gen)
            got = paged_attention(q, k_cache, v_cache, table, d)
            want = cm.attention(q, k, v, d)
            assert torch.equal(got, want), (page_size, Sq, used)


def test_paged_kv_refusals_name_the_argument():
    from compilemask.api.serving import paged_attention

    mask = cm.compile_mask(masks.causal())
    d = query_descriptor(mask, None, 100, 1, batch_size=2)
    k, v = (torch.randn(2, 100, 2, 32) for _ in range(2))
    k_cache, v_cache, table = _paged((k, v), 32, torch.Generator().manual_seed(0))
    q = torch.randn(2, 1, 4, 32)
    with pytest.raises(NotImplementedError, match="forward only"):
        paged_attention(q.requires_grad_(), k_cache, v_cache, table, d)
    q = q.detach()
    with pytest.raises(ValueError, match="page_table must be int32"):
        paged_attention(q, k_cache, v_cache, table.long(), d)
    with pytest.raises(ValueError, match="fewer than desc's seqlen_k"):
        paged_attention(q, k_cache, v_cache, table[:, :3], d)
    with pytest.raises(TypeError, match="share a floating dtype"):
        paged_attention(q, k_cache.half(), v_cache, table, d)
    with pytest.raises(ValueError, match="seqlen_q 1; q gives batch 2, seqlen_q 3"):
        paged_attention(torch.randn(2, 3, 4, 32), k_cache, v_cache, table, d)
    with pytest.raises(NotImplementedError, match="cute engine has no paged or varlen keys"):
        paged_attention(q, k_cache, v_cache, table, d, backend="cute")
    with pytest.raises(TypeError, match="desc must be an ExecutionDescriptor"):
        paged_attention(q, k_cache, v_cache, table, None)
    with torch.no_grad():  # grad-requiring inputs are fine without grad
        out = paged_attention(q.requires_grad_(), k_cache, v_cache, table, d)
    assert torch.equal(out, cm.attention(q.detach(), k, v, d))
    q = q.detach()
    bad = table.clone()
    bad[1, 0] = -1  # torch would read the last page
    with pytest.raises(ValueError, match=r"page_table entries must lie in \[0, "):
        paged_attention(q, k_cache, v_cache, bad, d, backend="reference")
    # entries past a request's used keys are not read: unset ones are fine
    short = query_descriptor(mask, None, 100, 1, batch_size=2, seqused_k=torch.tensor([100, 40]))
    unset = table.clone()
    unset[1, 2:] = -1
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, unset, short,
                                               backend="reference"),
                               paged_attention(q, k_cache, v_cache, table, short,
                                               backend="reference"))


def _packed_batch(mask, gen, used_k, used_q, Hkv=2, D=32, dtype=torch.float32, device="cpu"):
    """A packed batch: per-request metadata over its positions, q / k / v packed by the counts,
    the descriptor, and each request's own [1, Sq_b, H, D] contiguous call for comparison."""
    Bq, Sk, Sq = len(used_k), max(used_k), max(used_q)
    meta = masks.random_meta(mask.spec, Bq, Sk, gen)
    meta = {k: v.to(device) for k, v in meta.items()} if meta else None
    d = query_descriptor(mask, meta, Sk, Sq, batch_size=Bq, seqused_k=torch.tensor(used_k),
                         seqused_q=torch.tensor(used_q), device=device)
    q = torch.randn(sum(used_q), 2 * Hkv, D, generator=gen).to(device, dtype)
    k, v = (torch.randn(sum(used_k), Hkv, D, generator=gen).to(device, dtype) for _ in range(2))
    return meta, d, q, k, v


@pytest.mark.parametrize("name", ["causal", "prefix_lm", "tree_verify", "hstu",
                                  "sliding_window"])
def test_varlen_batch_equals_each_request_alone(name):
    """A packed batch (each request's queries its last positions, FA4's varlen layout) gives
    each request's own output: its query_descriptor alone on its contiguous keys; with paged
    keys too."""
    from compilemask.api.serving import paged_attention, varlen_attention

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    gen = torch.Generator().manual_seed(4)
    used_k, used_q = [300, 17, 1, 64], [5, 17, 1, 0]
    meta, d, q, k, v = _packed_batch(mask, gen, used_k, used_q)
    assert d.seqused_q.tolist() == used_q and d.q_offset == -1
    out = varlen_attention(q, k, v, d)
    assert out.shape == q.shape
    k_cache, v_cache, table = _paged((*(_unpack(t, used_k) for t in (k, v)),), 16, gen)
    paged = paged_attention(q, k_cache, v_cache, table, d)
    qo = ko = 0
    for b, (nk, nq) in enumerate(zip(used_k, used_q)):
        one = {p: t[b:b + 1] for p, t in (meta or {}).items()} or None
        if nq:
            alone = query_descriptor(mask, one, nk, nq, batch_size=1)
            want = cm.attention(q[None, qo:qo + nq], k[None, ko:ko + nk], v[None, ko:ko + nk],
                                alone)[0]
            assert torch.equal(out[qo:qo + nq], want), (name, b)
            assert torch.equal(paged[qo:qo + nq], want), (name, b)
        qo, ko = qo + nq, ko + nk


def _unpack(t, used):
    """[B, max, ...] zero-padded from a packed [total, ...]."""
    out = t.new_zeros(len(used), max(used), *t.shape[1:])
    o = 0
    for b, n in enumerate(used):
        out[b, :n] = t[o:o + n]
        o += n
    return out


def test_varlen_refusals_name_the_argument():
    from compilemask.api.serving import varlen_attention

    mask = cm.compile_mask(masks.causal())
    _, d, q, k, v = _packed_batch(mask, torch.Generator().manual_seed(0), [9, 4], [2, 4])
    with pytest.raises(ValueError, match=r"q must be \[total_q, H, D\]"):
        varlen_attention(q[None], k, v, d)
    with pytest.raises(ValueError, match=r"seqused_k=, seqused_q="):
        varlen_attention(q, k, v, query_descriptor(mask, None, 9, 4, batch_size=2,
                                                   seqused_k=torch.tensor([9, 4])))
    with pytest.raises(ValueError, match="q holds 5 rows"):
        varlen_attention(q[:5], k, v, d)
    with pytest.raises(ValueError, match="seqused_q .* needs seqused_k"):
        query_descriptor(mask, None, 9, 4, batch_size=2, seqused_q=torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="exceeds"):
        query_descriptor(mask, None, 9, 4, batch_size=2, seqused_k=torch.tensor([9, 3]),
                         seqused_q=torch.tensor([2, 4]))
    with pytest.raises(NotImplementedError, match="forward only"):
        varlen_attention(q.requires_grad_(), k, v, d)
    with pytest.raises(ValueError, match=r"k holds 10 rows, the descriptor's seqused_k \[9, 4\]"):
        varlen_attention(q.detach(), k[:10], v[:10], d, backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "tree_verify"])
def test_gpu_varlen_batch_vs_float32_reference(name):
    """A packed batch on FA4's varlen kernels (native for causal / window, the interval
    mask_mod otherwise), contiguous and paged keys, within twice PyTorch's bf16 error per
    request; a request with no queries, one with a single key."""
    from compilemask.api.serving import paged_attention, varlen_attention
    from compilemask.kernels.dispatch import select_served_engine

    from helpers import check_output_vs_reference

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    gen = torch.Generator().manual_seed(8)
    used_k, used_q = [1000, 517, 1, 900], [64, 1, 1, 0]
    meta, d, q, k, v = _packed_batch(mask, gen, used_k, used_q, D=128, dtype=torch.bfloat16,
                                     device="cuda")
    engine = "native" if mask.native_pattern is not None else "fa4"
    assert select_served_engine("t", q, d, "auto") == engine
    k_cache, v_cache, table = _paged(tuple(_unpack(t, used_k) for t in (k, v)), 128, gen)
    dense = d.dense_mask()
    for out in (varlen_attention(q, k, v, d), paged_attention(q, k_cache, v_cache, table, d)):
        qo = ko = 0
        for b, (nk, nq) in enumerate(zip(used_k, used_q)):
            if nq:
                check_output_vs_reference(out[None, qo:qo + nq], q[None, qo:qo + nq],
                                          k[None, ko:ko + nk], v[None, ko:ko + nk],
                                          dense[b:b + 1, :nq, :nk])
            qo, ko = qo + nq, ko + nk


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "tree_verify",
                                  "packed_documents"])
def test_gpu_paged_kv_vs_float32_reference(name):
    """FA4's paged kernels (native for masks proven causal / windowed, the interval mask_mod on
    every tile otherwise) within twice PyTorch's bf16 error, at FA4's TMA page size (128) and a
    smaller one (64, cp.async loads), decode steps and chunks, with per-request lengths."""
    from compilemask.api.serving import paged_attention

    from helpers import check_output_vs_reference

    mask = cm.compile_mask(masks.EXAMPLES[name]())
    gen = torch.Generator().manual_seed(7)
    Sk, Bq = 1000, 3
    meta = {k: v.cuda() for k, v in (masks.random_meta(mask.spec, Bq, Sk, gen) or {}).items()}
    for page_size in (128, 64):
        k, v = (torch.randn(Bq, Sk, 2, 128, generator=gen).to("cuda", torch.bfloat16)
                for _ in range(2))
        k_cache, v_cache, table = _paged((k, v), page_size, gen)
        for Sq, used in ((1, None), (77, None), (1, torch.tensor([1000, 517, 3])),
                         (64, torch.tensor([900, 5, 1000]))):
            used = None if used is None else used.cuda()
            d = query_descriptor(mask, meta or None, Sk, Sq, batch_size=Bq, seqused_k=used,
                                 device="cuda")
            q = torch.randn(Bq, Sq, 4, 128, generator=gen).to("cuda", torch.bfloat16)
            out = paged_attention(q, k_cache, v_cache, table, d)
            check_output_vs_reference(out, q, k, v, d.dense_mask())


def test_request_batches_run_native_only_where_fa4_aligns_them():
    """FA4's own kernels run request batches of masks proven causal or windowed; [B, Sq] queries
    of a mask with keys to the right (full, two-sided window) stay on the mask_mod, since rows
    before a short request's first key see nothing in the mask and keys in FA4's; packed
    queries have no such rows."""
    from compilemask.kernels.dispatch import runs_native_served as _runs_native

    used, used_q = torch.tensor([9, 2]), torch.tensor([3, 2])
    for spec, rows_before in ((masks.causal(), True), (masks.sliding_window(4), True),
                              (_FULL, False), (_TWO_SIDED, False)):
        mask = cm.compile_mask(spec)
        assert mask.native_pattern is not None, spec.name
        d = query_descriptor(mask, None, 9, 3, batch_size=2, seqused_k=used)
        assert _runs_native(d) is rows_before, spec.name
        d = query_descriptor(mask, None, 9, 3, batch_size=2, seqused_k=used, seqused_q=used_q)
        assert _runs_native(d), spec.name
    d = query_descriptor(cm.compile_mask(masks.prefix_lm()), {"prefix_len": torch.tensor([1, 1])},
                         9, 3, batch_size=2, seqused_k=used, seqused_q=used_q)
    assert not _runs_native(d)


def _full_rule(i, j):
    return j >= 0


def _two_sided_rule(i, j):
    return (j >= i - 2) & (j <= i + 2)


def _every(i):
    return True


_FULL = cm.MaskSpec("full", regions=[cm.Region("all", _every, _full_rule)])
_TWO_SIDED = cm.MaskSpec("two_sided", regions=[cm.Region("all", _every, _two_sided_rule)])


def test_fa4_length_arguments_are_made_once_per_descriptor():
    """cu_seqlens / seqused_k for FA4 come from the descriptor's counts, made once per
    descriptor (a layer loop launches nothing for them)."""
    from compilemask.api.serving import _lengths
    from compilemask.kernels.contract import OpSlots

    mask = cm.compile_mask(masks.causal())
    d = query_descriptor(mask, None, 9, 4, batch_size=2, seqused_k=torch.tensor([9, 4]),
                         seqused_q=torch.tensor([2, 4]))
    got = _lengths(d, paged=False)  # the op's served slots
    assert got is _lengths(d, paged=False)
    assert got["cu_seqlens_q"].tolist() == [0, 2, 6] and got["cu_seqlens_k"].tolist() == [0, 9, 13]
    fa4_args = OpSlots(**got).served_lengths(d.seqlen_q, d.seqlen_k)
    assert (fa4_args["max_seqlen_q"], fa4_args["max_seqlen_k"]) == (4, 9)
    assert "seqused_k" not in fa4_args and "page_table" not in fa4_args
    assert _lengths(d, paged=True)["seqused_k"].tolist() == [9, 4]
    square = query_descriptor(mask, None, 9, 1, batch_size=2)
    assert _lengths(square, paged=True)["seqused_k"].tolist() == [9, 9]


def test_reference_on_served_rows_runs_any_score_mod():
    """The reference engine runs any score_mod on served rows at their positions, one the
    converter does not read (a -inf constant) included; rows whose positions the descriptor
    does not hold (a context-parallel shard's) run only one whose reading of q_idx is known, and
    the refusal says why."""
    import dataclasses

    from compilemask.api.serving import query_descriptor

    mask = cm.compile_mask(masks.causal())
    desc = query_descriptor(mask, None, 16, 4, batch_size=1)
    q, k = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)

    def no_first_key(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == 0, float("-inf"), score)

    def not_before_q(score, b, h, q_idx, kv_idx):  # reads q_idx: a position, not a local row
        return torch.where(kv_idx + 3 < q_idx, score - 1.0, score)

    for fn in (no_first_key, not_before_q):
        want = cm.attention(q, k, k, mask.preprocess(None, 16), score_mod=fn)[:, -4:]
        torch.testing.assert_close(
            cm.attention(q[:, -4:], k, k, desc, score_mod=fn, backend="reference"), want)
    shard = dataclasses.replace(desc, q_offset=-1)  # rows elsewhere, positions not recorded
    torch.testing.assert_close(  # a -inf score is a masked one: converted, reads no q_idx
        cm.attention(q[:, -4:], k, k, shard, score_mod=no_first_key, backend="reference"),
        cm.attention(q, k, k, mask.preprocess(None, 16), score_mod=no_first_key)[:, -4:])

    def unread(score, b, h, q_idx, kv_idx):  # the converter does not read gelu
        return torch.nn.functional.gelu(score) + q_idx

    with pytest.raises(NotImplementedError, match="not rows 0.*does not convert.*gelu"):
        cm.attention(q[:, -4:], k, k, shard, score_mod=unread, backend="reference")
