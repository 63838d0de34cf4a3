"""CuTe DSL forward kernel: CPU compile checks (CI) and GPU correctness checks (-m gpu)."""

from __future__ import annotations

import glob
import logging
import math
import os
import random
import shutil
import subprocess
import zlib

import pytest
import sympy as sp
import torch

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from compilemask.compiler.tiles import pack_bitmap, tile_states  # noqa: E402
from compilemask.contract.descriptor import TileConfig  # noqa: E402
from compilemask.kernels import Fallback, FlashFwdConfig, compile_flash_fwd  # noqa: E402
from compilemask.kernels.config import default_tiles  # noqa: E402
from compilemask.kernels.interface import flash_fwd  # noqa: E402

from helpers import sweep  # noqa: E402

SI, SJ = sp.symbols("i j", integer=True)
STRIDE = sp.Symbol("stride", integer=True)
FIRST = sp.Function("first")
# visible iff causal AND (same residue mod stride OR before the row's "first" column)
FALLBACK_EXPR = sp.And(SJ <= SI, sp.Or(sp.Eq(sp.Mod(SI - SJ, STRIDE), 0), SJ < FIRST(SI)))


# a per-row array read at the column: same document id (doc(i) == doc(j)), causal
DOC = sp.Function("doc")
FALLBACK_J_EXPR = sp.And(SJ <= SI, sp.Eq(DOC(SI), DOC(SJ)))


def fallback_spec(regions=(0,)):
    return Fallback.from_expr(FALLBACK_EXPR, ["stride"], ["first"], regions=regions)


def fallback_j_spec(regions=(0,)):
    return Fallback.from_expr(FALLBACK_J_EXPR, [], ["doc"], regions=regions)


# ---------------------------------------------------------------------------------------------
# CPU: the kernels compile for sm_90a (no GPU needed)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sm90_env():
    yield "sm_90a"  # compile target passed as --gpu-arch: no GPU needed


def _cfg(dtype, hdim, K, arch=90, fallback=None, warp_specialized=True):
    tm, tn = default_tiles(hdim, arch)
    return FlashFwdConfig(
        dtype=dtype,
        head_dim=hdim,
        tile_m=tm,
        tile_n=tn,
        num_intervals=K,
        has_fallback=fallback is not None,
        fallback_hash=fallback.hash if fallback else "",
        fallback_regions=fallback.regions if fallback else (),
        num_params=fallback.num_params if fallback else 0,
        num_row_params=fallback.num_row_params if fallback else 0,
        arch=arch,
        warp_specialized=warp_specialized and arch >= 90,
    )


@sweep("dtype,hdim,K", [(d, h, k) for d in ("bf16", "fp16") for h in (64, 128) for k in (1, 2, 4)],
       default=[("bf16", 128, 2)])  # fp16 and hdim 64 compile in the other tests
def test_compile_sm90(sm90_env, dtype, hdim, K):
    fn = compile_flash_fwd(_cfg(dtype, hdim, K), gpu_arch=sm90_env)
    assert fn is not None


def test_compile_sm90_fallback_logs_once(sm90_env, caplog):
    fb = fallback_spec(regions=(0, 2))
    cfg = _cfg("bf16", 128, 2, fallback=fb)
    with caplog.at_level(logging.INFO, logger="compilemask"):
        compile_flash_fwd(cfg, fb, gpu_arch=sm90_env)
        compile_flash_fwd(cfg, fb, gpu_arch=sm90_env)  # cached: no second build, no second log
    msgs = [r for r in caplog.records if "fallback predicate" in r.getMessage()]
    assert len(msgs) == 1


def test_compile_sm90_fallback_array_at_j(sm90_env):
    fb = fallback_j_spec()
    assert compile_flash_fwd(_cfg("fp16", 64, 1, fallback=fb), fb, gpu_arch=sm90_env) is not None


def test_compile_sm90_ws_without_overlap(sm90_env):
    cfg = FlashFwdConfig(
        **{**_cfg("fp16", 128, 1).__dict__, "intra_wg_overlap": False, "pingpong": False}
    )
    assert compile_flash_fwd(cfg, gpu_arch=sm90_env) is not None


@pytest.mark.parametrize("hdim", [64, pytest.param(128, marks=pytest.mark.slow)])
def test_compile_sm90_single_role(sm90_env, hdim):
    # the non-warp-specialized wgmma variant (cp.async loads, all warps compute)
    cfg = _cfg("bf16", hdim, 2, warp_specialized=False)
    assert compile_flash_fwd(cfg, gpu_arch=sm90_env) is not None


def test_compile_sm80_path(sm90_env):
    # the portable mma.sync path also builds (here for an sm_90a target)
    assert compile_flash_fwd(_cfg("fp16", 64, 2, arch=80), gpu_arch=sm90_env) is not None


def test_launch_descriptor_tensors():
    # the host side of the one descriptor argument: what a launch passes, field for field
    from compilemask.kernels.descriptor_tensors import DescriptorTensors, DescriptorTensorsTorch

    B, Sq, K = 3, 10, 2
    iv = torch.arange(Sq * K * 2, dtype=torch.int64).view(1, Sq, K, 2)
    bm = torch.ones(1, 4, 1, dtype=torch.int32)
    d = DescriptorTensorsTorch.of(B, iv, bm)
    assert d._fields == DescriptorTensors._fields
    assert [tuple(t.shape) for t in d] == [(B, Sq, 2 * K), (B, 4, 1), (B, Sq), (B, 1), (B, Sq, 1)]
    assert all(t.dtype == torch.int32 and t.stride(-1) == 1 for t in d)
    assert torch.equal(d.intervals[2], iv.view(Sq, 2 * K).int())
    assert d.intervals.stride(0) == 0 and d.bitmap.stride(0) == 0  # batch 1: broadcast, no copy
    assert (d.row_region == -1).all() and not d.params.any() and not d.row_params.any()
    # per-sequence tensors of the batch are passed as they are
    rr = torch.zeros(B, Sq, dtype=torch.int32)
    pr = torch.tensor([[5], [6], [7]], dtype=torch.int32)
    rp = torch.zeros(B, Sq, 2, dtype=torch.int32)
    d = DescriptorTensorsTorch.of(B, iv.expand(B, -1, -1, -1), bm.expand(B, -1, -1), rr, pr, rp)
    assert d.row_region.data_ptr() == rr.data_ptr()
    assert d.params[:, 0].tolist() == [5, 6, 7] and d.row_params.shape == (B, Sq, 2)
    assert d.intervals.stride(0) == Sq * 2 * K
    fake = DescriptorTensors.fake(cute.sym_int(), cute.sym_int(), K)
    assert [len(t.shape) for t in fake] == [t.dim() for t in d]


def test_config_fields_of_a_fallback():
    # the fallback's part of both kernel configs, so the compile-cache keys tell masks apart
    import sympy as sp

    from compilemask.kernels.config import FlashBwdConfig
    from compilemask.kernels.fallback import Fallback, config_fields

    si, sj = sp.symbols("i j", integer=True)
    fb = Fallback.from_expr(sp.And(sj <= si, sp.Eq(sp.Mod(si - sj, 2), 0)), regions=(0, 2))
    assert config_fields(None) == dict(has_fallback=False, fallback_hash="",
                                       fallback_regions=(), num_params=0, num_row_params=0)
    got = config_fields(fb)
    assert got == dict(has_fallback=True, fallback_hash=fb.hash, fallback_regions=(0, 2),
                       num_params=0, num_row_params=0) and len(fb.hash) > 0
    cfgs = [c(dtype="bf16", head_dim=128, tile_m=128, tile_n=128, num_intervals=2, **f)
            for c in (FlashFwdConfig, FlashBwdConfig) for f in (got, config_fields(None))]
    assert cfgs[0] != cfgs[1] and cfgs[2] != cfgs[3] and cfgs[0].fallback_hash == fb.hash


def test_hdim256_not_implemented():
    q = torch.zeros(1, 8, 1, 256, dtype=torch.bfloat16)
    iv = torch.zeros(1, 8, 1, 2, dtype=torch.int32)
    bm = torch.zeros(1, 1, 1, dtype=torch.int32)
    with pytest.raises(NotImplementedError):
        flash_fwd(q, q, q, iv, bm, tile_m=128, tile_n=128)


def _nvdisasm():
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia.cu13  # noqa: F401

        for base in nvidia.cu13.__path__:
            cand = os.path.join(base, "bin", "nvdisasm")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    return None


def test_sass_has_hgmma(sm90_env, tmp_path, monkeypatch):
    exe = _nvdisasm()
    if exe is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm>=13.3)")
    monkeypatch.setenv("PATH", os.path.dirname(exe) + os.pathsep + os.environ.get("PATH", ""))
    compile_flash_fwd(
        _cfg("bf16", 128, 2),
        gpu_arch=sm90_env,
        use_cache=False,
        extra_options=f"--keep-sass --keep-cubin --dump-dir {tmp_path}",
    )
    cubins = glob.glob(str(tmp_path / "*.cubin"))
    if not cubins:
        pytest.skip("the DSL did not keep the cubin in this environment")
    text = subprocess.run(
        [exe, "-c", cubins[0]], capture_output=True, text=True, timeout=120
    ).stdout
    assert "HGMMA" in text, "sm90 kernel must use wgmma (HGMMA)"
    assert " LDL" not in text and " STL" not in text, "register spills to local memory"


def _sass(cfg, tmp_path, fallback=None):
    exe = _nvdisasm()
    if exe is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm>=13.3)")
    d = tmp_path / f"k{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    compile_flash_fwd(cfg, fallback, gpu_arch="sm_90a", use_cache=False,
                      extra_options=f"--keep-sass --keep-cubin --dump-dir {d}")
    cubins = glob.glob(str(d / "*.cubin"))
    if not cubins:
        pytest.skip("the DSL did not keep the cubin in this environment")
    return subprocess.run([exe, "-c", cubins[0]], capture_output=True, text=True,
                          timeout=120).stdout


def test_mask_bits_sass(sm90_env, tmp_path, monkeypatch):
    """mask_bits (KernelOptions(fwd_mask="bits"), CPU): partial tiles test the row's K
    intervals once per row (a word of the thread's column bits) and one bit per element. At
    K = 6 the per-element test spills to local memory and costs over a thousand integer
    compares per thread; with bits there are no spills and a tenth of the compares. With a
    fallback predicate it compiles too (the predicate stays per element)."""
    from dataclasses import replace

    monkeypatch.setenv("PATH", os.path.dirname(_nvdisasm() or "x") + os.pathsep
                       + os.environ.get("PATH", ""))
    cmp_ = _sass(_cfg("bf16", 128, 6), tmp_path)
    bits = _sass(replace(_cfg("bf16", 128, 6), mask_bits=True), tmp_path)
    assert " STL" in cmp_  # what the bits remove (if this changes, update the docstring)
    assert " STL" not in bits and " LDL" not in bits, "register spills to local memory"
    n_cmp, n_bits = cmp_.count("ISETP"), bits.count("ISETP")
    assert n_cmp > 1000 and n_bits * 10 < n_cmp, (n_cmp, n_bits)
    assert "HGMMA" in bits
    fb = fallback_spec()
    text = _sass(replace(_cfg("bf16", 128, 2, fallback=fb), mask_bits=True), tmp_path, fb)
    assert "HGMMA" in text


def test_mask_bits_knob():
    """KernelOptions.fwd_mask picks the partial-tile test; a wrong value is a clear error before
    any kernel is built."""
    from compilemask.contract.options import KernelOptions

    q = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    iv = torch.zeros(1, 8, 1, 2, dtype=torch.int32)
    bm = torch.zeros(1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="fwd_mask"):
        flash_fwd(q, q, q, iv, bm, tile_m=128, tile_n=128, arch=90,
                  options=KernelOptions(fwd_mask="bitz"))


# ---------------------------------------------------------------------------------------------
# Descriptor helpers for the tests (plain torch)
# ---------------------------------------------------------------------------------------------
def causal_intervals(B, Sq, Sk):
    i = torch.arange(Sq)
    iv = torch.zeros(B, Sq, 1, 2, dtype=torch.int64)
    iv[:, :, 0, 1] = torch.clamp(i + 1, max=Sk)
    return iv


def hstu_like_intervals(B, Sq, Sk, gen):
    """K=2: a per-sequence global prefix [0, c_b) plus a causal sliding window of width w_b."""
    iv = torch.zeros(B, Sq, 2, 2, dtype=torch.int64)
    i = torch.arange(Sq)
    for b in range(B):
        c = int(torch.randint(0, max(Sk // 3, 1) + 1, (1,), generator=gen))
        w = int(torch.randint(1, max(Sk // 2, 2) + 1, (1,), generator=gen))
        iv[b, :, 0, 1] = min(c, Sk)
        lo = torch.clamp(i - w + 1, min=0)
        hi = torch.clamp(i + 1, max=Sk)
        iv[b, :, 1, 0] = torch.where(hi > lo, lo, torch.zeros_like(lo))
        iv[b, :, 1, 1] = torch.clamp(hi - lo, min=0)
    return iv


def random_intervals(B, Sq, Sk, gen, K=5):
    """K random slots per row inside [0, Sk): overlapping, zero-length and tiny ones, and runs
    that start or end inside a thread's column pair (the partial-tile test's edge cases)."""
    st = torch.randint(0, Sk, (B, Sq, K), generator=gen)
    ln = torch.randint(0, 200, (B, Sq, K), generator=gen)
    ln[torch.rand(B, Sq, K, generator=gen) < 0.2] = 0
    ln[torch.rand(B, Sq, K, generator=gen) < 0.2] = 1
    iv = torch.stack([st, torch.minimum(ln, Sk - st)], dim=-1)
    iv[iv[..., 1] == 0] = 0  # an empty slot is (0, 0)
    return iv


def with_empty_rows(iv, gen):
    """Blank random rows and (when long enough) a block of 150 leading rows."""
    iv = iv.clone()
    B, Sq = iv.shape[:2]
    blank = torch.rand(B, Sq, generator=gen) < 0.2
    if Sq > 300:
        blank[0, :150] = True
    iv[blank] = 0
    return iv


def dense_from_intervals(iv, Sk):
    j = torch.arange(Sk).view(1, 1, 1, Sk)
    s = iv[..., 0].unsqueeze(-1)
    ln = iv[..., 1].unsqueeze(-1)
    return ((j - s >= 0) & (j - s < ln)).any(dim=2)  # [B, Sq, Sk]


def fallback_dense(B, Sq, Sk, params, row_params):
    i = torch.arange(Sq).view(1, Sq, 1)
    j = torch.arange(Sk).view(1, 1, Sk)
    stride = params[:, 0].view(B, 1, 1).to(torch.int64)
    first = row_params[:, :, 0].view(B, Sq, 1).to(torch.int64)
    return (j <= i) & ((torch.remainder(i - j, stride) == 0) | (j < first))


def make_bitmap(iv, always_masked, tile_m, tile_n, Sq, Sk):
    st = tile_states(iv[..., 0], iv[..., 1], always_masked, TileConfig(tile_m, tile_n), Sq, Sk)
    return pack_bitmap(st)


# ---------------------------------------------------------------------------------------------
# GPU: numerics against a float32 dense masked softmax
# ---------------------------------------------------------------------------------------------
def ref_attention(q, k, v, mask, scale):
    """float32 reference: out [B,Sq,H,D], lse [B,H,Sq]; rows that see nothing -> 0 / -inf."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    kk = k.float().repeat_interleave(H // Hkv, dim=2)
    vv = v.float().repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    m = mask.unsqueeze(1)
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out, lse


def torch_lowp_attention(q, k, v, mask, scale):
    """PyTorch's own low-precision result: SDPA with the bool mask in q.dtype."""
    H, Hkv = q.shape[2], k.shape[2]
    kk = k.repeat_interleave(H // Hkv, dim=2).transpose(1, 2)
    vv = v.repeat_interleave(H // Hkv, dim=2).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kk, vv, attn_mask=mask.unsqueeze(1), scale=scale
    )
    return o.transpose(1, 2).float().nan_to_num(0.0)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = [
    # (mask, B, Sq, Sk, H, Hkv, D, dtype)
    ("causal", 2, 1, 1, 2, 2, 128, torch.bfloat16),
    ("causal", 2, 127, 127, 2, 1, 128, torch.bfloat16),
    ("causal", 2, 128, 128, 4, 2, 64, torch.float16),
    ("causal", 2, 129, 129, 2, 2, 64, torch.bfloat16),
    ("causal", 2, 1000, 1000, 4, 1, 128, torch.float16),
    ("causal", 1, 8192, 8192, 2, 2, 128, torch.bfloat16),
    ("causal", 2, 127, 1000, 2, 2, 128, torch.bfloat16),
    ("causal", 2, 1000, 129, 2, 2, 64, torch.float16),
    ("hstu", 3, 1000, 1000, 4, 2, 128, torch.bfloat16),
    ("hstu", 2, 129, 129, 2, 2, 64, torch.float16),
    ("hstu", 2, 1, 1000, 2, 1, 64, torch.bfloat16),
    ("empty", 2, 1000, 1000, 2, 2, 128, torch.bfloat16),
    ("empty", 2, 127, 129, 2, 1, 64, torch.float16),
    ("multi", 2, 1000, 1000, 2, 1, 128, torch.bfloat16),
    ("multi", 2, 129, 300, 2, 2, 64, torch.float16),
    ("fallback", 2, 1000, 1000, 4, 2, 128, torch.bfloat16),
    ("fallback", 2, 129, 127, 2, 2, 64, torch.float16),
    ("fallback_j", 2, 1000, 1000, 2, 1, 128, torch.bfloat16),
    ("fallback_j", 2, 200, 129, 2, 2, 64, torch.float16),
]


def _build_case(mask_kind, B, Sq, Sk, gen):
    row_region = params = row_params = None
    fb = None
    if mask_kind == "causal":
        iv = causal_intervals(B, Sq, Sk)
        dense = dense_from_intervals(iv, Sk)
    elif mask_kind == "hstu":
        iv = hstu_like_intervals(B, Sq, Sk, gen)
        dense = dense_from_intervals(iv, Sk)
    elif mask_kind == "multi":
        iv = with_empty_rows(random_intervals(B, Sq, Sk, gen), gen)
        dense = dense_from_intervals(iv, Sk)
    elif mask_kind == "empty":
        iv = with_empty_rows(hstu_like_intervals(B, Sq, Sk, gen), gen)
        dense = dense_from_intervals(iv, Sk)
    elif mask_kind == "fallback":
        # region 0: fallback predicate over causal intervals; region 1: plain causal;
        # region -1: rows that see nothing
        iv = causal_intervals(B, Sq, Sk)
        row_region = torch.randint(0, 2, (B, Sq), generator=gen, dtype=torch.int64)
        row_region[torch.rand(B, Sq, generator=gen) < 0.05] = -1
        iv[row_region == -1] = 0
        params = torch.randint(2, 5, (B, 1), generator=gen, dtype=torch.int64)
        row_params = torch.randint(0, max(Sk // 4, 1), (B, Sq, 1), generator=gen)
        fb = fallback_spec(regions=(0,))
        dense = dense_from_intervals(iv, Sk)
        pred = fallback_dense(B, Sq, Sk, params, row_params)
        dense = torch.where((row_region == 0).unsqueeze(-1), dense & pred, dense)
    elif mask_kind == "fallback_j":
        # region 0 (most rows): causal intervals AND doc(i) == doc(j) (array read at j);
        # region 1: plain causal
        iv = causal_intervals(B, Sq, Sk)
        row_region = (torch.rand(B, Sq, generator=gen) < 0.1).to(torch.int64)
        params = torch.zeros(B, 0, dtype=torch.int64)
        doc = torch.cumsum((torch.rand(B, Sq, generator=gen) < 0.01).to(torch.int64), dim=1)
        row_params = doc.unsqueeze(-1)
        fb = fallback_j_spec(regions=(0,))
        dense = dense_from_intervals(iv, Sk)
        same = doc[:, :, None] == doc[:, None, :Sk] if Sk <= Sq else None
        pred = torch.zeros(B, Sq, Sk, dtype=torch.bool)
        pred[:, :, : min(Sk, Sq)] = same[:, :, : min(Sk, Sq)]
        dense = torch.where((row_region == 0).unsqueeze(-1), dense & pred, dense)
    else:
        raise ValueError(mask_kind)
    always = torch.zeros(B, Sq, dtype=torch.bool) if row_region is None else (row_region == 0)
    return iv, dense, always, row_region, params, row_params, fb


@gpu
@needs_cuda
# variants: -bits / -compare: partial tiles by column bits or by the interval compares
# (KernelOptions.fwd_mask; the default is bits on sm90, compare on sm80)
@pytest.mark.parametrize("variant", ["sm90ws", "sm90", "sm80", "sm90ws-compare", "sm80-bits"])
@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"{c[0]}-B{c[1]}-{c[2]}x{c[3]}-h{c[4]}/{c[5]}-d{c[6]}-{str(c[7])[6:]}",
)
def test_fwd_numerics(case, variant):
    from compilemask.contract.options import KernelOptions

    mask_kind, B, Sq, Sk, H, Hkv, D, dtype = case
    variant, *opts = variant.split("-")
    options = KernelOptions(fwd_mask=next((o for o in opts if o in ("bits", "compare")), None))
    arch = 80 if variant == "sm80" else 90
    major, _ = torch.cuda.get_device_capability()
    if arch == 90 and major != 9:
        pytest.skip("wgmma paths need sm_90")
    if arch == 80 and Sq > 2000 and mask_kind != "causal":
        pytest.skip("keep the mma.sync run short")
    if variant == "sm90" and Sq > 2000:
        pytest.skip("keep the single-role wgmma run short")
    seed = zlib.crc32(repr((case, variant + "".join(opts))).encode())
    gen = torch.Generator().manual_seed(seed)
    iv, dense, always, row_region, params, row_params, fb = _build_case(mask_kind, B, Sq, Sk, gen)
    tm, tn = default_tiles(D, arch)
    bm = make_bitmap(iv, always, tm, tn, Sq, Sk)
    dev = "cuda"
    torch.manual_seed(seed)
    q = torch.randn(B, Sq, H, D, device=dev, dtype=dtype)
    k = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dtype)
    v = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dtype)
    scale = 1.0 / math.sqrt(D)
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    lse = torch.full((B, H, Sq), float("nan"), device=dev)
    out, lse = flash_fwd(
        q,
        k,
        v,
        iv.to(dev),
        bm.to(dev),
        None if row_region is None else row_region.to(dev),
        None if params is None else params.to(dev),
        None if row_params is None else row_params.to(dev),
        tile_m=tm,
        tile_n=tn,
        softmax_scale=scale,
        fallback=fb,
        arch=arch,
        warp_specialized=variant == "sm90ws",
        out=out,
        lse=lse,
        options=options,
    )
    torch.cuda.synchronize()
    dmask = dense.to(dev)
    ref_o, ref_lse = ref_attention(q, k, v, dmask, scale)
    lp_o = torch_lowp_attention(q, k, v, dmask, scale)
    assert not torch.isnan(out).any(), "NaN (or unwritten) output"
    assert not torch.isnan(lse).any(), "NaN (or unwritten) LSE"
    err = (out.float() - ref_o).abs().max().item()
    err_torch = (lp_o - ref_o).abs().max().item()
    assert err <= 2 * err_torch + 1e-4, (err, err_torch)
    empty = ~dmask.any(dim=-1)  # [B, Sq]
    if empty.any():
        assert (out[empty] == 0).all(), "rows that see nothing must be exact zeros"
        e = empty.unsqueeze(1).expand(B, H, Sq)
        assert torch.isneginf(lse[e]).all()
        assert torch.isfinite(lse[~e]).all()
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    assert lse_err <= 2e-3 * max(1.0, ref_lse[fin].abs().max().item() if fin.any() else 1.0), (
        lse_err
    )


# ---------------------------------------------------------------------------------------------
# CPU: partial tiles by bits (KernelOptions(fwd_mask="bits")), the very functions on Python ints
# ---------------------------------------------------------------------------------------------
WGMMA_COLS = [8 * (c // 2) + c % 2 for c in range(32)]  # a thread's columns in a 128-wide tile


def test_pattern_of_offsets():
    from compilemask.kernels.mask import pattern_of_offsets

    assert pattern_of_offsets(WGMMA_COLS) == (32, 2, 8)
    assert pattern_of_offsets(WGMMA_COLS[:16]) == (16, 2, 8)  # 64-wide tiles
    assert pattern_of_offsets(list(range(8))) == (8, 8, 8)  # contiguous columns
    assert pattern_of_offsets([0, 1, 4, 5, 8, 9]) == (6, 2, 4)
    assert pattern_of_offsets([0, 2, 4, 6]) == (4, 1, 2)  # every other column
    assert pattern_of_offsets([0, 1, 8, 10]) is None
    assert pattern_of_offsets(list(range(64))) is None  # more than one 32-bit word


@pytest.mark.parametrize(
    "cols", [WGMMA_COLS, WGMMA_COLS[:16], list(range(16)), [2 * c for c in range(32)]]
)
def test_interval_bits_equal_the_interval_test(cols):
    """Every bit of every row word equals ``OR_k start_k <= kv_idx < end_k`` for the column it
    stands for: random slots around the tile, including empty, zero-length and clipped ones,
    and slots that cover the whole tile; each of a quad's four first columns."""
    from compilemask.kernels.mask import interval_bits, pattern_of_offsets

    pattern = pattern_of_offsets(cols)
    rng = random.Random(7)
    tile_n = 128
    for trial in range(3000):
        K = rng.randrange(1, 7)
        n_start = tile_n * rng.randrange(0, 4)
        base = rng.choice([0, 2, 4, 6])  # the thread's first column in the tile
        slots = []
        for _ in range(K):
            kind = rng.random()
            if kind < 0.15:
                s, e = 0, 0  # an unused slot
            elif kind < 0.25:
                s = rng.randrange(-50, 700)
                e = s  # zero length
            elif kind < 0.35:
                s = n_start - rng.randrange(0, 40)  # the whole tile and more
                e = n_start + tile_n + rng.randrange(0, 40)
            else:
                s = n_start + rng.randrange(-40, tile_n + 40)
                e = s + rng.randrange(0, 90)
            slots += [max(s, 0), max(e, 0)]
        x0 = n_start + base
        word = interval_bits(slots, None, K, x0, pattern, 1, min, max) & 0xFFFFFFFF
        for c, off in enumerate(cols):
            kv_idx = x0 + off
            want = any(slots[2 * k] <= kv_idx < slots[2 * k + 1] for k in range(K))
            assert bool((word >> c) & 1) == want, (trial, slots, base, c)
        assert word >> len(cols) == 0  # no bit past the thread's columns
