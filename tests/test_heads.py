"""Per-head masks as head groups: per-head windows and retrieval / streaming heads (GQA kept
where a group holds whole kv heads, gathered otherwise) equal dense attention with the
[B, H, Sq, Sk] mask, outputs, LSE and gradients (float64); a score_mod sees the model's heads."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask import masks

B, S, H, HKV, D = 2, 29, 4, 2, 8


def _dense(q, k, v, mask4, score_mod=None):
    G = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(G, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[-1] ** -0.5
    if score_mod is not None:
        from compilemask.compiler.reference import apply_score_mod

        s = apply_score_mod(s, score_mod)
    s = s.masked_fill(~mask4, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(mask4, torch.exp(s - lse.unsqueeze(-1).clamp(min=-1e30)), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse


def _check_vs_dense(groups, mask4, seed):
    """Attention through ``groups`` and its gradients equal dense attention with ``mask4``."""
    q, k, v = _qkv(seed)
    out = cm.attention(q, k, v, groups)
    ref, _ = _dense(q, k, v, mask4)
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    exp = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, n, D, generator=g, dtype=torch.float64, requires_grad=True)
                 for n in (H, HKV, HKV))


CASES = {
    "per_head_windows": lambda: [cm.compile_mask(masks.sliding_window(w)) for w in (3, 7, 7, 20)],
    # retrieval heads 0-1 (kv head 0, GQA kept) and streaming heads 2-3
    "duo_whole_kv_heads": lambda: [cm.compile_mask(masks.causal())] * 2
    + [cm.compile_mask(masks.sink_window(6, 2))] * 2,
    # a kv head's query heads in two groups: its k/v gathered per query head
    "duo_split_kv_heads": lambda: [cm.compile_mask(masks.causal()),
                                   cm.compile_mask(masks.sink_window(6, 2))] * 2,
    "prefix_lm_and_hstu": lambda: [cm.compile_mask(masks.prefix_lm())] * 3
    + [cm.compile_mask(masks.hstu())],
}


def _meta():
    g = torch.Generator().manual_seed(3)
    meta = masks.random_meta(masks.hstu(), B, S, g)
    meta.update(masks.random_meta(masks.prefix_lm(), B, S, g))
    return meta


@pytest.mark.parametrize("case", sorted(CASES))
def test_head_groups_equal_dense_per_head_attention(case):
    head_masks = CASES[case]()
    groups = cm.preprocess_heads(head_masks, _meta(), S, batch_size=B)
    assert len(groups.groups) == len({m.key for m in head_masks})
    mask4 = groups.dense_mask()
    assert mask4.shape == (B, H, S, S)
    for h, m in enumerate(head_masks):
        own = {p: _meta()[p] for p in m.spec.params} or None
        assert torch.equal(mask4[:, h], m.preprocess(own, S, batch_size=B).dense_mask())
    q, k, v = _qkv()
    out, lse = cm.attention(q, k, v, groups, return_lse=True)
    want, want_lse = _dense(q, k, v, mask4)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    assert torch.autograd.gradcheck(lambda *x: cm.attention(*x, groups), (q, k, v),
                                    fast_mode=True)


def test_head_groups_score_mod_sees_the_model_heads():
    bias = torch.tensor([0.0, 1.0, -2.0, 3.0], dtype=torch.float64)

    def per_head(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (kv_idx - q_idx) / 8

    groups = cm.preprocess_heads(CASES["duo_split_kv_heads"](), None, S, batch_size=B)
    q, k, v = _qkv(1)
    out = cm.attention(q, k, v, groups, score_mod=per_head)
    want, _ = _dense(q, k, v, groups.dense_mask(), score_mod=per_head)
    torch.testing.assert_close(out, want)


def test_head_groups_errors():
    causal = cm.compile_mask(masks.causal())
    with pytest.raises(TypeError, match="head 1's mask is a MaskSpec"):
        cm.preprocess_heads([causal, masks.causal()], None, S)
    with pytest.raises(ValueError, match="empty"):
        cm.preprocess_heads([], None, S)
    groups = cm.preprocess_heads([causal] * 2, None, S, batch_size=B)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q has 4 heads, the HeadGroups 2"):
        cm.attention(q, k, v, groups)
    d = causal.preprocess(None, S, batch_size=B)
    with pytest.raises(ValueError, match="not each of 0..2 once"):
        cm.HeadGroups(((d, (0, 1)), (d, (1,))), 3)
    # a group's query heads pair with its kv heads in order: given out of order, refused
    with pytest.raises(ValueError, match=r"heads \(2, 0\) are not ascending"):
        cm.HeadGroups(((d, (2, 0)), (d, (1, 3))), 4)
    assert "heads [0, 1]" in groups.explain()
    # a sink of another length is refused before the groups slice it
    win = cm.compile_mask(masks.sliding_window(3))
    mixed = cm.preprocess_heads([causal, win, causal, win], None, S, batch_size=B)
    with pytest.raises(ValueError, match=r"learnable_sink must be \[H\] = \[4\], got \[8\]"):
        cm.attention(q, k, v, mixed, learnable_sink=torch.zeros(8), backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["per_head_windows", "duo_whole_kv_heads", "duo_split_kv_heads"])
def test_gpu_head_groups_vs_float32_reference(case):
    """Each group on its GPU engine (native windows, FA4 lists for the sink window), forward and
    backward within twice PyTorch's bf16 error of the float32 reference."""
    Sg = 1000
    groups = cm.preprocess_heads(CASES[case](), None, Sg, batch_size=2, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, Sg, H, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, Sg, HKV, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    do = torch.randn_like(q)

    def run(dtype, **kw):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o = (cm.attention(*xs, groups, **kw) if kw else _dense(*xs, groups.dense_mask())[0])
        o.backward(do.to(dtype))
        return [o] + [x.grad for x in xs]

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    got, exact, bf16 = run(torch.bfloat16, backend="auto"), run(
        torch.float32, backend="reference"), run(torch.bfloat16)
    for what, a, e, t in zip(("out", "dq", "dk", "dv"), got, exact, bf16):
        assert rel(a, e) <= 2 * rel(t, e) + 1e-4, (what, rel(a, e), rel(t, e))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["per_head_windows", "duo_split_kv_heads"])
def test_gpu_head_groups_never_synchronize(case):
    """A batch's new HeadGroups (its preprocess) + forward + backward: no host synchronization
    after the first batch of a grouping (its index tensors are shared by every HeadGroups of
    that grouping)."""
    Sg, head_masks = 1000, CASES[case]()
    q = torch.randn(2, Sg, H, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, Sg, HKV, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    for step in range(2):
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            groups = cm.preprocess_heads(head_masks, None, Sg, batch_size=2, device="cuda")
            cm.attention(q, k, v, groups).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_head_groups_of_one_grouping_share_their_index_tensors():
    """Index tensors are made once per grouping, not per HeadGroups (a host list copied to a GPU
    synchronizes); views need none at all."""
    head_masks = CASES["duo_split_kv_heads"]()
    a, b = (cm.preprocess_heads(head_masks, None, S, batch_size=B) for _ in range(2))
    assert a is not b and a.indices(2, "cpu")[1] is b.indices(2, "cpu")[1]


@pytest.mark.parametrize("fold", [False, True])
def test_head_groups_in_a_transformers_model(fold):
    """Per-head windows through a tiny Qwen3 (GQA) equal SDPA given the [B, H, S, S] mask,
    logits and gradients; as groups, and folded (``w[h]`` converted per head)."""
    transformers = pytest.importorskip("transformers")
    import copy

    from compilemask.integrations import transformers as cm_hf

    name = cm_hf.register()
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, use_cache=False,
                                   dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation="sdpa")
    mod = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                        attn_implementation=name)
    mod.load_state_dict(ref.state_dict())
    if fold:
        specs, metas = cm.from_mask_mod_heads(_windows_mm, num_heads=4, batch_size=2)
        groups = cm.preprocess_heads([cm.compile_mask(s) for s in specs], metas, 33,
                                     batch_size=2, fold=True)
        assert groups.folded
    else:
        groups = cm.preprocess_heads(CASES["per_head_windows"](), None, 33, batch_size=2)
    ids = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    runs = []
    for model, kw in ((ref, {"attention_mask": groups.dense_mask()}),
                      (mod, {"compilemask_desc": groups})):
        model.zero_grad()
        out = model(ids, **kw)
        out.logits.square().mean().backward()
        runs.append((out.logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=2e-5, rtol=1e-4)
    for a, b in zip(runs[1][1], runs[0][1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def _head_mask_mods():
    """FlexAttention mask_mods that read h, as models write them."""
    window = torch.tensor([3, 17, 3, 50])
    is_global = torch.tensor([True, False, False, True])
    prefix = torch.tensor([[5, 0, 9, 2], [1, 12, 0, 7]])  # [B, H]
    doc = torch.randint(0, 3, (B, H, S), generator=torch.Generator().manual_seed(1)).sort(-1)[0]

    def per_head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window[h])

    def duo(b, h, q_idx, kv_idx):  # retrieval heads causal, streaming heads sinks + window
        streaming = (kv_idx < 2) | (q_idx - kv_idx < 6)
        return (kv_idx <= q_idx) & (is_global[h] | streaming)

    def branch_on_h(b, h, q_idx, kv_idx):
        return torch.where(h < 2, kv_idx <= q_idx, (kv_idx < prefix[b, h]) | (kv_idx <= q_idx))

    def per_head_documents(b, h, q_idx, kv_idx):
        return doc[b, h, q_idx] == doc[b, h, kv_idx]

    return [per_head_window, duo, branch_on_h, per_head_documents]


@pytest.mark.parametrize("fold", [None, False])
@pytest.mark.parametrize("n", range(4))
def test_mask_mods_reading_h_equal_create_mask_per_head(n, fold):
    """``from_mask_mod_heads``: h a constant per head, head-indexed tensors selected at it;
    the head groups' [B, H, Sq, Sk] mask equals FlexAttention's create_mask, and attention
    equals dense per-head attention; heads with equal rules share a compiled mask. By default
    heads of one compiled mask fold into one descriptor; ``fold=False`` keeps groups."""
    from torch.nn.attention.flex_attention import create_mask

    mm = _head_mask_mods()[n]
    specs, metas = cm.from_mask_mod_heads(mm, num_heads=H, batch_size=B)
    compiled = [cm.compile_mask(s) for s in specs]
    assert len(compiled) == len(metas) == H
    groups = cm.preprocess_heads(compiled, metas, seqlen_q=S, batch_size=B, fold=fold)
    one_mask = len({c.key for c in compiled}) == 1
    assert groups.folded == (fold is None and one_mask), groups  # every head's w[h] its own
    want = create_mask(mm, B, H, S, S, device="cpu")
    assert torch.equal(groups.dense_mask(), want), mm.__name__
    q, k, v = _qkv(3)
    kk, vv = (t.repeat_interleave(H // HKV, dim=2) for t in (k, v))
    out = cm.attention(q, kk, vv, groups)
    ref, _ = _dense(q, kk, vv, want)
    torch.testing.assert_close(out, ref)
    # w[h] / is_global[h] are one param (w_sel) of every head's rule: one compiled mask;
    # h < 2 splits the heads into two masks
    assert len({c.key for c in compiled}) == (2 if mm.__name__ == "branch_on_h" else 1)


def test_mask_mods_reading_h_refusals():
    mm = _head_mask_mods()[0]
    with pytest.raises(NotImplementedError, match=r"from_mask_mod_heads\(mask_mod, num_heads"):
        cm.from_mask_mod(mm)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        cm.from_mask_mod_heads(mm, num_heads=0)
    with pytest.raises(NotImplementedError, match="index 4 of dimension 0 .* out of range"):
        cm.from_mask_mod_heads(mm, num_heads=5)
    specs, metas = cm.from_mask_mod_heads(mm, num_heads=H)
    with pytest.raises(ValueError, match="meta is a list of 4, the heads 3"):
        cm.preprocess_heads([cm.compile_mask(s) for s in specs[:3]], metas, seqlen_q=S)


def test_constant_indices_select_before_reading():
    """``t[b, 3]``, ``t[0]`` and ``t[b, 1, q_idx]``: a constant index selects first."""
    from torch.nn.attention.flex_attention import create_mask

    lens = torch.tensor([[4, 9, 1], [0, 20, 6]])
    first = torch.tensor([7, 2])
    rows = torch.randint(0, 30, (B, 2, S), generator=torch.Generator().manual_seed(2))

    def mm(b, h, q_idx, kv_idx):
        return ((kv_idx < lens[b, 1]) | (kv_idx == first[0])) & (kv_idx <= rows[b, 1, q_idx])

    spec, meta = cm.from_mask_mod(mm, batch_size=B)
    got = cm.compile_mask(spec).preprocess(meta, seqlen_q=S, batch_size=B).dense_mask()
    assert torch.equal(got, create_mask(mm, B, 1, S, S, device="cpu")[:, 0])


def test_consecutive_head_runs_split_into_views():
    """Groups that are consecutive runs of whole kv heads run on views of q, k, v (no
    gathers); any other grouping gathers its heads."""
    meta = _meta()
    expect = {"duo_whole_kv_heads": ([2, 2], [1, 1]), "per_head_windows": None,
              "duo_split_kv_heads": None, "prefix_lm_and_hstu": None}
    for case, sizes in expect.items():
        groups = cm.preprocess_heads(CASES[case](), meta, seqlen_q=S, batch_size=B)
        assert groups.split_sizes(H // HKV) == sizes, case
    groups = cm.preprocess_heads(CASES["per_head_windows"](), None, seqlen_q=S, batch_size=B)
    assert groups.split_sizes(1) == ([1, 2, 1], [1, 2, 1])


# ---- folded heads: one descriptor of a sequence per (batch, head), one launch ----------------
WINDOWS = torch.tensor([2, 5, 11, 30])


def _windows_mm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOWS[h])


def _docs_mm(doc):
    def mm(b, h, q_idx, kv_idx):
        return (doc[b, h, q_idx] == doc[b, h, kv_idx]) & (kv_idx <= q_idx)
    return mm


def _folded(mm, Sq=S):
    specs, metas = cm.from_mask_mod_heads(mm, num_heads=H, batch_size=B, seqlen=Sq)
    return cm.preprocess_heads([cm.compile_mask(s) for s in specs], metas, Sq, batch_size=B,
                               fold=True)


@pytest.mark.parametrize("case", ["windows", "documents", "tables"])
def test_folded_heads_equal_flex_and_dense_attention(case):
    """Heads of one compiled mask with their own metadata (``w[h]``, per-head documents),
    folded: the mask equals create_mask per head, attention and its gradients dense
    attention with that [B, H, Sq, Sk] mask (GQA)."""
    from torch.nn.attention.flex_attention import create_mask

    if case == "windows":
        mm = _windows_mm
    elif case == "tables":  # a bool table per head, read at the token pair
        t = torch.rand(B, H, S, S, generator=torch.Generator().manual_seed(5)) < 0.3

        def mm(b, h, q_idx, kv_idx):
            return t[b, h, q_idx, kv_idx] | (q_idx == kv_idx)
    else:
        doc = torch.randint(0, 3, (B, H, S), generator=torch.Generator().manual_seed(3))
        mm = _docs_mm(doc.sort(dim=-1).values)
    groups = _folded(mm)
    assert groups.folded and groups.batch_size == B and len(groups.groups) == 1
    assert "folded" in groups.explain()
    want = create_mask(mm, B, H, S, S, device="cpu")
    assert torch.equal(groups.dense_mask(), want)
    _check_vs_dense(groups, want, seed=0)


def test_fold_needs_one_compiled_mask_and_runs_on_fa4_only():
    """Heads of different masks stay groups; folded heads refuse the native and cute engines
    by name."""
    from compilemask.kernels.dispatch import why_not

    per_head = CASES["per_head_windows"]()  # four compiled windows, three masks
    groups = cm.preprocess_heads(per_head, None, S, batch_size=B, fold=True)
    assert not groups.folded and len(groups.groups) == 3
    desc = _folded(_windows_mm).groups[0][0]
    q = torch.empty(B, S, H, D)
    for engine in ("native", "cute"):
        assert "fa4 engine" in why_not(q, desc, engine, False, heads=H)
    with pytest.raises(ValueError, match="q has 3 heads, the HeadGroups 4"):
        cm.attention(torch.randn(B, S, 3, D), torch.randn(B, S, 1, D),
                     torch.randn(B, S, 1, D), _folded(_windows_mm))


@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [4, 2])
def test_gpu_folded_heads_vs_float32_reference(hkv):
    """Per-head windows in one FA4 launch (per-head lists, the mask_mod at row b * H + h),
    MHA and GQA, forward and backward within twice PyTorch's bf16 error; no host sync."""
    from helpers import check_attention_vs_reference

    Sg = 1000
    w = torch.tensor([64, 200, 513, 1000], device="cuda")

    def mm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w[h])

    specs, metas = cm.from_mask_mod_heads(mm, num_heads=H, batch_size=2)
    head_masks = [cm.compile_mask(s) for s in specs]
    groups = cm.preprocess_heads(head_masks, metas, Sg, batch_size=2, device="cuda", fold=True)
    assert groups.folded
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, Sg, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, Sg, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    check_attention_vs_reference(groups, q, k, v, "fa4", groups.dense_mask())
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = cm.preprocess_heads(head_masks, metas, Sg, batch_size=2, device="cuda", fold=True)
        qq = q.detach().requires_grad_()
        cm.attention(qq, k, v, again).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_gpu_folded_per_head_documents_vs_float32_reference():
    """Per-head packed documents (a mask proven native as segments) folded: the lists are made
    with the descriptor and FA4's one launch runs every head."""
    from helpers import check_attention_vs_reference

    Sg = 1000
    gen = torch.Generator().manual_seed(1)
    doc = torch.randint(0, 5, (2, H, Sg), generator=gen).sort(dim=-1).values.cuda()
    specs, metas = cm.from_mask_mod_heads(_docs_mm(doc), num_heads=H, batch_size=2)
    groups = cm.preprocess_heads([cm.compile_mask(s) for s in specs], metas, Sg, batch_size=2,
                                 device="cuda", fold=True)
    assert groups.folded and groups.groups[0][0].lists is not None
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, Sg, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    check_attention_vs_reference(groups, q, k, v, "fa4", groups.dense_mask())


def test_folded_heads_under_torch_compile():
    """Folded heads through the custom ops in a compiled graph (fullgraph), equal to eager."""
    groups = _folded(_windows_mm)
    q, k, v = _qkv()
    f = torch.compile(lambda a, b, c: cm.attention(a, b, c, groups), backend="eager",
                      fullgraph=True)
    torch.testing.assert_close(f(q, k, v), cm.attention(q, k, v, groups))


# ---- per-head masks written in the DSL: the head index h, metadata with a head axis ----------

H_GLOBAL = 3  # a module constant a rule may read under its own name


def _duo_spec():
    # retrieval heads (h < 2) causal, the others 4 sinks and a window of w keys
    def visible(i, j):
        return (j <= i) & ((h < 2) | (j < 4) | (j > i - w))  # noqa: F821

    return cm.MaskSpec("duo_rules", params=("w",), regions=[cm.Region(
        "all", lambda i: True, visible)])


def _brute(mask, meta):
    from compilemask.compiler.reference import brute_force_mask

    B_, scal, arrs, _ = mask.normalize_meta(meta, S, S, B, None)
    return brute_force_mask(mask, B_, scal, arrs, S, S)


@pytest.mark.parametrize("fold", [None, False])
def test_rules_reading_h_equal_brute_force_per_head(fold):
    """A rule reading ``h`` (no param or variable of that name): ``preprocess(...,
    num_heads=H)`` gives HeadGroups whose [B, H, Sq, Sk] mask is the user's rule called per head
    (brute force), folded by default; one head's descriptor with ``meta['h']``; attention and
    gradients equal dense per-head attention."""
    mask = cm.compile_mask(_duo_spec())
    assert mask.head_param == "h" and mask.spec.params == ("w", "h")
    assert "h: the query head" in mask.explain()
    w = torch.tensor([2, 9])
    groups = mask.preprocess({"w": w}, S, num_heads=H, fold=fold)
    assert groups.folded == (fold is None) and groups.num_heads == H
    dense = groups.dense_mask()
    assert dense.shape == (B, H, S, S)
    for h_ in range(H):
        want = _brute(mask, {"w": w, "h": h_})
        assert torch.equal(dense[:, h_], want), h_
        assert torch.equal(mask.preprocess({"w": w, "h": h_}, S).dense_mask(), want)
    assert not torch.equal(dense[:, 0], dense[:, 2])  # the heads differ
    _check_vs_dense(groups, dense, seed=5)


def test_head_axis_metadata_per_head():
    """With ``num_heads``, scalars ``[B, H]``, arrays ``[B, H, Sq]`` and tables ``[B, H, Sq,
    M]`` carry a head axis, each head reads its slice; equal to the rule per head. Without it
    a head axis stays a shape error (never a head count guessed from a shape)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randint(1, S, (B, H), generator=g)
    win = cm.compile_mask(cm.MaskSpec("w_per_head", params=("w",), regions=[cm.Region(
        "all", lambda i: True, lambda i, j: (j <= i) & (j > i - w))]))
    with pytest.raises(ValueError, match=r"a value per head is \[B, H\] with preprocess"):
        win.preprocess({"w": w}, S)
    groups = win.preprocess({"w": w}, S, num_heads=H)
    assert groups.num_heads == H and groups.folded
    ii, jj = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    assert torch.equal(groups.dense_mask(), (jj <= ii) & (jj > ii - w.view(B, H, 1, 1)))
    docs = cm.compile_mask(cm.MaskSpec("docs_per_head", params=("doc",), regions=[cm.Region(
        "all", lambda i: True, lambda i, j: (j <= i) & (doc[j] == doc[i]))]))
    doc = torch.randint(0, 4, (B, H, S), generator=g).sort(-1).values
    groups = docs.preprocess({"doc": doc}, S, num_heads=H)
    assert groups.num_heads == H
    want = (jj <= ii) & (doc.unsqueeze(-1) == doc.unsqueeze(-2))
    assert torch.equal(groups.dense_mask(), want)
    tree = cm.compile_mask(cm.MaskSpec("tab_per_head", params=("anc",), regions=[cm.Region(
        "all", lambda i: True, lambda i, j: (j <= i) & (anc[i, j] == 1))]))
    anc = torch.rand(B, H, S, S, generator=g) < 0.5
    groups = tree.preprocess({"anc": anc}, S, num_heads=H)
    assert torch.equal(groups.dense_mask(), (jj <= ii) & anc)


def test_per_head_preprocess_refusals_name_the_fix():
    mask = cm.compile_mask(_duo_spec())
    with pytest.raises(ValueError, match=r"reads the head index 'h': pass num_heads=H"):
        mask.preprocess({"w": 3}, S)
    with pytest.raises(ValueError, match=r"reads the head index 'h': preprocess\(\.\.\., "
                                         r"num_heads=H\) sets it per head"):
        mask.normalize_meta({"w": 3}, S, S, B, None)  # the bound Preprocessor's check too
    with pytest.raises(ValueError, match=r"num_heads=4 sets per head; leave 'h' out"):
        mask.preprocess({"w": 3, "h": 1}, S, num_heads=4)
    with pytest.raises(ValueError, match=r"num_heads=3, but param 'w' .* has 4 heads"):
        mask.preprocess({"w": torch.ones(B, 4, dtype=torch.int64)}, S, num_heads=3)
    with pytest.raises(ValueError, match=r"num_heads must be a positive int"):
        mask.preprocess({"w": 3}, S, num_heads=0)
    plain = cm.compile_mask(masks.causal())
    with pytest.raises(ValueError, match=r"fold applies to per-head masks"):
        plain.preprocess(None, S, fold=True)
    # every head the same mask: HeadGroups of one group for the [B, H, Sq, Sk] view
    groups = plain.preprocess(None, S, batch_size=B, num_heads=H)
    assert len(groups.groups) == 1 and not groups.folded
    assert groups.dense_mask().shape == (B, H, S, S)


def test_a_variable_named_h_stays_a_constant():
    """``h`` bound in the rule's scope (a global, a closure cell) or declared as a param keeps
    its meaning: only an unbound ``h`` is the head index."""
    h = 2
    closure = cm.compile_mask(cm.MaskSpec("h_closure", regions=[cm.Region(
        "all", lambda i: True, lambda i, j: j <= i - h)]))
    module = cm.compile_mask(cm.MaskSpec("h_module", regions=[cm.Region(
        "all", lambda i: True, lambda i, j: j <= i - H_GLOBAL)]))
    declared = cm.compile_mask(cm.MaskSpec("h_param", params=("h",), regions=[cm.Region(
        "all", lambda i: True, lambda i, j: j <= i - h)]))
    assert closure.head_param is module.head_param is declared.head_param is None
    ii, jj = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    assert torch.equal(closure.preprocess(None, S).dense_mask()[0], jj <= ii - 2)
    assert torch.equal(declared.preprocess({"h": 5}, S).dense_mask()[0], jj <= ii - 5)


@pytest.mark.gpu
def test_gpu_rules_reading_h_vs_float32_reference():
    """DuoAttention heads written with ``h`` in the DSL, folded into one FA4 launch on CUDA,
    GQA, forward and backward within twice PyTorch's bf16 error."""
    from helpers import check_attention_vs_reference

    Sg = 1000
    mask = cm.compile_mask(_duo_spec())
    groups = mask.preprocess({"w": torch.tensor([300, 77], device="cuda")}, Sg, num_heads=H)
    assert groups.folded
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, Sg, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, Sg, HKV, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    check_attention_vs_reference(groups, q, k, v, "fa4", groups.dense_mask())
