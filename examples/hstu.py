"""HSTU (generative recommendation), as in the paper's Listing 1: context rows see the
context and the history, history rows are causal, and target rows see the context and history
plus their own group of ``group_size`` targets causally (K = 2 for the target region).

    python examples/hstu.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import compilemask as cm
from compilemask.showcase import run_example


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


def main(seqlen: int = 512, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""
    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code)


if __name__ == "__main__":
    main()
