"""CompileMask inside a transformers model: a tiny Qwen3 (GQA) with the registered attention
against the same weights under SDPA given the descriptor's dense mask, logits and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import compilemask as cm  # noqa: E402
from compilemask.dsl import packing  # noqa: E402
from compilemask.integrations import transformers as cm_hf  # noqa: E402
from compilemask.masks import causal, hstu, sliding_window  # noqa: E402

B, S, VOCAB = 2, 45, 128  # S not a multiple of 16
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def name():
    return cm_hf.register()


def _config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False,
                dtype=torch.float32)
    return transformers.Qwen3Config(**{**base, **kw})


def _models(impl, scaling=None, **kw):
    """Two models with the same weights: SDPA and ``impl``. from_config writes the attention
    implementation into the config it is given, so each gets its own copy."""
    torch.manual_seed(0)
    cfg = _config(**kw)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation="sdpa")
    mod = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation=impl)
    mod.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "sdpa" and mod.config._attn_implementation == impl
    if scaling is not None:  # not the default D**-0.5: the model's scaling must reach the kernel
        for m in (ref, mod):
            for layer in m.model.layers:
                layer.self_attn.scaling = scaling
    return ref, mod


def _loss_and_grads(model, ids, **kw):
    model.zero_grad()
    out = model(ids, **kw)
    labels = ids.roll(-1, dims=1)
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(ref_run, mod_run):
    (la, ga), (lb, gb) = ref_run, mod_run
    torch.testing.assert_close(lb, la, **TOL)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


HSTU_META = {"ctx_end": torch.tensor([5, 0]), "hist_end": torch.tensor([30, 20]),
             "seq_end": torch.tensor([45, 40]), "group_size": torch.tensor([4, 7])}
CASES = {
    # context rows see ahead, targets see their group; rows 40.. of sequence 1 see nothing
    "hstu": (hstu, HSTU_META),
    "causal": (causal, {}),
    "sliding_window": (lambda: sliding_window(9), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_gradients_match_sdpa(name, case):
    make, meta = CASES[case]
    desc = cm.compile_mask(make()).preprocess(meta, seqlen_q=S, batch_size=B)
    ref, mod = _models(name, scaling=0.2)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    dense = desc.dense_mask()
    # a 4-D mask goes to the attention function as it is: SDPA's bool convention, True = attend
    ref_run = _loss_and_grads(ref, ids, attention_mask=dense[:, None])
    mod_run = _loss_and_grads(mod, ids, compilemask_desc=desc)
    _assert_same(ref_run, mod_run)
    assert all(torch.isfinite(g).all() for g in mod_run[1].values())


def test_gqa_views_and_scaling_reach_cm_attention(name, monkeypatch):
    seen = []
    real = cm_hf.attention

    def spy(q, k, v, desc, **kw):
        seen.append((q.shape, k.shape, v.shape, kw["softmax_scale"]))
        return real(q, k, v, desc, **kw)

    monkeypatch.setattr(cm_hf, "attention", spy)
    _, mod = _models(name, scaling=0.3)
    desc = cm.compile_mask(causal()).preprocess({}, seqlen_q=S, batch_size=B)
    out = mod(torch.zeros(B, S, dtype=torch.long), compilemask_desc=desc)
    assert out.logits.shape == (B, S, VOCAB)
    # [B, S, H, D] with the 2 kv heads as they are (no repeat_kv), once per layer
    assert seen == [((B, S, 4, 16), (B, S, 2, 16), (B, S, 2, 16), 0.3)] * 2


def test_missing_descriptor_is_a_value_error(name):
    _, mod = _models(name)
    with pytest.raises(ValueError, match="compilemask_desc"):
        mod(torch.zeros(B, S, dtype=torch.long))


def test_wrong_descriptor_type_and_4d_mask(name):
    _, mod = _models(name)
    ids = torch.zeros(B, S, dtype=torch.long)
    with pytest.raises(TypeError, match="compilemask_desc"):
        mod(ids, compilemask_desc="causal")
    desc = cm.compile_mask(causal()).preprocess({}, seqlen_q=S, batch_size=B)
    with pytest.raises(ValueError, match="attention_mask"):
        mod(ids, attention_mask=torch.ones(B, 1, S, S, dtype=torch.bool), compilemask_desc=desc)
    with pytest.raises(ValueError, match="seqlen_q"):  # cm.attention's shape check
        mod(ids[:, :-1], compilemask_desc=desc)


def test_dropout_in_training_is_refused(name):
    _, mod = _models(name, attention_dropout=0.1)
    desc = cm.compile_mask(causal()).preprocess({}, seqlen_q=S, batch_size=B)
    ids = torch.zeros(B, S, dtype=torch.long)
    mod.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        mod(ids, compilemask_desc=desc)
    mod.eval()  # transformers passes dropout 0 in eval
    assert mod(ids, compilemask_desc=desc).logits.shape == (B, S, VOCAB)


SLIDING = dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True,
               sliding_window=9)


def test_dict_of_descriptors_by_layer_type(name):
    """Qwen3 with a sliding-window layer: transformers' own causal and sliding masks (SDPA, no
    mask given) against one descriptor per layer type."""
    ref, mod = _models(name, **SLIDING)
    assert [cm_hf.layer_type(m.self_attn) for m in mod.model.layers] == SLIDING["layer_types"]
    descs = {"full_attention": cm.compile_mask(causal()).preprocess({}, seqlen_q=S, batch_size=B),
             "sliding_attention": cm.compile_mask(sliding_window(9)).preprocess(
                 {}, seqlen_q=S, batch_size=B)}
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(2))
    ref_run = _loss_and_grads(ref, ids)
    _assert_same(ref_run, _loss_and_grads(mod, ids, compilemask_desc=descs))
    # causal everywhere: the sliding layer combines it with its window, the same model
    _assert_same(ref_run, _loss_and_grads(mod, ids, compilemask_desc=descs["full_attention"]))
    with pytest.raises(ValueError, match="sliding_attention"):
        mod(ids, compilemask_desc={"full_attention": descs["full_attention"]})


def test_layer_type_without_config():
    class Attn(torch.nn.Module):
        pass

    a = Attn()
    assert cm_hf.layer_type(a) == "full_attention"
    a.sliding_window = 128
    assert cm_hf.layer_type(a) == "sliding_attention"
    a.layer_type = "chunked_attention"
    assert cm_hf.layer_type(a) == "chunked_attention"
    a.config = transformers.Qwen3Config(layer_types=["full_attention", "sliding_attention"],
                                        num_hidden_layers=2)
    a.layer_idx = 0
    assert cm_hf.layer_type(a) == "full_attention"


def test_packed_hstu_with_position_ids(name):
    """Three HSTU sequences packed in one row (position_ids restart, so RoPE restarts): the
    packed run equals SDPA on the dense mask, and each sequence's rows equal that sequence run
    alone with ``masks.hstu``."""
    lens = [17, 21, 9]
    per_seq = {"ctx_end": torch.tensor([3, 0, 2]), "hist_end": torch.tensor([10, 12, 9]),
               "group_size": torch.tensor([3, 4, 5])}
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    total = sum(lens)
    meta = packing.packed_hstu_meta(position_ids=pos, **per_seq)
    desc = cm.compile_mask(packing.packed_hstu_spec()).preprocess(meta, seqlen_q=total)
    ref, mod = _models(name)
    ids = torch.randint(0, VOCAB, (1, total), generator=torch.Generator().manual_seed(3))
    _assert_same(_loss_and_grads(ref, ids, attention_mask=desc.dense_mask()[:, None],
                                 position_ids=pos),
                 _loss_and_grads(mod, ids, compilemask_desc=desc, position_ids=pos))
    packed = mod(ids, compilemask_desc=desc, position_ids=pos).logits
    single = cm.compile_mask(hstu())
    start = 0
    for n, L in enumerate(lens):
        m = {k: int(v[n]) for k, v in per_seq.items()} | {"seq_end": L}
        alone = mod(ids[:, start:start + L],
                    compilemask_desc=single.preprocess(m, seqlen_q=L)).logits
        torch.testing.assert_close(packed[:, start:start + L], alone, **TOL)
        start += L


def test_torch_compile_fullgraph(name):
    """The registered function traces into one graph (no graph breaks), descriptor and all;
    a new batch's descriptor reuses it."""
    _, mod = _models(name)
    mask = cm.compile_mask(hstu())
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(4))
    # cm.attention logs its CPU-path line once, and a traced logging call is a graph break:
    # an eager call says it first
    mod(ids, compilemask_desc=mask.preprocess(HSTU_META, seqlen_q=S))
    torch._dynamo.reset()
    compiled = torch.compile(mod, backend="eager", fullgraph=True)
    for shift in (0, 3):
        meta = {k: v + shift if k != "group_size" else v for k, v in HSTU_META.items()}
        desc = mask.preprocess(meta, seqlen_q=S)
        torch.testing.assert_close(compiled(ids, compilemask_desc=desc).logits,
                                   mod(ids, compilemask_desc=desc).logits, **TOL)


def test_torch_compile_fullgraph_cold(name, monkeypatch):
    from compilemask.api import api

    monkeypatch.setattr(api, "_SAID", set())  # as in a fresh process
    torch._dynamo.reset()
    _, mod = _models(name)
    desc = cm.compile_mask(hstu()).preprocess(HSTU_META, seqlen_q=S)
    compiled = torch.compile(mod, backend="eager", fullgraph=True)
    compiled(torch.zeros(B, S, dtype=torch.long), compilemask_desc=desc)


def test_docs_transformers_lines_run(tmp_path):
    """The first lines of docs/transformers.md, as written, on a tiny Qwen3 saved to disk."""
    import re
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "transformers.md").read_text()
    code = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    transformers.AutoModelForCausalLM.from_config(_config()).save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(5))
    env = {"AutoModelForCausalLM": transformers.AutoModelForCausalLM, "cm": cm,
           "path": str(tmp_path), "meta": HSTU_META, "S": S, "input_ids": ids, "labels": ids}
    exec(compile(code, "docs/transformers.md", "exec"), env)
    assert env["model"].config._attn_implementation == "compilemask"
    assert torch.isfinite(env["loss"]) and env["loss"].requires_grad


def test_context_parallel_arguments_are_checked(name):
    """compilemask_cp needs the rank's shard_descriptor and the plan's local length (the
    checks come before any collective, so no process group is needed here)."""
    from compilemask.api import distributed as cp

    _, mod = _models(name)
    mask = cm.compile_mask(hstu())
    plan = cp.make_plan(mask, HSTU_META, S, 2, tile=16, batch_size=B)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(6))
    ids_l, pos_l = cm_hf.shard_inputs(ids, plan, 1)
    rows = plan.rows[1]
    assert ids_l.shape == pos_l.shape == (B, plan.local_len)
    assert torch.equal(pos_l[0], torch.where(rows < S, rows, 0))  # global positions, pad 0
    assert torch.equal(ids_l[:, rows < S], ids[:, rows[rows < S]])
    with pytest.raises(ValueError, match="compilemask_cp.*compilemask_desc"):
        mod(ids_l, position_ids=pos_l, compilemask_cp=(plan, None))
    full = mask.preprocess(HSTU_META, seqlen_q=S)
    with pytest.raises(ValueError, match="compilemask_desc is for seqlen_q 45"):
        mod(ids_l, position_ids=pos_l, compilemask_desc=full, compilemask_cp=plan)
    desc = cp.shard_descriptor(mask, HSTU_META, plan, 1, batch_size=B)
    with pytest.raises(ValueError, match="compilemask_cp: the model got 45 tokens"):
        mod(ids, compilemask_desc=desc, compilemask_cp=(plan, None))
    with pytest.raises(TypeError, match="compilemask_cp"):
        mod(ids_l, position_ids=pos_l, compilemask_desc=desc, compilemask_cp="ring")
