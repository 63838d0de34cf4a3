"""HSTU (generative recommendation), as in the paper's Listing 1: context rows see the
context and the history, history rows are causal, and target rows see the context and history
plus their own group of ``group_size`` targets causally (K = 2 for the target region).

    python examples/hstu.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import pathlib

import torch

import compilemask as cm
from compilemask.masks import random_meta


def when_context(i):
    return i < ctx_end  # noqa: F821 (ctx_end, hist_end, seq_end, group_size: runtime params)


def context_sees(i, j):
    return j < hist_end  # noqa: F821


def when_history(i):
    return ctx_end <= i < hist_end  # noqa: F821


def history_sees(i, j):
    return j <= i


def when_target(i):
    return hist_end <= i < seq_end  # noqa: F821


def target_sees(i, j):
    group_start = hist_end + (i - hist_end) // group_size * group_size  # noqa: F821
    return j < hist_end or group_start <= j <= i  # noqa: F821


SPEC = cm.MaskSpec("hstu", params=["ctx_end", "hist_end", "seq_end", "group_size"], regions=[
    cm.Region("context", when=when_context, visible=context_sees),
    cm.Region("history", when=when_history, visible=history_sees),
    cm.Region("target", when=when_target, visible=target_sees),
])


def main(seqlen: int = 512, batch: int = 2, seed: int = 0, out_dir=None,
         show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""
    mask = cm.compile_mask(SPEC)
    print(mask.explain(show_code=show_code))
    meta = random_meta(SPEC, batch, seqlen, torch.Generator().manual_seed(seed))
    desc = mask.preprocess(meta, seqlen_q=seqlen, seqlen_k=seqlen, batch_size=batch,
                           fwd_tiles=(64, 64), check=True)
    ref = mask.reference_mask(meta, seqlen_q=seqlen, seqlen_k=seqlen, batch_size=batch)
    if not torch.equal(desc.dense_mask(), ref):
        raise SystemExit(f"{SPEC.name}: descriptor mask != reference mask of the Python rules")
    print(f"\ndescriptor mask == reference mask of the Python rules ({batch} x {seqlen}^2): OK")
    if meta:
        print("metadata of sequence 0:",
              {k: (v[0].tolist() if v.dim() == 1 else "per-row array") for k, v in meta.items()})
    out = pathlib.Path(out_dir) if out_dir else pathlib.Path(__file__).resolve().parent / "out"
    path = cm.visualize(desc, batch=0, path=str(out / "hstu.png"))
    print(desc.to_string(batch=0))
    print(f"picture: {path}")
    return desc


if __name__ == "__main__":
    main()
