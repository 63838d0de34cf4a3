"""Masks that change every batch in a training loop: new lengths compile nothing, descriptors
live where attention runs, no host synchronization, CUDA graphs, torch.compile, warmup.

The CPU tests check the shape-dynamic programs on TileLang's C target and the compiled path on
the reference engine; the GPU tests (``-m gpu``) check every engine under
``torch.cuda.set_sync_debug_mode("error")`` and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask.codegen import blocksparse as tlb
from compilemask.codegen import preprocess as tlp
from compilemask.masks import EXAMPLES, packed_documents, random_meta
from compilemask.pipeline import pipeline

NAMES = sorted(EXAMPLES)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def sink_window():
    """A mask without params (its descriptor needs no metadata)."""
    return cm.MaskSpec("sink_window_test", params=[], regions=[
        cm.Region("all", when=lambda i: i >= 0,
                  visible=lambda i, j: j <= i and (j < 4 or j > i - 300))])


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


def test_bound_preprocessor_takes_new_lengths_without_compiling():
    """One preprocess program and one list program serve every length (C target)."""
    mask = cm.compile_mask(EXAMPLES["hstu"]())
    pre = mask.preprocessor(300, batch_size=2, device="cpu", check_values=False)
    gen = torch.Generator().manual_seed(0)
    for n, S in enumerate((300, 129, 1000, 517)):
        meta = random_meta(mask.spec, 2, S, gen)
        if n == 1:
            built = (tlp.compile_count(), tlb.compile_count())
        d = pre(meta, seqlen_q=S)
        ref = mask.preprocess(meta, S, batch_size=2, backend="torch")
        assert (d.seqlen_q, d.seqlen_k) == (S, S)
        assert torch.equal(d.dense_mask(), ref.dense_mask()), S
        assert torch.equal(d.fwd_bitmap, ref.fwd_bitmap) and torch.equal(d.bwd_bitmap,
                                                                         ref.bwd_bitmap)
    assert (tlp.compile_count(), tlb.compile_count()) == built


_PREBUILD = """
import os, sys, torch
from compilemask.codegen import blocksparse as tlb, tilelang_build as tb
from compilemask.compiler.blocksparse import lists_from_bitmap
progs = tlb.list_programs(target="c", config=tlb.ListsConfig(threads=32, tpr=8,
                                                             tpr_transposed=8))
assert len(progs) == 2 and len({p.source for p in progs}) == 2  # by rows, by columns
assert tb.prebuild(progs) == 2  # both compiled, in two worker processes
assert tb.prebuild(progs) == 0  # this machine has them now
builds = [f for _, _, fs in os.walk(os.environ["TILELANG_CACHE_DIR"]) for f in fs]
assert len(builds) >= 2, builds
print("OK")
"""


@pytest.mark.slow  # two programs of its own (an empty cache folder)
def test_first_use_compiles_the_programs_at_once(tmp_path):
    """``prebuild`` compiles the programs a first batch needs in worker processes, into the
    cache folder a later process (and this one) loads from; built programs are not rebuilt."""
    pytest.importorskip("tilelang")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TILELANG_CACHE_DIR",
                                                            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")}
    env["COMPILEMASK_CACHE_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", _PREBUILD], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_descriptor_moves_once_per_device():
    """A descriptor made on one device is copied to another once (kept with it), not per call."""
    mask = cm.compile_mask(sink_window())
    d = mask.preprocess(None, 200, batch_size=2)
    assert pipeline.on_device(d, "cpu") is d
    meta = torch.device("meta")
    a, b = pipeline.on_device(d, meta), pipeline.on_device(d, meta)
    assert a is b and a.device == meta and a.seqlen_q == 200


@pytest.mark.slow  # inductor compiles (torch.compile, dynamic shapes)
def test_compiled_model_changing_lengths_compiles_once():
    """torch.compile with dynamic shapes: new lengths reuse the first graph. Dynamo specializes
    sizes 0 and 1 (every length here has 2+ bitmap words) and, by default, sizes that happen to
    be equal (duck sizing: the batch and a bitmap's word count, say), which is turned off here
    as a loop with changing lengths should."""
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as fx_config

    mask = cm.compile_mask(EXAMPLES["hstu"]())

    def layer(q, k, v, desc):
        return cm.attention(q, k, v, desc) * 2

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(layer, dynamic=True)
    gen = torch.Generator().manual_seed(1)
    with fx_config.patch(use_duck_shape=False):
        for n, S in enumerate((2200, 2500, 3100, 2333, 4000)):
            meta = random_meta(mask.spec, 3, S, gen)
            d = mask.preprocess(meta, S, batch_size=3)
            q = torch.randn(3, S, 1, 32, generator=gen)
            out = f(q, q, q, d)
            assert torch.allclose(out, layer(q, q, q, d), atol=1e-5)
            if n == 0:
                first = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == first
    torch._dynamo.reset()  # the graphs were made under a config the next test does not have


def test_warmup_builds_the_preprocess_program_on_cpu():
    mask = cm.compile_mask(EXAMPLES["causal"]())
    took = cm.warmup(mask, [100, 257], device="cpu")
    assert set(took) == {(100, None), (257, None)}
    before = tlp.compile_count()
    mask.preprocess({}, 999, batch_size=1, backend="tilelang")
    assert tlp.compile_count() == before


def test_fixed_segments_are_the_exact_ones_padded():
    """``max_segments``: cu_seqlens of a fixed size, the segments then empty ones."""
    mask = cm.compile_mask(packed_documents())
    starts = torch.tensor([[0, 0, 0, 3, 3, 5, 5, 5], [0, 1, 1, 1, 1, 1, 6, 6]])
    exact = mask.preprocess({"doc_start": starts}, 8, batch_size=2)
    fixed = mask.preprocess({"doc_start": starts}, 8, batch_size=2, max_segments=9)
    cu, n = exact.segments
    cu9, s = fixed.segments
    assert torch.equal(cu[:7], torch.tensor([0, 3, 5, 8, 9, 14, 16], dtype=torch.int32))
    # both padded past FA4's many-segments threshold with empty segments: one kernel variant
    assert s == 8 and n == 5 and len(cu9) == len(cu) == 258
    assert torch.equal(cu9, cu) and bool((cu[7:] == 16).all())


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _engines(mask):
    out = ["fa4", "cute"]
    if mask.native_pattern is not None:
        out.insert(0, "native")
    return out


def _gpu_meta(mask, B, S, seed):
    meta = random_meta(mask.spec, B, S, torch.Generator().manual_seed(seed))
    return {k: v.to("cuda", torch.int32).contiguous() for k, v in meta.items()}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_no_host_sync(name):
    """Preprocess (the bound fast path) + forward + backward never synchronize, every engine."""
    mask = cm.compile_mask(EXAMPLES[name]())
    B, S = 2, 1100
    pre = mask.preprocessor(S, batch_size=B, max_segments=B * S)
    meta = _gpu_meta(mask, B, S, 0)
    q, k, v = (torch.randn(B, S, 2, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    for engine in _engines(mask):
        for general in (False, True):  # the bound fast path, then preprocess's general path
            torch.cuda.set_sync_debug_mode("error")
            try:
                desc = (mask.preprocess(meta, S, batch_size=B, max_segments=B * S,
                                        device="cuda") if general else pre(meta))
                out = cm.attention(q, k, v, desc, backend=engine)
                out.sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        ref = cm.attention(q.float(), k.float(), v.float(), desc, backend="reference")
        assert (out.float() - ref).abs().max() < 0.05, (name, engine)


@pytest.mark.gpu
@gpu
def test_gpu_new_lengths_compile_nothing():
    """After one step, steps at other lengths compile no program and no FA4 kernel."""
    from flash_attn.cute import interface as fa4i

    mask = cm.compile_mask(EXAMPLES["hstu"]())
    q0 = torch.randn(4 * 4096, 2, 128, device="cuda", dtype=torch.bfloat16)

    def step(S, B):
        q = q0[:B * S].view(B, S, 2, 128).clone().requires_grad_(True)
        desc = mask.preprocess(_gpu_meta(mask, B, S, S), S, batch_size=B)
        cm.attention(q, q, q, desc).sum().backward()

    def built():
        fa4_kernels = sum(len(getattr(fa4i, n).compile_cache.cache) for n in dir(fa4i)
                          if hasattr(getattr(getattr(fa4i, n), "compile_cache", None), "cache"))
        return tlp.compile_count(), tlb.compile_count(), fa4_kernels

    step(2048, 4)
    first = built()
    for S, B in ((1500, 3), (4096, 2), (3333, 4), (1025, 1)):
        step(S, B)
    assert built() == first


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,engine", [("hstu", "fa4"), ("hstu", "cute"), ("clear", "fa4"),
                                         ("packed_documents", "native"), ("causal", "native")])
def test_gpu_cuda_graph_preprocess_and_train_step(name, engine):
    """Preprocess + forward + backward captured once, replayed on new metadata values: the
    same output and gradients as eager, on every engine."""
    mask = cm.compile_mask(EXAMPLES[name]())
    B, S = 2, 1000
    pre = mask.preprocessor(S, batch_size=B, max_segments=B * S)
    meta = _gpu_meta(mask, B, S, 0)
    q = torch.randn(B, S, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    # our kernels' deterministic backward: replay and eager must then agree bit for bit (the
    # atomic dQ sum otherwise rounds differently run to run)
    det = engine == "cute"

    def run():
        desc = pre(meta)
        out = cm.attention(q, q, q, desc, backend=engine, deterministic=det)
        (grad,) = torch.autograd.grad(out.float().square().sum(), q)
        return out, grad

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_g, grad_g = run()
    for seed in (1, 2):
        new = _gpu_meta(mask, B, S, seed)
        for key in meta:
            meta[key].copy_(new[key])
        g.replay()
        out_e, grad_e = run()
        assert torch.equal(out_g, out_e)
        if det:
            assert torch.equal(grad_g, grad_e)
        else:  # one fp32 sum in another order, rounded to bf16: one bf16 step apart at most
            a, b = grad_g.float(), grad_e.float()
            step = torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs())
            assert ((a - b).abs() <= step + 1e-5 * b.abs().max()).all(), (a - b).abs().max()


@pytest.mark.gpu
@gpu
def test_gpu_descriptor_without_params_copied_once():
    """A mask without params preprocessed on the CPU runs on the GPU; its copy (with lists)
    is made once, and equals a descriptor made on the GPU."""
    mask = cm.compile_mask(sink_window())
    d = mask.preprocess(None, 1000, batch_size=2)
    assert d.device.type == "cpu"
    on = pipeline.on_device(d, "cuda")
    assert on is pipeline.on_device(d, torch.device("cuda")) and on.lists is not None
    ref = mask.preprocess(None, 1000, batch_size=2, device="cuda")
    for kind in pipeline.LIST_KINDS_FA4:
        a, b = on.block_sparse(kind), ref.block_sparse(kind)
        assert torch.equal(a.mask_cnt, b.mask_cnt) and torch.equal(a.full_cnt, b.full_cnt)
    q = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(cm.attention(q, q, q, d), cm.attention(q, q, q, ref))
