"""One train step per method inside an NVTX range, for Nsight Compute (bench/h200.sh ncu):
ours (preprocess, forward, backward with its pre/postprocess) and FA4 native on causal, at one
sequence length of the benchmark's shapes (8 heads x 128, bf16, 128K tokens per batch). The
kernel variants are `--options` (compilemask.KernelOptions), so a profile can compare builds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

import compilemask as cm  # noqa: E402
from bench.workloads import WORKLOADS, batch_for, make_meta  # noqa: E402

H, D = 8, 128


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mask", default="causal", choices=sorted(WORKLOADS))
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--methods", default="cm,fa4")
    ap.add_argument("--options", default="", type=cm.KernelOptions.from_str,
                    help="cm: the cute kernels' variants, e.g. bwd_meta=async")
    args = ap.parse_args(argv)
    S, B = args.seqlen, batch_for(args.seqlen)
    meta = make_meta(args.mask, B, S, device="cuda")
    pre = cm.compile_mask(WORKLOADS[args.mask]()).preprocessor(S, batch_size=B)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))

    def step(method):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        if method == "cm":
            out = cm.attention(qq, kk, vv, pre(meta), options=args.options)
        else:
            from flash_attn.cute import flash_attn_func

            assert args.mask == "causal", "fa4 runs the causal mask only"
            out = flash_attn_func(qq, kk, vv, causal=True)
            out = out[0] if isinstance(out, tuple) else out
        out.backward(do)

    methods = [m for m in args.methods.split(",") if m != "fa4" or args.mask == "causal"]
    # NVTX ranges are per thread: run the backward on this thread (not autograd's device
    # thread), so that the profiled range holds the backward's kernels too
    torch.autograd.set_multithreading_enabled(False)
    for m in methods:  # compile and warm up outside the profiled range
        step(m)
        step(m)
    torch.cuda.synchronize()
    for m in methods:
        torch.cuda.nvtx.range_push(f"measure_{m}")
        step(m)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print(f"ncu case: {args.mask} S={S} B={B} methods={methods}", flush=True)


if __name__ == "__main__":
    main()
