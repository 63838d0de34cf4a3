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
sys.path.append(str(ROOT))

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


RESERVE_GIB = 0  # --reserve-gib
MAX_SEGMENTS = None  # --max-segments: fixed-size cu_seqlens for segments masks (no host sync)
PEER = None  # --peer fa4: the same steps through flash-attn-4 directly (causal, packed documents)


def peer_step(meta, S, B, q, k, v):
    """FA4 as a user calls it: causal, or varlen over the documents with ``cu_seqlens`` made by
    torch ops from ``doc_start`` (and the longest document read on the host)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    if "doc_start" not in meta:
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out
    pos = torch.arange(S, device=q.device, dtype=torch.int32)
    starts = (meta["doc_start"] == pos).reshape(-1).nonzero().flatten().to(torch.int32)
    cu = torch.cat([starts, starts.new_tensor([B * S])])
    max_len = int((cu[1:] - cu[:-1]).max())
    flat = [t.reshape(B * S, H, D) for t in (q, k, v)]
    out = flash_attn_varlen_func(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                 max_seqlen_k=max_len, causal=True)
    out = out[0] if isinstance(out, tuple) else out
    return out.view(B, S, H, D)


def step(mask, meta, S, B, qkv, phases=None):
    """One step; with ``phases`` (a list), synchronizes after each part and appends its time."""
    def part(t0):
        if phases is None:
            return t0
        torch.cuda.synchronize()
        now = time.perf_counter()
        phases.append(now - t0)
        return now

    t0 = part(time.perf_counter())
    q, k, v = (t[:B * S].view(B, S, H, D) for t in qkv)
    q.requires_grad_(True)
    if PEER == "fa4":
        out = peer_step(meta, S, B, q, k, v)
        t0 = part(part(t0))  # no preprocess part: its time is in the forward
        out.backward(torch.ones_like(out))
        part(t0)
        return out
    desc = mask.preprocess(meta, S, batch_size=B, device="cuda", max_segments=MAX_SEGMENTS)
    t0 = part(t0)
    out = cm.attention(q, k, v, desc)
    t0 = part(t0)
    out.backward(torch.ones_like(out))
    part(t0)
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


class _Profiles:
    """--profile: host time by function over the cold steps and over as many warm ones."""

    def __init__(self, on):
        import cProfile

        self.cold, self.warm = (cProfile.Profile(), cProfile.Profile()) if on else (None, None)

    def run(self, prof, fn):
        if prof is None:
            return fn()
        prof.enable()
        try:
            return fn()
        finally:
            prof.disable()

    def report(self, path, top=30):
        import io
        import pstats

        if self.cold is None:
            return
        stats = {}
        for which, prof in (("cold", self.cold), ("warm", self.warm)):
            st = pstats.Stats(prof, stream=io.StringIO())
            for (f, ln, fn), (_cc, _nc, tt, ct, _callers) in st.stats.items():
                stats.setdefault(f"{f}:{ln}({fn})", {})[which] = (tt, ct)
        rows = sorted(stats.items(), key=lambda kv: -(kv[1].get("cold", (0, 0))[1]
                                                      - kv[1].get("warm", (0, 0))[1]))
        lines = ["cumulative s cold - warm | cold | warm | tottime cold - warm | function"]
        for name, v in rows[:top]:
            c, w = v.get("cold", (0, 0)), v.get("warm", (0, 0))
            lines.append(f"{c[1] - w[1]:8.4f} | {c[1]:8.4f} | {w[1]:8.4f} | "
                         f"{c[0] - w[0]:8.4f} | {name[-110:]}")
        Path(path).write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:16]), flush=True)


class _KernelProfiles:
    """--kernel-profile: device time per kernel (torch.profiler's CUDA activity) over the cold
    steps against as many warm ones, to tell which kernel a cold step spends longer in."""

    def __init__(self, on):
        self.on = on
        self.totals = {"cold": {}, "warm": {}}

    def run(self, which, fn):
        if not self.on:
            return fn()
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()  # (the CPU's activity only to try this out there)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            out = fn()
        for ev in prof.key_averages():
            t = (getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                 if cuda else ev.cpu_time_total)
            if t:
                self.totals[which][ev.key] = self.totals[which].get(ev.key, 0.0) + t
        return out

    def report(self, path, top=25):
        if not self.on:
            return
        cold, warm = self.totals["cold"], self.totals["warm"]
        rows = sorted(set(cold) | set(warm), key=lambda k: -(cold.get(k, 0) - warm.get(k, 0)))
        lines = ["device us, cold - warm | cold | warm | kernel"]
        lines += [f"{cold.get(k, 0) - warm.get(k, 0):10.1f} | {cold.get(k, 0):10.1f} | "
                  f"{warm.get(k, 0):10.1f} | {k[:100]}" for k in rows[:top]]
        Path(path).write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:16]), flush=True)


class _Timelines(_KernelProfiles):
    """--timeline: where the GPU idles inside a step. Each profiled step (CPU and CUDA activity,
    Python stacks) gives its wall time, GPU busy time and every idle gap of the GPU, charged to
    the innermost host op running mid-gap and the first frame of ours or flash-attn's above it;
    cold steps are summed against as many warm ones."""

    OURS = ("compilemask", "kernels/", "codegen/", "flash_attn", "bench/")

    def run(self, which, fn):
        if not self.on:
            return fn()
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                         else [])
        with profile(activities=acts, with_stack=True) as prof:
            out = fn()
        self._add(which, prof.events())
        return out

    def _where(self, ev):
        for frame in getattr(ev, "stack", None) or []:
            if any(o in frame for o in self.OURS) and "dynamic_loop" not in frame:
                return frame
        return "(no frame of ours)"

    def _add(self, which, events):
        dev = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
        cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        if not cpu:
            return
        t0 = min(e.time_range.start for e in cpu)
        t1 = max(e.time_range.end for e in events)
        busy, gaps, end = 0.0, [], t0
        for a, b in sorted((e.time_range.start, e.time_range.end) for e in dev):
            if a > end:
                gaps.append((end, a))
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        if t1 > end:
            gaps.append((end, t1))
        tot = self.totals[which]
        tot["wall"] = tot.get("wall", 0.0) + (t1 - t0)
        tot["gpu busy"] = tot.get("gpu busy", 0.0) + busy
        for a, b in gaps:
            mid = (a + b) / 2
            inner = [e for e in cpu if e.time_range.start <= mid <= e.time_range.end]
            if not inner:
                key = "(host outside any op)"
            else:
                ev = min(inner, key=lambda e: e.time_range.end - e.time_range.start)
                key = f"{ev.name[:40]} @ {self._where(ev)}"
            tot["gap " + key] = tot.get("gap " + key, 0.0) + (b - a)


def loop(name, steps, seed, phases=False, profiles=None, kernels=None):
    rng = random.Random(seed)
    spec = SPECS[name]()
    t0 = time.perf_counter()
    mask = cm.compile_mask(spec)
    compile_mask_s = time.perf_counter() - t0
    qkv = [torch.randn(TOKENS, H, D, device="cuda", dtype=DTYPE) for _ in range(3)]
    if RESERVE_GIB:  # one large cached segment: cold steps' new sizes split it, no cudaMalloc
        torch.empty(RESERVE_GIB << 30, dtype=torch.uint8, device="cuda")  # freed at once, kept
    rows = []
    for n in range(steps):
        S = rng.randint(1024, 32768)
        B = max(1, TOKENS // S)
        t0 = time.perf_counter()
        meta = metadata(spec, B, S, seed + n)  # host work: the GPU idles, as between steps
        gap = time.perf_counter() - t0
        before = _keys()
        cold_parts, warm_parts = ([] if phases else None), ([] if phases else None)
        prof = profiles or _Profiles(False)
        kprof = kernels if (kernels is not None and n) else _KernelProfiles(False)
        cold = kprof.run("cold", lambda: prof.run(
            prof.cold if n else None,
            lambda: timed(lambda: step(mask, meta, S, B, qkv, cold_parts))))
        compiled = _new_keys(before, _keys())
        # the same step at a now warm length, after the same host work (the GPU as idle as
        # before the cold step), and right after another step (the GPU busy)
        def after_gap():
            metadata(spec, B, S, seed + n)
            return timed(lambda: step(mask, meta, S, B, qkv))

        warm = min(after_gap() for _ in range(2))
        warm_busy = min(timed(lambda: step(mask, meta, S, B, qkv)) for _ in range(2))
        if n:  # as many warm steps profiled as cold ones
            prof.run(prof.warm, lambda: timed(lambda: step(mask, meta, S, B, qkv)))
            kprof.run("warm", lambda: timed(lambda: step(mask, meta, S, B, qkv)))
        if phases:  # preprocess, forward, backward, each synchronized, cold then warm
            timed(lambda: step(mask, meta, S, B, qkv, warm_parts))
        rows.append({"step": n, "S": S, "B": B, "host_gap_s": gap, "cold_s": cold,
                     "warm_s": warm, "ratio": cold / warm, "warm_busy_s": warm_busy,
                     "ratio_busy": cold / warm_busy, "compiled": compiled,
                     "cold_phases": cold_parts and cold_parts[1:],
                     "warm_phases": warm_parts and warm_parts[-3:]})
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
marks = []
def mark(what):
    torch.cuda.synchronize() if "torch" in globals() and torch.cuda.is_initialized() else None
    marks.append((what, time.perf_counter() - t0))
import torch, compilemask as cm
from compilemask import masks
from bench.workloads import make_meta
mark("import")
S, B = 32768, 4
mask = cm.compile_mask(masks.hstu())
mark("compile_mask")
meta = make_meta("hstu", B, S, device="cuda")
q, k, v = (torch.randn(B, S, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
mark("cuda_init_inputs")
desc = mask.preprocess(meta, S, batch_size=B)
mark("preprocess")
out = cm.attention(q, k, v, desc)
mark("forward")
out.backward(torch.ones_like(out)); torch.cuda.synchronize()
mark("backward")
print("FIRST_STEP_S", time.perf_counter() - t0)
print("PHASES", " ".join(f"{w}={t:.2f}" for w, t in marks))
"""


# the peer: flash-attn-4 alone, its first causal 32K train step in a process (its own cache)
PEER = """
import time; t0 = time.perf_counter()
import torch
from flash_attn.cute import flash_attn_func
t1 = time.perf_counter()
q, k, v = (torch.randn(4, 32768, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
out = flash_attn_func(q, k, v, causal=True)
out = out[0] if isinstance(out, tuple) else out
out.backward(torch.ones_like(out)); torch.cuda.synchronize()
print("FIRST_STEP_S", time.perf_counter() - t0)
print("PHASES", f"import={t1 - t0:.2f} step={time.perf_counter() - t1:.2f}")
"""

# what importing costs on its own, each in a fresh process
IMPORTS = ("import torch", "import torch, compilemask", "import tilelang",
           "import flash_attn.cute")


def _import_times():
    out = {}
    for stmt in IMPORTS:
        code = f"import time; t0 = time.perf_counter(); {stmt}; print(time.perf_counter() - t0)"
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True)
        out[stmt] = float(r.stdout.split()[-1]) if r.returncode == 0 else None
    return out


def second_process():
    res = {"imports_s": _import_times()}
    print("imports:", res["imports_s"], flush=True)
    for who, script in (("peer_fa4_causal", PEER), ("compilemask_hstu", SECOND)):
        times, phases = _twice(script)
        res[who] = {"first_process_s": times[0], "second_process_s": times[1],
                    "first_process_phases": phases[0], "second_process_phases": phases[1]}
    return res


def _twice(script):
    times, phases = [], []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))})
        line = [x for x in r.stdout.splitlines() if x.startswith("FIRST_STEP_S")]
        if not line:
            print(r.stdout[-2000:], r.stderr[-4000:])
            raise SystemExit("second-process run failed")
        times.append(float(line[-1].split()[1]))
        phases.append([x for x in r.stdout.splitlines() if x.startswith("PHASES")][-1][7:])
        print("second-process run:", times[-1], phases[-1], flush=True)
    return times, phases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", default=",".join(SPECS))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--second-process", action="store_true")
    ap.add_argument("--max-segments", type=int, default=None,
                    help="preprocess(max_segments=N): segments masks without host sync")
    ap.add_argument("--profile", action="store_true",
                    help="host profile of the cold steps against as many warm ones")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="device time per kernel of the cold steps against as many warm ones")
    ap.add_argument("--peer", choices=["fa4"], default=None,
                    help="run the steps through flash-attn-4 itself (causal, packed documents)")
    ap.add_argument("--reserve-gib", type=int, default=0,
                    help="reserve this many GiB in the caching allocator before the loop")
    ap.add_argument("--timeline", action="store_true",
                    help="where the GPU idles in the cold steps against as many warm ones")
    ap.add_argument("--phases", action="store_true",
                    help="also time preprocess, forward and backward of each step apart")
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
    lines = ["| mask | first step (s) | worst later cold/warm | at S | median | over 1.2x "
             "| loop compile (s) | worst cold/warm, warm right after a step | over 1.2x |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in args.masks.split(","):
        global MAX_SEGMENTS, RESERVE_GIB, PEER
        MAX_SEGMENTS, RESERVE_GIB, PEER = args.max_segments, args.reserve_gib, args.peer
        profiles = _Profiles(args.profile)
        kernels = (_Timelines(True) if args.timeline
                   else _KernelProfiles(args.kernel_profile))
        r = loop(name, args.steps, args.seed, args.phases, profiles, kernels)
        profiles.report(out / f"profile_{name}.txt")
        kernels.report(out / f"kernels_{name}.txt")
        results.append(r)
        w = r["worst_step"] or {}
        later = sorted(x["ratio"] for x in r["steps"][1:]) or [float("nan")]
        over = sum(x > 1.2 for x in later)
        busy = [x["ratio_busy"] for x in r["steps"][1:]] or [float("nan")]
        lines.append(f"| {name} | {r['first_step_s']:.2f} | {r['max_ratio_after_first']:.2f}x "
                     f"| {w.get('S')} | {later[len(later) // 2]:.2f}x | {over} "
                     f"| {r['loop_compile_s']:.1f} | {max(busy):.2f}x "
                     f"| {sum(x > 1.2 for x in busy)} |")
        print(lines[-1], flush=True)
    (out / f"dynamic_loop_{stamp}.json").write_text(json.dumps(results, indent=1))
    (out / f"dynamic_loop_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
