"""Every sample of one mask's train step, with the GPU's clocks, power and throttle reasons.

A round-based median (``bench/engines.py --rounds``) of a 50 ms step at ``--rep 100`` holds
two samples; on a GPU at its power cap the clock moves between samples, and such medians move
with it. This prints each sample of four timings, interleaved over rounds, so a drift can be
told from noise: the fa4 engine on a prebuilt descriptor (engines.py's ``fa4``), on the
preprocess's own descriptor, with the preprocess in each call (``fa4+pre``), and the always-True
ceiling (``fa4_true``).

    python bench/samples.py --mask hstu --seqlen 32768 --rounds 4 --rep 500
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))

import compilemask as cm  # noqa: E402
from bench import engines as E  # noqa: E402
from compilemask.pipeline.pipeline import with_lists  # noqa: E402

STATE = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mask", default="hstu", choices=sorted(E.SPECS))
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rep", type=int, default=500, help="do_bench's budget per timing, ms")
    args = ap.parse_args()
    import triton

    S, dev = args.seqlen, "cuda"
    B = max(1, E.TOKENS // S)
    meta = E.workload_meta(args.mask, B, S, dev)
    pre = cm.compile_mask(E.SPECS[args.mask]()).preprocessor(S, batch_size=B)
    desc = pre(meta)
    prebuilt = with_lists(desc)
    gen = torch.Generator(device=dev).manual_seed(S)
    q, k, v = (torch.randn(B, S, E.H, E.D, device=dev, dtype=E.DTYPE, generator=gen)
               for _ in range(3))
    do = torch.randn(q.shape, device=dev, dtype=E.DTYPE, generator=gen)

    def train(d):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        cm.attention(qq, kk, vv, d, backend="fa4").backward(do)

    timings = {"fa4 (prebuilt)": (lambda: train(prebuilt), None),
               "fa4 (preprocess's)": (lambda: train(desc), None),
               "fa4+pre": (lambda: train(pre(meta)), None),
               "ceiling": (lambda: train(prebuilt), E._CeilingMaskMod)}
    print(f"{args.mask} S={S} B={B} H={E.H} D={E.D}: ms per sample; [SM clock MHz, power W, "
          "temperature C, throttle reasons (0x4: software power cap)]")
    for r in range(args.rounds):
        for name, (fn, ctx) in timings.items():
            if ctx is None:
                t = triton.testing.do_bench(fn, warmup=100, rep=args.rep, return_mode="all")
            else:
                with ctx():
                    t = triton.testing.do_bench(fn, warmup=100, rep=args.rep, return_mode="all")
            smi = ", ".join(E.gpu_state(STATE) or ["n/a"])
            print(f"round {r} {name:19s} median {statistics.median(t):7.2f} [{smi}] "
                  + " ".join(f"{x:.1f}" for x in t), flush=True)


if __name__ == "__main__":
    main()
