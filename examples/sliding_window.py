"""Sliding-window causal attention: row i sees keys (i - WINDOW, i] (K = 1).

    python examples/sliding_window.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import compilemask as cm
from compilemask.showcase import run_example

WINDOW = 96  # a compile-time constant: a plain int bound in the module


def sees(i, j):
    return i - WINDOW < j <= i


SPEC = cm.MaskSpec(f"sliding_window_{WINDOW}", params=[], regions=[
    cm.Region("all", when=lambda i: True, visible=sees),
])


def main(seqlen: int = 512, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""
    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code)


if __name__ == "__main__":
    main()
