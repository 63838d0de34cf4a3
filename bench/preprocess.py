"""Preprocess benchmark (H200): generated TileLang kernel vs torch.compile(create_block_mask).

For HSTU, shared-prompt RM, CLEAR and causal at S = 1K..32K with 128K tokens per batch
(B = 131072 / S), times

* ``ours``: ``CompiledMask.preprocess(meta, S, backend="tilelang")`` end to end (host work +
  allocation + one launch), and the same call replayed from a CUDA graph (device time);
* ``flex``: ``torch.compile(create_block_mask)(mask_mod, B, None, S, S)`` for the same mask as a
  FlexAttention mask_mod (B set to the batch: metadata differs per sequence; H=None, broadcast
  over heads), forward block mask only.

Median of >= 20 timed calls after warm-up, CUDA events. Writes a markdown table.

    python bench/preprocess.py [--out bench/results/preprocess_<date>.md] [--budget-s 200]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import time

import torch

import compilemask as cm
from compilemask import masks as M

TOKENS = 128 * 1024
SEQLENS = [1024, 2048, 4096, 8192, 16384, 32768]
REPS = 30


def mask_mods(name, meta):
    """FlexAttention mask_mods with the same semantics as the MaskSpecs (first guard wins)."""
    if name == "causal":
        return lambda b, h, q, kv: kv <= q
    if name == "hstu":
        ce, he, se, gs = meta["ctx_end"], meta["hist_end"], meta["seq_end"], meta["group_size"]

        def hstu(b, h, q, kv):
            c, e, s, g = ce[b], he[b], se[b], gs[b]
            ctx = (q < c) & (kv < e)
            hist = (q >= c) & (q < e) & (kv <= q)
            start = e + ((q - e) // g) * g
            tgt = (q >= c) & (q >= e) & (q < s) & ((kv < e) | ((kv >= start) & (kv <= q)))
            return ctx | hist | tgt
        return hstu
    if name == "shared_prompt_rm":
        keys = ["prompt_end", "r1_end", "r2_end", "r3_end", "r4_end", "r5_end", "r6_end"]
        bt = [meta[k] for k in keys]

        def rm(b, h, q, kv):
            bounds = [t[b] for t in bt]
            pe = bounds[0]
            taken = q < pe
            out = taken & (kv <= q)
            for k in range(6):
                lo, hi = bounds[k], bounds[k + 1]
                g = (q >= lo) & (q < hi) & ~taken
                out = out | (g & ((kv < pe) | ((kv >= lo) & (kv <= q))))
                taken = taken | g
            return out
        return rm
    if name.startswith("clear"):
        te_, ir_ = meta["text_end"], meta["img_rows"]
        W, R = 16, 1

        def clear(b, h, q, kv):
            te, end = te_[b], te_[b] + ir_[b] * W
            text = (q < te) & (kv < end)
            img = (q >= te) & (q < end)
            in_img = (kv >= te) & (kv < end)
            near = ((((kv - te) // W) - ((q - te) // W)).abs() <= R) & (
                (((kv - te) % W) - ((q - te) % W)).abs() <= R)
            return text | (img & ((kv < te) | (in_img & near)))
        return clear
    raise KeyError(name)


def time_events(fn, reps=REPS, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)  # us
    return statistics.median(ts)


def time_graph(fn, reps=REPS, inner=20):
    """Device time per call: ``inner`` calls captured back to back in one CUDA graph, so that
    the host's launch rate does not bound the measurement."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    return time_events(g.replay, reps=reps) / inner


def bytes_written(d):
    ts = [d.intervals, d.row_region, d.fwd_bitmap, d.bwd_bitmap, d.params, d.row_params]
    return sum(t.numel() * t.element_size() for t in ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="skip remaining flex baselines (compiles are slow) past this budget")
    ap.add_argument("--flex-seqlens", default="1024,8192,32768")
    ap.add_argument("--flex-masks", default="hstu,shared_prompt_rm,clear,causal")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sweep-threads", default="",
                    help="e.g. 256,512,1024: device time per block size (hstu, clear; 1K, 32K)")
    args = ap.parse_args()
    t_start = time.time()
    dev = torch.device("cuda")
    specs = {"hstu": M.hstu(), "shared_prompt_rm": M.shared_prompt_rm(), "clear": M.clear(),
             "causal": M.causal()}
    flex_seqlens = {int(x) for x in args.flex_seqlens.split(",") if x}
    cbm = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask

        cbm = torch.compile(create_block_mask)
    rows = []
    for name, spec in specs.items():
        m = cm.compile_mask(spec)
        for S in SEQLENS:
            B = TOKENS // S
            gen = torch.Generator().manual_seed(S)
            meta = {k: v.to(dev) for k, v in M.random_meta(spec, B, S, gen).items()}
            kw = dict(batch_size=B, device=dev, backend="tilelang")

            def ours(m=m, meta=meta, S=S, kw=kw):
                return m.preprocess(meta, S, **kw)
            d = ours()
            ref = m.preprocess(meta, S, batch_size=B, device=dev, backend="torch")
            same = all(torch.equal(getattr(d, f), getattr(ref, f)) for f in (
                "intervals", "row_region", "fwd_bitmap", "bwd_bitmap"))
            t_e2e = time_events(ours)
            t_dev = time_graph(ours)
            nbytes = bytes_written(d)
            flex = None
            if (cbm is not None and S in flex_seqlens and name in args.flex_masks.split(",")
                    and time.time() - t_start < args.budget_s):
                mod = mask_mods(name, meta)
                try:
                    flex = time_events(
                        lambda mod=mod, B=B, S=S: cbm(mod, B, None, S, S, device="cuda"),
                        reps=20, warmup=2)
                except Exception as e:  # noqa: BLE001
                    flex = f"error: {type(e).__name__}"
            rows.append((name, S, B, m.num_intervals, t_e2e, t_dev, nbytes, flex, same))
            print(rows[-1], flush=True)
            write(args, rows, [])
    sweep = []
    if args.sweep_threads:
        from compilemask.codegen import preprocess as tlp

        default = tlp._THREADS
        for th in [int(x) for x in args.sweep_threads.split(",")]:
            tlp._THREADS = th
            for name in ("hstu", "clear"):
                m = cm.compile_mask(specs[name])
                for S in (1024, 32768):
                    B = TOKENS // S
                    gen = torch.Generator().manual_seed(S)
                    meta = {k: v.to(dev) for k, v in M.random_meta(specs[name], B, S, gen).items()}
                    t = time_graph(lambda m=m, meta=meta, S=S, B=B: m.preprocess(
                        meta, S, batch_size=B, device=dev, backend="tilelang"))
                    sweep.append((th, name, S, B, t))
                    print(sweep[-1], flush=True)
        tlp._THREADS = default
    write(args, rows, sweep)


def write(args, rows, sweep):
    from compilemask.codegen import preprocess as tlp

    gpu = torch.cuda.get_device_name()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "uncommitted"
    except Exception:  # noqa: BLE001
        commit = "unknown"
    date = datetime.date.today().isoformat()
    lines = [f"# Preprocess benchmark, {date}", "",
             f"GPU: {gpu}; torch {torch.__version__}; commit {commit}; "
             f"{TOKENS} tokens per batch; median of {REPS} (flex: 20) after warm-up; "
             f"{tlp._THREADS} threads per block.", "",
             "ours e2e: `preprocess(..., backend='tilelang')` per call (host + alloc + launch), "
             "CUDA events; ours dev: the same call replayed from a CUDA graph (device time); "
             "bytes: descriptor bytes written (Interval Table, row_region, both bitmaps, "
             "metadata copies); BW at the device time. flex: "
             "`torch.compile(create_block_mask)(mask_mod, B, None, S, S)` (forward block mask "
             "only, H broadcast).", "",
             "| mask | S | B | K | ours e2e (us) | ours dev (us) | bytes | BW (GB/s) | "
             "flex (us) | flex / ours e2e | flex / ours dev | = ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, S, B, K, te, td, nb, flex, same in rows:
        if isinstance(flex, float):
            fx, ratio = f"{flex:.0f}", f"{flex / te:.0f}x | {flex / td:.0f}x"
        else:
            fx, ratio = (flex or "-"), "- | -"
        lines.append(f"| {name} | {S} | {B} | {K} | {te:.1f} | {td:.1f} | {nb} | "
                     f"{nb / td / 1e3:.0f} | {fx} | {ratio} | {'yes' if same else 'NO'} |")
    if sweep:
        lines += ["", "Threads per block (device time, us, CUDA-graph replay):", "",
                  "| threads | mask | S | B | us |", "|---|---|---|---|---|"]
        lines += [f"| {th} | {n} | {S} | {B} | {t:.1f} |" for th, n, S, B, t in sweep]
    text = "\n".join(lines) + "\n"
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"preprocess_{date}.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
