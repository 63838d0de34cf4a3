"""Dilated causal attention: causal, every STRIDE-th key only. ``(i - j) % STRIDE == 0``
is not an interval in j, so the region keeps a predicate: the interval [0, i] over-approximates
it for tile classification (no tile is ever full) and partial tiles evaluate the residual
predicate element by element. ``explain()`` says so (FALLBACK ... because ...).

    python examples/dilated_causal.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import pathlib

import torch

import compilemask as cm
from compilemask.masks import random_meta

STRIDE = 2


SPEC = cm.MaskSpec(f"dilated_causal_{STRIDE}", params=[], regions=[
    cm.Region("all", when=lambda i: True,
              visible=lambda i, j: j <= i and (i - j) % STRIDE == 0),
])


def main(seqlen: int = 384, batch: int = 2, seed: int = 0, out_dir=None,
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
    path = cm.visualize(desc, batch=0, path=str(out / "dilated_causal.png"))
    print(desc.to_string(batch=0))
    print(f"picture: {path}")
    return desc


if __name__ == "__main__":
    main()
