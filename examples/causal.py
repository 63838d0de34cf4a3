"""Causal attention: every row sees itself and the keys before it (K = 1).

The mask, its metadata recipe and its FlexAttention equivalent are in
``compilemask/masks/causal.py``.

    python examples/causal.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

from compilemask.masks import causal
from compilemask.showcase import run_example

SPEC = causal()


def main(seqlen: int = 512, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""
    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code)


if __name__ == "__main__":
    main()
