"""KernelOptions (the cute kernels' variants), default_options, the compile cache, env.py."""

from __future__ import annotations

import threading

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.contract.cache import CompileCache
from compilemask.contract.options import KernelOptions, default_options


def test_values_are_checked():
    for name, bad in (("fwd_mask", "bitz"), ("bwd_arch", 100), ("bwd_dq", "bulk"),
                      ("bwd_meta", "smem"), ("bwd_bitmap", "regs")):
        with pytest.raises(ValueError, match=name):
            KernelOptions(**{name: bad})
    with pytest.raises(ValueError, match="no field"):
        KernelOptions.from_str("fwd_mask=bits,tile=64")


def test_string_round_trip():
    """The form that crosses the custom ops."""
    for opts in (KernelOptions(), KernelOptions(bwd_arch=80, bwd_dq="red2"),
                 KernelOptions(fwd_mask="compare", bwd_meta="async", bwd_bitmap="global")):
        assert KernelOptions.from_str(opts.to_str()) == opts
    assert KernelOptions().to_str() == "" and str(KernelOptions()) == "defaults"
    assert KernelOptions(bwd_arch=90, fwd_mask="bits").to_str() == "bwd_arch=90,fwd_mask=bits"


@pytest.mark.parametrize("arch,K,n_m,want", [
    (90, 1, 16, (90, "red2", "bits", "regs", "smem")),
    (90, 2, 4096, (90, "red2", "bits", "regs", "smem")),
    (90, 3, 4097, (90, "red2", "bits", "async", "global")),
    (80, 6, 1, (80, "atomic", "compare", "async", "smem")),
    (89, 1, 1, (80, "atomic", "compare", "regs", "smem")),
    (100, 1, 1, (80, "red2", "bits", "regs", "smem")),
    (0, 1, 1, (80, "atomic", "compare", "regs", "smem")),  # no GPU
])
def test_default_options(arch, K, n_m, want):
    got = default_options(arch, K, n_m)
    assert (got.bwd_arch, got.bwd_dq, got.fwd_mask, got.bwd_meta, got.bwd_bitmap) == want
    assert KernelOptions().resolve(arch, K, n_m) == got
    set_one = KernelOptions(bwd_meta="async").resolve(arch, K, n_m)
    assert set_one.bwd_meta == "async" and set_one.fwd_mask == got.fwd_mask


def test_describe_names_every_field():
    text = KernelOptions(fwd_mask="compare").describe(90)
    assert text.startswith("bwd_arch=90, bwd_dq=red2, fwd_mask=compare, bwd_meta=regs (async")
    assert "bwd_bitmap=smem (global for > 4096 q tiles)" in text


def test_compile_keys_differ_per_option_set():
    pytest.importorskip("cutlass")
    from compilemask.kernels.common import compile_cache_key
    from compilemask.kernels.config import FlashFwdConfig

    cfg = FlashFwdConfig("bf16", 128, 128, 128, 1, mask_bits=True)
    keys = {compile_cache_key(cfg, "sm_90a", o)
            for o in (None, KernelOptions(fwd_mask="bits"), KernelOptions(bwd_meta="async"))}
    assert len(keys) == 3
    assert compile_cache_key(cfg, "sm_90a") == compile_cache_key(cfg, "sm_90a", KernelOptions())


def _desc(B=2, S=24):
    spec = masks.hstu()
    mask = cm.compile_mask(spec)
    meta = masks.random_meta(spec, B, S, gen=torch.Generator().manual_seed(0))
    return mask.preprocess(meta, seqlen_q=S, backend="torch")


def test_attention_passes_options_through_the_op():
    """cm.attention(options=) reaches the custom op as its string, eager and under
    torch.compile(fullgraph=True); a wrong type is refused."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from compilemask.kernels.contract import unpack

    desc = _desc()
    q, k, v = (torch.randn(2, 24, 2, 16) for _ in range(3))
    opts = KernelOptions(fwd_mask="compare", bwd_meta="async")
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.compilemask.attention_fwd.default:
                seen.append(unpack(args[3:])[2].options)  # the settings' options, by name
            return func(*args, **(kwargs or {}))

    with Spy():
        eager = cm.attention(q, k, v, desc, options=opts)
        cm.attention(q, k, v, desc)
    assert seen == [opts.to_str(), ""]
    f = torch.compile(lambda a, b, c: cm.attention(a, b, c, desc, options=opts),
                      backend="eager", fullgraph=True)
    torch.testing.assert_close(f(q, k, v), eager)
    with pytest.raises(TypeError, match="KernelOptions"):
        cm.attention(q, k, v, desc, options="fwd_mask=bits")


def test_compile_cache_builds_once_per_key():
    cache = CompileCache("test")
    calls = []
    gate = threading.Event()

    def build(key):
        def run():
            gate.wait(5)
            calls.append(key)
            return object()
        return run

    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get("a", build("a"))))
               for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert calls == ["a"] and len({id(x) for x in got}) == 1 and cache.builds == 1
    assert cache.get("a", build("a")) is got[0]
    assert cache.get("a", build("a"), use_cache=False) is not got[0]  # built anew, not stored
    assert cache.get("a", build("a")) is got[0] and len(cache) == 1

    def fail():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        cache.get("b", fail)
    assert "b" not in cache
    assert cache.get("b", build("b")) is not None


def test_one_cache_dir_for_generated_sources(monkeypatch):
    import os

    from compilemask.codegen import cute_predicate
    from compilemask.contract.env import cache_dir, cache_root, configure_compile_caches

    assert os.path.dirname(cache_dir("tilelang")) == os.path.dirname(cache_dir("predicates"))
    # the compilers' own caches (TileLang builds, FA4 kernels) live there too, unless the user
    # chose a folder for them
    variables = ("TILELANG_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    for var in variables:
        monkeypatch.delenv(var, raising=False)
    configure_compile_caches.cache_clear()
    configure_compile_caches()
    for var in variables:
        assert os.environ[var].startswith(cache_root()), var
    monkeypatch.setenv("TILELANG_CACHE_DIR", "/elsewhere")
    configure_compile_caches.cache_clear()
    configure_compile_caches()
    assert os.environ["TILELANG_CACHE_DIR"] == "/elsewhere"
    configure_compile_caches.cache_clear()
    pytest.importorskip("cutlass")
    src = "import cutlass.cute as cute\n\n\n@cute.jit\ndef f(x):\n    return x\n"
    cute_predicate.compile_predicate(src, "f")
    name = f"cm_pred_{cute_predicate.source_hash(src)}.py"
    assert os.path.exists(os.path.join(cache_dir("predicates"), name))
