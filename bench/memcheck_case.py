"""A small end-to-end case for ``compute-sanitizer --tool memcheck`` (bench/h200.sh memcheck):
the TileLang preprocess, the CuTe forward and the backward, for an interval mask with ragged
shapes (HSTU, S = 300: partial edge tiles) and a fallback mask (dilated causal, S = 200), GQA."""

from __future__ import annotations

import torch

import compilemask as cm
from compilemask.masks import EXAMPLES, random_meta


def main():
    torch.manual_seed(0)
    for name, B, S in (("hstu", 2, 300), ("dilated_causal", 1, 200)):
        mask = cm.compile_mask(EXAMPLES[name]())
        meta = {k: v.cuda().contiguous() for k, v in
                random_meta(mask.spec, B, S, torch.Generator().manual_seed(1)).items()}
        desc = mask.preprocessor(S, batch_size=B)(meta)
        q = torch.randn(B, S, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, S, 2, 64, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        out = cm.attention(q, k, v, desc)
        out.float().square().sum().backward()
        torch.cuda.synchronize()
        ok = all(bool(torch.isfinite(t).all()) for t in (out, q.grad, k.grad, v.grad))
        print(f"memcheck case {name}: B={B} S={S} finite={ok}", flush=True)
        assert ok


if __name__ == "__main__":
    main()
