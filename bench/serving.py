"""Serving: a decode step over a KV cache, ours against FA4's own kernel, same run.

    python bench/serving.py --seqlens 8192,32768 --out $OUT

Per cache length: one query per sequence (``--queries`` for chunked prefill or draft
verification), B=8, H=32 query heads over 8 kv heads, D=128, bf16. ``cm`` is ``cm.attention``
with the step's descriptor made (``compilemask.api.serving.query_descriptor``: the causal mask's
last rows, FA4's own bottom-right causal kernel); ``cm+desc`` makes the descriptor too (once
per step, shared by every layer); ``fa4`` is ``flash_attn_func(..., causal=True)``. Prefill with
the per-request mask build is ``bench/engines.py --modes fwd`` (``bash bench/h200.sh serving``
runs both). ``--page-size N`` adds decode steps over a paged KV cache (a shuffled pool of
N-key pages): ``fa4`` is ``flash_attn_varlen_func(..., page_table=, seqused_k=, causal=True)``,
``cm`` is ``compilemask.api.serving.paged_attention`` for the causal mask (FA4's own paged kernel)
and for prefix-LM (FA4's paged kernel with the interval mask_mod on every tile). Median of
triton's do_bench.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

import compilemask as cm  # noqa: E402
from compilemask import masks  # noqa: E402
from compilemask.api.serving import query_descriptor  # noqa: E402

B, H, HKV, D = 8, 32, 8, 128


def _bench(fn, rep):
    import triton

    return triton.testing.do_bench(fn, warmup=max(25, rep // 4), rep=rep, return_mode="median")


def _graphed(fn):
    """fn captured in one CUDA graph (as a serving engine runs its decode step): the replay,
    which times the GPU work alone, without the host's per-call cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _host_ms(fn, n=300):
    """Host time per call with the GPU never waited on (a launch-bound call's real cost)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    took = time.perf_counter() - t0
    torch.cuda.synchronize()
    return took / n * 1e3


def profile_point(Sk: int, Sq: int, out: Path) -> None:
    """Where a call's host time goes: cProfile of cm.attention on a decode step, top 40."""
    import cProfile
    import io
    import pstats

    mask = cm.compile_mask(masks.causal())
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Sk, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    desc = query_descriptor(mask, None, Sk, Sq, batch_size=B, device="cuda")
    for label, fn in (("attention", lambda: cm.attention(q, k, v, desc)),
                      ("descriptor", lambda: query_descriptor(mask, None, Sk, Sq, batch_size=B,
                                                              device="cuda"))):
        fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        (out / f"serving_profile_{label}.txt").write_text(buf.getvalue())
        print(f"  profile {label}: {buf.getvalue().splitlines()[0] if buf.getvalue() else ''}")


def decode_point(Sk: int, Sq: int, rep: int) -> dict:
    from flash_attn.cute import flash_attn_func

    mask = cm.compile_mask(masks.causal())
    g = torch.Generator(device="cuda").manual_seed(Sk)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Sk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    desc = query_descriptor(mask, None, Sk, Sq, batch_size=B, device="cuda")
    row = {"Sk": Sk, "Sq": Sq, "engine": cm.api.api.select_engine(q, desc)}
    row["fa4"] = _bench(lambda: flash_attn_func(q, k, v, causal=True), rep)
    row["cm"] = _bench(lambda: cm.attention(q, k, v, desc), rep)
    row["desc"] = _bench(lambda: query_descriptor(mask, None, Sk, Sq, batch_size=B,
                                                  device="cuda"), rep)
    row["cm+desc"] = _bench(lambda: cm.attention(
        q, k, v, query_descriptor(mask, None, Sk, Sq, batch_size=B, device="cuda")), rep)
    # the descriptor from the preprocess program's rows variant (one launch) instead of torch ops
    row["desc_program"] = _bench(lambda: query_descriptor(mask, None, Sk, Sq, batch_size=B,
                                                          device="cuda", backend="tilelang"), rep)
    row["cm+desc_program_graph"] = _bench(_graphed(lambda: cm.attention(
        q, k, v, query_descriptor(mask, None, Sk, Sq, batch_size=B, device="cuda",
                                  backend="tilelang"))), rep)
    row["fa4_host"] = _host_ms(lambda: flash_attn_func(q, k, v, causal=True))
    row["cm_host"] = _host_ms(lambda: cm.attention(q, k, v, desc))
    row["fa4_graph"] = _bench(_graphed(lambda: flash_attn_func(q, k, v, causal=True)), rep)
    row["cm_graph"] = _bench(_graphed(lambda: cm.attention(q, k, v, desc)), rep)
    row["cm+desc_graph"] = _bench(_graphed(lambda: cm.attention(
        q, k, v, query_descriptor(mask, None, Sk, Sq, batch_size=B, device="cuda"))), rep)
    print(f"  graphs: fa4 {row['fa4_graph']:.4f} cm {row['cm_graph']:.4f} cm+desc "
          f"{row['cm+desc_graph']:.4f}; host per call: fa4 {row['fa4_host']:.4f} cm "
          f"{row['cm_host']:.4f}", flush=True)
    print(f"  decode Sk={Sk:6d} Sq={Sq:3d} {row['engine']:7s} fa4 {row['fa4']:.4f} ms  cm "
          f"{row['cm']:.4f} ms ({row['fa4'] / row['cm']:.2f}x)  desc {row['desc']:.4f} ms",
          flush=True)
    return row


def paged_point(Sk: int, Sq: int, page_size: int, rep: int) -> dict:
    from flash_attn.cute import flash_attn_varlen_func

    from compilemask.api.serving import paged_attention

    g = torch.Generator(device="cuda").manual_seed(Sk)
    per = (Sk + page_size - 1) // page_size
    table = torch.randperm(B * per, device="cuda", generator=g).view(B, per).to(torch.int32)
    k_cache, v_cache = (torch.randn(B * per, page_size, HKV, D, device="cuda",
                                    dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    used = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    causal = query_descriptor(cm.compile_mask(masks.causal()), None, Sk, Sq, batch_size=B,
                              device="cuda")
    prefix = query_descriptor(cm.compile_mask(masks.prefix_lm()),
                              {"prefix_len": torch.full((B,), Sk // 2, device="cuda")}, Sk, Sq,
                              batch_size=B, device="cuda")
    row = {"Sk": Sk, "Sq": Sq, "page_size": page_size}
    with torch.no_grad():
        row["fa4"] = _bench(lambda: flash_attn_varlen_func(
            q, k_cache, v_cache, page_table=table, seqused_k=used, causal=True), rep)
        row["cm_causal"] = _bench(lambda: paged_attention(q, k_cache, v_cache, table, causal),
                                  rep)
        row["cm_prefix_lm"] = _bench(lambda: paged_attention(q, k_cache, v_cache, table,
                                                             prefix), rep)
    print(f"  paged Sk={Sk:6d} Sq={Sq:3d} page {page_size}: fa4 {row['fa4']:.4f} ms  causal "
          f"{row['cm_causal']:.4f} ms ({row['fa4'] / row['cm_causal']:.2f}x)  prefix-LM "
          f"{row['cm_prefix_lm']:.4f} ms", flush=True)
    return row


def paged_markdown(rows) -> str:
    out = ["", "Paged KV cache (eager calls): FA4's paged causal kernel, ours for the causal mask "
           "(FA4's own, native) and for prefix-LM (the interval mask_mod on every tile).", "",
           "| Sk | queries | page size | FA4 causal | ours causal | vs FA4 | ours prefix-LM | "
           "prefix-LM vs FA4 causal |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['Sk']} | {r['Sq']} | {r['page_size']} | {r['fa4']:.4f} | "
                   f"{r['cm_causal']:.4f} | {r['fa4'] / r['cm_causal']:.2f}x | "
                   f"{r['cm_prefix_lm']:.4f} | {r['fa4'] / r['cm_prefix_lm']:.2f}x |")
    return "\n".join(out) + "\n"


def to_markdown(rows, header) -> str:
    out = [header, "", "Eager calls (host cost included), then each captured in a CUDA graph "
           "(GPU work alone); host: per-call host time with the GPU not waited on; (program): the "
           "descriptor by the preprocess program's rows variant, one launch.", "",
           "| Sk | queries | engine | FA4 | ours | ours vs FA4 | descriptor | ours + descriptor "
           "| FA4 graph | ours graph | vs FA4 | ours + descriptor graph | host FA4 | host ours "
           "| descriptor (program) | ours + descriptor (program) graph |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['Sk']} | {r['Sq']} | {r['engine']} | {r['fa4']:.4f} | {r['cm']:.4f} | "
                   f"{r['fa4'] / r['cm']:.2f}x | {r['desc']:.4f} | {r['cm+desc']:.4f} | "
                   f"{r['fa4_graph']:.4f} | {r['cm_graph']:.4f} | "
                   f"{r['fa4_graph'] / r['cm_graph']:.2f}x | {r['cm+desc_graph']:.4f} | "
                   f"{r['fa4_host']:.4f} | {r['cm_host']:.4f} | {r['desc_program']:.4f} | "
                   f"{r['cm+desc_program_graph']:.4f} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="8192,32768")
    ap.add_argument("--queries", default="1")
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--page-size", default="",
                    help="comma-separated page sizes: also time decode steps over a paged cache")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile one call's host time (serving_profile_*.txt)")
    args = ap.parse_args(argv)
    header = (f"# Decode steps: {datetime.date.today()} · {torch.cuda.get_device_name()} · "
              f"B={B}, H={H}/{HKV}, D={D}, bf16, ms\n\n`python bench/serving.py --seqlens "
              f"{args.seqlens} --queries {args.queries} --rep {args.rep}`")
    rows = [decode_point(Sk, Sq, args.rep) for Sk in map(int, args.seqlens.split(","))
            for Sq in map(int, args.queries.split(","))]
    paged = [paged_point(Sk, Sq, int(ps), args.rep) for ps in filter(None,
             args.page_size.split(",")) for Sk in map(int, args.seqlens.split(","))
             for Sq in map(int, args.queries.split(","))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile_point(int(args.seqlens.split(",")[0]), 1, out)
    text = to_markdown(rows, header) + (paged_markdown(paged) if paged else "")
    (out / "serving_decode.json").write_text(json.dumps({"decode": rows, "paged": paged},
                                                        indent=1))
    (out / "serving_decode.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
