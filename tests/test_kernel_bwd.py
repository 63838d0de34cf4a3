"""CuTe DSL backward kernel: CPU compile checks (CI) and GPU correctness checks (-m gpu)."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

import compilemask as cm  # noqa: E402
from compilemask import masks  # noqa: E402
from compilemask.compiler.reference import attention_reference  # noqa: E402
from compilemask.kernels.config import FlashBwdConfig  # noqa: E402
from compilemask.kernels.fallback import Fallback  # noqa: E402
from compilemask.kernels.flash_bwd import FlashBwd  # noqa: E402
from compilemask.kernels.flash_bwd_sm90 import FlashBwdSm90  # noqa: E402
from compilemask.kernels.interface import compile_flash_bwd  # noqa: E402

from helpers import sweep  # noqa: E402

SM90 = "sm_90a"  # compile target passed as --gpu-arch: no GPU needed


def _ptx(cfg, dump_dir):
    """The PTX of the backward kernel for ``cfg``, compiled for sm_90a (no GPU, no cache)."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    compile_flash_bwd(cfg, gpu_arch=SM90, use_cache=False,
                      extra_options=f"--keep-ptx --dump-dir {dump_dir}")
    return "".join(p.read_text() for p in dump_dir.rglob("*.ptx"))


# ---------------------------------------------------------------------------------------------
# CPU: the backward kernel compiles for sm_90a (no GPU, no launch)
# ---------------------------------------------------------------------------------------------
def test_default_arch(monkeypatch):
    """wgmma (90) on sm_90 devices, mma.sync (80) otherwise; KernelOptions.bwd_arch
    overrides."""
    from compilemask.contract.options import KernelOptions, device_arch

    def default_arch(device=None, options=None):
        return (options or KernelOptions()).resolve(device_arch(device), 1).bwd_arch

    assert default_arch() == 80 and default_arch(torch.device("cpu")) == 80
    for cap, want in (((9, 0), 90), ((8, 9), 80), ((10, 0), 80)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, cap=cap: cap)
        assert default_arch(torch.device("cuda", 0)) == want
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
    assert default_arch(torch.device("cuda", 0), KernelOptions(bwd_arch=80)) == 80


def test_dq_reduce_variants_emit_their_instructions(tmp_path):
    """The mma.sync kernel's dQ accumulation (KernelOptions.bwd_dq): ``atomic`` one float32
    atomic per element, ``red2`` (its default on sm_90) one red.global.add.v2.f32 per column
    pair; the sm90 kernel adds bulk only (``test_sm90_kernel_structure``); anything else is
    refused."""
    modes = [("atomic", "atom.global.add.f32", "add.v2.f32"),
             ("red2", "red.relaxed.gpu.global.add.v2.f32", "atom.global.add")]
    for mode, want, other in modes:
        cfg = FlashBwdConfig(dtype="bf16", head_dim=64, tile_m=64, tile_n=128, num_intervals=1,
                             arch=80, dq_reduce=mode)
        ptx = _ptx(cfg, tmp_path / mode)
        assert want in ptx and other not in ptx, mode
    assert FlashBwdConfig("bf16", 64, 64, 128, 1).dq_reduce == "atomic"
    assert FlashBwdConfig("bf16", 64, 64, 128, 1, arch=90).dq_reduce == "bulk"
    assert not FlashBwd.can_implement(FlashBwdConfig("bf16", 64, 64, 128, 1, dq_reduce="bulk"))
    for mode in ("atomic", "red2", "tma"):
        assert not FlashBwdSm90.can_implement(FlashBwdConfig("bf16", 64, 64, 128, 1, arch=90,
                                                             dq_reduce=mode))
    assert not FlashBwd.can_implement(FlashBwdConfig("bf16", 64, 64, 128, 1, dq_reduce="tma"))


@pytest.mark.parametrize("hdim", [64, 128])
def test_dq_fragment_order(hdim):
    """The bulk dQ keeps each q tile in wgmma-fragment order: the postprocess order is a
    permutation, and thread 0's first vector holds (0, 0), (0, 1), (8, 0), (8, 1) (CUTLASS's sm90
    accumulator layout), warpgroup 1's half starts at column D/2."""
    from compilemask.kernels.interface import _dq_fragment_order

    order = _dq_fragment_order(64, hdim, torch.device("cpu"))
    assert sorted(order.tolist()) == list(range(64 * hdim))
    where = torch.empty_like(order)
    where[order] = torch.arange(64 * hdim)  # position -> row * D + col
    rc = [(int(x) // hdim, int(x) % hdim) for x in where]
    assert rc[:8] == [(0, 0), (0, 1), (8, 0), (8, 1), (0, 2), (0, 3), (8, 2), (8, 3)]
    assert rc[4 * 32: 4 * 32 + 2] == [(16, 0), (16, 1)]  # thread 32: warp 1
    assert rc[512:514] == [(0, 8), (0, 9)]  # vector k = 1
    assert rc[32 * hdim: 32 * hdim + 2] == [(0, hdim // 2), (0, hdim // 2 + 1)]


@sweep("dtype,hdim,K", [("bf16", 128, 2), ("fp16", 64, 1), ("bf16", 64, 4)],
       default=[("bf16", 128, 2)])
def test_sm90_kernel_structure(dtype, hdim, K, tmp_path):
    """The sm90 backward kernel, from its PTX:

    * warp specialization: the producer warpgroup issues the TMA loads (K, V once; Q, dO per q
      tile) and gives registers back (setmaxnreg.dec) to the two wgmma warpgroups
      (setmaxnreg.inc); no cp.async, no block-wide barrier after the set-up;
    * one barrier of the wgmma warpgroups per q tile (named barrier 3; one more before the loop);
    * the wgmma schedule: S and dP issued back to back (wait 1: S), dP (wait 0), then dV, dQ, dK
      in flight together (wait 1: dV, wait 1: dQ, wait 0: dK);
    * dS stored with 4 stmatrix.x4.trans per thread, no 16-bit stores;
    * dQ: the writer warp issues one bulk reduce-add per warpgroup half (2 per q tile) after
      the halves' full barriers (4, 5), and frees each half once the previous add has read it
      (wait_group.read 1, 0; barriers 6, 7)."""
    cfg = FlashBwdConfig(dtype=dtype, head_dim=hdim, tile_m=64, tile_n=128, num_intervals=K,
                         arch=90)
    ptx = _ptx(cfg, tmp_path)
    assert "cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier::complete_tx::bytes" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
    assert "cp.async.cg" not in ptx and "cp.async.ca" not in ptx
    assert len(re.findall(r"bar\.sync\s+0;", ptx)) == 1  # pipeline set-up only
    assert len(re.findall(r"bar\.sync\s+3, 256;", ptx)) == 2
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits == ["1", "0", "1", "1", "0"], waits
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 4
    assert "st.shared.b16" not in ptx
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2
    assert "atom.global.add" not in ptx and "red.relaxed" not in ptx
    for bar in ("bar.sync \t4, 160;", "bar.sync \t5, 160;", "bar.arrive 6, 160;",
                "bar.arrive 7, 160;"):
        assert bar in ptx, bar
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read\s+1;", ptx)) == 1
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)) == 2


# arch 80: the mma.sync path, 90: the wgmma path
@sweep("hdim,K,arch", [(h, k, a) for h in (64, 128) for k in (1, 2) for a in (80, 90)],
       default=[(128, 2, 90), (64, 1, 80)])
def test_compile_sm90_bf16(hdim, K, arch):
    cfg = FlashBwdConfig(dtype="bf16", head_dim=hdim, tile_m=64, tile_n=128, num_intervals=K,
                         arch=arch)
    assert compile_flash_bwd(cfg, gpu_arch=SM90) is not None


@pytest.mark.parametrize("arch", [pytest.param(80, marks=pytest.mark.slow), 90])
def test_compile_sm90_fp16_k4(arch):
    cfg = FlashBwdConfig(dtype="fp16", head_dim=128, tile_m=64, tile_n=128, num_intervals=4,
                         arch=arch)
    assert compile_flash_bwd(cfg, gpu_arch=SM90) is not None


def test_compile_sm90_fallback_logs_once(caplog):
    mask = cm.compile_mask(masks.dilated_causal())
    fb = Fallback.from_mask(mask)
    cfg = FlashBwdConfig(dtype="bf16", head_dim=64, tile_m=64, tile_n=128,
                         num_intervals=mask.num_intervals, has_fallback=True,
                         fallback_hash=fb.hash, fallback_regions=fb.regions,
                         num_params=fb.num_params, num_row_params=fb.num_row_params)
    with caplog.at_level(logging.INFO, logger="compilemask"):
        compile_flash_bwd(cfg, fb, gpu_arch=SM90)
        compile_flash_bwd(cfg, fb, gpu_arch=SM90)
    msgs = [r for r in caplog.records if "flash_bwd kernel with fallback" in r.getMessage()]
    assert len(msgs) == 1


# arch 80 with a fallback: test_compile_sm90_fallback_logs_once
@pytest.mark.parametrize("arch", [pytest.param(80, marks=pytest.mark.slow), 90])
def test_compile_sm90_fallback_row_params(arch):
    import sympy as sp

    i, j = sp.symbols("i j", integer=True)
    first = sp.Function("first")
    stride = sp.Symbol("stride", integer=True)
    expr = sp.And(j <= i, sp.Or(sp.Eq(sp.Mod(i - j, stride), 0), j < first(i)))
    fb = Fallback.from_expr(expr, ["stride"], ["first"], regions=(0, 2))
    cfg = FlashBwdConfig(dtype="bf16", head_dim=128, tile_m=64, tile_n=128, num_intervals=2,
                         has_fallback=True, fallback_hash=fb.hash, fallback_regions=fb.regions,
                         num_params=fb.num_params, num_row_params=fb.num_row_params, arch=arch)
    assert compile_flash_bwd(cfg, fb, gpu_arch=SM90) is not None


def test_deterministic_compiles_with_ordered_adds(tmp_path):
    """deterministic (sm90 kernel): before each dQ half's bulk add, the writer warp's lane 0
    spins on the half's semaphore (ld.acquire); after both adds it waits for them to finish (not
    only to read shared memory) and counts them (red.release); the mma.sync kernel and other
    dQ modes refuse it."""
    cfg = FlashBwdConfig(dtype="bf16", head_dim=128, tile_m=64, tile_n=128, num_intervals=2,
                         arch=90, deterministic=True)
    ptx = _ptx(cfg, tmp_path)
    assert "ld.acquire.gpu.global.b32" in ptx
    assert ptx.count("red.release.gpu.global.add.s32") == 2  # one per half
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\s+0;", ptx)) == 1
    # the only read-wait left is the one that keeps sdQ until the CTA's last add has read it
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read\s+\d+;", ptx)) == 1
    assert not FlashBwdSm90.can_implement(FlashBwdConfig("bf16", 128, 64, 128, 2, arch=90,
                                                         dq_reduce="red2", deterministic=True))
    assert not FlashBwd.can_implement(FlashBwdConfig("bf16", 128, 64, 128, 2,
                                                     deterministic=True))


@pytest.mark.parametrize("dtype,hdim", [("bf16", 128), ("fp16", 64)])
def test_aux_kernels_compile_vectorized(dtype, hdim, tmp_path):
    """The backward's pre- and postprocess kernels compile for sm_90a with vector accesses:
    dPsum reads D/32 contiguous 16-bit elements of O and dO per lane in one load each; the dQ
    postprocess reads four 8-byte dq_accum pairs and writes 8 outputs in one 16-byte store."""
    from compilemask.kernels.bwd_aux import AuxConfig, compile_aux

    vec = {64: "ld.global.v2.b16", 128: "ld.global.v4.b16"}[hdim]
    for kind, want in (("dpsum", {vec: 2, "st.global.b32": 1}),
                       ("dq", {"ld.global.v2.b32": 4, "st.global.v4.b32": 1})):
        d = tmp_path / kind
        d.mkdir()
        compile_aux(AuxConfig(kind, dtype, hdim), gpu_arch=SM90, use_cache=False,
                    extra_options=f"--keep-ptx --dump-dir {d}")
        ptx = "".join(p.read_text() for p in d.rglob("*.ptx"))
        got = {op: len(re.findall(re.escape(op) + r"\s", ptx)) for op in want}
        assert got == want, (kind, got)
    with pytest.raises(ValueError, match="kind"):
        compile_aux(AuxConfig("dk", dtype, hdim), gpu_arch=SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hdim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_aux_kernels_vs_torch(dtype, hdim):
    """dPsum vs a float64 rowsum; the dQ postprocess vs the host gather of the fragment order
    (``_dq_fragment_order``), scaled and cast: bit-identical. S = 300 ends mid-tile."""
    from compilemask.kernels.bwd_aux import AuxConfig, compile_aux
    from compilemask.kernels.interface import _dq_fragment_order

    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    B, S, H, D = 2, 300, 3, hdim
    g = torch.Generator(device="cuda").manual_seed(7)
    out = torch.randn(B, S, H, D, device="cuda", generator=g).to(dtype)
    dout = torch.randn(B, S, H, D, device="cuda", generator=g).to(dtype)
    dpsum = torch.empty(B, H, S, device="cuda")
    compile_aux(AuxConfig("dpsum", name, D))(out, dout, dpsum)
    ref = torch.einsum("bshd,bshd->bhs", dout.double(), out.double())
    assert (dpsum.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
    n_m = -(-S // 64)
    acc = torch.randn(B, H, n_m, 64 * D, device="cuda", generator=g)
    dq = torch.empty(B, S, H, D, device="cuda", dtype=dtype)
    compile_aux(AuxConfig("dq", name, D))(acc, dq, 0.37)
    order = _dq_fragment_order(64, D, acc.device)
    rows = acc.index_select(-1, order).view(B, H, n_m * 64, D)[:, :, :S].transpose(1, 2)
    assert torch.equal(dq, (rows * 0.37).to(dtype))


def test_meta_async_ptx(tmp_path):
    """meta_async (KernelOptions(bwd_meta="async"), sm90 kernel; CPU): the consumers copy the next
    q tile's row metadata global -> shared with 4-byte cp.async (LSE, dPsum, 2K slot words per
    row thread, at the prologue and in the loop) and wait for their own copies before the
    item's barrier; no new barrier, fewer global loads than the register path."""
    from dataclasses import replace

    K = 2
    cfg = FlashBwdConfig("bf16", 128, 64, 128, K, arch=90)
    regs = _ptx(cfg, tmp_path / "regs")
    ptx = _ptx(replace(cfg, meta_async=True), tmp_path / "async")
    assert ptx.count("cp.async.ca.shared.global") == 2 * (2 + 2 * K)
    assert ptx.count("cp.async.commit_group") == 2
    assert len(re.findall(r"cp\.async\.wait_group\s+0;", ptx)) == 2
    assert "cp.async" not in regs.replace("cp.async.bulk", "")
    for p in (regs, ptx):
        assert len(re.findall(r"bar\.sync\s+3, 256;", p)) == 2
    assert ptx.count("ld.global") < regs.count("ld.global")
    assert not FlashBwd.can_implement(replace(cfg, arch=80, dq_reduce="atomic", meta_async=True))
    assert FlashBwdSm90.can_implement(replace(cfg, meta_async=True))


def test_bitmap_smem_ptx(tmp_path):
    """bitmap_smem (the sm90 default; CPU): the CTA copies its bitmap row to shared memory
    once, and every scan then reads it there: one global load of bitmap words (the copy)
    where the global variant has one per scan site; rows longer than the copy keep global
    reads."""
    from dataclasses import replace

    from compilemask.contract.options import BITMAP_SMEM_WORDS, bitmap_fits_smem

    cfg = FlashBwdConfig("bf16", 128, 64, 128, 1, arch=90)
    assert cfg.bitmap_smem
    smem = _ptx(cfg, tmp_path / "smem")
    glob = _ptx(replace(cfg, bitmap_smem=False), tmp_path / "global")
    # first tile, producer, dQ writer, consumer next tile and tile state: 5 sites -> 1 copy
    assert glob.count("ld.global") - smem.count("ld.global") == 4
    assert smem.count("ld.shared") > glob.count("ld.shared")
    assert bitmap_fits_smem(16 * BITMAP_SMEM_WORDS) and not bitmap_fits_smem(
        16 * BITMAP_SMEM_WORDS + 1)


def test_meta_async_fallback_compiles(tmp_path):
    """meta_async with a fallback predicate: the predicate is evaluated per score (its
    generated function is in the PTX), and the cp.async copies carry the rows' region and
    params too."""

    from compilemask.kernels.autograd import _fallback, register_mask

    mask = cm.compile_mask(masks.dilated_causal())
    register_mask(mask)
    fb = _fallback(str(mask.key))
    cfg = FlashBwdConfig("bf16", 128, 64, 128, mask.num_intervals, arch=90, meta_async=True,
                         has_fallback=True, fallback_hash=fb.hash,
                         fallback_regions=fb.regions, num_params=fb.num_params,
                         num_row_params=fb.num_row_params)
    tmp_path.mkdir(exist_ok=True)
    compile_flash_bwd(cfg, fb, gpu_arch=SM90, use_cache=False,
                      extra_options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.rglob("*.ptx"))
    assert "rem.s32" in ptx or "rem.u32" in ptx or "div.s32" in ptx  # the dilation predicate
    # per copy site: LSE, dPsum, 2K slots, the region and R row params
    n = 2 + 2 * mask.num_intervals + 1 + fb.num_row_params
    assert ptx.count("cp.async.ca.shared.global") == 2 * n


def test_can_implement():
    ok = FlashBwdConfig(dtype="bf16", head_dim=128, tile_m=64, tile_n=128, num_intervals=2)
    assert FlashBwd.can_implement(ok)
    assert not FlashBwd.can_implement(FlashBwdConfig("bf16", 256, 64, 128, 2))
    assert not FlashBwd.can_implement(FlashBwdConfig("bf16", 128, 64, 128, 0))
    assert not FlashBwd.can_implement(FlashBwdConfig("fp32", 128, 64, 128, 1))
    assert FlashBwdSm90.can_implement(FlashBwdConfig("bf16", 128, 64, 128, 2, arch=90))
    assert not FlashBwdSm90.can_implement(FlashBwdConfig("bf16", 128, 128, 128, 2, arch=90))


# ---------------------------------------------------------------------------------------------
# GPU: gradients vs the float32 reference, error <= 2x PyTorch's own bf16 error
# ---------------------------------------------------------------------------------------------
def _attn_lowp(q, k, v, dense, scale):
    """Dense masked attention computed in the inputs' dtype (PyTorch's own bf16 path)."""
    H, Hkv = q.shape[2], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if H != Hkv:
        kt = kt.repeat_interleave(H // Hkv, dim=1)
        vt = vt.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    s = s.masked_fill(~dense.unsqueeze(1), float("-inf"))
    seen = dense.any(-1)[:, None, :, None]  # rows that see nothing: P = 0 (no NaN)
    s = torch.where(seen, s, torch.zeros_like(s))
    p = (torch.softmax(s.float(), dim=-1) * seen).to(q.dtype)
    return torch.matmul(p, vt).transpose(1, 2)


def _check_case(spec, B, S, H, Hkv, D, dtype=torch.bfloat16, seed=0, arch=None,
                deterministic=False, **options):
    from compilemask.contract.options import KernelOptions
    from compilemask.kernels.autograd import _fallback, register_mask
    from compilemask.kernels.interface import flash_bwd

    mask = cm.compile_mask(spec)
    meta = masks.random_meta(spec, B, S, gen=torch.Generator().manual_seed(seed))
    desc = mask.preprocess(meta, seqlen_q=S, batch_size=B, backend="torch").to("cuda")
    dense = desc.dense_mask()
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g)
    scale = 1.0 / math.sqrt(D)

    def grads(fn, inputs):
        xs = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*xs)
        out.backward(dout.to(out.dtype))
        return [x.grad for x in xs]

    qf, kf, vf = (t.float() for t in (q, k, v))
    ref = grads(lambda a, b, c: attention_reference(a, b, c, dense, scale), (qf, kf, vf))
    pt = grads(lambda a, b, c: _attn_lowp(a, b, c, dense, scale), (q, k, v))
    with torch.no_grad():
        out, lse = attention_reference(q, k, v, dense, softmax_scale=scale, return_lse=True)
    register_mask(mask)
    fb = _fallback(str(mask.key))
    got = flash_bwd(dout, q, k, v, out, lse, desc.intervals, desc.bwd_bitmap, desc.row_region,
                    desc.params, desc.row_params, tile_m=desc.bwd_tiles.tile_m,
                    tile_n=desc.bwd_tiles.tile_n, softmax_scale=scale, fallback=fb,
                    deterministic=deterministic,
                    options=KernelOptions(bwd_arch=arch, **options))
    torch.cuda.synchronize()
    report = []
    for name, a, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        assert a.shape == r.shape and a.dtype == dtype, name
        assert torch.isfinite(a).all(), f"{name}: non-finite"
        err = (a.float() - r).abs().max().item()
        pt_err = (p.float() - r).abs().max().item()
        tol = 2 * pt_err + 1e-3 * r.abs().max().item() + 1e-5
        report.append(f"{name} err {err:.2e} pt {pt_err:.2e}")
        assert err <= tol, f"{spec.name} S={S} H={H}/{Hkv} D={D} {name}: {err} > {tol} ({report})"
    empty = ~dense.any(-1)  # rows that see nothing: dq exactly zero
    if empty.any():
        assert torch.equal(got[0][empty], torch.zeros_like(got[0][empty]))
    return report


@pytest.mark.gpu
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("S", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("name", ["causal", "hstu"])
@pytest.mark.parametrize("D", [64, 128])
def test_bwd_vs_reference(name, S, D, arch):
    spec = getattr(masks, name)()
    print(name, S, D, arch, _check_case(spec, 2, S, 4, 2, D, seed=S + D, arch=arch))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["shared_prompt_rm", "clear", "dilated_causal", "prefix_lm",
                                  "packed_documents", "sliding_window"])
@pytest.mark.parametrize("arch", [80, 90])
def test_bwd_other_masks(name, arch):
    spec = getattr(masks, name)()
    print(name, arch, _check_case(spec, 2, 300, 2, 1, 128, seed=3, arch=arch))


@pytest.mark.gpu
@pytest.mark.parametrize("meta", ["async", "regs"])
@pytest.mark.parametrize("name,S", [("causal", 1), ("causal", 1000), ("hstu", 129),
                                    ("clear", 1000), ("shared_prompt_rm", 300),
                                    ("packed_documents", 257), ("dilated_causal", 300)])
def test_bwd_meta_async_vs_reference(name, S, meta):
    """KernelOptions.bwd_meta forced for every mask: async (the default only for K > 2) by
    per-thread cp.async, and regs (the default only for K <= 2: CLEAR's K = 6 is the case the
    default runs do not cover)."""
    spec = getattr(masks, name)()
    print(name, S, meta, _check_case(spec, 2, S, 4, 2, 128, seed=S + 13, arch=90,
                                     bwd_meta=meta))


@pytest.mark.gpu
@pytest.mark.parametrize("bitmap", ["smem", "global"])
@pytest.mark.parametrize("name,S", [("causal", 2100), ("hstu", 1100), ("clear", 1500)])
def test_bwd_bitmap_smem_vs_reference(name, S, bitmap):
    """KernelOptions.bwd_bitmap: the scans read the CTA's bitmap row from its shared-memory copy
    (the default) or from global memory (rows longer than the copy), on rows of 2 to 3 words."""
    spec = getattr(masks, name)()
    print(name, S, bitmap, _check_case(spec, 2, S, 2, 1, 128, seed=S + 7, arch=90,
                                       bwd_bitmap=bitmap))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", [80, 90])
def test_bwd_fp16_mqa(arch):
    print("fp16", arch, _check_case(masks.hstu(), 2, 257, 4, 1, 64, dtype=torch.float16, seed=9,
                                    arch=arch))


@pytest.mark.gpu
@pytest.mark.parametrize("name,S,H,Hkv,D", [("causal", 1000, 4, 2, 128), ("hstu", 129, 4, 4, 64),
                                             ("clear", 300, 2, 1, 128),
                                             ("dilated_causal", 257, 2, 2, 128)])
def test_bwd_deterministic_vs_reference(name, S, H, Hkv, D):
    spec = getattr(masks, name)()
    print(name, _check_case(spec, 2, S, H, Hkv, D, seed=5, arch=90, deterministic=True))


@pytest.mark.gpu
def test_bwd_deterministic_is_bitwise_repeatable():
    """deterministic=True: dQ (and dK, dV) bit-identical over repeated runs, through cm.attention
    and autograd, on a case where many kv tiles add to each dQ tile."""
    spec = masks.causal()
    mask = cm.compile_mask(spec)
    B, S, H, Hkv, D = 2, 4096, 4, 2, 128
    desc = mask.preprocess(masks.random_meta(spec, B, S), seqlen_q=S, batch_size=B,
                           backend="torch").to("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (H, Hkv, Hkv))
    dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def grads():
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        cm.attention(*xs, desc, deterministic=True).backward(dout)
        return [x.grad for x in xs]

    first = grads()
    for _ in range(4):
        for a, b in zip(grads(), first):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_op_cuda_compile_matches_eager():
    """cm kernels end to end through the custom op (forward kernel + backward kernel), eager vs
    torch.compile."""
    from compilemask.kernels.autograd import attention_op

    spec = masks.hstu()
    mask = cm.compile_mask(spec)
    B, S, H, Hkv, D = 2, 200, 4, 2, 128
    desc = mask.preprocess(masks.random_meta(spec, B, S), seqlen_q=S, backend="torch").to("cuda")
    torch.manual_seed(0)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(q, k, v):
        return attention_op(q, k, v, desc).float().square().sum()

    def run(fn):
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward()
        return [t.grad.clone() for t in (q, k, v)]

    eager = run(f)
    comp = run(torch.compile(f, backend="aot_eager", fullgraph=True))
    for a, b in zip(comp, eager):
        # dq is summed with float32 atomics: the order (and the last bf16 bit) may differ
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-2 * b.abs().max().item())
