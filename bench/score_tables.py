"""Train steps (forward + backward) with a trainable T5 relative-bias table on causal attention,
in interleaved rounds (one length, 128K tokens per batch, H=8, D=128, bf16):

* ``cm_trained``: ``cm.attention`` on the fa4 engine, the table's gradient from the backward's
  hook (``docs/decisions/trainable-score-tables.md``);
* ``cm_frozen``: the same call with the table detached (the bar: within 1.3x of this);
* ``flex_triton``: compiled FlexAttention (Triton), which trains the table with an atomic add
  per score (the bar: at least 1.5x as fast as this).

Each method's median over the rounds, every round timing the methods one after another; the
table gradients of ``cm_trained`` and ``flex_triton`` are compared once (relative error).

    python bench/score_tables.py [S] [ROUNDS] [METHODS]

``METHODS``: a comma-separated subset (``cm_trained,cm_frozen`` times a variant of the hook
without Flex-Triton's seconds per call).
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask import masks  # noqa: E402
from compilemask.dsl import score_mods  # noqa: E402
from compilemask.pipeline.pipeline import with_lists  # noqa: E402

S = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
B, H, D, dev = max(1, 131072 // S), 8, 128, "cuda"
g = torch.Generator(device=dev).manual_seed(S)
q, k, v, do = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, generator=g)
               for _ in range(4))
table = torch.randn(32, H, device=dev, generator=g).requires_grad_()
trained = score_mods.t5_bias(table, 128)
frozen = score_mods.t5_bias(table.detach(), 128)
# a native mask's descriptor has no tile lists of its own: the fa4 engine reads these
desc = with_lists(cm.compile_mask(masks.causal()).preprocess(None, S, batch_size=B, device=dev))
bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, B, None, S, S, device=dev)
fx = torch.compile(flex_attention, dynamic=False)
qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))


def leaf(*ts):
    return [t.detach().requires_grad_() for t in ts]


def cm_trained():
    table.grad = None
    a, b, c = leaf(q, k, v)
    cm.attention(a, b, c, desc, backend="fa4", score_mod=trained).backward(do)


def cm_frozen():
    a, b, c = leaf(q, k, v)
    cm.attention(a, b, c, desc, backend="fa4", score_mod=frozen).backward(do)


# Flex-Triton's default backward tiles need 288 KB of shared memory with a captured-buffer
# gradient at D=128, past an H100's 227 KB: the smaller tiles below are its fallback
SMALL_TILES = {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_stages": 1}
flex_options = {}


def flex_triton():
    table.grad = None
    a, b, c = leaf(qt, kt, vt)
    fx(a, b, c, score_mod=trained, block_mask=bm,
       kernel_options=flex_options or None).backward(dot)


METHODS = {"cm_trained": cm_trained, "cm_frozen": cm_frozen, "flex_triton": flex_triton}
if len(sys.argv) > 3:
    METHODS = {n: METHODS[n] for n in sys.argv[3].split(",")}


T0 = time.perf_counter()


def phase(what: str) -> None:
    """Where the time goes (compiles dominate a first run), as it goes."""
    print(f"[{time.perf_counter() - T0:6.1f} s] {what}", flush=True)


def timed(fn, budget_ms: float = 200.0) -> float:
    """Mean ms per call over as many calls as fit ``budget_ms`` (1 to 50): Flex-Triton's
    per-score atomics into a small table take seconds a call, which ``do_bench``'s fixed five
    estimate calls and its warm-up multiply."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(1, min(50, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def main():
    cm_trained()
    ours = table.grad.clone()
    phase("cm_trained compiled and run")
    cm_frozen()
    phase("cm_frozen compiled and run")
    rel = None
    if "flex_triton" in METHODS:
        rel = flex_gradient_error(ours)
    times = {n: [] for n in METHODS}
    for r in range(ROUNDS):
        for n, fn in METHODS.items():
            times[n].append(timed(fn))
        phase(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.3f} ms" for n, t in times.items()))
    med = {n: statistics.median(t) for n, t in times.items()}
    compared = "" if rel is None else f"; table grad vs Flex-Triton: rel err {rel:.2e}"
    print(f"{torch.cuda.get_device_name()} S={S} B={B} H={H} D={D} causal, T5 table 32x{H}"
          + compared)
    for n, t in med.items():
        print(f"  {n:12s} {t:8.3f} ms")
    print(f"  trained / frozen {med['cm_trained'] / med['cm_frozen']:.3f}x (bar <= 1.3x)"
          + (f"; Flex-Triton / trained {med['flex_triton'] / med['cm_trained']:.2f}x "
             "(bar >= 1.5x)" if "flex_triton" in med else ""))


def flex_gradient_error(ours) -> float:
    """Compiles Flex-Triton (its smaller tiles where the default ones do not fit) and returns
    the relative error between its table gradient and ``ours``."""
    try:
        flex_triton()
    except Exception as e:  # its default tiles do not fit: the smaller ones, said
        print(f"Flex-Triton's default tiles failed ({type(e).__name__}); with {SMALL_TILES}")
        flex_options.update(SMALL_TILES)
        torch._dynamo.reset()
        flex_triton()
    theirs = table.grad.clone()
    phase("flex_triton compiled and run")
    return ((ours - theirs).norm() / theirs.norm()).item()


if __name__ == "__main__":
    main()
