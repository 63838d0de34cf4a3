"""The engine decision's benchmark: every CompileMask engine and every peer, in one run.

    python bench/engines.py --seqlens 32768 --modes fwd,train --out $OUT

Per (mask, S, mode): our engines (``native`` where the compiler proved a native pattern,
``fa4`` = FA4's block-sparse kernels + the interval mask_mod, ``cute`` = our kernels) with the
descriptor prebuilt (kernel) and with the preprocess (``pre + kernel``); the peers Flex-FA4
(``flex_attention(..., kernel_options={"BACKEND": "FLASH"})``) with a prebuilt BlockMask and with
its ``create_block_mask``, Flex-Triton with a prebuilt BlockMask, and FA4 native (causal /
``window_size`` / ``flash_attn_varlen_func`` on the same documents). 128K tokens per batch, H=8,
D=128, bf16. Effective TFLOP/s count visible pairs only (4 * pairs * D * H forward, 3.5x that
for a train step). Median of triton's do_bench.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

import compilemask as cm  # noqa: E402
from bench.workloads import flex_mask_mod, make_meta  # noqa: E402
from compilemask import masks
from compilemask.contract.options import device_arch  # noqa: E402
from compilemask.dsl import score_mods  # noqa: E402
from compilemask.pipeline.pipeline import PipelineConfig, with_lists  # noqa: E402

H, D, DTYPE = 8, 128, torch.bfloat16
TOKENS = 128 * 1024
WINDOW = 4096

SPECS = {
    "causal": masks.causal,
    "sliding_window": lambda: masks.sliding_window(WINDOW),
    "packed_documents": masks.packed_documents,
    "hstu": masks.hstu,
    "shared_prompt_rm": masks.shared_prompt_rm,
    "clear": lambda: masks.clear(2, 64),
    "dilated_causal": masks.dilated_causal,
    "sink_window": lambda: masks.sink_window(WINDOW, 4),
    "chunked_causal": lambda: masks.chunked_causal(8192),
    "block_causal": lambda: masks.block_causal(32),
    "packed_prefix_lm": masks.packed_prefix_lm,
    "prefix_lm": masks.prefix_lm,
    "tree_verify": lambda: masks.tree_verify(8),
    "draft_tree": masks.draft_tree,
}
# the fa4 engine with its mask_mod forced (KernelOptions.mask_mod), and the ceiling: the same
# lists with a mask_mod that returns True (a wrong mask, timing only: what any cheaper
# partial-tile test could gain at most)
FA4_VARIANTS = {"fa4_rules": "rules", "fa4_intervals": "intervals", "fa4_rows": "rows",
                "fa4_true": None}


def make_score_mod(name, dev):
    """The score_mods measured with a mask (``--score-mod``): the same callable goes to
    cm.attention and to FlexAttention."""
    if name == "alibi":
        return score_mods.alibi(score_mods.alibi_slopes(H, dev))
    if name == "softcap":
        return score_mods.softcap(50)
    if name == "t5":
        return score_mods.t5_bias(torch.randn(32, H, device=dev,
                                              generator=torch.Generator(dev).manual_seed(0)))
    if name == "temperature":
        return score_mods.temperature(torch.linspace(0.5, 1.5, H, device=dev))
    raise ValueError(f"unknown score_mod {name!r}")


@functools.lru_cache(maxsize=None)
def _true_mask_mod():
    from compilemask.codegen.cute_predicate import compile_predicate

    return compile_predicate("\n".join([
        "import cutlass", "import cutlass.cute as cute", "", "",
        "@cute.jit",
        "def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):",
        "    frag = cute.make_rmem_tensor(1, cutlass.Boolean)",
        "    frag[0] = kv_idx[0] >= 0",
        "    return frag.load()", ""]), "mask_mod")


class _CeilingMaskMod:
    """Within the block: FA4's block-sparse engine runs the always-True mask_mod."""

    def __enter__(self):
        from compilemask.kernels import fa4

        self.saved = fa4.mask_mod, fa4.aux_tensors
        fa4.mask_mod = lambda *args, **kwargs: _true_mask_mod()
        fa4.aux_tensors = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        from compilemask.kernels import fa4

        fa4.mask_mod, fa4.aux_tensors = self.saved


def doc_meta(B, S, seed=0):
    """Documents of random length in [512, 8192] packed into each sequence."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        pos = 0
        while pos < S:
            n = int(torch.randint(512, 8193, (1,), generator=g))
            starts[b, pos:pos + n] = pos
            pos += n
    return {"doc_start": starts}


def workload_meta(name, B, S, dev):
    if name in ("causal", "sliding_window", "dilated_causal", "sink_window", "chunked_causal",
                "block_causal"):
        return {}
    if name == "packed_documents":
        return {k: v.to(dev, torch.int32) for k, v in doc_meta(B, S).items()}
    if name == "prefix_lm":  # a bidirectional prefix of a quarter to a half of each sequence
        g = torch.Generator().manual_seed(S)
        return {"prefix_len": torch.randint(S // 4, S // 2 + 1, (B,), generator=g).to(
            dev, torch.int32)}
    if name in ("packed_prefix_lm", "tree_verify", "draft_tree"):  # the recipes' bench_meta
        # (documents of 256-4096 tokens; 256 draft tokens in a tree after a long prefix)
        meta = masks.recipes_for(SPECS[name]()).bench_meta(B, S)
        return {k: v.to(dev, torch.bool if v.dtype is torch.bool else torch.int32)
                for k, v in meta.items()}
    return make_meta(name, B, S, device=dev)


def workload_mask_mod(name, meta, S):
    if name == "sliding_window":
        return lambda b, h, q, kv: (kv <= q) & (q - kv < WINDOW)
    if name == "dilated_causal":
        return lambda b, h, q, kv: (kv <= q) & ((q - kv) % 2 == 0)
    if name == "packed_documents":
        flat = meta["doc_start"].reshape(-1)  # 1-D loads: what the FLASH backend translates
        return lambda b, h, q, kv: (flat[b * S + q] <= kv) & (kv <= q)
    if name in ("sink_window", "chunked_causal", "block_causal", "packed_prefix_lm",
                "prefix_lm", "tree_verify", "draft_tree"):
        return masks.flex_mask_mod(SPECS[name](), meta)
    return flex_mask_mod(name, meta)


def _bench(fn, rep, ctx=None):
    import triton

    with ctx() if ctx else contextlib.nullcontext():
        return triton.testing.do_bench(fn, warmup=max(25, rep // 4), rep=rep,
                                       return_mode="median")


ROUNDS = 1  # --rounds: every method of a point timed again, in turn, this many times


def gpu_state(fields: str = "clocks.sm") -> list[str] | None:
    """``nvidia-smi``'s values of ``fields`` (its --query-gpu names) for this GPU, or None."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,"
                              "nounits", f"--id={torch.cuda.current_device()}"],
                             capture_output=True, text=True, timeout=10).stdout
        return [v.strip() for v in out.split(",")]
    except Exception:
        return None


def _sm_clock():
    """The SM clock in MHz right after a timing, or None: at the H200's power cap it moves
    between 1.4 and 1.75 GHz, and a round's median moves with it (bench/samples.py)."""
    state = gpu_state()
    return int(state[0]) if state and state[0].isdigit() else None


def _rounds(row, timers, rep):
    """Time the point's methods ROUNDS - 1 more times, one after another in each round, each
    round in a rotated order (a GPU's clocks drift over a point's minutes; interleaving spreads
    that over every method), and keep each method's median over the rounds."""
    for r in range(1, ROUNDS):
        # each round starts one method later, so no method always follows the same one (a
        # heavy predecessor leaves the GPU hotter, and its clocks lower)
        for method, fn, ctx in timers[r % len(timers):] + timers[:r % len(timers)]:
            try:
                row[method]["rounds"].append(_bench(fn, rep, ctx))
                row[method].setdefault("sm_mhz", []).append(_sm_clock())
            except torch.cuda.OutOfMemoryError:  # the rounds it did count
                torch.cuda.empty_cache()
    for method, _, _ in timers:
        r = row[method]
        r["ms"] = statistics.median(r["rounds"])
        r["tflops"] = r["flops"] / r["ms"] / 1e9
        if ROUNDS > 1:
            mhz = [m for m in r.get("sm_mhz", []) if m]
            print(f"  {row['mask']:17s} {row['S']:6d} {row['mode']:5s} {method:22s} "
                  f"{r['ms']:9.3f} ms median of " + " ".join(f"{x:.3f}" for x in r["rounds"])
                  + (f" (SM {min(mhz)}-{max(mhz)} MHz)" if mhz else ""), flush=True)


@functools.lru_cache(maxsize=None)
def _cbm():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


@functools.lru_cache(maxsize=None)
def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _pairs(name, desc):
    """Visible pairs, one sequence at a time (the dense mask of a whole batch is large)."""
    if name == "dilated_causal":  # closed form: the predicate's dense grid would be int64
        i = torch.arange(desc.seqlen_q, dtype=torch.int64)
        return desc.batch_size * int((i // 2 + 1).sum())
    from dataclasses import replace

    total = 0
    for b in range(desc.batch_size):
        one = replace(desc, intervals=desc.intervals[b:b + 1], row_region=desc.row_region[b:b + 1],
                      params=desc.params[b:b + 1], row_params=desc.row_params[b:b + 1])
        total += int(one.dense_mask().sum())
    return total


def run_point(name, S, mode, methods, rep, rows, options=None, score_mod=None):
    B, dev = max(1, TOKENS // S), "cuda"
    smod = make_score_mod(score_mod, dev) if score_mod else None
    meta = workload_meta(name, B, S, dev)
    mask = cm.compile_mask(SPECS[name]())
    pre = mask.preprocessor(S, batch_size=B)
    desc = pre(meta)
    # the fa4 engine's kernel timings read prebuilt lists (a native mask's preprocess writes
    # none, and the engine would build them on every call)
    desc_fa4 = with_lists(desc)
    pairs = _pairs(name, desc)
    flops = 4.0 * pairs * D * H * (3.5 if mode == "train" else 1.0)
    gen = torch.Generator(device=dev).manual_seed(S)
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=DTYPE, generator=gen) for _ in range(3))
    do = torch.randn_like(q)
    row = {"mask": name + (f"+{score_mod}" if score_mod else ""), "S": S, "B": B, "mode": mode,
           "pairs": pairs,
           "native_pattern": (mask.native_pattern.describe() if mask.native_pattern
                              else None)}

    def rec(method, ms, note=""):
        row[method] = {"ms": ms, "tflops": flops / ms / 1e9 if ms else None, "note": note}
        print(f"  {name:17s} {S:6d} {mode:5s} {method:22s} "
              + (f"{ms:9.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s" if ms else note), flush=True)

    timers = []

    def timed(method, fn, ctx=None):
        # fn must bind its values now: later rounds call it after the loop has moved on
        rec(method, _bench(fn, rep, ctx))
        row[method].update(rounds=[row[method]["ms"]], flops=flops, sm_mhz=[_sm_clock()])
        timers.append((method, fn, ctx))

    def train_or_fwd(f, qq, kk, vv, dout):
        if mode == "fwd":
            return f(qq, kk, vv)
        qq, kk, vv = (t.detach().requires_grad_() for t in (qq, kk, vv))
        f(qq, kk, vv).backward(dout)

    for method in methods:
        try:
            if method in ("native", "fa4", "cute"):
                try:
                    cm.api.api.select_engine(q, desc, method)
                except NotImplementedError as e:
                    rec(method, None, f"n/a ({str(e)[:60]})")
                    continue

                def ours(d, eng=method):
                    return lambda a, b_, c: cm.attention(a, b_, c, d, backend=eng,
                                                         options=options, score_mod=smod)

                d = desc_fa4 if method == "fa4" else desc
                timed(method, functools.partial(train_or_fwd, ours(d), q, k, v, do))
                timed(f"{method}+pre", lambda o=ours: train_or_fwd(o(pre(meta)), q, k, v, do))
            elif method in ("native_tanh", "fa4_tanh"):  # the softcap as a generated score_mod
                eng = method.split("_")[0]
                opts = replace(options or cm.KernelOptions(), softcap="score_mod")
                d = desc_fa4 if eng == "fa4" else desc
                f = (lambda a, b_, c, eng=eng, opts=opts, d=d: cm.attention(
                    a, b_, c, d, backend=eng, options=opts, score_mod=smod))
                timed(method, functools.partial(train_or_fwd, f, q, k, v, do))
            elif method in FA4_VARIANTS:
                variant = FA4_VARIANTS[method]
                if variant is not None:
                    try:
                        opts = replace(options or cm.KernelOptions(), mask_mod=variant)
                        from compilemask.codegen.cute_mask_mod import mask_mod_source

                        mask_mod_source(mask, variant)
                    except ValueError as e:
                        rec(method, None, f"n/a ({str(e)[:60]})")
                        continue
                    f = (lambda a, b_, c, opts=opts: cm.attention(
                        a, b_, c, desc_fa4, backend="fa4", options=opts, score_mod=smod))
                    timed(method, functools.partial(train_or_fwd, f, q, k, v, do))
                elif smod is not None:  # the ceiling drops the aux tensors a score_mod reads
                    rec(method, None, "n/a (the ceiling runs without a score_mod's tables)")
                else:
                    f = (lambda a, b_, c: cm.attention(a, b_, c, desc_fa4, backend="fa4"))
                    timed(method, functools.partial(train_or_fwd, f, q, k, v, do),
                          _CeilingMaskMod)
            elif method in ("fa4_cols", "fa4_cols+pre"):
                # the backward masked by the column view (the descriptor carries it)
                cfg = PipelineConfig(column_view=True)
                if mask.column_view is None:
                    rec(method, None, f"n/a (no column view: {mask.column_view_reason})"[:60])
                    continue
                if method == "fa4_cols":
                    dcols = with_lists(mask.preprocess(meta, S, batch_size=B, device=dev,
                                                       config=cfg))
                    f = (lambda a, b_, c, d=dcols: cm.attention(a, b_, c, d, backend="fa4",
                                                                options=options))
                    timed(method, functools.partial(train_or_fwd, f, q, k, v, do))
                else:
                    pre_cols = mask.preprocessor(S, batch_size=B, config=cfg)
                    timed(method, lambda p=pre_cols: train_or_fwd(
                        lambda a, b_, c: cm.attention(a, b_, c, p(meta), backend="fa4",
                                                      options=options), q, k, v, do))
            elif method == "preprocess":
                timed("preprocess", lambda: pre(meta))
            elif method in ("flex_flash", "flex_triton"):
                mm = workload_mask_mod(name, meta, S)
                opts = {"BACKEND": "FLASH"} if method == "flex_flash" else None
                qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))
                bm = _cbm()(mm, B, None, S, S, device=dev)

                def flex(bmask, opts=opts):
                    return lambda a, b_, c: _flex()(a, b_, c, block_mask=bmask,
                                                    score_mod=smod, kernel_options=opts)

                timed(method, functools.partial(train_or_fwd, flex(bm), qt, kt, vt, dot))
                if method == "flex_flash":
                    timed("block_mask", lambda mm=mm: _cbm()(mm, B, None, S, S, device=dev))
                    timed("flex_flash+bm", lambda mm=mm, flex=flex: train_or_fwd(
                        flex(_cbm()(mm, B, None, S, S, device=dev)), qt, kt, vt, dot))
            elif method == "fa4_native":
                from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

                if smod is not None:
                    continue
                if name == "causal":
                    def f(a, b_, c):
                        return flash_attn_func(a, b_, c, causal=True)[0]
                elif name == "sliding_window":
                    def f(a, b_, c):
                        return flash_attn_func(a, b_, c, window_size=(WINDOW - 1, 0))[0]
                elif name in ("packed_documents", "chunked_causal"):
                    cu, mx = desc.segments

                    def f(a, b_, c):
                        o = flash_attn_varlen_func(
                            a.reshape(B * S, H, D), b_.reshape(B * S, H, D),
                            c.reshape(B * S, H, D), cu_seqlens_q=cu, cu_seqlens_k=cu,
                            max_seqlen_q=mx, max_seqlen_k=mx, causal=True)
                        return (o[0] if isinstance(o, tuple) else o).view(B, S, H, D)
                else:
                    continue
                timed("fa4_native", functools.partial(train_or_fwd, f, q, k, v, do))
        except torch.cuda.OutOfMemoryError:
            rec(method, None, "OOM")
            torch.cuda.empty_cache()
        except Exception as e:  # a method that fails is reported, not fatal
            rec(method, None, f"failed: {type(e).__name__}: {str(e)[:100]}")
            traceback.print_exc()
    _rounds(row, timers, rep)
    rows.append(row)


HEAD_WINDOWS = (512, 1024, 2048, 4096)  # per_head_windows: heads 2w, 2w+1 see window w


def run_heads_point(S, mode, rep, rows):
    """Per-head sliding windows (``per_head_windows``): ours as head groups (each group FA4's
    own window kernel on its heads) and folded (Flex's ``w[h]`` mask_mod converted per head,
    one FA4 launch with per-head lists), Flex-FA4 with a per-head BlockMask of the same
    mask_mod."""
    B, dev = max(1, TOKENS // S), "cuda"
    per = H // len(HEAD_WINDOWS)
    windows = torch.tensor([w for w in HEAD_WINDOWS for _ in range(per)], device=dev)
    head_masks = [cm.compile_mask(masks.sliding_window(w)) for w in HEAD_WINDOWS
                  for _ in range(per)]

    def pre():
        return cm.preprocess_heads(head_masks, None, seqlen_q=S, batch_size=B, device=dev)

    groups = pre()

    def mm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < windows[h])

    i = torch.arange(S, dtype=torch.int64)
    pairs = B * per * sum(int(torch.minimum(i + 1, torch.tensor(w)).sum())
                          for w in HEAD_WINDOWS)
    flops = 4.0 * pairs * D * (3.5 if mode == "train" else 1.0)
    gen = torch.Generator(device=dev).manual_seed(S)
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=DTYPE, generator=gen) for _ in range(3))
    do = torch.randn_like(q)
    row = {"mask": "per_head_windows", "S": S, "B": B, "mode": mode, "pairs": pairs,
           "native": "sliding windows per head group"}

    def rec(method, ms, note=""):
        row[method] = {"ms": ms, "tflops": flops / ms / 1e9 if ms else None, "note": note}
        print(f"  per_head_windows  {S:6d} {mode:5s} {method:22s} "
              + (f"{ms:9.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s" if ms else note), flush=True)

    def run(f, qq, kk, vv, dout):
        if mode == "fwd":
            return f(qq, kk, vv)
        qq, kk, vv = (t.detach().requires_grad_() for t in (qq, kk, vv))
        f(qq, kk, vv).backward(dout)

    # the same mask_mod as Flex's, folded: one descriptor of B x H sequences, one FA4 launch
    specs, metas = cm.from_mask_mod_heads(mm, num_heads=H, batch_size=B)
    shared = [cm.compile_mask(s) for s in specs]

    def pre_folded():
        return cm.preprocess_heads(shared, metas, S, batch_size=B, device=dev, fold=True)

    folded = pre_folded()
    try:
        rec("native", _bench(lambda: run(lambda a, b_, c: cm.attention(a, b_, c, groups), q, k,
                                         v, do), rep))
        rec("native+pre", _bench(lambda: run(lambda a, b_, c: cm.attention(a, b_, c, pre()), q,
                                             k, v, do), rep))
        rec("preprocess", _bench(pre, rep))
        rec("folded", _bench(lambda: run(lambda a, b_, c: cm.attention(a, b_, c, folded), q, k,
                                         v, do), rep))
        rec("folded+pre", _bench(lambda: run(lambda a, b_, c: cm.attention(
            a, b_, c, pre_folded()), q, k, v, do), rep))
        qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))
        opts = {"BACKEND": "FLASH"}
        bm = _cbm()(mm, B, H, S, S, device=dev)
        rec("flex_flash", _bench(lambda: run(lambda a, b_, c: _flex()(
            a, b_, c, block_mask=bm, kernel_options=opts), qt, kt, vt, dot), rep))
        rec("block_mask", _bench(lambda: _cbm()(mm, B, H, S, S, device=dev), rep))
        rec("flex_flash+bm", _bench(lambda: run(lambda a, b_, c: _flex()(
            a, b_, c, block_mask=_cbm()(mm, B, H, S, S, device=dev), kernel_options=opts), qt,
            kt, vt, dot), rep))
    except Exception as e:  # reported, not fatal
        rec("native", None, f"failed: {type(e).__name__}: {str(e)[:100]}")
        traceback.print_exc()
    rows.append(row)


def _ratio(row, a, b):
    x, y = row.get(a) or {}, row.get(b) or {}
    if x.get("ms") and y.get("ms"):
        return f"{y['ms'] / x['ms']:.2f}x"
    return ""


def to_markdown(rows, header):
    cols = ["native", "fa4", *FA4_VARIANTS, "fa4_cols", "cute", "fa4_native", "native_tanh",
            "fa4_tanh", "folded", "flex_flash", "flex_triton", "native+pre", "fa4+pre",
            "fa4_cols+pre", "folded+pre", "flex_flash+bm", "preprocess", "block_mask"]
    out = [header, "", "ms (effective TFLOP/s); ratios > 1 mean the default engine is faster.",
           "", "| mask | S | mode | " + " | ".join(cols)
           + " | default | default vs flex_flash kernel | vs FA4 native | pre+kernel vs "
           "flex_flash+bm |", "|" + "---|" * (len(cols) + 7)]
    for r in rows:
        cells = []
        for c in cols:
            x = r.get(c)
            if not x:
                cells.append("")
            elif x["ms"] is None:
                cells.append(x["note"][:40])
            elif c in ("preprocess", "block_mask"):
                cells.append(f"{x['ms']:.4f}")
            else:
                cells.append(f"{x['ms']:.3f} ({x['tflops']:.0f})")
        dflt = "native" if (r.get("native") or {}).get("ms") else "fa4"
        cells += [dflt, _ratio(r, dflt, "flex_flash"), _ratio(r, dflt, "fa4_native"),
                  _ratio(r, dflt + "+pre", "flex_flash+bm")]
        out.append(f"| {r['mask']} | {r['S']} | {r['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", default=",".join(SPECS))
    ap.add_argument("--seqlens", default="8192,32768")
    ap.add_argument("--modes", default="fwd,train")
    ap.add_argument("--methods",
                    default="preprocess,native,fa4,cute,fa4_native,flex_flash,flex_triton")
    ap.add_argument("--rep", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every method of a point this many times, interleaved, and keep "
                         "the median (clock drift over a point spreads over all its methods)")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--tag", default="engines")
    ap.add_argument("--score-mod", default="",
                    help="a score_mod with every mask, for ours and Flex: alibi, softcap, t5, "
                         "temperature; mask:score_mod pairs in --masks choose one per mask")
    ap.add_argument("--options", default="", type=cm.KernelOptions.from_str,
                    help="the cute engine's kernel variants, e.g. bwd_meta=async "
                         "(compilemask.KernelOptions; default: default_options)")
    args = ap.parse_args(argv)
    global ROUNDS
    ROUNDS = max(1, args.rounds)
    commit = os.environ.get("CM_COMMIT") or subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
        cwd=ROOT).stdout.strip() or "unknown"
    header = (f"# Engines: {datetime.date.today()} · {torch.cuda.get_device_name()} · commit "
              f"{commit} · torch {torch.__version__} · H={H}, D={D}, bf16, 128K tokens per batch"
              f" · cute kernel options {args.options.describe(device_arch(torch.device('cuda')))}"
              f"\n\n`python bench/engines.py --masks {args.masks} --seqlens {args.seqlens} "
              f"--modes {args.modes} --methods {args.methods} --rep {args.rep}"
              + (f" --rounds {ROUNDS}" if ROUNDS > 1 else "")
              + (f" --options {args.options.to_str()}" if args.options.to_str() else "") + "`")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in args.modes.split(","):
        for S in map(int, args.seqlens.split(",")):
            for item in args.masks.split(","):
                name, _, smod = item.partition(":")
                if name == "per_head_windows":
                    run_heads_point(S, mode, args.rep, rows)
                    continue
                run_point(name, S, mode, args.methods.split(","), args.rep, rows, args.options,
                          smod or args.score_mod or None)
                (out / f"{args.tag}.json").write_text(json.dumps(rows, indent=1))
                (out / f"{args.tag}.md").write_text(to_markdown(rows, header))
    print(to_markdown(rows, header))


if __name__ == "__main__":
    main()
