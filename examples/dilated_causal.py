"""Dilated causal attention: causal, every STRIDE-th key only. ``(i - j) % STRIDE == 0``
is not an interval in j, so the region keeps a predicate: the interval [0, i] over-approximates
it for tile classification (no tile is ever full) and partial tiles evaluate the residual
predicate element by element. ``explain()`` says so (FALLBACK ... because ...).

    python examples/dilated_causal.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import compilemask as cm
from compilemask.showcase import run_example

STRIDE = 2


SPEC = cm.MaskSpec(f"dilated_causal_{STRIDE}", params=[], regions=[
    cm.Region("all", when=lambda i: True,
              visible=lambda i, j: j <= i and (i - j) % STRIDE == 0),
])


def main(seqlen: int = 384, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""
    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code)


if __name__ == "__main__":
    main()
