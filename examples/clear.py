"""CLEAR-style multimodal mask: text tokens see the text and the image, image tokens (a grid
of ``img_rows`` x WIDTH after the text) see the text and a square window of RADIUS around
themselves; K = 2R + 2 (the text interval + one interval per image row of the window).

The mask, its metadata recipe and its FlexAttention equivalent are in
``compilemask/masks/clear.py``.

    python examples/clear.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

from compilemask.masks import clear
from compilemask.masks.clear import explain_k
from compilemask.showcase import run_example

RADIUS = 1  # compile-time constants of the mask
WIDTH = 8

SPEC = clear(RADIUS, WIDTH)


def main(seqlen: int = 384, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, say why K = 2R + 2, preprocess random metadata, check the
    descriptor's mask against the brute-force mask of the Python rules, save the picture, print
    the tiles."""
    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code, before=lambda mask: explain_k(mask, RADIUS, WIDTH))


if __name__ == "__main__":
    main()
