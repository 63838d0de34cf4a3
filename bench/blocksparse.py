"""Block-sparse lists benchmark (H200): the TileLang kernel per pass, at 128K tokens.

For the attention benchmark's workloads (bench/workloads.py) at S = 128K (B = 1) and 32K (B = 4)
and a random bitmap (the densest lists: every state equally likely), the three passes

* ``fwd``: from ``fwd_bitmap`` (1024 x 1024 tiles at 128K),
* ``bwd``: from ``bwd_bitmap`` (1024 kv tiles x 2048 q tiles of 64 rows),
* ``bwd128``: the forward bitmap by columns (1024 x 1024),

checks every output against the torch reference and times it: device time per call (20 calls
in one CUDA graph), and the host time of a ``block_sparse_lists`` call. ``--sweep`` times other
thread layouts on the random bitmap (their kernels compiled in parallel processes first).

    python bench/blocksparse.py [--sweep] [--jobs 12] [--out bench/results/blocksparse.md]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import time

import torch

import compilemask as cm
from bench import workloads as W
from bench.preprocess import time_graph, time_host
from compilemask.blocksparse import lists_from_bitmap
from compilemask.codegen import blocksparse as tlb
from compilemask.tiles import pack_bitmap

SHAPES = [(131072, 1), (32768, 4)]
# (threads, max_tpr, wpt) of the sweep; the first is the default
LAYOUTS = [(256, 64, 1), (128, 64, 1), (256, 32, 1), (128, 32, 2), (512, 64, 1), (256, 128, 1)]


def passes(d):
    """name -> (bitmap, packed tiles, transpose) of a descriptor's three passes."""
    n_m, n_n = d.fwd_tiles.num_blocks(d.seqlen_q, d.seqlen_k)
    m_b, _ = d.bwd_tiles.num_blocks(d.seqlen_q, d.seqlen_k)
    return {"fwd": (d.fwd_bitmap, n_n, False), "bwd": (d.bwd_bitmap, m_b, False),
            "bwd128": (d.fwd_bitmap, n_n, True)}


def random_passes(S, B, dev):
    g = torch.Generator().manual_seed(S)
    out = {}
    for name, (rows, tiles, transpose) in {"fwd": (S // 128, S // 128, False),
                                           "bwd": (S // 128, S // 64, False),
                                           "bwd128": (S // 128, S // 128, True)}.items():
        st = torch.randint(0, 3, (B, rows, tiles), generator=g).to(torch.uint8)
        st = torch.where(st == 2, torch.tensor(3, dtype=torch.uint8), st)
        out[name] = (pack_bitmap(st).to(dev), tiles, transpose)
    return out


def same(ref, out):
    C = ref.num_cols
    slot = torch.arange(C, device=ref.mask_idx.device)
    for rc, ri, oc, oi in ((ref.mask_cnt, ref.mask_idx, out.mask_cnt, out.mask_idx),
                           (ref.full_cnt, ref.full_idx, out.full_cnt, out.full_idx)):
        live = slot < rc.unsqueeze(-1)
        if not (torch.equal(rc, oc) and torch.equal(torch.where(live, ri, 0),
                                                    torch.where(live, oi, 0))):
            return False
    return True


def entries(lists):
    return int(lists.mask_cnt.sum() + lists.full_cnt.sum())


def _compile(args):
    pl, target = args
    t = time.time()
    tlb.block_sparse_kernel(pl, target)  # fills TileLang's disk cache for the parent
    return time.time() - t


def sweep_plans(cases):
    plans = []
    for bm, tiles, transpose in cases:
        rows, cols = (tiles, bm.shape[1]) if transpose else (bm.shape[1], tiles)
        for threads, max_tpr, wpt in LAYOUTS:
            try:
                plans.append(tlb.plan(rows, cols, transpose, threads=threads, max_tpr=max_tpr,
                                      wpt=wpt))
            except ValueError:
                pass
    return list(dict.fromkeys(plans))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    lines = ["| workload | S | B | pass | R x C | entries | ok | device us | fill us | host us |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cases = {}
    for S, B in SHAPES:
        for name in ("causal", "hstu", "shared_prompt_rm", "clear"):
            m = cm.compile_mask(W.WORKLOADS[name]())
            d = m.preprocess(W.make_meta(name, B, S, device="cuda"), S, batch_size=B,
                             device=dev, backend="tilelang")
            for p, c in passes(d).items():
                cases[(name, S, B, p)] = c
        for p, c in random_passes(S, B, dev).items():
            cases[("random", S, B, p)] = c
    plans = {k: tlb.plan(*((t, bm.shape[1]) if tr else (bm.shape[1], t)), tr, fill)
             for k, (bm, t, tr) in cases.items() for fill in (False, True)}
    todo = list(dict.fromkeys(plans.values()))
    if args.sweep:
        todo += sweep_plans([cases[("random", 131072, 1, p)] for p in ("fwd", "bwd", "bwd128")])
    todo = list(dict.fromkeys(todo))
    with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex:
        secs = list(ex.map(_compile, [(pl, "cuda") for pl in todo]))
    print(f"compiled {len(todo)} kernels in parallel: {time.time() - t0:.0f}s "
          f"(each {min(secs):.1f}-{max(secs):.1f}s)", flush=True)
    for (name, S, B, p), (bm, tiles, transpose) in cases.items():
        ref = lists_from_bitmap(bm, tiles, transpose=transpose)
        out = tlb.block_sparse_lists(bm, tiles, transpose)
        filled = tlb.block_sparse_lists(bm, tiles, transpose, fill=True)
        ok = same(ref, out) and all(torch.equal(a, b) for a, b in zip(ref, filled))
        dev_us = time_graph(lambda bm=bm, t=tiles, tr=transpose: tlb.block_sparse_lists(bm, t, tr))
        fill_us = time_graph(lambda bm=bm, t=tiles, tr=transpose:
                             tlb.block_sparse_lists(bm, t, tr, fill=True))
        host_us = time_host(lambda bm=bm, t=tiles, tr=transpose: tlb.block_sparse_lists(bm, t, tr))
        lines.append(f"| {name} | {S} | {B} | {p} | {ref.num_rows} x {ref.num_cols} | "
                     f"{entries(ref)} | {ok} | {dev_us:.1f} | {fill_us:.1f} | {host_us:.1f} |")
        print(lines[-1], flush=True)
    if args.sweep:
        lines += ["", "| pass | threads | TPR | WPT | RPB | chunks | device us |",
                  "|---|---|---|---|---|---|---|"]
        for p in ("fwd", "bwd", "bwd128"):
            bm, tiles, transpose = cases[("random", 131072, 1, p)]
            ref = lists_from_bitmap(bm, tiles, transpose=transpose)
            for pl in sweep_plans([(bm, tiles, transpose)]):
                ok = same(ref, tlb._launch(bm, pl))
                us = time_graph(lambda bm=bm, pl=pl: tlb._launch(bm, pl))
                lines.append(f"| {p} | {pl.threads} | {pl.tpr} | {pl.wpt} | {pl.rpb} | "
                             f"{pl.chunks} | {us:.1f}{'' if ok else ' WRONG'} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
