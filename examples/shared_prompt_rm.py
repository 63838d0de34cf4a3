"""Shared-prompt reward model: one prompt and six responses packed after it; every
response sees the prompt and itself causally, never the other responses (K = 2).

    python examples/shared_prompt_rm.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import compilemask as cm
from compilemask.showcase import run_example

ENDS = ["prompt_end", "r1_end", "r2_end", "r3_end", "r4_end", "r5_end", "r6_end"]


def prompt_and_own(i, j, start):
    """A response row sees the shared prompt and its own response causally."""
    return j < prompt_end or start <= j <= i  # noqa: F821 (prompt_end is a runtime param)


# noqa: F821 below: the segment ends are runtime params
SPEC = cm.MaskSpec("shared_prompt_rm", params=ENDS, regions=[
    cm.Region("prompt", when=lambda i: i < prompt_end, visible=lambda i, j: j <= i),  # noqa: F821
    cm.Region("response1", when=lambda i: prompt_end <= i < r1_end,  # noqa: F821
              visible=lambda i, j: prompt_and_own(i, j, prompt_end)),  # noqa: F821
    cm.Region("response2", when=lambda i: r1_end <= i < r2_end,  # noqa: F821
              visible=lambda i, j: prompt_and_own(i, j, r1_end)),  # noqa: F821
    cm.Region("response3", when=lambda i: r2_end <= i < r3_end,  # noqa: F821
              visible=lambda i, j: prompt_and_own(i, j, r2_end)),  # noqa: F821
    cm.Region("response4", when=lambda i: r3_end <= i < r4_end,  # noqa: F821
              visible=lambda i, j: prompt_and_own(i, j, r3_end)),  # noqa: F821
    cm.Region("response5", when=lambda i: r4_end <= i < r5_end,  # noqa: F821
              visible=lambda i, j: prompt_and_own(i, j, r4_end)),  # noqa: F821
    cm.Region("response6", when=lambda i: r5_end <= i < r6_end,  # noqa: F821
              visible=lambda i, j: prompt_and_own(i, j, r5_end)),  # noqa: F821
])


def main(seqlen: int = 512, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""
    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code)


if __name__ == "__main__":
    main()
