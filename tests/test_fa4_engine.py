"""The FA4 engines: native patterns (proofs and segments), the mask_mod, engine selection, and on
the GPU every example mask through every engine against a float32 reference."""

from __future__ import annotations

import os

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.compiler.native import native_pattern

from helpers import check_attention_vs_reference, fake_on_cuda, sweep

M, R = cm.MaskSpec, cm.Region

# ---------------------------------------------------------------------------------------------
# native patterns (CPU)
# ---------------------------------------------------------------------------------------------
NATIVE = {
    "causal": ("window", None, 0, False),
    "sliding_window": ("window", 6, 0, False),
    "packed_documents": ("segments", None, 0, False),
    "chunked_causal": ("segments", None, 0, False),
}


@pytest.mark.parametrize("name", sorted(masks.EXAMPLES))
def test_examples_native_or_not(name):
    pat = native_pattern(cm.compile_mask(masks.EXAMPLES[name]()))
    if name not in NATIVE:
        assert pat is None, pat
        return
    kind, left, right, br = NATIVE[name]
    assert (pat.kind, pat.window_left, pat.window_right, pat.bottom_right) == (kind, left, right,
                                                                                br)
    assert pat.proof.startswith("z3:")


def _spec(name, params, when, visible):
    return M(name, params, [R("all", when=when, visible=visible)])


def test_more_native_patterns():
    full = _spec("t_full", [], lambda i: True, lambda i, j: True)
    br = _spec("t_br", [], lambda i: True, lambda i, j: j <= i + seqlen_k - seqlen_q)  # noqa: F821
    win = _spec("t_win", [], lambda i: True, lambda i, j: i - 100 <= j <= i + 5)
    docwin = _spec("t_dw", ["doc_start"], lambda i: True,
                   lambda i, j: doc_start[i] <= j <= i and j > i - 64)  # noqa: F821
    assert native_pattern(cm.compile_mask(full)).kind == "full"
    p = native_pattern(cm.compile_mask(br))
    assert p.causal and p.bottom_right and p.applies(100, 300)
    p = native_pattern(cm.compile_mask(win))
    assert (p.window_left, p.window_right, p.bottom_right) == (100, 5, False)
    assert p.applies(64, 64) and not p.applies(64, 65)
    p = native_pattern(cm.compile_mask(docwin))
    assert (p.kind, p.window_left, p.segment_param) == ("segments", 63, "doc_start")


def _fa4_native_mask(kwargs, Sq, Sk):
    """The mask FA4's native kernel computes from its arguments (bottom-right aligned)."""
    i = torch.arange(Sq).view(-1, 1) + (Sk - Sq)
    j = torch.arange(Sk).view(1, -1)
    if kwargs.get("causal"):
        return j <= i
    left, right = kwargs.get("window_size", (None, None))
    assert all(-(2**31) <= w < 2**31 for w in (left, right) if w is not None)  # FA4's Int32
    vis = torch.ones(Sq, Sk, dtype=torch.bool)
    if left is not None:
        vis &= j >= i - left
    if right is not None:
        vis &= j <= i + right
    return vis


@pytest.mark.parametrize("Sq,Sk", [(8, 8), (5, 9), (9, 5), (1, 1)])
def test_native_arguments_reach_fa4_within_int32_and_exact(Sq, Sk):
    """A proven window of any size reaches FA4 as arguments it takes (Int32: a side past the
    sequence is no bound, so 2**32 never wraps to -1 or 0), which compute the rules exactly."""
    from compilemask.kernels.fa4 import _native_kwargs

    ran = 0
    for rule in (lambda i, j: i - 4294967296 < j <= i, lambda i, j: j <= i + 4294967296,
                 lambda i, j: i - 3_000_000_000 <= j <= i + 3_000_000_000,
                 lambda i, j: i - 3 <= j <= i + 2, lambda i, j: j <= i + seqlen_k - seqlen_q,  # noqa: F821
                 lambda i, j: i - 2 <= j <= i):
        mask = cm.compile_mask(_spec("t_big", [], lambda i: True, rule))
        desc = mask.preprocess(None, Sq, Sk, backend="torch")
        if desc.native is None or not desc.native_applies():
            continue
        got = _fa4_native_mask(_native_kwargs(desc.native, Sq, Sk), Sq, Sk)
        assert torch.equal(got, mask.reference_mask(None, Sq, Sk)[0]), (Sq, Sk)
        ran += 1
    assert ran >= (6 if Sq == Sk else 1)  # top-left windows apply to square shapes only


def test_near_misses_are_not_native():
    # a window whose guard excludes rows, two regions, an off-by-one against causal
    guarded = _spec("t_g", ["n"], lambda i: i < n, lambda i, j: j <= i)  # noqa: F821
    strict = _spec("t_s", [], lambda i: True, lambda i, j: j < i)
    two = M("t_two", ["x"], [R("a", when=lambda i: i < x, visible=lambda i, j: j <= i),  # noqa: F821
                            R("b", when=lambda i: True, visible=lambda i, j: j <= i + 1)])
    for s in (guarded, two):
        assert native_pattern(cm.compile_mask(s)) is None, s.name
    # j < i would be the window (None, -1), which FA4 reads as unbounded on the right
    assert native_pattern(cm.compile_mask(strict)) is None


def _doc_meta(B, S, gen, scattered=False):
    starts = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        cuts = sorted(torch.randperm(S - 1, generator=gen)[:5].add(1).tolist())
        for c in cuts:
            starts[b, c:] = c
    if scattered:
        starts[0, S - 1] = 1  # not a segmentation: its predecessor starts elsewhere
    return {"doc_start": starts}


@pytest.mark.parametrize("S", [1, 130, 517])
def test_segments_cu_seqlens_equal_the_mask(S):
    mask = cm.compile_mask(masks.packed_documents())
    gen = torch.Generator().manual_seed(S)
    meta = _doc_meta(3, S, gen)
    desc = mask.preprocess(meta, seqlen_q=S)
    cu, longest = desc.segments
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 3 * S
    # block-diagonal causal over the flattened rows == the descriptor's mask
    seg = torch.bucketize(torch.arange(3 * S), cu[1:].long(), right=True)
    i = torch.arange(3 * S)
    flat = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    dense = desc.dense_mask()
    for b in range(3):
        blk = flat[b * S:(b + 1) * S, b * S:(b + 1) * S]
        assert torch.equal(blk, dense[b])
        assert not flat[b * S:(b + 1) * S].logical_and(
            (i < b * S) | (i >= (b + 1) * S)).any()
    assert longest == int((cu[1:] - cu[:-1]).max())


@pytest.mark.parametrize("S,chunk", [(1, 48), (130, 48), (517, 128), (96, 48), (300, 7)])
def test_chunk_cu_seqlens_equal_the_mask(S, chunk):
    mask = cm.compile_mask(masks.chunked_causal(chunk))
    pat = mask.native_pattern
    assert (pat.kind, pat.chunk, pat.segment_param, pat.causal) == ("segments", chunk, None, True)
    assert "chunks of" in pat.describe()
    desc = mask.preprocess({}, seqlen_q=S, batch_size=3)
    cu, longest = desc.segments
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 3 * S
    assert len(cu) == max(len(torch.unique(cu)), 258) and longest == min(chunk, S)
    seg = torch.bucketize(torch.arange(3 * S), cu[1:].long(), right=True)
    i = torch.arange(3 * S)
    flat = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    ref = mask.reference_mask({}, seqlen_q=S, batch_size=3)
    for b in range(3):
        assert torch.equal(flat[b * S:(b + 1) * S, b * S:(b + 1) * S], ref[b])
        assert not flat[b * S:(b + 1) * S].logical_and(
            (i < b * S) | (i >= (b + 1) * S)).any()


def test_segments_refused_when_not_a_segmentation():
    mask = cm.compile_mask(masks.packed_documents())
    meta = _doc_meta(2, 100, torch.Generator().manual_seed(1), scattered=True)
    desc = mask.preprocess(meta, seqlen_q=100)
    assert desc.segments is None
    assert torch.equal(desc.dense_mask(), mask.reference_mask(meta, seqlen_q=100))


def test_explain_names_the_native_path():
    text = cm.compile_mask(masks.causal()).explain()
    assert "native" in text and "z3" in text
    assert "native" in cm.compile_mask(masks.hstu()).explain()  # says it is not native, too


# ---------------------------------------------------------------------------------------------
# engine selection (CPU)
# ---------------------------------------------------------------------------------------------
def test_cpu_runs_the_reference_and_refuses_gpu_backends():
    mask = cm.compile_mask(masks.causal())
    desc = mask.preprocess({}, seqlen_q=33, batch_size=1)
    q = torch.randn(1, 33, 2, 16)
    assert cm.api.api.select_engine(q, desc) == "reference"
    for backend in ("fa4", "native", "cute"):
        with pytest.raises(NotImplementedError, match=backend):
            cm.attention(q, q, q, desc, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        cm.attention(q, q, q, desc, backend="flex")
    out = cm.attention(q, q, q, desc, backend="reference")
    assert out.shape == q.shape


def test_top_level_kernels_import_is_inert(monkeypatch):
    # the repository root on sys.path makes kernels/ importable as "kernels", which transformers
    # probes for: that import must not register the custom ops a second time
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    # the name ``kernels`` is left as it was
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    mod = importlib.import_module("kernels")
    try:
        assert not hasattr(mod, "attention_op") and getattr(mod, "__version__", None) is None
        mask = cm.compile_mask(masks.hstu())
        meta = masks.random_meta(mask.spec, 2, 40, torch.Generator().manual_seed(0))
        desc = mask.preprocess(meta, seqlen_q=40)
        q = torch.randn(2, 40, 2, 8, dtype=torch.float64)
        out = cm.attention(q, q, q, desc)
        from compilemask.compiler.reference import attention_reference

        torch.testing.assert_close(out, attention_reference(q, q, q, desc.dense_mask()))
    finally:
        sys.modules.pop("kernels", None)


# ---------------------------------------------------------------------------------------------
# the generated mask_mod compiles inside FA4's kernels (CPU, fake tensors)
# ---------------------------------------------------------------------------------------------
def _fa4_fake_env():
    pytest.importorskip("flash_attn.cute")
    assert os.environ.get("CUTE_DSL_ARCH") == "sm_90a"  # set by conftest before cutlass loads


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
@sweep("name,head_dim", [("hstu", 64), ("hstu", 128), ("clear", 128), ("dilated_causal", 128),
                         ("sink_window", 128)],
       default=[("hstu", 128), ("sink_window", 128)])
def test_mask_mod_compiles_in_fa4_forward_and_backward(name, head_dim):
    mask = cm.compile_mask(masks.EXAMPLES[name]())
    gen = torch.Generator().manual_seed(0)
    _compiles_in_fa4(mask, masks.random_meta(mask.spec, 2, 300, gen), head_dim)


@pytest.mark.slow  # kernels of their own
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
def test_bit_operation_predicate_compiles_in_fa4():
    """A predicate with integer bit operations (Int32 & | ^ in the generated mask_mod)."""
    def sees(i, j):
        return j <= i and ((i ^ j) & 3) != (i | 1) % 4

    spec = cm.MaskSpec("bit_predicate", params=[], regions=[
        cm.Region("all", when=lambda i: i >= 0, visible=sees)])
    _compiles_in_fa4(cm.compile_mask(spec), {}, 128)


@pytest.mark.slow  # kernels of their own
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
@pytest.mark.parametrize("variant", ["predicate", "intervals"])
def test_table_predicate_compiles_in_fa4(variant):
    """A table param's read (a word of row_params at a computed column, its bit) in FA4's
    forward and backward, as the whole-mask predicate and after the interval test."""
    from compilemask.codegen.cute_mask_mod import mask_mod_variant

    spec = cm.MaskSpec("table_tree", params=["p", "n", "anc"], regions=[
        cm.Region("all", when=lambda i: True,
                  visible=lambda i, j: (j < p) | ((j >= p) & (j < p + n)  # noqa: F821
                                                  & anc[i, j - p]))])  # noqa: F821
    mask = cm.compile_mask(spec)
    assert mask_mod_variant(mask) == "predicate"
    gen = torch.Generator().manual_seed(0)
    meta = {"p": torch.tensor([200, 150]), "n": torch.tensor([100, 80]),
            "anc": torch.rand(2, 300, 100, generator=gen) < 0.3}
    _compiles_in_fa4(mask, meta, 128, variant)


@pytest.mark.slow  # kernels of their own
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
def test_folded_heads_compile_in_fa4():
    """Per-head windows folded into one launch: per-head lists ``[B, H, R, C]`` and a mask_mod
    reading row ``b * H + h`` of the descriptor, in FA4's forward and backward (GQA)."""
    _fa4_fake_env()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask.codegen.cute_mask_mod import mask_mod_source
    from compilemask.kernels import fa4

    H, B, S, D = 4, 2, 300, 128
    w = torch.tensor([16, 64, 128, 200])

    def mm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w[h])

    specs, metas = cm.from_mask_mod_heads(mm, num_heads=H, batch_size=B)
    groups = cm.preprocess_heads([cm.compile_mask(s) for s in specs], metas, S, batch_size=B,
                                 fold=True)
    desc = groups.groups[0][0]
    assert groups.folded and desc.batch_size == B * H
    assert f"b = batch[0] * Int32({H}) + head[0]" in mask_mod_source(desc.mask, heads=H)
    lists = {k: desc.block_sparse(k) for k in ("fwd", "bwd64")}
    with FakeTensorMode():
        q = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(B, S, 2, D, dtype=torch.bfloat16, device="cuda")
        fdesc, flists, _ = fake_on_cuda(desc, lists)
        out, lse = fa4.fwd(q, kv, kv, fdesc, D**-0.5, "fa4", lists=flists["fwd"], heads=H)
        assert out.shape == q.shape and lse.shape == (B, H, S)
        dq, dk, dv = fa4.bwd(q, q, kv, kv, out, lse, fdesc, D**-0.5, "fa4",
                             lists=flists["bwd64"], heads=H)[:3]
        assert dq.shape == q.shape and dk.shape == kv.shape


def _compiles_in_fa4(mask, meta, head_dim, variant=None, config=None):
    _fa4_fake_env()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask.codegen.cute_mask_mod import mask_mod
    from compilemask.kernels import fa4

    B, S, H, D = 2, 300, 4, head_dim
    desc = mask.preprocess(meta or None, seqlen_q=S, batch_size=B, config=config)
    lists = {k: desc.block_sparse(k) for k in ("fwd", "bwd64" if D == 128 else "bwd128")}
    mm = mask_mod(mask, variant)
    assert mm is mask_mod(mask, variant)  # cached by the mask's key
    with FakeTensorMode():
        q = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
        fdesc, flists, _ = fake_on_cuda(desc, lists)
        out, lse = fa4.fwd(q, q, q, fdesc, D**-0.5, "fa4", lists=flists["fwd"], variant=variant)
        assert out.shape == q.shape and lse.shape == (B, H, S)
        bwd_lists = flists["bwd64" if D == 128 else "bwd128"]
        dq, dk, dv = fa4.bwd(q, q, q, q, out, lse, fdesc, D**-0.5, "fa4", lists=bwd_lists,
                             variant=variant)
        assert dq.shape == q.shape and dk.shape == q.shape


# ---------------------------------------------------------------------------------------------
# GPU: every example mask through every engine that runs it
# ---------------------------------------------------------------------------------------------
def _gpu_case(name, B, S, H, Hkv, D, seed, Sk=None):
    spec = masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    gen = torch.Generator().manual_seed(seed)
    meta = {k: v.cuda() for k, v in masks.random_meta(spec, B, S, gen).items()}
    desc = mask.preprocess(meta, seqlen_q=S, seqlen_k=Sk, batch_size=B, device="cuda")
    Sk = S if Sk is None else Sk
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return mask, desc, q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(masks.EXAMPLES))
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_engines_vs_float32_reference(name, D):
    mask, desc, q, k, v = _gpu_case(name, 2, 1000, 4, 2, D, seed=7)
    dense = desc.dense_mask()
    engines = ["fa4"] + (["native"] if desc.native is not None else [])
    assert cm.api.api.select_engine(q, desc) == ("native" if "native" in engines else "fa4")
    for engine in engines:
        check_attention_vs_reference(desc, q, k, v, engine, dense)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hstu", "clear", "shared_prompt_rm", "prefix_lm",
                                  "sink_window", "block_causal", "chunked_causal"])
@pytest.mark.parametrize("variant", ["rules", "intervals"])
def test_gpu_fa4_mask_mod_variants(name, variant):
    # either partial-tile test on FA4's block-sparse engine, chunked (native) included
    mask, desc, q, k, v = _gpu_case(name, 2, 1000, 4, 2, 128, seed=11)
    check_attention_vs_reference(desc, q, k, v, "fa4", desc.dense_mask(),
                                 options=cm.KernelOptions(mask_mod=variant))


@pytest.mark.gpu
def test_gpu_rules_give_way_where_host_metadata_reach_past_the_length():
    """CLEAR (2, 64), whose default backward test is its rules in int32, with image rows
    given on the host far past the sequence (64 * 2**25 wraps int32): the descriptor records
    it and the call reads the table, exact; asked for the rules by name, it raises."""
    mask = cm.compile_mask(masks.clear(2, 64))
    desc = mask.preprocess({"text_end": torch.tensor([100, 37]),
                            "img_rows": torch.tensor([2**25, 3])}, seqlen_q=512, device="cuda")
    assert desc.meta_max == 2**25
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 512, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    check_attention_vs_reference(desc, q, k, v, "fa4", mask.reference_mask(
        {"text_end": torch.tensor([100, 37]), "img_rows": torch.tensor([2**25, 3])}, 512))
    with pytest.raises(ValueError, match="int32.*metadata up to 33554432"):
        cm.attention(q, k, v, desc, backend="fa4", options=cm.KernelOptions(mask_mod="rules"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hstu", "clear", "causal"])
def test_gpu_fa4_rectangular_and_mha(name):
    # Sq != Sk (top-left causal is then not native), no GQA, seqlen not a multiple of 128
    mask, desc, q, k, v = _gpu_case(name, 1, 700, 2, 2, 128, seed=3, Sk=900)
    check_attention_vs_reference(desc, q, k, v, "fa4", desc.dense_mask())
    assert cm.api.api.select_engine(q, desc) == "fa4"


@pytest.mark.gpu
def test_gpu_lists_tilelang_equal_torch():
    """The lists a CUDA preprocess writes (one TileLang launch, ``desc.lists``) equal the torch
    reference of every kind; ``block_sparse`` views them."""
    from compilemask.compiler.blocksparse import descriptor_lists
    from compilemask.pipeline.pipeline import LIST_KINDS_FA4

    for name in ("hstu", "clear", "dilated_causal"):
        _, desc, *_ = _gpu_case(name, 3, 3000, 1, 1, 64, seed=5)
        assert desc.lists is not None and desc.lists.kinds == LIST_KINDS_FA4
        for kind in LIST_KINDS_FA4:
            a = descriptor_lists(desc, kind)  # torch
            b = desc.block_sparse(kind)  # TileLang, views of desc.lists
            assert b.mask_idx.untyped_storage().data_ptr() == \
                desc.lists.buffer.untyped_storage().data_ptr()
            for cnt_a, idx_a, cnt_b, idx_b in ((a[0], a[1], b[0], b[1]), (a[2], a[3], b[2], b[3])):
                assert torch.equal(cnt_a, cnt_b)
                live = torch.arange(idx_a.shape[-1], device=idx_a.device) < cnt_a[..., None]
                assert torch.equal(idx_a[live], idx_b[live])


@pytest.mark.gpu
def test_gpu_cpu_descriptor_on_device_gets_lists():
    """A descriptor made on the CPU (no lists there) gets, on the GPU attention runs on, one copy
    with the device's lists, made once and kept; attention on either gives the same output."""
    from compilemask.pipeline import pipeline

    mask = cm.compile_mask(masks.hstu())
    meta = masks.random_meta(mask.spec, 2, 1000, torch.Generator().manual_seed(4))
    desc = mask.preprocess(meta, seqlen_q=1000)  # CPU metadata: the torch reference on the CPU
    assert desc.device.type == "cpu" and desc.lists is None
    moved = pipeline.on_device(desc, "cuda")
    assert moved.device.type == "cuda" and moved.lists is not None
    assert pipeline.on_device(desc, "cuda") is moved  # kept with the descriptor
    assert pipeline.on_device(moved, "cuda") is moved
    assert torch.equal(moved.dense_mask().cpu(), desc.dense_mask())
    q, k, v = (torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    torch.testing.assert_close(cm.attention(q, k, v, desc), cm.attention(q, k, v, moved),
                               atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_native_and_fa4_under_torch_compile_and_graphs():
    mask, desc, q, k, v = _gpu_case("hstu", 2, 1024, 4, 4, 128, seed=2)
    f = torch.compile(lambda q, k, v: cm.attention(q, k, v, desc), fullgraph=True)
    torch.testing.assert_close(f(q, k, v), cm.attention(q, k, v, desc), atol=0, rtol=0)
    # CUDA graph: preprocess + attention captured once, replayed on new metadata
    spec = masks.hstu()
    pre = mask.preprocessor(1024, batch_size=2)
    gen = torch.Generator().manual_seed(9)
    meta = {k_: t.cuda().contiguous() for k_, t in masks.random_meta(spec, 2, 1024, gen).items()}
    assert pre(meta).lists is not None  # written by the bound call, captured with it below
    for _ in range(2):
        out = cm.attention(q, k, v, pre(meta))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cm.attention(q, k, v, pre(meta))
    new = {k_: t.cuda() for k_, t in masks.random_meta(spec, 2, 1024, gen).items()}
    for k_ in meta:
        meta[k_].copy_(new[k_])
    g.replay()
    want = cm.attention(q, k, v, mask.preprocess(new, seqlen_q=1024, batch_size=2))
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_flex_document_mask_runs_natively():
    # FlexAttention's standard document mask (per-token ids) is proven causal within segments
    gen = torch.Generator().manual_seed(3)
    ids = torch.sort(torch.randint(0, 7, (2, 100), generator=gen)).values

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

    spec, meta = cm.from_mask_mod(document_causal)
    mask = cm.compile_mask(spec)
    assert mask.native_pattern is not None and mask.native_pattern.kind == "segments"
    desc = mask.preprocess(meta, seqlen_q=100)
    cu, longest = desc.segments
    flat = ids.reshape(-1)
    starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), flat[1:] != flat[:-1]])
                           | (torch.arange(200) % 100 == 0)).reshape(-1)
    n = len(starts)  # then empty segments: FA4's many-segments kernels for every batch
    assert cu[:n].tolist() == starts.tolist() and bool((cu[n:] == 200).all())
    from torch.nn.attention.flex_attention import create_mask

    assert torch.equal(desc.dense_mask(), create_mask(document_causal, 2, 1, 100, 100,
                                                      device="cpu")[:, 0])


def test_mask_mods_of_different_masks_key_different_fa4_kernels():
    """flash-attn-4 keys a compiled kernel by ``hash_callable(mask_mod)``, the hash of that one
    function's source: the generated mask_mods of different masks (whose wrappers can read alike
    and differ only in the functions they call) must hash apart, every variant."""
    pytest.importorskip("flash_attn.cute")
    from flash_attn.cute.utils import hash_callable

    from compilemask.codegen.cute_mask_mod import mask_mod

    def even(i, j):  # (dilated causal is the stride 2)
        return j <= i and (i - j) % 4 == 0

    def third(i, j):
        return j <= i and (i - j) % 3 == 0

    fallback = [cm.compile_mask(_spec(n, [], lambda i: True, f))
                for n, f in (("t_even", even), ("t_third", third))]
    # (the rules of an all-fallback mask are its predicate: the same code, one kernel)
    made = [(m, v) for m in fallback for v in ("predicate", "intervals")]
    made += [(cm.compile_mask(masks.EXAMPLES[n]()), None)
             for n in ("causal", "sink_window", "block_causal", "chunked_causal",
                       "dilated_causal", "sliding_window")]
    hashes = [hash_callable(mask_mod(m, v)) for m, v in made]
    assert len(set(hashes)) == len(made)
    assert hash_callable(mask_mod(fallback[0], "rules")) == hashes[0]
    # the interval test's code is the same for masks of equal K without fallbacks: one kernel
    a, b = (cm.compile_mask(masks.EXAMPLES[n]()) for n in ("block_causal", "chunked_causal"))
    assert hash_callable(mask_mod(a, "intervals")) == hash_callable(mask_mod(b, "intervals"))
