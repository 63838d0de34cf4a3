"""Speculative-decoding tree verification: a causal prefix, then draft tokens forming a tree;
each draft token sees the whole prefix, its ancestors in the tree and itself.

``tree_start`` (per sequence) is the first draft position; ``anc_0 .. anc_{depth-1}`` (per
row) are the positions of a draft token's ancestors below the prefix (the row itself where
there are fewer: metadata is non-negative, and that slot adds nothing), read only for draft
rows. ``tree_meta(prefix_len, parents, seqlen, depth)`` builds them from a parent list (EAGLE's
draft trees); up to ``depth + 2`` intervals per row, all exact.

    python -m compilemask.masks.tree_verify
"""

from __future__ import annotations

import linecache

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["tree_verify", "tree_meta", "random_meta", "bench_meta", "flex_mask_mod", "main"]


def tree_verify(depth: int = 4) -> MaskSpec:
    """A causal prefix of ``tree_start`` tokens and a draft tree of at most ``depth`` levels
    after it (the root's children are level 1)."""
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 16:
        raise ValueError(f"tree_verify: depth must be an int in [1, 16], got {depth!r}")
    names = [f"anc_{d}" for d in range(depth)]
    # one clause per level, as source the front end reads (registered in linecache)
    clauses = " or ".join(f"j == {n}[i]" for n in names)
    src = f"def sees(i, j):\n    return j < tree_start or j == i or {clauses}\n"
    fname = f"<compilemask.masks.tree_verify depth={depth}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    env: dict = {}
    exec(compile(src, fname, "exec"), env)  # noqa: S102
    spec = MaskSpec(f"tree_verify_{depth}", params=["tree_start", *names], regions=[
        Region("prefix", when=lambda i: i < tree_start, visible=lambda i, j: j <= i),  # noqa: F821
        Region("draft", when=lambda i: i >= tree_start, visible=env["sees"]),  # noqa: F821
    ])
    return register(spec, Recipes(__name__, lambda b, s, g=None: random_meta(b, s, g, depth),
                                  lambda meta, seqlen=None: flex_mask_mod(meta, depth),
                                  lambda b, s, seed=0: bench_meta(b, s, seed, depth)))


def tree_meta(prefix_len: int, parents, seqlen: int, depth: int) -> dict:
    """One sequence's metadata: ``parents[t]`` is draft token t's parent among the drafts (-1:
    a child of the last prefix token), drafts at positions ``prefix_len + t``; positions past
    the drafts (up to ``seqlen``) are more drafts' room and see like roots."""
    parents = [int(p) for p in parents]
    anc = torch.arange(seqlen, dtype=torch.int64).repeat(depth, 1)  # no ancestor: itself
    for t in range(len(parents)):
        chain, p = [], parents[t]
        while p >= 0:
            if p >= t:
                raise ValueError(f"tree_meta: draft {t}'s parent {p} does not come before it")
            chain.append(prefix_len + p)
            p = parents[p]
        if len(chain) > depth:
            raise ValueError(f"tree_meta: draft {t} has {len(chain)} ancestors, depth is {depth}")
        for d, pos in enumerate(chain):
            anc[d, prefix_len + t] = pos
    meta = {"tree_start": torch.tensor([prefix_len])}
    meta.update({f"anc_{d}": anc[d].view(1, seqlen) for d in range(depth)})
    return meta


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None,
                depth: int = 4) -> dict:
    """Prefixes of 0 to the whole sequence, random trees of at most ``depth`` levels after."""
    gen = gen or torch.Generator().manual_seed(0)
    parts = []
    for _ in range(batch_size):
        prefix = int(torch.randint(0, seqlen + 1, (1,), generator=gen))
        parents, level = [], []
        for t in range(seqlen - prefix):
            p = int(torch.randint(-1, t, (1,), generator=gen)) if t else -1
            if p >= 0 and level[p] >= depth:
                p = -1
            parents.append(p)
            level.append(1 if p < 0 else level[p] + 1)
        parts.append(tree_meta(prefix, parents, seqlen, depth))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def bench_meta(batch: int, seqlen: int, seed: int = 0, depth: int = 4,
               drafts: int = 256) -> dict:
    """EAGLE-style verification: a long prefix, then ``drafts`` tokens in a tree of ``depth``
    levels (each draft's parent drawn among the earlier drafts of the level above)."""
    gen = torch.Generator().manual_seed(seed)
    n = min(drafts, seqlen)
    parts = []
    for _ in range(batch):
        parents, level = [], []
        for t in range(n):
            p = -1
            if t:
                cand = [u for u in range(t) if level[u] < depth]
                p = cand[int(torch.randint(0, len(cand), (1,), generator=gen))] if cand else -1
            parents.append(p)
            level.append(1 if p < 0 else level[p] + 1)
        parts.append(tree_meta(seqlen - n, parents, seqlen, depth))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def flex_mask_mod(meta: dict, depth: int = 4):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    start = meta["tree_start"]
    anc = [meta[f"anc_{d}"] for d in range(depth)]

    def tree_verify(b, h, q_idx, kv_idx):
        draft = q_idx >= start[b]
        seen = (kv_idx < start[b]) | (kv_idx == q_idx)
        for a in anc:
            seen = seen | (kv_idx == a[b, q_idx])
        return torch.where(draft, seen, kv_idx <= q_idx)
    return tree_verify


def main(seqlen: int = 48, batch: int = 1, seed: int = 0):
    return show(tree_verify(4), seqlen, batch, seed)


if __name__ == "__main__":
    main()
