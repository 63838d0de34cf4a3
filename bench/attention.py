"""Single-operator attention benchmark on one GPU: CompileMask vs its peers, in one run.

    python bench/attention.py --mode fwd --seqlens 1024,8192,32768 --out bench/results
    python bench/attention.py --mode train --merge a.json b.json --tag merged  # no GPU needed

Methods: ``cm`` (our preprocess + kernel; kernel-only reported too), ``flex_triton`` and
``flex_flash`` (FlexAttention, BlockMask built per batch with B = batch by a compiled
``create_block_mask``), ``fa4`` (FA4 native, causal only), ``sdpa`` (dense masked SDPA under
torch.compile; skipped when the dense mask would not fit). Effective TFLOP/s counts visible
pairs only (4·pairs·D·H forward; backward 2.5× forward). Median of ``--rep`` ms of timing after
warm-up, by triton.testing.do_bench.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

import compilemask as cm  # noqa: E402
from bench.workloads import WORKLOADS, batch_for, flex_mask_mod, make_meta  # noqa: E402

H, D = 8, 128
DTYPE = torch.bfloat16
METHODS = ("cm", "flex_triton", "flex_flash", "fa4", "sdpa")  # table and plot order


def _bench(fn, rep_ms):
    import triton

    return triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms,
                                   return_mode="median")


@functools.lru_cache(maxsize=None)
def _compiled_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


@functools.lru_cache(maxsize=None)
def _compiled_flex(backend):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def run_one(name, S, mode, methods, rep_ms, results, deterministic=False, breakdown=False,
            options=None):
    B = batch_for(S)
    dev = "cuda"
    meta = make_meta(name, B, S, device=dev)
    mask = cm.compile_mask(WORKLOADS[name]())
    gen = torch.Generator(device=dev).manual_seed(S)
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=DTYPE, generator=gen) for _ in range(3))
    do = torch.randn_like(q)
    pre = mask.preprocessor(S, batch_size=B)  # per step: pre(meta), the training-loop call
    desc = pre(meta)
    pairs = int(desc.dense_mask().sum()) if S <= 8192 else _pairs_from_intervals(desc)
    flops = 4.0 * pairs * D * H * (3.5 if mode == "train" else 1.0)
    row = {"mask": name, "S": S, "B": B, "mode": mode, "visible_pairs": pairs}

    def record(method, ms, kernel_ms=None, note=""):
        row[method] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12 if ms else None,
                       "kernel_ms": kernel_ms, "note": note}
        print(f"  {name:18s} S={S:6d} B={B:4d} {method:12s} "
              + (f"{ms:9.3f} ms {flops / (ms * 1e-3) / 1e12:7.1f} TFLOP/s" if ms else note)
              + (f"  (kernel {kernel_ms:.3f} ms)" if kernel_ms else ""), flush=True)

    def step_cm(with_pre=True, fwd_only=False):
        d = pre(meta) if with_pre else desc
        if mode == "train" and not fwd_only:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            cm.attention(qq, kk, vv, d, deterministic=deterministic,
                         options=options).backward(do)
        else:
            cm.attention(q, k, v, d, options=options)

    for method in methods:
        try:
            if method == "cm":
                kernel = _bench(lambda: step_cm(False), rep_ms)
                pre_ms = _bench(lambda: pre(meta), rep_ms)
                total = _bench(step_cm, rep_ms)
                record("cm", total, kernel, note=f"preprocess {pre_ms:.3f} ms")
                row["cm"]["preprocess_ms"] = pre_ms
                if mode == "train":  # Table 1 breakdown: forward alone, backward = the rest
                    row["cm"]["fwd_ms"] = _bench(lambda: step_cm(False, fwd_only=True), rep_ms)
            elif method in ("flex_triton", "flex_flash"):
                mm = flex_mask_mod(name, meta)
                cbm = _compiled_block_mask()
                flex = _compiled_flex(method)
                opts = {"BACKEND": "FLASH"} if method == "flex_flash" else None
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                def build():
                    return cbm(mm, B, None, S, S, device=dev)

                bm = build()

                def run_flex(block_mask, fwd_only=False):
                    if mode == "train" and not fwd_only:
                        qq, kk, vv = (t.detach().requires_grad_() for t in (qt, kt, vt))
                        flex(qq, kk, vv, block_mask=block_mask, kernel_options=opts).backward(
                            do.transpose(1, 2))
                    else:
                        flex(qt, kt, vt, block_mask=block_mask, kernel_options=opts)

                kernel = _bench(lambda: run_flex(bm), rep_ms)
                bm_ms = _bench(build, rep_ms)
                total = _bench(lambda: run_flex(build()), rep_ms)
                record(method, total, kernel, note=f"block mask {bm_ms:.3f} ms")
                row[method]["block_mask_ms"] = bm_ms
                if mode == "train" and breakdown:  # a second compile (no autograd graph)
                    row[method]["fwd_ms"] = _bench(lambda: run_flex(bm, True), rep_ms)
            elif method == "fa4":
                if name != "causal":
                    continue
                from flash_attn.cute import flash_attn_func

                def run_fa4(fwd_only=False):
                    if mode == "train" and not fwd_only:
                        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                        o = flash_attn_func(qq, kk, vv, causal=True)
                        (o[0] if isinstance(o, tuple) else o).backward(do)
                    else:
                        flash_attn_func(q, k, v, causal=True)

                ms = _bench(run_fa4, rep_ms)
                record("fa4", ms, ms)
                if mode == "train" and breakdown:
                    row["fa4"]["fwd_ms"] = _bench(lambda: run_fa4(True), rep_ms)
            elif method == "sdpa":
                if B * S * S > 2**31:
                    record("sdpa", None, note="OOM (dense mask)")
                    continue
                dense = desc.dense_mask().unsqueeze(1)
                f = torch.compile(torch.nn.functional.scaled_dot_product_attention)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                def run_sdpa():
                    if mode == "train":
                        qq, kk, vv = (t.detach().requires_grad_() for t in (qt, kt, vt))
                        f(qq, kk, vv, attn_mask=dense).backward(do.transpose(1, 2))
                    else:
                        f(qt, kt, vt, attn_mask=dense)

                ms = _bench(run_sdpa, rep_ms)
                record("sdpa", ms, ms)
        except torch.cuda.OutOfMemoryError as e:
            # the allocator's own numbers say whether it is this shape or what earlier runs left
            print(f"  OOM in {method}: {str(e).splitlines()[0][:200]} "
                  f"(allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB)", flush=True)
            record(method, None, note="OOM")
            torch.cuda.empty_cache()
        except Exception as e:  # a peer that fails is reported, not fatal
            record(method, None, note=f"failed: {type(e).__name__}: {str(e)[:120]}")
            traceback.print_exc()
    results.append(row)


def _pairs_from_intervals(desc):
    """Visible pairs without a dense mask (interval slots do not overlap for these masks)."""
    return int(desc.intervals[..., 1].to(torch.int64).sum())


def to_markdown(results, mode, meta_line):
    methods = list(METHODS)
    extra = ["cm kernel ms", "cm preprocess ms"]
    if mode == "train":
        extra += ["cm fwd ms", "cm bwd ms"]
    extra += ["flex_flash kernel ms", "flex block mask ms", "best peer / cm",
              "flex_flash kernel / cm kernel"]
    out = [f"# Attention {mode} benchmark", "", meta_line, "",
           "| mask | S | B | " + " | ".join(f"{m} ms (TFLOP/s)" for m in methods)
           + " | " + " | ".join(extra) + " |",
           "|" + "---|" * (len(methods) + len(extra) + 3)]

    def num(x, fmt=".3f"):
        return "" if x is None else f"{x:{fmt}}"

    for r in results:
        cells = []
        best = None
        for m in methods:
            x = r.get(m)
            if not x:
                cells.append("")
                continue
            if x["ms"] is None:
                cells.append(x["note"])
                continue
            cells.append(f"{x['ms']:.3f} ({x['tflops']:.0f})")
            if m != "cm":
                best = x["ms"] if best is None else min(best, x["ms"])
        c = r.get("cm") or {}
        ff = r.get("flex_flash") or {}
        cells += [num(c.get("kernel_ms")), num(c.get("preprocess_ms"), ".4f")]
        if mode == "train":
            fwd = c.get("fwd_ms")
            cells += [num(fwd), num(c["kernel_ms"] - fwd if fwd and c.get("kernel_ms") else None)]
        bms = [x.get("block_mask_ms") for x in (r.get("flex_triton") or {}, ff)]
        bms = [b for b in bms if b]
        cells += [num(ff.get("kernel_ms")), num(min(bms) if bms else None),
                  f"{best / c['ms']:.2f}x" if best and c.get("ms") else "",
                  f"{ff['kernel_ms'] / c['kernel_ms']:.2f}x"
                  if ff.get("kernel_ms") and c.get("kernel_ms") else ""]
        out.append(f"| {r['mask']} | {r['S']} | {r['B']} | " + " | ".join(cells) + " |")
    if mode == "train":
        out += _breakdown(results)
    return "\n".join(out) + "\n"


def _breakdown(results):
    """The paper's Table 1 split of a train step, per method where the forward was timed
    alone: mask preparation (our preprocess, Flex's block mask), forward, backward (the kernel
    time less the forward), and the step with the preparation."""
    lines = []
    for r in results:
        for m in METHODS:
            x = r.get(m) or {}
            if not (x.get("ms") and x.get("fwd_ms") and x.get("kernel_ms")):
                continue
            prep = x.get("preprocess_ms", x.get("block_mask_ms"))
            lines.append(f"| {r['mask']} | {r['S']} | {m} | "
                         + ("" if prep is None else f"{prep:.3f}")
                         + f" | {x['fwd_ms']:.3f} | {x['kernel_ms'] - x['fwd_ms']:.3f} | "
                         f"{x['ms']:.3f} |")
    if not lines:
        return []
    return ["", "Breakdown (ms; backward = kernel time - forward alone):", "",
            "| mask | S | method | preprocess / block mask | fwd | bwd | pre + fwd + bwd |",
            "|---|---|---|---|---|---|---|", *lines]


def plot(results, mode, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["mask"] for r in results})
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in results if r["mask"] == name]
        for color, m in enumerate(METHODS):  # one color per method in every panel
            pts = [(r["S"], r[m]["tflops"]) for r in rows if r.get(m) and r[m]["ms"]]
            oom = [r["S"] for r in rows if r.get(m) and r[m]["ms"] is None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m, color=f"C{color}")
            for s in oom:
                ax.annotate(f"{m} OOM", (s, 0), fontsize=7, color=f"C{color}")
        seqlens = sorted({r["S"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [f"{s // 1024}K" if s >= 1024 else str(s) for s in seqlens])
        ax.set_ylim(bottom=0)
        ax.set_title(name)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("effective TFLOP/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{mode}: 8 heads x 128, bf16, 128K tokens per batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge(paths, mode, out: Path, tag: str = "merged"):
    """One markdown table and one plot from several runs' JSON results. Points are keyed by
    (mask, S, method): a later file's measurement of a method replaces an earlier one, and a
    later OOM or failure does not replace a measurement (a sweep's process can run out of memory
    on leftovers of earlier shapes where a fresh process does not). The header names each source
    file, the header line of its markdown table (date, GPU, commit, kernel knobs) and the points
    it contributed."""
    rows, owner, sources = {}, {}, []
    for p in map(Path, paths):
        for r in json.loads(p.read_text()):
            key = (r["mask"], r["S"])
            row = rows.setdefault(key, {k: v for k, v in r.items() if k not in METHODS})
            for m in METHODS:
                x = r.get(m)
                if x is None or (x["ms"] is None and (row.get(m) or {}).get("ms")):
                    continue
                row[m] = x
                owner[(*key, m)] = p.name
        md = p.with_suffix(".md")
        meta = md.read_text().splitlines()[2] if md.exists() else "(no markdown next to it)"
        sources.append((p.name, meta))
    order = {m: i for i, m in enumerate(WORKLOADS)}
    results = sorted(rows.values(), key=lambda r: (order.get(r["mask"], 99), r["S"]))
    lines = []
    for name, meta in sources:
        got = {}
        for (mask, S, m), src in sorted(owner.items(), key=lambda kv: kv[0]):
            if src == name:
                got.setdefault(f"{mask} {m}", []).append(str(S))
        used = "; ".join(f"{k} @ {','.join(v)}" for k, v in got.items()) or "nothing (replaced)"
        lines.append(f"- `{name}`: {meta}\n  - points used: {used}")
    meta_line = "Merged from:\n\n" + "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"attention_{mode}_{tag or 'merged'}"
    md = to_markdown(results, mode, meta_line)
    (out / f"{stem}.md").write_text(md)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, mode, out / f"{stem}.png")
    print(md)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["fwd", "train"], default="fwd")
    ap.add_argument("--masks", default=",".join(WORKLOADS))
    ap.add_argument("--seqlens", default="1024,8192,32768")
    ap.add_argument("--methods", default="cm,flex_triton,flex_flash,fa4,sdpa")
    ap.add_argument("--rep", type=int, default=200, help="ms of timed repetitions per point")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--tag", default="", help="added to the output file names")
    ap.add_argument("--deterministic", action="store_true",
                    help="cm: cm.attention(..., deterministic=True) (fixed dQ summation order)")
    ap.add_argument("--options", default="", type=cm.KernelOptions.from_str,
                    help="cm: the cute kernels' variants, e.g. bwd_meta=async,fwd_mask=compare "
                         "(compilemask.KernelOptions; default: default_options)")
    ap.add_argument("--breakdown", action="store_true",
                    help="train: also time the peers' forward alone (Table 1's fwd / bwd split; "
                         "one more torch.compile per Flex point)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no measuring: one table and plot from the results of earlier runs "
                         "(one device call each), each row once (the last file wins)")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.mode, Path(args.out), args.tag)
    results = []
    # CM_COMMIT: the device machine's copy of the tree may carry a stale .git
    commit = os.environ.get("CM_COMMIT") or subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
        cwd=ROOT).stdout.strip() or "unknown"
    # the kernel variants, so that a table says which ones it measured
    from compilemask.contract.options import device_arch

    knobs = {"kernel options": args.options.describe(device_arch(torch.device("cuda"))),
             "deterministic": str(args.deterministic)}
    meta_line = (f"{datetime.date.today()} · {torch.cuda.get_device_name()} · commit {commit} · "
                 f"torch {torch.__version__} · H={H}, D={D}, bf16, 128K tokens per batch · "
                 + ", ".join(f"{k} {v}" for k, v in knobs.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"attention_{args.mode}{'_' + args.tag if args.tag else ''}_{datetime.date.today()}"
    for name in args.masks.split(","):
        for S in map(int, args.seqlens.split(",")):
            run_one(name, S, args.mode, args.methods.split(","), args.rep, results,
                    deterministic=args.deterministic, breakdown=args.breakdown,
                    options=args.options)
            # written after every point: a run cut short keeps what it measured
            md = to_markdown(results, args.mode, meta_line)
            (out / f"{stem}.md").write_text(md)
            (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    print(md)
    plot(results, args.mode, out / f"{stem}.png")


if __name__ == "__main__":
    main()
