"""Mask factories with readable names: the paper's masks and the common ones.

Each returns a MaskSpec; ``random_meta(name, ...)`` draws metadata for it (tests, demos)."""

from __future__ import annotations

import torch

from compilemask.dsl import MaskSpec, Region

__all__ = [
    "causal",
    "sliding_window",
    "prefix_lm",
    "packed_documents",
    "hstu",
    "shared_prompt_rm",
    "clear",
    "dilated_causal",
    "random_meta",
    "EXAMPLES",
]


def causal() -> MaskSpec:
    """Every row sees itself and the keys before it."""
    return MaskSpec("causal", params=[], regions=[
        Region("all", when=lambda i: True, visible=lambda i, j: j <= i),
    ])


def sliding_window(window: int = 256) -> MaskSpec:
    """Causal within a window: row i sees keys (i - window, i]."""
    return MaskSpec(f"sliding_window_{window}", params=[], regions=[
        Region("all", when=lambda i: True, visible=lambda i, j: i - window < j <= i),
    ])


def prefix_lm() -> MaskSpec:
    """A bidirectional prefix of ``prefix_len`` keys, causal after it."""
    def sees(i, j):
        return j < prefix_len or j <= i  # noqa: F821 (a param)

    return MaskSpec("prefix_lm", params=["prefix_len"], regions=[
        Region("all", when=lambda i: True, visible=sees),
    ])


def packed_documents() -> MaskSpec:
    """Documents packed in one sequence, causal within each: ``doc_start[i]`` per row."""
    return MaskSpec("packed_documents", params=["doc_start"], regions=[
        Region("doc", when=lambda i: True,
               visible=lambda i, j: doc_start[i] <= j <= i),  # noqa: F821
    ])


def hstu() -> MaskSpec:
    """Generative recommendation (HSTU): context, causal history, and grouped targets that see
    the context and history plus their own group causally."""

    def when_context(i):
        return i < ctx_end  # noqa: F821

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

    return MaskSpec("hstu", params=["ctx_end", "hist_end", "seq_end", "group_size"], regions=[
        Region("context", when=when_context, visible=context_sees),
        Region("history", when=when_history, visible=history_sees),
        Region("target", when=when_target, visible=target_sees),
    ])


def _prompt_and_own(i, j, start):
    """A response row sees the shared prompt and its own response causally."""
    return j < prompt_end or start <= j <= i  # noqa: F821


def shared_prompt_rm() -> MaskSpec:
    """Reward model over one prompt and six responses packed after it."""
    p = ["prompt_end", "r1_end", "r2_end", "r3_end", "r4_end", "r5_end", "r6_end"]
    # noqa: F821 below: the metadata names are runtime params
    return MaskSpec("shared_prompt_rm", params=p, regions=[
        Region("prompt", when=lambda i: i < prompt_end, visible=lambda i, j: j <= i),  # noqa: F821
        Region("response1", when=lambda i: prompt_end <= i < r1_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, prompt_end)),  # noqa: F821
        Region("response2", when=lambda i: r1_end <= i < r2_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r1_end)),  # noqa: F821
        Region("response3", when=lambda i: r2_end <= i < r3_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r2_end)),  # noqa: F821
        Region("response4", when=lambda i: r3_end <= i < r4_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r3_end)),  # noqa: F821
        Region("response5", when=lambda i: r4_end <= i < r5_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r4_end)),  # noqa: F821
        Region("response6", when=lambda i: r5_end <= i < r6_end,  # noqa: F821
               visible=lambda i, j: _prompt_and_own(i, j, r5_end)),  # noqa: F821
    ])


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

    return MaskSpec(f"clear_r{radius}_w{width}", params=["text_end", "img_rows"], regions=[
        Region("text", when=when_text, visible=text_sees),
        Region("image", when=when_image, visible=image_sees),
    ])


def dilated_causal(stride: int = 2) -> MaskSpec:
    """Causal, every ``stride``-th key only: not an interval rule, so it keeps a predicate."""
    return MaskSpec(f"dilated_causal_{stride}", params=[], regions=[
        Region("all", when=lambda i: True,
               visible=lambda i, j: j <= i and (i - j) % stride == 0),
    ])


EXAMPLES = {
    "causal": causal,
    "sliding_window": lambda: sliding_window(7),
    "prefix_lm": prefix_lm,
    "packed_documents": packed_documents,
    "hstu": hstu,
    "shared_prompt_rm": shared_prompt_rm,
    "clear": lambda: clear(1, 8),
    "dilated_causal": dilated_causal,
}


def _sorted_cuts(gen, B, n, hi):
    """n non-decreasing cut points per sequence in [0, hi], with zero-length segments likely."""
    cuts = torch.randint(0, hi + 1, (B, n), generator=gen)
    same = torch.rand(B, n, generator=gen) < 0.15
    cuts = torch.where(same, torch.zeros_like(cuts), cuts)
    return torch.sort(cuts, dim=1).values


def random_meta(spec: MaskSpec, batch_size: int, seqlen: int, gen: torch.Generator | None = None):
    """Random metadata for the factory masks above, with degenerate cases (empty segments,
    segments past the end of the sequence)."""
    gen = gen or torch.Generator().manual_seed(0)
    B, S = batch_size, seqlen
    over = S + S // 4 + 1  # segments may run past the end
    name = spec.name
    if name in ("causal",) or name.startswith(("sliding_window", "dilated_causal")):
        return {}
    if name == "prefix_lm":
        return {"prefix_len": torch.randint(0, over, (B,), generator=gen)}
    if name == "packed_documents":
        ds = torch.zeros(B, S, dtype=torch.int64)
        for b in range(B):
            bounds = sorted(torch.randint(0, S, (4,), generator=gen).tolist())
            for x in bounds:
                ds[b, x:] = x
        return {"doc_start": ds}
    if name == "hstu":
        c = _sorted_cuts(gen, B, 3, over)
        return {"ctx_end": c[:, 0], "hist_end": c[:, 1], "seq_end": c[:, 2],
                "group_size": torch.randint(1, max(2, S // 4), (B,), generator=gen)}
    if name == "shared_prompt_rm":
        c = _sorted_cuts(gen, B, 7, over)
        keys = ["prompt_end", "r1_end", "r2_end", "r3_end", "r4_end", "r5_end", "r6_end"]
        return {k: c[:, n] for n, k in enumerate(keys)}
    if name.startswith("clear"):
        width = int(name.split("_w")[1])
        text = torch.randint(0, S // 2 + 1, (B,), generator=gen)
        rows = torch.randint(0, S // width + 2, (B,), generator=gen)
        return {"text_end": text, "img_rows": rows}
    raise KeyError(f"no random metadata recipe for mask {name!r}")
