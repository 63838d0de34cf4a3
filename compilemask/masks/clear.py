"""CLEAR-style multimodal mask: text tokens [0, text_end) see the text and the image; image
tokens (a grid of ``img_rows`` x ``width`` after the text) see the text and a square window of
``radius`` around themselves on the grid.

Written naturally with ``(j - text_end) // width`` and ``% width``: the compiler bounds the
quotient ``row_j`` to the 2R+1 values row_i - R .. row_i + R and enumerates them, one interval
per image row of the window, so K = 2R + 2 (the text interval + 2R+1 window rows).

    python -m compilemask.masks.clear
"""

from __future__ import annotations

import functools

import torch

from compilemask.dsl import MaskSpec, Region
from compilemask.masks._registry import Recipes, register, show

__all__ = ["clear", "random_meta", "flex_mask_mod", "bench_meta", "explain_k", "main"]


def clear(radius: int = 1, width: int = 16) -> MaskSpec:
    """CLEAR-style multimodal mask: text tokens [0, text_end) see everything; image tokens
    (a grid of ``img_rows`` x ``width`` after the text) see the text and a square window of
    ``radius`` around themselves on the grid."""

    def when_text(i):
        return i < text_end  # noqa: F821

    def text_sees(i, j):
        return j < text_end + img_rows * width  # noqa: F821

    def when_image(i):
        return text_end <= i < text_end + img_rows * width  # noqa: F821

    def image_sees(i, j):
        in_image = text_end <= j < text_end + img_rows * width  # noqa: F821
        row_i, col_i = (i - text_end) // width, (i - text_end) % width  # noqa: F821
        row_j, col_j = (j - text_end) // width, (j - text_end) % width  # noqa: F821
        near = abs(row_j - row_i) <= radius and abs(col_j - col_i) <= radius
        return j < text_end or (in_image and near)  # noqa: F821

    spec = MaskSpec(f"clear_r{radius}_w{width}", params=["text_end", "img_rows"], regions=[
        Region("text", when=when_text, visible=text_sees),
        Region("image", when=when_image, visible=image_sees),
    ])
    return register(spec, Recipes(
        __name__, functools.partial(random_meta, width=width),
        functools.partial(flex_mask_mod, radius=radius, width=width),
        functools.partial(bench_meta, width=width)))


def random_meta(batch_size: int, seqlen: int, gen: torch.Generator | None = None,
                width: int = 16) -> dict:
    """Text of up to half the sequence and a grid of rows that may run past its end."""
    gen = gen or torch.Generator().manual_seed(0)
    text = torch.randint(0, seqlen // 2 + 1, (batch_size,), generator=gen)
    rows = torch.randint(0, seqlen // width + 2, (batch_size,), generator=gen)
    return {"text_end": text, "img_rows": rows}


def bench_meta(batch: int, seqlen: int, seed: int = 0, width: int = 64) -> dict:
    """At scale: the image grid fills 15/16 of the sequence, the text before it, jittered."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((batch,), max(1, (seqlen * 15 // 16) // width))
    text = torch.clamp(seqlen - rows * width - torch.randint(0, 16, (batch,), generator=g), min=0)
    return {"text_end": text.to(torch.int32), "img_rows": rows.to(torch.int32)}


def flex_mask_mod(meta: dict, seqlen: int | None = None, radius: int = 1, width: int = 16):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""
    text, rows = meta["text_end"], meta["img_rows"]
    W, R = width, radius

    def clear(b, h, q_idx, kv_idx):
        t = text[b]
        end = t + rows[b] * W
        text_row = (q_idx < t) & (kv_idx < end)
        qi, kj = q_idx - t, kv_idx - t
        near = ((kj // W - qi // W).abs() <= R) & ((kj % W - qi % W).abs() <= R)
        image_row = (q_idx >= t) & (q_idx < end) & (
            (kv_idx < t) | ((kv_idx >= t) & (kv_idx < end) & near))
        return text_row | image_row
    return clear


def explain_k(mask, radius: int, width: int) -> None:
    """Say why K = 2R + 2 (exits if the compiler found another K)."""
    R = radius
    print(f"\nK = {mask.num_intervals} = 2R + 2 with R = {R}: the image region sees 1 "
          f"interval of text keys [0, text_end) plus one interval per image row of its "
          f"window; the rule bounds the quotient row_j = (j - text_end) // {width} to "
          f"row_i - {R} .. row_i + {R}, 2R + 1 = {2 * R + 1} values, and the compiler "
          f"enumerates them (on each of those rows, the columns col_i - {R} .. col_i + {R} "
          f"clipped to the grid are one interval).")
    if mask.num_intervals != 2 * R + 2:
        raise SystemExit(f"expected K = 2R + 2 = {2 * R + 2}, got {mask.num_intervals}")


def main(seqlen: int = 256, batch: int = 1, seed: int = 0, radius: int = 1, width: int = 8):
    return show(clear(radius, width), seqlen, batch, seed,
                before=lambda mask: explain_k(mask, radius, width))


if __name__ == "__main__":
    main()
