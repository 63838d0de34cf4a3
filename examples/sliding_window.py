"""Sliding-window causal attention: row i sees keys (i - WINDOW, i] (K = 1).

    python examples/sliding_window.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import pathlib

import torch

import compilemask as cm
from compilemask.masks import random_meta

WINDOW = 96  # a compile-time constant: a plain int bound in the module


def sees(i, j):
    return i - WINDOW < j <= i


SPEC = cm.MaskSpec(f"sliding_window_{WINDOW}", params=[], regions=[
    cm.Region("all", when=lambda i: True, visible=sees),
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
    path = cm.visualize(desc, batch=0, path=str(out / "sliding_window.png"))
    print(desc.to_string(batch=0))
    print(f"picture: {path}")
    return desc


if __name__ == "__main__":
    main()
