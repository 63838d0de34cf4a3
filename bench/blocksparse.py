"""Block-sparse lists benchmark (H200): the TileLang list programs per pass, at 128K tokens.

For the attention benchmark's workloads (bench/workloads.py) at S = 128K (B = 1) and 32K (B = 4)
and a random bitmap (the densest lists: every state equally likely), the three passes

* ``fwd``: from ``fwd_bitmap`` (1024 x 1024 tiles at 128K),
* ``bwd``: from ``bwd_bitmap`` (1024 kv tiles x 2048 q tiles of 64 rows),
* ``bwd128``: the forward bitmap by columns (1024 x 1024),

and ``all``, the three in one launch as the pipeline writes them (``packed_lists``), checks every
output against the torch reference and times it: device time per call (20 calls in one CUDA
graph), and the host time of a call. A program takes its shapes at run time, so the default
config compiles five programs for every case (each pass with and without ``fill``, and ``all``).
``--sweep`` times other launch configs (``ListsConfig``) on the random bitmap; their programs
compile in parallel processes first.

    python bench/blocksparse.py [--sweep] [--configs 256:16:16:1,...] [--jobs 12]
                                [--out bench/results/blocksparse.md]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.* as a script

import compilemask as cm  # noqa: E402
from bench import workloads as W  # noqa: E402
from bench.preprocess import time_graph, time_host  # noqa: E402
from compilemask.codegen import blocksparse as tlb  # noqa: E402
from compilemask.compiler.blocksparse import lists_from_bitmap  # noqa: E402
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    PackedLists,
    pack_bitmap,
)

SHAPES = [(131072, 1), (32768, 4)]
# threads:tpr:tpr_transposed:wpt per ListsConfig of the sweep; the first is the default
CONFIGS = "256:16:16:1,128:16:16:1,256:32:32:1,256:64:32:1,128:32:8:2,512:16:16:1,256:16:4:1"
PASSES = ("fwd", "bwd", "bwd128")
KIND_OF = {"fwd": "fwd", "bwd": "bwd64", "bwd128": "bwd128"}  # pass -> list kind


def parse_configs(text: str) -> list[tlb.ListsConfig]:
    out = []
    for item in text.split(","):
        threads, tpr, tpr_t, wpt = (int(x) for x in item.split(":"))
        out.append(tlb.ListsConfig(threads=threads, tpr=tpr, tpr_transposed=tpr_t, wpt=wpt))
    return out


def passes(d):
    """name -> (bitmap, packed tiles, transpose) of a descriptor's three passes."""
    n_m, n_n = d.fwd_tiles.num_blocks(d.seqlen_q, d.seqlen_k)
    m_b, _ = d.bwd_tiles.num_blocks(d.seqlen_q, d.seqlen_k)
    return {"fwd": (d.fwd_bitmap, n_n, False), "bwd": (d.bwd_bitmap, m_b, False),
            "bwd128": (d.fwd_bitmap, n_n, True)}


def random_passes(S, B, dev):
    """The passes of random bitmaps shaped as a descriptor's at Sq = Sk = S (``bwd128`` reads
    the forward one by columns, as ``packed_lists`` does)."""
    g = torch.Generator().manual_seed(S)
    out = {}
    for name, (rows, tiles) in {"fwd": (S // 128, S // 128), "bwd": (S // 128, S // 64)}.items():
        st = torch.randint(0, 3, (B, rows, tiles), generator=g).to(torch.uint8)
        st = torch.where(st == 2, torch.tensor(3, dtype=torch.uint8), st)
        out[name] = (pack_bitmap(st).to(dev), tiles, False)
    out["bwd128"] = (out["fwd"][0], S // 128, True)
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


def dims(bm, tiles, transpose):
    """(list rows, column tiles) of a pass."""
    return (tiles, bm.shape[1]) if transpose else (bm.shape[1], tiles)


def one_kind(pl: tlb.BlockSparsePlan) -> tlb.MultiPlan:
    return tlb.MultiPlan(((pl, 0),), 1)


def run_plan(bm, pl, rows, cols):
    """One pass through the one-part program of ``pl``, viewed as its four outputs."""
    mplan = one_kind(pl)
    buf = tlb.block_sparse_multi((bm,), mplan, ((rows, cols),))
    layout = {"k": (mplan.offsets(((rows, cols),))[0], rows, cols)}
    return PackedLists(buf, bm.shape[0], layout).view("k")


def all_kinds(cases, S, config=tlb.DEFAULT_LISTS_CONFIG):
    """The pipeline's launch (every kind in one buffer) on the fwd and bwd bitmaps of ``cases``
    (a descriptor's, or random ones of the same shapes)."""
    fwd, bwd = cases["fwd"][0], cases["bwd"][0]
    return tlb.packed_lists(fwd, bwd, DEFAULT_FWD_TILES, DEFAULT_BWD_TILES, S, S,
                            config=config)


def fa4_plan(config):
    """The MultiPlan ``packed_lists`` runs for FA4's three kinds."""
    return tlb.multi_plan([(False, 0), (False, 1), (True, 0)], 2, config)


def _compile(mplan):
    t = time.time()
    tlb.multi_kernel(mplan, "cuda")  # fills TileLang's disk cache for the parent
    return time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--configs", default=CONFIGS,
                    help="ListsConfigs of the sweep, threads:tpr:tpr_transposed:wpt, "
                         "comma-separated")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = parse_configs(args.configs)
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
            cases[(name, S, B)] = passes(d)
        cases[("random", S, B)] = random_passes(S, B, dev)
    # one program per (transpose, fill, config), whatever the shapes
    todo = [one_kind(tlb.plan(tr, fill)) for tr in (False, True) for fill in (False, True)]
    todo.append(fa4_plan(tlb.DEFAULT_LISTS_CONFIG))
    if args.sweep:
        todo += [one_kind(tlb.plan(tr, config=c)) for c in configs for tr in (False, True)]
        todo += [fa4_plan(c) for c in configs]
    todo = list(dict.fromkeys(todo))
    with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex:
        secs = list(ex.map(_compile, todo))
    print(f"compiled {len(todo)} programs in parallel: {time.time() - t0:.0f}s "
          f"(each {min(secs):.1f}-{max(secs):.1f}s)", flush=True)
    for (name, S, B), by_pass in cases.items():
        for p, (bm, tiles, transpose) in by_pass.items():
            ref = lists_from_bitmap(bm, tiles, transpose=transpose)
            out = tlb.block_sparse_lists(bm, tiles, transpose)
            filled = tlb.block_sparse_lists(bm, tiles, transpose, fill=True)
            ok = same(ref, out) and all(torch.equal(a, b) for a, b in zip(ref, filled))
            dev_us = time_graph(lambda bm=bm, t=tiles, tr=transpose:
                                tlb.block_sparse_lists(bm, t, tr))
            fill_us = time_graph(lambda bm=bm, t=tiles, tr=transpose:
                                 tlb.block_sparse_lists(bm, t, tr, fill=True))
            host_us = time_host(lambda bm=bm, t=tiles, tr=transpose:
                                tlb.block_sparse_lists(bm, t, tr))
            lines.append(f"| {name} | {S} | {B} | {p} | {ref.num_rows} x {ref.num_cols} | "
                         f"{entries(ref)} | {ok} | {dev_us:.1f} | {fill_us:.1f} | "
                         f"{host_us:.1f} |")
            print(lines[-1], flush=True)
        packed = all_kinds(by_pass, S)
        refs = {p: lists_from_bitmap(bm, t, transpose=tr) for p, (bm, t, tr) in by_pass.items()}
        ok = all(same(refs[p], packed.view(KIND_OF[p])) for p in PASSES)
        dev_us = time_graph(lambda c=by_pass, S=S: all_kinds(c, S))
        host_us = time_host(lambda c=by_pass, S=S: all_kinds(c, S))
        lines.append(f"| {name} | {S} | {B} | all | 3 kinds | "
                     f"{sum(entries(r) for r in refs.values())} | {ok} | {dev_us:.1f} | - | "
                     f"{host_us:.1f} |")
        print(lines[-1], flush=True)
    if args.sweep:
        lines += ["", "| pass | threads | TPR | WPT | RPB | chunks | device us |",
                  "|---|---|---|---|---|---|---|"]
        rand = cases[("random", 131072, 1)]
        for p in PASSES:
            bm, tiles, transpose = rand[p]
            ref = lists_from_bitmap(bm, tiles, transpose=transpose)
            rows, cols = dims(bm, tiles, transpose)
            for pl in dict.fromkeys(tlb.plan(transpose, config=c) for c in configs):
                ok = same(ref, run_plan(bm, pl, rows, cols))
                us = time_graph(lambda bm=bm, pl=pl, r=rows, c=cols: run_plan(bm, pl, r, c))
                lines.append(f"| {p} | {pl.threads} | {pl.tpr} | {pl.wpt} | {pl.rpb} | "
                             f"{pl.chunks(cols)} | {us:.1f}{'' if ok else ' WRONG'} |")
                print(lines[-1], flush=True)
        refs = {p: lists_from_bitmap(bm, t, transpose=tr) for p, (bm, t, tr) in rand.items()}
        for c in configs:
            packed = all_kinds(rand, 131072, c)
            ok = all(same(refs[p], packed.view(KIND_OF[p])) for p in PASSES)
            us = time_graph(lambda c=c: all_kinds(rand, 131072, c))
            rpb = "/".join(str(pl.rpb) for pl, _ in fa4_plan(c).parts)
            lines.append(f"| all | {c.threads} | {c.tpr}/{c.tpr_transposed} | {c.wpt} | {rpb} | "
                         f"- | {us:.1f}{'' if ok else ' WRONG'} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
