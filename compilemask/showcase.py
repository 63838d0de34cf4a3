"""What every example's ``main()`` does, in one place: compile and explain a spec, preprocess
random metadata, check the descriptor against the brute-force mask, save the picture."""

from __future__ import annotations

import pathlib

import torch

from compilemask.compiled import compile_mask
from compilemask.masks import random_meta

__all__ = ["run_example"]


def run_example(spec, script: str, *, seqlen: int = 512, batch: int = 2, seed: int = 0,
                out_dir=None, show_code: bool = True, before=None):
    """Run one example; ``script`` is the example's ``__file__`` (names the picture and its
    default folder ``examples/out``); ``before(mask)`` prints or checks more after explain."""
    from compilemask import visualize

    mask = compile_mask(spec)
    print(mask.explain(show_code=show_code))
    if before is not None:
        before(mask)
    meta = random_meta(spec, batch, seqlen, torch.Generator().manual_seed(seed))
    desc = mask.preprocess(meta, seqlen_q=seqlen, seqlen_k=seqlen, batch_size=batch,
                           fwd_tiles=(64, 64), check=True)
    ref = mask.reference_mask(meta, seqlen_q=seqlen, seqlen_k=seqlen, batch_size=batch)
    if not torch.equal(desc.dense_mask(), ref):
        raise SystemExit(f"{spec.name}: descriptor mask != reference mask of the Python rules")
    print(f"\ndescriptor mask == reference mask of the Python rules ({batch} x {seqlen}^2): OK")
    if meta:
        print("metadata of sequence 0:",
              {k: (v[0].tolist() if v.dim() == 1 else "per-row array") for k, v in meta.items()})
    script = pathlib.Path(script).resolve()
    out = pathlib.Path(out_dir) if out_dir else script.parent / "out"
    path = visualize(desc, batch=0, path=str(out / f"{script.stem}.png"))
    print(desc.to_string(batch=0))
    print(f"picture: {path}")
    return desc
