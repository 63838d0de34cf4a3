"""A training loop whose sequence length changes every step: what a new length costs.

    python bench/dynamic_loop.py --steps 50 --out $OUT            # the loop table
    python bench/dynamic_loop.py --second-process --out $OUT      # first 32K step of a new process

Per mask, ``--steps`` steps, each at a new random length S in [1K, 32K] with B = 128K // S
sequences (H=8, D=128, bf16) and new metadata: the step (preprocess + attention forward and
backward) is timed when first run at that length (cold: whatever compiles, compiles here) and
again right after (warm). The loop's compile time is the sum of cold minus warm; the table gives
the first step, the worst cold/warm ratio over the later steps and the total. Masks: the paper's
(HSTU, shared-prompt RM, CLEAR), causal and packed documents (native), and a mask without params
(4 sink tokens + a causal window of 4096), whose descriptor is built on the GPU (``device=``).

``--second-process`` runs, twice in fresh processes, import + compile + preprocess + one 32K HSTU
train step: the second run reads every compiled program from the cache folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import compilemask as cm  # noqa: E402
from compilemask import masks  # noqa: E402

H, D, DTYPE = 8, 128, torch.bfloat16
TOKENS = 128 * 1024


def sink_window(i, j):
    return j <= i and (j < 4 or j > i - 4096)


def no_params():
    return cm.MaskSpec("sink_window", params=[], regions=[
        cm.Region("all", when=lambda i: i >= 0, visible=sink_window)])


SPECS = {
    "hstu": masks.hstu,
    "shared_prompt_rm": masks.shared_prompt_rm,
    "clear": lambda: masks.clear(2, 64),
    "causal": masks.causal,
    "packed_documents": masks.packed_documents,
    "sink_window": no_params,
}


def metadata(spec, B, S, seed):
    rec = masks.recipes_for(spec) if spec.params else None
    if rec is None:
        return {}
    make = getattr(rec, "bench_meta", None)
    meta = (make(B, S, seed) if make is not None
            else rec.random_meta(B, S, torch.Generator().manual_seed(seed)))
    return {k: v.to(device="cuda", dtype=torch.int32) for k, v in meta.items()}


def step(mask, meta, S, B, qkv):
    q, k, v = (t[:B * S].view(B, S, H, D) for t in qkv)
    q.requires_grad_(True)
    desc = mask.preprocess(meta, S, batch_size=B, device="cuda")
    out = cm.attention(q, k, v, desc)
    out.backward(torch.ones_like(out))
    return out


def _caches():
    """Every compiled-program cache in play: ours and flash-attn-4's (per entry point)."""
    from compilemask.codegen import blocksparse, preprocess

    out = {"tilelang_preprocess": preprocess._KERNELS._items,
           "tilelang_lists": blocksparse._KERNELS._items}
    try:
        from flash_attn.cute import interface as fa4i
    except ImportError:
        return out
    for name in dir(fa4i):
        cache = getattr(getattr(fa4i, name), "compile_cache", None)
        if cache is not None and hasattr(cache, "cache"):
            out[f"fa4.{name}"] = cache.cache
    return out


def _keys():
    return {name: set(map(repr, c)) for name, c in _caches().items()}


def _new_keys(before, after):
    """(cache, key) pairs that a step added, the key shortened to the fields that differ from
    an existing entry of that cache."""
    new = []
    for name, keys in after.items():
        for k in keys - before.get(name, set()):
            new.append(f"{name}: {k[:400]}")
    return new


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def loop(name, steps, seed):
    rng = random.Random(seed)
    spec = SPECS[name]()
    t0 = time.perf_counter()
    mask = cm.compile_mask(spec)
    compile_mask_s = time.perf_counter() - t0
    qkv = [torch.randn(TOKENS, H, D, device="cuda", dtype=DTYPE) for _ in range(3)]
    rows = []
    for n in range(steps):
        S = rng.randint(1024, 32768)
        B = max(1, TOKENS // S)
        meta = metadata(spec, B, S, seed + n)
        before = _keys()
        cold = timed(lambda: step(mask, meta, S, B, qkv))
        compiled = _new_keys(before, _keys())
        warm = min(timed(lambda: step(mask, meta, S, B, qkv)) for _ in range(2))
        rows.append({"step": n, "S": S, "B": B, "cold_s": cold, "warm_s": warm,
                     "ratio": cold / warm, "compiled": compiled})
        if compiled and n:
            print(f"  {name} step {n} (S={S}, B={B}) compiled {len(compiled)}: "
                  + " | ".join(compiled), flush=True)
    later = rows[1:]
    return {"mask": name, "compile_mask_s": compile_mask_s, "first_step_s": rows[0]["cold_s"],
            "max_ratio_after_first": max(r["ratio"] for r in later) if later else None,
            "worst_step": max(later, key=lambda r: r["ratio"]) if later else None,
            "loop_compile_s": sum(r["cold_s"] - r["warm_s"] for r in rows),
            "steps": rows}


SECOND = """
import time; t0 = time.perf_counter()
import torch, compilemask as cm
from compilemask import masks
from bench.workloads import make_meta
S, B = 32768, 4
mask = cm.compile_mask(masks.hstu())
meta = make_meta("hstu", B, S, device="cuda")
q, k, v = (torch.randn(B, S, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
out = cm.attention(q, k, v, mask.preprocess(meta, S, batch_size=B))
out.backward(torch.ones_like(out)); torch.cuda.synchronize()
print("FIRST_STEP_S", time.perf_counter() - t0)
"""


def second_process():
    times = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", SECOND], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))})
        line = [x for x in r.stdout.splitlines() if x.startswith("FIRST_STEP_S")]
        if not line:
            print(r.stdout[-2000:], r.stderr[-4000:])
            raise SystemExit("second-process run failed")
        times.append(float(line[-1].split()[1]))
    return {"first_process_s": times[0], "second_process_s": times[1]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", default=",".join(SPECS))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--second-process", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    if args.second_process:
        res = second_process()
        print(json.dumps(res))
        (out / f"second_process_{stamp}.json").write_text(json.dumps(res, indent=1))
        return res
    results = []
    lines = ["| mask | first step (s) | worst later cold/warm | at S | loop compile (s) |",
             "|---|---|---|---|---|"]
    for name in args.masks.split(","):
        r = loop(name, args.steps, args.seed)
        results.append(r)
        w = r["worst_step"] or {}
        lines.append(f"| {name} | {r['first_step_s']:.2f} | {r['max_ratio_after_first']:.2f}x "
                     f"| {w.get('S')} | {r['loop_compile_s']:.1f} |")
        print(lines[-1], flush=True)
    (out / f"dynamic_loop_{stamp}.json").write_text(json.dumps(results, indent=1))
    (out / f"dynamic_loop_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
