"""Forward attention timing: CompileMask CuTe kernel vs FA4 (flash_attn.cute) vs FlexAttention.

Causal, 8 heads, head dim 128, bf16, 128K tokens per batch (S = 1K..32K, B = 128..4).
TFLOP/s counts visible (q, k) pairs only: 4 * visible * D * H FLOPs for the forward.

    python bench/fwd.py [--seqlens 1024,2048,...] [--no-flex] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)


def _bench(fn, warmup=10, rep=50):
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms


def causal_descriptor(B, S, tile_m, tile_n, dev):
    from compilemask.compiler.tiles import pack_bitmap, tile_states
    from compilemask.contract.descriptor import TileConfig

    i = torch.arange(S, device=dev)
    starts = torch.zeros(B, S, 1, dtype=torch.int64, device=dev)
    lens = (i + 1).view(1, S, 1).expand(B, S, 1).contiguous()
    st = tile_states(
        starts,
        lens,
        torch.zeros(B, S, dtype=torch.bool, device=dev),
        TileConfig(tile_m, tile_n),
        S,
        S,
    )
    iv = torch.stack([starts, lens], dim=-1).to(torch.int32).contiguous()
    return iv, pack_bitmap(st)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--tokens", type=int, default=128 * 1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument(
        "--variants",
        default="sm90ws,sm90ws_ovl,sm90ws_plain,sm90",
        help="our kernels to time: sm90ws (TMA + warp-specialized wgmma, "
        "intra-warpgroup overlap + pingpong), sm90ws_ovl (no pingpong), "
        "sm90ws_plain (neither), sm90 (single-role wgmma, cp.async), "
        "sm80 (mma.sync)",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument(
        "--commit",
        default=os.environ.get("COMPILEMASK_COMMIT", ""),
        help="commit to record (default: git rev-parse --short HEAD)",
    )
    args = ap.parse_args()

    from compilemask.kernels.config import default_tiles
    from compilemask.kernels.interface import flash_fwd

    dev = "cuda"
    H, D = args.heads, args.dim
    dtype = torch.bfloat16
    scale = 1.0 / math.sqrt(D)
    rows = []
    flex = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention)
        except Exception as e:  # pragma: no cover
            print("flex unavailable:", e)
    fa4 = None
    if not args.no_fa4:
        try:
            from flash_attn.cute import flash_attn_func as fa4
        except Exception as e:  # pragma: no cover
            print("FA4 unavailable:", e)

    for S in [int(s) for s in args.seqlens.split(",")]:
        B = max(args.tokens // S, 1)
        visible = B * S * (S + 1) // 2
        flops = 4 * visible * D * H
        q = torch.randn(B, S, H, D, device=dev, dtype=dtype)
        k = torch.randn(B, S, H, D, device=dev, dtype=dtype)
        v = torch.randn(B, S, H, D, device=dev, dtype=dtype)
        row = {"S": S, "B": B}
        for var in args.variants.split(","):
            arch = 80 if var == "sm80" else 90
            ws = var.startswith("sm90ws")
            ovl = var != "sm90ws_plain"
            pp = var == "sm90ws"
            tm, tn = default_tiles(D, arch)
            iv, bm = causal_descriptor(B, S, tm, tn, dev)
            out = torch.empty_like(q)
            lse = torch.empty(B, H, S, device=dev)

            def ours(
                arch=arch, ws=ws, ovl=ovl, pp=pp, tm=tm, tn=tn, iv=iv, bm=bm, out=out, lse=lse
            ):
                return flash_fwd(
                    q,
                    k,
                    v,
                    iv,
                    bm,
                    tile_m=tm,
                    tile_n=tn,
                    softmax_scale=scale,
                    arch=arch,
                    warp_specialized=ws,
                    intra_wg_overlap=ovl,
                    pingpong=pp,
                    out=out,
                    lse=lse,
                )

            ours()
            ms = _bench(ours)
            row[f"ours_{var}"] = flops / ms / 1e9
            if fa4 is not None and var == "sm90ws":
                ref = fa4(q, k, v, softmax_scale=scale, causal=True)
                ref = ref[0] if isinstance(ref, tuple) else ref
                row["max_diff_vs_fa4"] = (ours()[0].float() - ref.float()).abs().max().item()
        if fa4 is not None:
            try:
                ms = _bench(lambda: fa4(q, k, v, softmax_scale=scale, causal=True))
                row["fa4"] = flops / ms / 1e9
            except Exception as e:
                print("FA4 failed:", e)
        if flex is not None:
            try:
                bmask = create_block_mask(
                    lambda b, h, qi, ki: ki <= qi, None, None, S, S, device=dev
                )
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                try:

                    def fx():
                        return flex(
                            qt,
                            kt,
                            vt,
                            block_mask=bmask,
                            scale=scale,
                            kernel_options={"BACKEND": "TRITON"},
                        )

                    fx()
                except Exception:

                    def fx():
                        return flex(qt, kt, vt, block_mask=bmask, scale=scale)

                    fx()
                ms = _bench(fx)
                row["flex_triton"] = flops / ms / 1e9
            except Exception as e:
                print("flex failed:", e)
        print(row, flush=True)
        rows.append(row)
        q = k = v = None
        torch.cuda.empty_cache()

    cols = [
        c
        for c in [
            "ours_sm90ws",
            "ours_sm90ws_ovl",
            "ours_sm90ws_plain",
            "ours_sm90",
            "ours_sm80",
            "fa4",
            "flex_triton",
            "max_diff_vs_fa4",
        ]
        if any(c in r for r in rows)
    ]
    commit = args.commit
    try:
        commit = commit or (
            subprocess.run(
                ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except Exception:
        commit = commit or "unknown"
    gpu = torch.cuda.get_device_name()
    today = datetime.date.today().isoformat()
    lines = [
        f"# Forward attention, causal, bf16, H={H}, D={D}, {args.tokens} tokens per batch",
        "",
        f"date {today}, GPU {gpu}, commit {commit}, torch {torch.__version__}",
        "",
        "TFLOP/s counting visible pairs only (4 * visible * D * H); median of triton do_bench.",
        "",
        "| S | B | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for r in rows:
        vals = []
        for c in cols:
            x = r.get(c)
            vals.append("-" if x is None else (f"{x:.3g}" if c.startswith("max") else f"{x:.0f}"))
        lines.append(f"| {r['S']} | {r['B']} | " + " | ".join(vals) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"fwd_{today}_{gpu.replace(' ', '_')}.md")
    with open(path, "w") as f:
        f.write(text)
    print("wrote", path)


if __name__ == "__main__":
    main()
