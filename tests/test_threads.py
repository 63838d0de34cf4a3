"""Threads: masks compiled and preprocessed for the first time from several threads at once, and
one new mask shared by several threads, give exact descriptors and never crash (z3, which the
proofs run, is not thread-safe). Each run is a child process, so that a crash fails the test
instead of ending pytest."""

import os
import subprocess
import sys

import pytest

# 8 threads per round; each round compiles new masks (new constants, so new keys) and runs every
# first use at once: compile, preprocess, the column view, the native pattern; each descriptor
# against the brute-force oracle
_SCRIPT = r'''
import sys, threading
import torch
import compilemask as cm
from compilemask.dsl import MaskSpec, Region
from compilemask.masks import chunked_causal, sliding_window

THREADS = 8


def spec(kind, w):
    if kind == 0:
        return sliding_window(w)
    if kind == 1:
        return chunked_causal(w)
    if kind == 2:
        return MaskSpec(f"doc_window_{w}", params=["doc_start"], regions=[Region(
            "doc", when=lambda i: True,
            visible=lambda i, j: doc_start[i] <= j <= i and i - j < w)])  # noqa: F821
    return MaskSpec(f"prefix_window_{w}", params=["prefix"], regions=[
        Region("prompt", when=lambda i: i < prefix, visible=lambda i, j: j < prefix),  # noqa
        Region("rest", when=lambda i: True,
               visible=lambda i, j: j < prefix or (j <= i and i - j < w))])  # noqa: F821


def meta(mask, S, gen):
    out = {}
    for p in mask.spec.params:
        if p == "doc_start":
            starts = torch.zeros(1, S, dtype=torch.int64)
            s = 0
            for i in range(S):
                if i and torch.rand((), generator=gen) < 0.2:
                    s = i
                starts[0, i] = s
            out[p] = starts
        else:
            out[p] = int(torch.randint(0, S, (), generator=gen))
    return out


def check(mask, S, seed, errors):
    gen = torch.Generator().manual_seed(seed)
    m = meta(mask, S, gen)
    desc = mask.preprocess(m, S)
    mask.native_pattern, mask.column_view
    want = mask.reference_mask(m, S)
    if not torch.equal(mask.dense_mask(desc), want):
        errors.append(f"{mask.name}: descriptor differs from the brute-force oracle")


def run_threads(work):
    errors, barrier = [], threading.Barrier(THREADS)

    def one(k):
        barrier.wait()
        try:
            work(k, errors)
        except Exception as e:  # noqa: BLE001 - reported by the parent
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


rounds, modes = int(sys.argv[1]), sys.argv[2].split(",")
done = 0
for r in range(rounds * len(modes)):
    base = 3 + r * (THREADS + 1)
    S = 16 + r % 5
    if modes[r % len(modes)] == "shared":  # one new mask, every thread's first preprocess at once
        mask = cm.compile_mask(spec(r % 4, base))
        errors = run_threads(lambda k, errs: check(mask, S, k, errs))
    else:  # a new mask per thread, compiled in the thread
        errors = run_threads(
            lambda k, errs: check(cm.compile_mask(spec(k % 4, base + k)), S, k, errs))
    if errors:
        print("\n".join(errors))
        sys.exit(1)
    done += THREADS
print(f"ok {done}")
'''


def _run(tmp_path, rounds: int, modes: str, timeout: float):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "threads.py"  # a file: the rules' source is read back
    script.write_text(_SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(rounds), modes], cwd=root,
                         capture_output=True, text=True, timeout=timeout)
    # a negative code is the signal that ended it (-11: a segmentation fault in z3)
    assert res.returncode == 0, (res.returncode, res.stdout[-3000:], res.stderr[-3000:])
    assert res.stdout.strip().endswith(f"ok {rounds * len(modes.split(',')) * 8}"), res.stdout


def test_first_preprocess_from_8_threads(tmp_path):
    # two rounds of new masks, one per thread, and two of one new mask shared by the threads
    _run(tmp_path, 2, "each,shared", timeout=300)


@pytest.mark.stress
def test_first_preprocess_from_8_threads_50_rounds(tmp_path):
    _run(tmp_path, 50, "each,shared", timeout=3000)
