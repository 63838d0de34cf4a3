"""Train steps of ALiBi + causal in interleaved rounds (one length, 128K tokens per batch, H=8,
D=128, bf16): ``cm.attention`` on the native engine (FA4's causal kernel); the same with a zero
LSE gradient passed (FA4's dlse path); the fa4 engine (FA4's block-sparse kernels, as Flex-FA4
runs them; its default mask_mod, the causal rules); Flex-FA4 with the same score_mod. Each
method's median over 6 rounds, every round timing the methods one after another (clock drift
then spreads over all of them).

    python bench/alibi_train.py [S]
"""
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.append(str(Path(__file__).resolve().parents[1]))
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask import masks
from compilemask.dsl import score_mods  # noqa: E402
from compilemask.pipeline.pipeline import with_lists  # noqa: E402

S = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
B, H, D, dev = max(1, 131072 // S), 8, 128, "cuda"
g = torch.Generator(device=dev).manual_seed(S)
q, k, v, do = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, generator=g)
               for _ in range(4))
smod = score_mods.alibi(score_mods.alibi_slopes(H).to(dev))
mask = cm.compile_mask(masks.causal())
desc = mask.preprocessor(S, batch_size=B)({})
desc_lists = with_lists(desc)  # a native mask's descriptor has no tile lists of its own
bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, B, None, S, S, device=dev)
fx = torch.compile(flex_attention, dynamic=False)
qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))


def leaf(*ts):
    return [t.detach().requires_grad_() for t in ts]


def ours():
    a, b, c = leaf(q, k, v)
    cm.attention(a, b, c, desc, backend="native", score_mod=smod).backward(do)


def ours_zero_dlse():
    a, b, c = leaf(q, k, v)
    o, lse = cm.attention(a, b, c, desc, backend="native", score_mod=smod, return_lse=True)
    torch.autograd.backward([o, lse], [do, torch.zeros_like(lse)])


def ours_fa4(options=None, d=desc_lists):
    a, b, c = leaf(q, k, v)
    cm.attention(a, b, c, d, backend="fa4", score_mod=smod, options=options).backward(do)


def flex():
    a, b, c = leaf(qt, kt, vt)
    fx(a, b, c, block_mask=bm, score_mod=smod, kernel_options={"BACKEND": "FLASH"}).backward(dot)


fns = {"ours": ours, "ours_zero_dlse": ours_zero_dlse, "ours_fa4": ours_fa4,
       "ours_fa4_rules": lambda: ours_fa4(cm.KernelOptions(mask_mod="rules")),
       "flex": flex}
res = {n: [] for n in fns}
for n, f in list(fns.items()):
    try:
        f()
    except Exception as e:
        print(n, "failed:", type(e).__name__, str(e)[:300], flush=True)
        del fns[n]
torch.cuda.synchronize()
for r in range(6):
    for n, f in fns.items():
        res[n].append(triton.testing.do_bench(f, warmup=75, rep=300, return_mode="median"))
    print("round", r, " ".join(f"{n} {res[n][-1]:.3f}" for n in fns), flush=True)
for n in fns:
    print(f"{n:16s} median {statistics.median(res[n]):.3f} "
          f"vs flex {statistics.median(res['flex']) / statistics.median(res[n]):.4f}x")
