"""Backward kernel timing (CUDA): the CuTe forward and backward (both MMA paths) per mask, and
FA4's causal backward for comparison. TFLOP/s count visible (q, k) pairs only.

    python bench/bwd.py [--mask causal hstu] [-S 8192] [-B 2] [--heads 8] [--hdim 128]
                        [--iters 10] [--arch 80 90]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)

import compilemask as cm
from compilemask import masks
from compilemask.contract.options import KernelOptions
from compilemask.kernels.fallback import Fallback
from compilemask.kernels.interface import flash_bwd, flash_fwd


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mask", nargs="+", default=["causal", "hstu"])
    ap.add_argument("-S", type=int, default=8192)
    ap.add_argument("-B", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    a = ap.parse_args(argv)
    B, S, H, D = a.B, a.S, a.heads, a.hdim

    def timeit(fn):
        for _ in range(2):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / a.iters

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    def run_mask(name):
        spec = getattr(masks, name)()
        mask = cm.compile_mask(spec)
        desc = mask.preprocess(masks.random_meta(spec, B, S), seqlen_q=S, batch_size=B,
                               backend="torch")
        desc = desc.to("cuda")
        fb = Fallback.from_mask(mask) if mask.has_fallback else None
        visible = float(desc.dense_mask().sum())
        fwd_args = (q, k, v, desc.intervals, desc.fwd_bitmap, desc.row_region, desc.params,
                    desc.row_params)
        out, lse = flash_fwd(*fwd_args, tile_m=desc.fwd_tiles.tile_m,
                             tile_n=desc.fwd_tiles.tile_n, fallback=fb)

        def bwd(arch):
            return flash_bwd(do, q, k, v, out, lse, desc.intervals, desc.bwd_bitmap,
                             desc.row_region, desc.params, desc.row_params,
                             tile_m=desc.bwd_tiles.tile_m, tile_n=desc.bwd_tiles.tile_n,
                             fallback=fb, options=KernelOptions(bwd_arch=arch))

        t_fwd = timeit(lambda: flash_fwd(*fwd_args, tile_m=desc.fwd_tiles.tile_m,
                                         tile_n=desc.fwd_tiles.tile_n, fallback=fb))
        fl = 4.0 * visible * D * H
        msg = (f"bench {name} B={B} S={S} H={H} D={D} density={visible / (B * S * S):.3f}: "
               f"fwd {t_fwd:.3f} ms ({fl / t_fwd / 1e9:.0f} TFLOP/s)")
        for arch in a.arch:
            t_bwd = timeit(lambda: bwd(arch))  # noqa: B023
            msg += f", bwd sm{arch} {t_bwd:.3f} ms ({2.5 * fl / t_bwd / 1e9:.0f} TFLOP/s)"
        print(msg, flush=True)

    for name in a.mask:
        try:
            run_mask(name)
        except Exception as e:  # report and go on with the next mask
            print(f"bench {name}: failed ({type(e).__name__}: {e})", flush=True)
    try:
        from flash_attn.cute import flash_attn_func

        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def fa4():
            o = flash_attn_func(qg, kg, vg, causal=True)
            o = o[0] if isinstance(o, tuple) else o
            o.backward(do)

        def fa4_fwd():
            with torch.no_grad():
                flash_attn_func(q, k, v, causal=True)

        t_f = timeit(fa4_fwd)
        t_fb = timeit(fa4)
        fl = 4.0 * B * S * (S + 1) / 2 * D * H
        print(f"bench FA4 causal: fwd {t_f:.3f} ms, bwd ~{t_fb - t_f:.3f} ms "
              f"({2.5 * fl / (t_fb - t_f) / 1e9:.0f} TFLOP/s)", flush=True)
    except Exception as e:  # FA4 absent or failing: the comparison is optional
        print(f"bench FA4: skipped ({type(e).__name__}: {e})")



if __name__ == "__main__":
    main()
