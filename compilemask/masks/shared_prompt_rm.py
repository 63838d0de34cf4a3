"""Shared-prompt reward model: one prompt and six responses packed after it; every response
sees the prompt and itself causally, never the other responses (K = 2).

    python -m compilemask.masks.shared_prompt_rm
"""

from __future__ import annotations

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._cuts import jitter, sorted_cuts
from compilemask.masks._registry import Recipes, register, show

__all__ = ["shared_prompt_rm", "ENDS", "random_meta", "flex_mask_mod", "bench_meta", "main"]

ENDS = ["prompt_end", "r1_end", "r2_end", "r3_end", "r4_end", "r5_end", "r6_end"]


def _prompt_and_own(i, j, start):
    """A response row sees the shared prompt and its own response causally."""
    return j < prompt_end or start <= j <= i  # noqa: F821


def shared_prompt_rm() -> MaskSpec:
    """Reward model over one prompt and six responses packed after it."""
    # noqa: F821 below: the metadata names are runtime params
    spec = MaskSpec("shared_prompt_rm", params=ENDS, regions=[
        Region("prompt", when=lambda i: i < prompt_end, visible=lambda i, j: j <= i),  # noqa: F821
        Region("response1", when=lambda i: prompt_end <= i < r1_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, prompt_end)),  # noqa: F821
        Region("response2", when=lambda i: r1_end <= i < r2_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r1_end)),  # noqa: F821
        Region("response3", when=lambda i: r2_end <= i < r3_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r2_end)),  # noqa: F821
        Region("response4", when=lambda i: r3_end <= i < r4_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r3_end)),  # noqa: F821
        Region("response5", when=lambda i: r4_end <= i < r5_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r4_end)),  # noqa: F821
        Region("response6", when=lambda i: r5_end <= i < r6_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r5_end)),  # noqa: F821
    ])
    return register(spec, Recipes(__name__, random_meta, flex_mask_mod, bench_meta))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """Segment ends with degenerate cases: empty responses, ends past the end of the sequence."""
    gen = gen or torch.Generator().manual_seed(0)
    c = sorted_cuts(gen, batch_size, 7, seqlen + seqlen // 4 + 1)
    return {k: c[:, n] for n, k in enumerate(ENDS)}


def bench_meta(batch: int, seqlen: int, seed: int = 0) -> dict:
    """At scale: a prompt of about S / 4, six responses of about S / 8 each, jittered;
    the last one ends at the end of the sequence."""
    g = torch.Generator().manual_seed(seed)
    ends = [jitter(g, batch, seqlen, 0.25, 0.05)]
    for r in range(1, 7):
        ends.append(torch.maximum(jitter(g, batch, seqlen, 0.25 + 0.75 * r / 6, 0.02), ends[-1]))
    ends[-1] = torch.full((batch,), seqlen)
    return {k: v.to(torch.int32) for k, v in zip(ENDS, ends)}


def flex_mask_mod(meta: dict, seqlen: int | None = None):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    ends = [meta[k] for k in ENDS]

    # no torch.where and no 2-D metadata: FlexAttention's FLASH backend (CuTe) translates
    # only elementwise comparisons and &/| of 1-D per-batch loads
    def rm(b, h, q_idx, kv_idx):
        e = [t[b] for t in ends]
        prompt = e[0]
        in_prompt = (q_idx < prompt) & (kv_idx <= q_idx)
        # kv_idx is in q_idx's response iff no response end lies in (kv_idx, q_idx]
        same = kv_idx >= prompt
        for r in range(1, 6):
            same = same & ((kv_idx >= e[r]) | (e[r] > q_idx))
        resp = (q_idx >= prompt) & (q_idx < e[6]) & (
            (kv_idx < prompt) | (same & (kv_idx <= q_idx)))
        return in_prompt | resp
    return rm


def main(seqlen: int = 256, batch: int = 1, seed: int = 0):
    return show(shared_prompt_rm(), seqlen, batch, seed)


if __name__ == "__main__":
    main()
