"""Read Nsight Compute source counters (``bench/h200.sh ncu_src``: the source page as CSV, one
section per kernel) and say where each kernel spends its executed instructions.

Per kernel: static and executed instruction counts, the executed opcode mix, and the hottest
straight-line runs (consecutive SASS lines with the same execution count, i.e. basic blocks),
each with its length, executions per instruction and share of the kernel. With ``--pair A B``
(kernel indices), the per-opcode difference of executed instructions, A minus B. With
``--stalls N``: the warp-state samples per kernel by stall reason, and the N SASS lines holding
the most samples, each with its two main reasons (where the warps wait, not what they issue).

    python bench/ncu_source.py bench/results/ncu/ncu_causal_8k_source_2026-11-29.csv.xz \
        --names cm_fwd,cm_bwd,fa4_fwd,fa4_bwd --pair 0 2 --pair 1 3
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import lzma
import re

__all__ = ["read_kernels", "read_samples", "opcode_mix", "hot_runs", "stall_lines"]


def _sections(path: str):
    """(kernel name, [{column: value}, ...]) per kernel section of the source-page CSV."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        lines = f.read().split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        name = next(csv.reader([lines[a]]))[1]
        rows = csv.DictReader(io.StringIO("\n".join(lines[a + 1:b])))
        yield name, [r for r in rows if None not in r.values()]


def read_kernels(path: str, sections=None) -> list[tuple[str, list[tuple[str, int]]]]:
    """[(kernel name, [(SASS text, executed warp instructions), ...]), ...] in file order
    (``sections``: ``_sections(path)`` already read)."""
    return [(name, [(r["Source"].strip(), int(r["Instructions Executed"] or 0)) for r in rows])
            for name, rows in (sections or _sections(path))]


def read_samples(path: str, sections=None) -> list[tuple[str, list[tuple[str, dict]]]]:
    """[(kernel name, [(SASS text, {stall reason: samples, "all": samples}), ...]), ...]: the
    warp-state sampling columns of the source page (``stall_*``, all samples, not the
    not-issued ones)."""
    kernels = []
    for name, rows in (sections or _sections(path)):
        reasons = [h for h in (rows[0] if rows else {})
                   if h.startswith("stall_") and "Not Issued" not in h]
        out = []
        for r in rows:
            d = {h[6:]: int(r[h] or 0) for h in reasons}
            d["all"] = int(r.get("Warp Stall Sampling (All Samples)") or 0)
            out.append((r["Source"].strip(), d))
        kernels.append((name, out))
    return kernels


def stall_lines(samples, top: int = 10):
    """The kernel's samples by reason (descending) and its ``top`` lines by samples, in line
    order: ([(reason, samples)], total, [(line, samples, sass, [(reason, samples)] * 2)])."""
    total = sum(d["all"] for _, d in samples) or 1
    by_reason = collections.Counter()
    for _, d in samples:
        for k, v in d.items():
            if k != "all":
                by_reason[k] += v
    hot = sorted(range(len(samples)), key=lambda i: -samples[i][1]["all"])[:top]
    lines = []
    for i in sorted(hot):
        sass, d = samples[i]
        # samples no exported reason column holds (e.g. at HGMMA) are reported as "other"
        other = d["all"] - sum(v for k, v in d.items() if k != "all")
        main = sorted([(v, k) for k, v in d.items() if k != "all"] + [(other, "other")],
                      reverse=True)[:2]
        lines.append((i, d["all"], sass, [(k, v) for v, k in main]))
    return by_reason.most_common(), total, lines


def _opcode(sass: str) -> str:
    body = re.sub(r"^@!?U?P\w+\s+", "", sass)  # drop the predicate
    return body.split()[0].split(".")[0] if body else "?"


def opcode_mix(ins) -> collections.Counter:
    mix = collections.Counter()
    for sass, n in ins:
        mix[_opcode(sass)] += n
    return mix


def hot_runs(ins, top: int = 12):
    """The ``top`` runs of consecutive lines with equal execution counts, by executed share:
    [(first line, length, executions per instruction, share, opcode summary)]."""
    runs, cur = [], []
    for i, (sass, n) in enumerate(ins):
        if cur and n != cur[-1][2]:
            runs.append(cur)
            cur = []
        cur.append((i, sass, n))
    runs.append(cur)
    total = sum(n for _, n in ins) or 1
    out = []
    for run in sorted(runs, key=lambda r: -len(r) * r[0][2])[:top]:
        ops = collections.Counter(_opcode(s) for _, s, _ in run)
        out.append((run[0][0], len(run), run[0][2], len(run) * run[0][2] / total,
                    " ".join(f"{o}{c}" for o, c in ops.most_common(8))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="source-page CSV (.csv or .csv.xz)")
    ap.add_argument("--names", default="", help="short names for the kernels, comma-separated")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--pair", nargs=2, type=int, action="append", default=[],
                    metavar=("A", "B"), help="opcode difference of kernel A minus kernel B")
    ap.add_argument("--stalls", type=int, default=0, metavar="N",
                    help="samples by stall reason and the N lines with the most samples")
    args = ap.parse_args(argv)
    sections = list(_sections(args.csv))  # one read of the (compressed) file
    kernels = read_kernels(args.csv, sections)
    names = args.names.split(",") if args.names else [k[0][:40] for k in kernels]
    for name, (_, ins) in zip(names, kernels):
        total = sum(n for _, n in ins)
        mix = opcode_mix(ins)
        print(f"== {name}: {len(ins)} SASS lines, {total:,} warp instructions executed")
        print("   mix: " + ", ".join(f"{o} {v / total:.1%}" for o, v in mix.most_common(12)))
        for first, length, execs, share, ops in hot_runs(ins, args.top):
            print(f"   line {first:5d} x{length:4d}  {execs:>11,d} each  {share:6.1%}  {ops}")
    for a, b in args.pair:
        ma, mb = opcode_mix(kernels[a][1]), opcode_mix(kernels[b][1])
        diff = sorted(((ma[o] - mb[o], o) for o in set(ma) | set(mb)), reverse=True)
        print(f"== {names[a]} - {names[b]}: {(sum(ma.values()) - sum(mb.values())) / 1e6:+.1f}M")
        print("   more: " + ", ".join(f"{o} {d / 1e6:+.1f}M" for d, o in diff[:12]))
        print("   less: " + ", ".join(f"{o} {d / 1e6:+.1f}M" for d, o in diff[-6:]))
    if args.stalls:
        for name, (_, samples) in zip(names, read_samples(args.csv, sections)):
            reasons, total, lines = stall_lines(samples, args.stalls)
            other = total - sum(v for _, v in reasons)  # as on the lines below
            print(f"== {name}: {total:,} warp-state samples")
            print("   by reason: " + ", ".join(f"{k} {v / total:.1%}" for k, v in reasons[:9])
                  + f"; other {other / total:.1%}")
            for i, n, sass, main in lines:
                why = ", ".join(f"{k} {v}" for k, v in main)
                print(f"   line {i:5d} {n:7d} ({n / total:5.1%})  {sass[:58]:58s} {why}")


if __name__ == "__main__":
    main()
