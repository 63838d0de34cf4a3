"""Speculative-decoding tree verification of any depth, with an ancestor table: a causal
prefix, then draft tokens forming a tree; each draft token sees the whole prefix, its ancestors
among the drafts and itself.

``tree_start`` (per sequence) is the first draft position; ``anc`` is a table param, ``[B, S,
M]``: ``anc[i, t]`` is set where draft ``t`` (position ``tree_start + t``) is row ``i``'s
ancestor or itself (JetSpec's ancestor matrix, one row per token). The prefix is an exact
interval (full tiles); the drafts' keys are a predicate over the table. ``tree_verify`` says the
same for trees of bounded depth as exact intervals; this one takes any tree.

    python -m compilemask.masks.draft_tree
"""

from __future__ import annotations

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["draft_tree", "draft_tree_meta", "random_meta", "bench_meta", "flex_mask_mod", "main"]


def draft_tree() -> MaskSpec:
    """A causal prefix of ``tree_start`` tokens, then drafts whose keys ``anc`` names."""
    spec = MaskSpec("draft_tree", params=["tree_start", "anc"], regions=[
        Region("prefix", when=lambda i: i < tree_start, visible=lambda i, j: j <= i),  # noqa: F821
        Region("draft", when=lambda i: i >= tree_start,  # noqa: F821
               # the drafts' keys are at most the row (ancestors come first): tiles past the
               # diagonal stay empty, the table is read between tree_start and the row
               visible=lambda i, j: (j < tree_start) | ((j >= tree_start) & (j <= i)  # noqa: F821
                                                         & anc[i, j - tree_start])),  # noqa: F821
    ])
    return register(spec, Recipes(__name__, random_meta, flex_mask_mod, bench_meta))


def draft_tree_meta(prefix_len: int, parents, seqlen: int) -> dict:
    """One sequence's metadata: ``parents[t]`` is draft t's parent among the drafts (-1: a child
    of the last prefix token), drafts at positions ``prefix_len + t``; the table has a column
    per draft."""
    parents = [int(p) for p in parents]
    n = len(parents)
    if prefix_len + n > seqlen:
        raise ValueError(f"draft_tree_meta: {prefix_len} prefix tokens and {n} drafts exceed "
                         f"seqlen {seqlen}")
    anc = torch.zeros(1, seqlen, max(n, 1), dtype=torch.bool)
    for t, p in enumerate(parents):
        if p >= t:
            raise ValueError(f"draft_tree_meta: draft {t}'s parent {p} does not come before it")
        row = prefix_len + t
        anc[0, row, t] = True
        while p >= 0:
            anc[0, row, p] = True
            p = parents[p]
    return {"tree_start": torch.tensor([prefix_len]), "anc": anc}


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None) -> dict:
    """Prefixes of 0 to the whole sequence, then random trees over the rest (a draft's parent
    any earlier draft, or the prefix)."""
    gen = gen or torch.Generator().manual_seed(0)
    parts = []
    for _ in range(batch_size):
        prefix = int(torch.randint(0, seqlen + 1, (1,), generator=gen))
        parents = [int(torch.randint(-1, t, (1,), generator=gen)) if t else -1
                   for t in range(seqlen - prefix)]
        parts.append(draft_tree_meta(prefix, parents, seqlen))
    M = max(p["anc"].shape[-1] for p in parts)
    anc = torch.cat([torch.nn.functional.pad(p["anc"], (0, M - p["anc"].shape[-1]))
                     for p in parts])
    return {"tree_start": torch.cat([p["tree_start"] for p in parts]), "anc": anc}


def bench_meta(batch: int, seqlen: int, seed: int = 0, drafts: int = 256) -> dict:
    """EAGLE-style verification: a long prefix, then ``drafts`` tokens in a random tree (each
    draft's parent any earlier draft, or the prefix)."""
    gen = torch.Generator().manual_seed(seed)
    n = min(drafts, seqlen)
    parts = [draft_tree_meta(seqlen - n, [int(torch.randint(-1, t, (1,), generator=gen)) if t
                                          else -1 for t in range(n)], seqlen)
             for _ in range(batch)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def flex_mask_mod(meta: dict, seqlen: int | None = None):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    start, anc = meta["tree_start"], meta["anc"]
    M = anc.shape[-1]

    def draft_tree(b, h, q_idx, kv_idx):
        t = kv_idx - start[b]
        drafted = (t >= 0) & (t < M) & anc[b, q_idx, t.clamp(0, M - 1)]
        return torch.where(q_idx < start[b], kv_idx <= q_idx, (kv_idx < start[b]) | drafted)
    return draft_tree


def main(seqlen: int = 48, batch: int = 1, seed: int = 0):
    return show(draft_tree(), seqlen, batch, seed)


if __name__ == "__main__":
    main()
