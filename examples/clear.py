"""CLEAR-style multimodal mask: text tokens [0, text_end) see the text and the image;
image tokens (a grid of ``img_rows`` x WIDTH after the text) see the text and a square window
of RADIUS around themselves on the grid.

Written naturally with ``(j - text_end) // WIDTH`` and ``% WIDTH``: the compiler bounds the
quotient ``row_j`` to the 2R+1 values row_i - R .. row_i + R and enumerates them, one interval
per image row of the window, so K = 2R + 2 (the text interval + 2R+1 window rows).

    python examples/clear.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import compilemask as cm
from compilemask.showcase import run_example

RADIUS = 1  # compile-time constants: plain ints bound in the module
WIDTH = 8


def when_text(i):
    return i < text_end  # noqa: F821 (text_end, img_rows: runtime params)


def text_sees(i, j):
    return j < text_end + img_rows * WIDTH  # noqa: F821


def when_image(i):
    return text_end <= i < text_end + img_rows * WIDTH  # noqa: F821


def image_sees(i, j):
    in_image = text_end <= j < text_end + img_rows * WIDTH  # noqa: F821
    row_i, col_i = (i - text_end) // WIDTH, (i - text_end) % WIDTH  # noqa: F821
    row_j, col_j = (j - text_end) // WIDTH, (j - text_end) % WIDTH  # noqa: F821
    near = abs(row_j - row_i) <= RADIUS and abs(col_j - col_i) <= RADIUS
    return j < text_end or (in_image and near)  # noqa: F821


SPEC = cm.MaskSpec(f"clear_r{RADIUS}_w{WIDTH}", params=["text_end", "img_rows"], regions=[
    cm.Region("text", when=when_text, visible=text_sees),
    cm.Region("image", when=when_image, visible=image_sees),
])


def main(seqlen: int = 384, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""

    def explain_k(mask):
        R = RADIUS
        print(f"\nK = {mask.num_intervals} = 2R + 2 with R = {R}: the image region sees 1 "
              f"interval of text keys [0, text_end) plus one interval per image row of its "
              f"window; the rule bounds the quotient row_j = (j - text_end) // {WIDTH} to "
              f"row_i - {R} .. row_i + {R}, 2R + 1 = {2 * R + 1} values, and the compiler "
              f"enumerates them (on each of those rows, the columns col_i - {R} .. col_i + {R} "
              f"clipped to the grid are one interval).")
        if mask.num_intervals != 2 * R + 2:
            raise SystemExit(f"expected K = 2R + 2 = {2 * R + 2}, got {mask.num_intervals}")

    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code, before=explain_k)


if __name__ == "__main__":
    main()
