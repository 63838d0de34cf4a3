"""Prefix-LM: a bidirectional prefix of ``prefix_len`` keys, causal after it (K = 1:
the union [0, prefix_len) | [0, i] is proved to be one interval).

    python examples/prefix_lm.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import compilemask as cm
from compilemask.showcase import run_example


def sees(i, j):
    return j < prefix_len or j <= i  # noqa: F821 (prefix_len is a runtime param)


SPEC = cm.MaskSpec("prefix_lm", params=["prefix_len"], regions=[
    cm.Region("all", when=lambda i: True, visible=sees),
])


def main(seqlen: int = 512, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""
    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code)


if __name__ == "__main__":
    main()
