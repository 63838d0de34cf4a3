"""Context-parallel plan balance (CPU): balanced vs head-tail sharding for the paper's masks.

For every workload of bench/workloads.py at S tokens (B = 131072 / S sequences, tile 128), per
plan kind and world size W: max/mean over the ranks of the plan's work measure (visible (q, k)
pairs) and of the kernel's (visible 128 x 128 tiles of the rank's row-sharded descriptor, the
tiles a block-sparse kernel runs).

    python bench/cp_balance.py [--seqlen 32768] [--world 2 4 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))
import compilemask as cm  # noqa: E402
from bench.workloads import WORKLOADS, batch_for, make_meta  # noqa: E402
from compilemask.api import distributed as cp  # noqa: E402


def visible_tiles(mask, meta, plan, batch) -> torch.Tensor:
    """Visible forward tiles per rank (int64 [W])."""
    return torch.stack([
        (cp.shard_descriptor(mask, meta, plan, r, batch_size=batch).tile_states() > 0).sum()
        for r in range(plan.world_size)])


def _ratio(w):
    w = w.to(torch.float64)
    return float(w.max() / w.mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args(argv)
    S = args.seqlen
    B = batch_for(S)
    print(f"S = {S}, B = {B}, tile 128; max/mean per rank (1.000 = perfect)\n")
    print("| mask | W | balanced pairs | balanced tiles | head-tail pairs | head-tail tiles |")
    print("|---|---|---|---|---|---|")
    for name in ("hstu", "shared_prompt_rm", "clear", "causal"):
        mask = cm.compile_mask(WORKLOADS[name]())
        meta = make_meta(name, B, S)
        for W in args.world:
            bal = cp.make_plan(mask, meta, S, W, "balanced", batch_size=B)
            ht = cp.make_plan(mask, meta, S, W, "head_tail", batch_size=B)
            cells = [f"{_ratio(p.work):.3f} | {_ratio(visible_tiles(mask, meta, p, B)):.3f}"
                     for p in (bal, ht)]
            print(f"| {name} | {W} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
