"""Why a trained ALiBi slope's error depends on the draw (CPU, float64 arithmetic): the slope's
gradient ``sum(dS * (kv_idx - q_idx))`` weighs each score by its distance, while a row's
``dS = P * (dP - D)`` sums to zero only when ``D = rowsum(dO * O)`` uses the exact output. A
flash-attention backward (FA4, Flex-Triton) forms ``D`` from the stored bf16 output, so each
row's ``dS`` is off by ``P * dO.(O - bf16(O))``, which the distance then amplifies.

Per seed, the slopes' gradient relative to the exact one (q, k, v, dO drawn in bf16; the test's
shapes: B=2, H=4, Hkv=2, S=1000, D=128, causal):

* ``flash``: exact arithmetic but for ``D`` from the bf16 output (the error no kernel of this
  design avoids);
* ``torch_bf16``: PyTorch's own bf16 computation, as ``tests/test_score_table_grads.py`` forms
  it (the bound is twice this);
* ``ratio``: flash / torch_bf16.

Seed 0 is the draw of ``test_gpu_table_gradients_vs_float32_reference``.

    python bench/table_grad_precision.py [FIRST_SEED] [SEEDS]
"""
import sys

import torch

from compilemask.dsl import score_mods

B, H, HKV, S, D = 2, 4, 2, 1000, 128


def slope_grads(q, k, v, do) -> dict:
    slopes = score_mods.alibi_slopes(H)
    i, j = torch.arange(S).view(S, 1), torch.arange(S).view(1, S)
    dist, causal = (j - i).double(), j <= i
    kr, vr = (t.repeat_interleave(H // HKV, dim=2).transpose(1, 2) for t in (k, v))
    qd, kd, vd, dod = (t.double() for t in (q.transpose(1, 2), kr, vr, do.transpose(1, 2)))
    s = qd @ kd.transpose(-1, -2) * D**-0.5 + slopes.double().view(1, H, 1, 1) * dist
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    o = p @ vd
    dp = dod @ vd.transpose(-1, -2)
    out = {}
    for name, o_used in (("exact", o), ("flash", o.to(torch.bfloat16).double())):
        ds = p * (dp - (dod * o_used).sum(-1, keepdim=True))
        out[name] = (ds * dist).sum((0, 2, 3))
    leaf = slopes.float().requires_grad_()
    s = torch.matmul(q.transpose(1, 2), kr.transpose(-1, -2)) * D**-0.5
    s = (s + leaf.view(1, H, 1, 1) * (j - i)).to(torch.bfloat16).masked_fill(~causal,
                                                                            float("-inf"))
    torch.matmul(torch.softmax(s, dim=-1), vr).transpose(1, 2).backward(do)
    out["torch_bf16"] = leaf.grad.double()
    return out


def main():
    first = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    print("| seed | flash | torch_bf16 | ratio |\n|---|---|---|---|")
    for seed in range(first, first + seeds):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(B, S, H, D, generator=g).bfloat16()
        k, v = (torch.randn(B, S, HKV, D, generator=g).bfloat16() for _ in range(2))
        do = torch.randn(B, S, H, D, generator=g).bfloat16()
        r = slope_grads(q, k, v, do)
        err = {n: ((r[n] - r["exact"]).norm() / r["exact"].norm()).item()
               for n in ("flash", "torch_bf16")}
        print(f"| {seed} | {err['flash']:.2e} | {err['torch_bf16']:.2e} | "
              f"{err['flash'] / err['torch_bf16']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
