"""Preprocess benchmark (H200): generated TileLang kernel vs torch.compile(create_block_mask).

For the workloads of bench/workloads.py (HSTU, shared-prompt RM, CLEAR, causal; same metadata as
the attention benchmark) plus the smaller CLEAR of ``compilemask.masks`` (K = 4), at S = 1K..32K
with 128K tokens per batch (B = 131072 / S), times

* ``ours``: ``CompiledMask.preprocess(meta, S, backend="tilelang")`` (general path) and the bound
  ``mask.preprocessor(S, batch_size=B)`` call, host time per call; the bound call replayed from a
  CUDA graph (device time); the tile lists' share: their launch alone (``packed_lists`` on the
  bound call's bitmaps, as the pipeline makes it), host and device time;
* ``flex``: ``torch.compile(create_block_mask)(mask_mod, B, None, S, S)`` for the same mask as a
  FlexAttention mask_mod (B set to the batch: metadata differs per sequence; H=None, broadcast
  over heads), forward block mask only.

Writes a markdown table. ``--sweep`` times ``PreprocessConfig`` variants (threads per block,
stage-1 row map, vector stores), each passed to the preprocessor in a ``PipelineConfig``.

    python bench/preprocess.py [--out bench/results/preprocess_<date>.md] [--budget-s 200]
                               [--sweep 512:linear,512:interleaved,512:linear:vec]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.* as a script

import compilemask as cm  # noqa: E402
from bench import workloads as W  # noqa: E402
from compilemask import masks as M  # noqa: E402
from compilemask.codegen.blocksparse import packed_lists  # noqa: E402
from compilemask.codegen.preprocess import (  # noqa: E402
    DEFAULT_PREPROCESS_CONFIG,
    PreprocessConfig,
)
from compilemask.compiler.blocksparse import descriptor_lists  # noqa: E402
from compilemask.pipeline.pipeline import LIST_KINDS_FA4, PipelineConfig  # noqa: E402

TOKENS = 128 * 1024
SEQLENS = [1024, 2048, 4096, 8192, 16384, 32768]
REPS = 30


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


def time_host(fn, reps=200, warmup=5):
    """Per call, back to back, wall clock then one sync: what a training loop pays on the host
    (the device work of each call is shorter than its host work, so this is host-bound)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def kernel_times(fn, calls=20):
    """(kernel name, mean device time in us) of every kernel ``fn`` launches, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us() / calls
    return sorted(out.items(), key=lambda kv: -kv[1])


def lists_launch(d):
    """The tile-list launch of a descriptor's pipeline (FA4's kinds in one buffer), alone."""
    return packed_lists(d.fwd_bitmap, d.bwd_bitmap, d.fwd_tiles, d.bwd_tiles, d.seqlen_q,
                        d.seqlen_k, LIST_KINDS_FA4)


def lists_ok(d) -> bool:
    """A non-native descriptor's lists (written by the pipeline) equal the torch reference of
    its bitmaps; a native one has none to check."""
    if d.native is not None and d.lists is None:
        return True
    if d.lists is None or d.lists.kinds != LIST_KINDS_FA4:
        return False
    for kind in LIST_KINDS_FA4:
        ref, got = descriptor_lists(d, kind), d.block_sparse(kind)
        for cnt, a, oc, b in ((ref.mask_cnt, ref.mask_idx, got.mask_cnt, got.mask_idx),
                              (ref.full_cnt, ref.full_idx, got.full_cnt, got.full_idx)):
            live = torch.arange(a.shape[-1], device=a.device) < cnt.unsqueeze(-1)
            if not (torch.equal(cnt, oc) and torch.equal(a[live], b[live])):
                return False
    return True


def parse_variant(variant: str) -> PreprocessConfig:
    """``threads:row_map[:vec]`` -> the config (vec: Interval Table rows in vector stores)."""
    th, row_map, *vec = variant.split(":")
    return PreprocessConfig(threads=int(th), row_map=row_map, vector_stores=vec == ["vec"])


def specs_and_meta():
    """The attention benchmark's workloads (bench/workloads.py, same metadata), plus the smaller
    CLEAR of compilemask.masks (radius 1, width 16: K = 4) measured before."""
    out = {n: (f(), lambda B, S, n=n: W.make_meta(n, B, S, device="cuda"))
           for n, f in W.WORKLOADS.items()}
    out["clear_r1w16"] = (M.clear(), lambda B, S: {
        k: v.to("cuda").contiguous()
        for k, v in M.random_meta(M.clear(), B, S, torch.Generator().manual_seed(S)).items()})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="skip remaining flex baselines (compiles are slow) past this budget")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    ap.add_argument("--flex-seqlens", default="1024,8192,32768")
    ap.add_argument("--flex-masks", default="hstu,shared_prompt_rm,clear,causal")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--masks", default="", help="only these workloads (comma-separated)")
    ap.add_argument("--kernels", action="store_true",
                    help="also the device time of every kernel of a bound call (torch.profiler)")
    ap.add_argument("--sweep", default="",
                    help="threads:row_map[:vec] variants, e.g. 512:linear,512:linear:vec: device "
                         "time per variant (hstu, clear, clear_r1w16; 1K, 16K, 32K); vec: "
                         "Interval Table rows in vector stores")
    args = ap.parse_args()
    t_start = time.time()
    dev = torch.device("cuda")
    workloads = specs_and_meta()
    flex_seqlens = {int(x) for x in args.flex_seqlens.split(",") if x}
    cbm = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask

        cbm = torch.compile(create_block_mask, dynamic=False)  # as bench/attention.py
    rows, kernels = [], []
    only = [x for x in args.masks.split(",") if x]
    for name, (spec, make) in workloads.items():
        if only and name not in only:
            continue
        m = cm.compile_mask(spec)
        for S in [int(x) for x in args.seqlens.split(",")]:
            B = TOKENS // S
            meta = make(B, S)
            kw = dict(batch_size=B, device=dev, backend="tilelang")
            pre = m.preprocessor(S, batch_size=B)

            def general(m=m, meta=meta, S=S, kw=kw):
                return m.preprocess(meta, S, **kw)

            def bound(pre=pre, meta=meta):
                return pre(meta)
            d, d_bound = general(), bound()
            ref = m.preprocess(meta, S, batch_size=B, device=dev, backend="torch")
            same = all(torch.equal(getattr(x, f), getattr(ref, f)) for f in (
                "intervals", "row_region", "fwd_bitmap", "bwd_bitmap", "params", "row_params")
                for x in (d, d_bound)) and lists_ok(d) and lists_ok(d_bound)
            t_gen = time_host(general)
            t_bound = time_host(bound)
            t_dev = time_graph(bound)
            if d_bound.lists is not None:  # the tile lists' share: their launch alone
                t_lists, t_lists_dev = (time_host(lambda d=d_bound: lists_launch(d)),
                                        time_graph(lambda d=d_bound: lists_launch(d)))
            else:
                t_lists = t_lists_dev = None  # a native mask: no lists
            nbytes = bytes_written(d)
            flex = None
            if (cbm is not None and S in flex_seqlens and name in args.flex_masks.split(",")
                    and time.time() - t_start < args.budget_s):
                mod = W.flex_mask_mod(name, meta)
                try:
                    flex = time_events(
                        lambda mod=mod, B=B, S=S: cbm(mod, B, None, S, S, device="cuda"),
                        reps=20, warmup=2)
                except Exception as e:  # noqa: BLE001
                    flex = f"error: {type(e).__name__}"
            rows.append((name, S, B, m.num_intervals, t_gen, t_bound, t_dev, nbytes, flex, same,
                         t_lists, t_lists_dev))
            print(rows[-1], flush=True)
            if args.kernels:
                kernels += [(name, S, k, us) for k, us in kernel_times(bound)]
            write(args, rows, [], kernels)
    sweep = []
    if args.sweep:
        for variant in args.sweep.split(","):
            config = PipelineConfig(preprocess=parse_variant(variant))
            for name in ("hstu", "clear", "clear_r1w16"):
                spec, make = workloads[name]
                m = cm.compile_mask(spec)
                for S in (1024, 16384, 32768):
                    B = TOKENS // S
                    meta = make(B, S)
                    pre = m.preprocessor(S, batch_size=B, config=config)
                    t = time_graph(lambda pre=pre, meta=meta: pre(meta))
                    sweep.append((variant.replace(":", " "), name, S, B, t))
                    print(sweep[-1], flush=True)
            write(args, rows, sweep, kernels)
    write(args, rows, sweep, kernels)


def write(args, rows, sweep, kernels=()):
    cfg = DEFAULT_PREPROCESS_CONFIG
    gpu = torch.cuda.get_device_name()
    try:
        # CM_COMMIT: the device machine's copy of the tree may carry a stale .git
        commit = os.environ.get("CM_COMMIT") or subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True,
            text=True).stdout.strip() or "uncommitted"
    except Exception:  # noqa: BLE001
        commit = "unknown"
    date = datetime.date.today().isoformat()
    lines = [f"# Preprocess benchmark, {date}", "",
             f"GPU: {gpu}; torch {torch.__version__}; commit {commit}; "
             f"{TOKENS} tokens per batch; median of {REPS} (flex: 20) after warm-up; "
             f"{cfg.threads} threads per block, {cfg.row_map} row map, vector stores "
             f"{'on' if cfg.vector_stores else 'off'}.", "",
             "general: `preprocess(meta, S, backend='tilelang')` per call; bound: "
             "`pre = mask.preprocessor(S, batch_size=B)` once, `pre(meta)` per call; both host "
             "time per call (200 calls back to back, wall clock, one sync: host + alloc + "
             "launch). dev: the bound call replayed from a CUDA graph (device time). bytes: "
             "descriptor bytes written (Interval Table, row_region, both bitmaps, metadata "
             "copies); BW at the device time. flex: "
             "`torch.compile(create_block_mask)(mask_mod, B, None, S, S)` (forward block mask "
             "only, H broadcast), CUDA events. = ref: both paths equal the torch reference.", "",
             "lists: the tile lists' launch alone (`packed_lists` of FA4's three kinds on the "
             "bound call's bitmaps, the launch the pipeline makes), host time per call and "
             "device time (CUDA graph); - for a native mask (no lists). = ref: the lists of "
             "both paths equal the torch reference's too.", "",
             "| mask | S | B | K | general (us) | bound (us) | dev (us) | lists (us) | "
             "lists dev (us) | bytes | BW (GB/s) | flex (us) | flex / bound | flex / dev | "
             "= ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, S, B, K, tg, tb, td, nb, flex, same, tl, tld in rows:
        if isinstance(flex, float):
            fx, ratio = f"{flex:.0f}", f"{flex / tb:.0f}x | {flex / td:.0f}x"
        else:
            fx, ratio = (flex or "-"), "- | -"
        tls = "- | -" if tl is None else f"{tl:.1f} | {tld:.1f}"
        lines.append(f"| {name} | {S} | {B} | {K} | {tg:.1f} | {tb:.1f} | {td:.1f} | {tls} | "
                     f"{nb} | "
                     f"{nb / td / 1e3:.0f} | {fx} | {ratio} | {'yes' if same else 'NO'} |")
    if sweep:
        lines += ["", "Threads per block and stage-1 row map (device time, us, CUDA-graph "
                  "replay):", "", "| threads, row map | mask | S | B | us |",
                  "|---|---|---|---|---|"]
        lines += [f"| {th} | {n} | {S} | {B} | {t:.1f} |" for th, n, S, B, t in sweep]
    if kernels:
        lines += ["", "Device time of each kernel of one bound call (torch.profiler, mean of 20 "
                  "calls):", "", "| mask | S | kernel | us |", "|---|---|---|---|"]
        lines += [f"| {n} | {S} | `{k[:70]}` | {us:.1f} |" for n, S, k, us in kernels]
    text = "\n".join(lines) + "\n"
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"preprocess_{date}.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
