"""Pictures of compiled masks: one sequence's mask with its tile states and region bands.

``visualize(desc, batch=0, path="mask.png")`` draws the mask of one sequence of an
``ExecutionDescriptor`` with the tile grid over it, every tile tinted by its Tile-State Bitmap
state, the region bands along the query axis and a title naming the spec, seqlens and K.

Two drawing modes:

``dense`` (``Sq * Sk <= dense_limit``, 4M elements by default)
    one image pixel per element (resampled to the figure's size when drawn): the mask of the
    sequence, from the Interval Table and, for fallback regions, the residual predicate:
    exactly what ``desc.dense_mask()[batch]`` holds.
``tiles`` (longer sequences)
    one pixel per tile, shaded by the tile's visible fraction. The visible count of a tile is
    computed from the Interval Table row by row: each row's <= K intervals are sorted and cut
    into disjoint pieces (they may overlap at run time; the union is what counts), and the
    pieces' overlaps with every tile's column range are summed over the tile's rows. Rows of
    fallback regions are evaluated densely, a bounded chunk of rows at a time. Nothing larger
    than ``chunk_elems`` (4M) elements per tensor is ever built, whatever the sequence length.

Colours (also in the legend): empty tiles light grey; full tiles green; partial tiles orange,
dark where keys are visible and light where they are masked (in ``tiles`` mode the shade goes
from light to dark with the visible fraction).
"""

from __future__ import annotations

import json
import os

import torch

from compilemask.compiler.reference import evaluate_predicate
from compilemask.contract.descriptor import TILE_FULL, TILE_MASKED, TILE_PARTIAL

__all__ = ["visualize", "figure", "image_format", "tile_visible_counts", "dense_rows",
           "PALETTE", "DENSE_LIMIT", "CHUNK_ELEMS"]

DENSE_LIMIT = 4 * 1024 * 1024  # above this many elements, draw at tile resolution
CHUNK_ELEMS = 4 * 1024 * 1024  # the largest [rows, Sk] block built in tile mode

# RGB (0-255) per tile state: (masked element colour, visible element colour)
PALETTE = {
    "empty": ((236, 236, 236), (236, 236, 236)),
    "full": ((27, 120, 55), (27, 120, 55)),
    "partial": ((253, 224, 197), (217, 95, 2)),
}
_REGION_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                   "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]


def _require_matplotlib():
    """Import matplotlib lazily. Figures are drawn on their own Agg canvas: pyplot and the
    user's backend are left alone."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "compilemask.visualize needs matplotlib, which is not installed: "
            "pip install 'compilemask[viz]' (or pip install matplotlib)"
        ) from e
    return Figure, FigureCanvasAgg


# ---- the numbers -------------------------------------------------------------------------------
def _states(desc, batch: int, backward: bool):
    st = desc.tile_states(backward=backward)[batch]
    if backward:
        st = st.transpose(0, 1)  # always q-tiles down, kv-tiles across
    tiles = desc.bwd_tiles if backward else desc.fwd_tiles
    return st, tiles


def _check_batch(desc, batch: int) -> int:
    B = desc.batch_size
    if not isinstance(batch, int) or not -B <= batch < B:
        raise IndexError(f"batch {batch!r} is out of range for a descriptor of batch size {B}")
    return batch % B


def dense_rows(desc, batch: int, r0: int, r1: int, c0: int = 0,
               c1: int | None = None) -> torch.Tensor:
    """bool ``[r1 - r0, c1 - c0]``: rows ``[r0, r1)`` and keys ``[c0, c1)`` of sequence
    ``batch``'s mask, exactly as ``desc.dense_mask()[batch, r0:r1, c0:c1]`` (intervals, and the
    residual predicate of fallback regions), without building the rest."""
    mask = desc.mask
    c1 = desc.seqlen_k if c1 is None else c1
    iv = desc.intervals[batch, r0:r1].to(torch.int64)  # [r, K, 2]
    j = torch.arange(c0, c1, device=iv.device, dtype=torch.int64)
    out = torch.zeros(r1 - r0, c1 - c0, dtype=torch.bool, device=iv.device)
    for k in range(iv.shape[1]):
        s, n = iv[:, k, 0:1], iv[:, k, 1:2]
        out |= (j >= s) & (j < s + n)
    if mask.has_fallback:
        reg = desc.row_region[batch, r0:r1]
        for r in mask.fallback_regions:
            rows = reg == r.index
            if bool(rows.any()):
                pred = _predicate_rows(desc, batch, r.index, r0, r1, c0, c1)
                out = torch.where(rows.unsqueeze(-1), out & pred, out)
    return out


def _predicate_rows(desc, batch, region_index, r0, r1, c0, c1) -> torch.Tensor:
    """The residual predicate of a fallback region on rows [r0, r1) x keys [c0, c1) of one
    sequence."""
    return evaluate_predicate(desc, region_index, batch, (r0, r1), (c0, c1))[0]


def _disjoint_pieces(iv: torch.Tensor):
    """Interval Table rows int64 ``[r, K, 2]`` (start, len) -> disjoint pieces ``[r, K]`` (a, b)
    whose union per row equals the union of the row's intervals (which may overlap)."""
    s, n = iv[..., 0], iv[..., 1]
    e = s + n
    s = torch.where(n > 0, s, 0)
    e = torch.where(n > 0, e, 0)
    s, order = torch.sort(s, dim=-1, stable=True)
    e = torch.gather(e, -1, order)
    reach = torch.cummax(e, dim=-1).values  # max end of the intervals up to k
    prev = torch.nn.functional.pad(reach[..., :-1], (1, 0), value=0)
    a = torch.maximum(s, prev)
    b = torch.maximum(e, a)
    return a, b


def tile_visible_counts(desc, batch: int = 0, backward: bool = False,
                        chunk_elems: int = CHUNK_ELEMS) -> torch.Tensor:
    """int64 ``[n_m, n_n]``: the number of visible elements of every tile of one sequence,
    from the Interval Table (bounded memory: see the module docstring)."""
    batch = _check_batch(desc, batch)
    tiles = desc.bwd_tiles if backward else desc.fwd_tiles
    Sq, Sk = desc.seqlen_q, desc.seqlen_k
    n_m, n_n = tiles.num_blocks(Sq, Sk)
    dev = desc.intervals.device
    K = desc.num_intervals
    col0 = torch.arange(n_n, device=dev, dtype=torch.int64) * tiles.tile_n
    col1 = torch.clamp(col0 + tiles.tile_n, max=Sk)
    counts = torch.zeros(n_m, n_n, dtype=torch.int64, device=dev)
    fb = None
    if desc.mask.has_fallback:
        fb = torch.zeros(Sq, dtype=torch.bool, device=dev)
        for r in desc.mask.fallback_regions:
            fb |= desc.row_region[batch] == r.index
    # interval rows: disjoint pieces x tile columns, a bounded chunk of rows at a time
    rows_per = max(1, chunk_elems // max(1, n_n * K))
    for r0 in range(0, Sq, rows_per):
        r1 = min(Sq, r0 + rows_per)
        a, b = _disjoint_pieces(desc.intervals[batch, r0:r1].to(torch.int64))  # [r, K]
        ov = torch.minimum(b.unsqueeze(-1), col1) - torch.maximum(a.unsqueeze(-1), col0)
        c = ov.clamp_(min=0).sum(dim=1)  # [r, n_n]
        if fb is not None:
            c[fb[r0:r1]] = 0  # fallback rows: counted densely below
        _add_rows(counts, c, r0, tiles.tile_m)
    # fallback rows: the residual predicate decides, evaluated densely on bounded row chunks
    if fb is not None and bool(fb.any()):
        step = max(1, chunk_elems // Sk)
        for r0 in range(0, Sq, step):
            r1 = min(Sq, r0 + step)
            sel = fb[r0:r1]
            if not bool(sel.any()):
                continue
            # only the key span the chunk's fallback rows can see (their intervals over-
            # approximate the predicate), from a tile boundary
            iv = desc.intervals[batch, r0:r1].to(torch.int64)[sel]
            live = iv[..., 1] > 0
            if not bool(live.any()):
                continue
            lo = int(iv[..., 0][live].min()) // tiles.tile_n * tiles.tile_n
            hi = int((iv[..., 0] + iv[..., 1])[live].max())
            d = dense_rows(desc, batch, r0, r1, lo, hi) & sel.unsqueeze(-1)
            t0 = lo // tiles.tile_n
            t1 = -(-hi // tiles.tile_n)
            _add_rows(counts[:, t0:t1], _col_sums(d, tiles.tile_n, t1 - t0), r0, tiles.tile_m)
    return counts


def _col_sums(d: torch.Tensor, tile_n: int, n_n: int) -> torch.Tensor:
    """bool [r, Sk] -> int64 [r, n_n]: visible keys per tile column range."""
    pad = n_n * tile_n - d.shape[1]
    x = torch.nn.functional.pad(d, (0, pad)) if pad else d
    return x.view(d.shape[0], n_n, tile_n).sum(dim=-1, dtype=torch.int64)


def _add_rows(counts, c, r0, tile_m):
    """counts[m] += sum of rows of c (which start at row r0) that fall in q-tile m."""
    m = torch.arange(r0, r0 + c.shape[0], device=c.device) // tile_m
    counts.index_add_(0, m, c)


def _tile_sizes(n, tile, S, device):
    sz = torch.full((n,), tile, dtype=torch.int64, device=device)
    sz[-1] = S - tile * (n - 1)
    return sz


# ---- the picture -------------------------------------------------------------------------------
def _lut() -> torch.Tensor:
    """uint8 [4, 2, 3]: colour of an element by (tile state, visible)."""
    lut = torch.zeros(4, 2, 3, dtype=torch.uint8)
    lut[0] = torch.tensor(PALETTE["empty"])
    lut[TILE_MASKED] = torch.tensor(PALETTE["empty"])  # never occurs
    lut[TILE_FULL] = torch.tensor(PALETTE["full"])
    lut[TILE_PARTIAL] = torch.tensor(PALETTE["partial"])
    return lut


def _dense_image(desc, batch, st, tiles):
    Sq, Sk = desc.seqlen_q, desc.seqlen_k
    vis = dense_rows(desc, batch, 0, Sq).cpu()
    st = st.cpu().long()
    rows = torch.arange(Sq) // tiles.tile_m
    cols = torch.arange(Sk) // tiles.tile_n
    state = st[rows][:, cols]  # [Sq, Sk]
    return _lut()[state, vis.long()].numpy()


def _tile_image(desc, batch, st, tiles, backward):
    Sq, Sk = desc.seqlen_q, desc.seqlen_k
    counts = tile_visible_counts(desc, batch, backward=backward).cpu()
    n_m, n_n = counts.shape
    area = (_tile_sizes(n_m, tiles.tile_m, Sq, "cpu")[:, None]
            * _tile_sizes(n_n, tiles.tile_n, Sk, "cpu")[None, :])
    frac = (counts.double() / area.double()).clamp(0, 1)
    st = st.cpu().long()
    lut = _lut().double()
    lo, hi = lut[st, 0], lut[st, 1]  # [n_m, n_n, 3]
    img = lo + (hi - lo) * frac.unsqueeze(-1)
    return img.round().to(torch.uint8).numpy(), counts


def _runs(region_row: torch.Tensor):
    """[(start, end, region index)] runs of equal values along the query axis."""
    r = region_row.cpu().long()
    if r.numel() == 0:
        return []
    cut = (r[1:] != r[:-1]).nonzero().flatten() + 1
    starts = [0] + cut.tolist()
    ends = cut.tolist() + [r.numel()]
    return [(s, e, int(r[s])) for s, e in zip(starts, ends, strict=True)]


def figure(desc, batch: int = 0, *, backward: bool = False, dense_limit: int = DENSE_LIMIT,
           width_px: int = 900, dpi: int = 100, title: str | None = None, grid: bool | None = None):
    """Build the figure; returns ``(fig, info)``. ``info`` holds the drawing mode and where the
    mask image lies in the saved PNG (pixels, origin top-left), which tests use to read tiles
    back; ``visualize`` stores it in the PNG's text chunk ``compilemask``."""
    Figure, FigureCanvasAgg = _require_matplotlib()
    from matplotlib.patches import Patch, Rectangle

    batch = _check_batch(desc, batch)
    Sq, Sk = desc.seqlen_q, desc.seqlen_k
    st, tiles = _states(desc, batch, backward)
    n_m, n_n = st.shape
    mode = "dense" if Sq * Sk <= dense_limit else "tiles"
    if mode == "dense":
        img = _dense_image(desc, batch, st, tiles)
    else:
        img, _ = _tile_image(desc, batch, st, tiles, backward)

    # layout in pixels: [band | image], title above, legend below
    W = int(width_px)
    H = int(min(max(W * Sq / Sk, 240), 1.6 * W))
    runs = _runs(desc.row_region[batch])
    n_reg = len({reg for _, _, reg in runs})
    reg_rows = -(-n_reg // 6)
    band_w, gap, left, right, top = 110, 6, 60, 30, 90
    bottom = 62 + 22 * (1 + reg_rows)
    fig_w = left + band_w + gap + W + right
    fig_h = top + H + bottom
    fig = Figure(figsize=(fig_w / dpi, fig_h / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    x0 = left + band_w + gap
    ax = fig.add_axes((x0 / fig_w, bottom / fig_h, W / fig_w, H / fig_h))
    # tile mode: one pixel per tile, so the image spans the padded tile grid; the axes clip
    # the edge tiles to the keys and rows that exist
    ext = (0, Sk, Sq, 0) if mode == "dense" else (0, n_n * tiles.tile_n, n_m * tiles.tile_m, 0)
    ax.imshow(img, extent=ext, aspect="auto", interpolation="nearest", resample=False)
    ax.set_xlim(0, Sk)
    ax.set_ylim(Sq, 0)
    ax.set_xlabel(f"key j (kv-tiles of {tiles.tile_n})")
    ax.tick_params(labelsize=8, labelleft=False)
    # tile grid, when the tiles are large enough on screen to see it
    px_m, px_n = H * tiles.tile_m / Sq, W * tiles.tile_n / Sk
    if grid is None:
        grid = min(px_m, px_n) >= 6
    if grid:
        for c in range(1, n_n):
            ax.axvline(c * tiles.tile_n, color="#555555", lw=0.5, alpha=0.6)
        for r in range(1, n_m):
            ax.axhline(r * tiles.tile_m, color="#555555", lw=0.5, alpha=0.6)

    # region bands along the query axis
    bax = fig.add_axes((left / fig_w, bottom / fig_h, band_w / fig_w, H / fig_h), sharey=ax)
    bax.set_xlim(0, 1)
    bax.set_xticks([])
    bax.set_ylabel(f"query i (q-tiles of {tiles.tile_m})")
    bax.tick_params(labelsize=8)
    names = {r.index: r.name for r in desc.mask.regions}
    seen = {}
    for s, e, reg in runs:
        colour = "#ffffff" if reg < 0 else _REGION_COLOURS[reg % len(_REGION_COLOURS)]
        bax.add_patch(Rectangle((0, s), 1, e - s, facecolor=colour, edgecolor="none"))
        label = names.get(reg, "(none)")
        seen[reg] = (label, colour)
        if (e - s) * H / Sq >= 11:
            bax.text(0.5, (s + e) / 2, label, ha="center", va="center", fontsize=8,
                     clip_on=True)
    bax.set_ylim(Sq, 0)

    # title and legends
    full = int((st == TILE_FULL).sum())
    partial = int((st == TILE_PARTIAL).sum())
    empty = st.numel() - full - partial
    K = desc.num_intervals
    fb = " (predicate fallback)" if desc.mask.has_fallback else ""
    head = title or (f"{desc.mask.name}{fb}: sequence {batch} of {desc.batch_size}")
    sub = (f"seqlen_q={Sq}  seqlen_k={Sk}  K={K}  "
           f"{'bwd' if backward else 'fwd'} tiles {tiles.tile_m}x{tiles.tile_n}  "
           + ("[element resolution]" if mode == "dense"
              else "[tile resolution: shade = visible fraction]"))
    fig.text(0.5, 1 - 30 / fig_h, head, ha="center", va="center", fontsize=13)
    fig.text(0.5, 1 - 58 / fig_h, sub, ha="center", va="center", fontsize=9)

    def rgb(c):
        return tuple(x / 255 for x in c)

    handles = [Patch(facecolor=rgb(PALETTE["full"][1]), label=f"full ({full})"),
               Patch(facecolor=rgb(PALETTE["partial"][1]), label=f"partial ({partial}): visible"),
               Patch(facecolor=rgb(PALETTE["partial"][0]), label="partial: masked"),
               Patch(facecolor=rgb(PALETTE["empty"][0]), edgecolor="#999999",
                     label=f"empty ({empty})")]
    fig.legend(handles=handles, loc="upper left", ncol=4, fontsize=8, frameon=False,
               bbox_to_anchor=(x0 / fig_w, (bottom - 50) / fig_h), borderaxespad=0)
    reg_handles = [Patch(facecolor=c, edgecolor="#999999", label=f"{idx}: {n}" if idx >= 0 else n)
                   for idx, (n, c) in sorted(seen.items())]
    if reg_handles:
        fig.legend(handles=reg_handles, loc="upper left", ncol=min(6, len(reg_handles)),
                   fontsize=8, frameon=False, bbox_to_anchor=(x0 / fig_w, (bottom - 72) / fig_h),
                   borderaxespad=0, title="regions (band at the left)", title_fontsize=8)

    info = {"mode": mode, "dpi": dpi, "image_px": [x0, top, W, H],
            "seqlen_q": Sq, "seqlen_k": Sk, "tile_m": tiles.tile_m, "tile_n": tiles.tile_n,
            "counts": {"full": full, "partial": partial, "empty": empty}, "K": K,
            "batch": batch, "grid": bool(grid)}
    return fig, info


def image_format(path) -> str:
    """The image format ``visualize`` writes to ``path``: its extension (any format matplotlib
    writes: png, svg, pdf, jpg, ...), png without one; else a ValueError listing them."""
    _, canvas = _require_matplotlib()
    ext = os.path.splitext(os.fspath(path))[1].lstrip(".").lower()
    if not ext:
        return "png"
    formats = canvas.get_supported_filetypes()
    if ext not in formats:
        raise ValueError(f"cannot write {os.fspath(path)!r}: unsupported image format '.{ext}' "
                         f"(supported: {', '.join(sorted(formats))})")
    return ext


def visualize(desc, batch: int = 0, path: str = "mask.png", **kw) -> str:
    """Draw sequence ``batch`` of ``desc`` (an ExecutionDescriptor) to the image ``path``:
    PNG, or any format matplotlib writes, by the extension (``image_format``).

    Keyword options: ``backward`` (draw the backward tiling), ``dense_limit`` (elements above
    which the tile-resolution mode is used), ``width_px``, ``dpi``, ``title``, ``grid``.
    A PNG carries the drawing's numbers as text metadata (key ``compilemask``, JSON).
    Returns ``path``."""
    path = os.fspath(path)
    fmt = image_format(path)  # before drawing: a bad extension fails fast
    fig, info = figure(desc, batch, **kw)
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    # only PNG takes free-form metadata keys; JPEG refuses any, PDF and SVG warn on unknown ones
    extra = {"metadata": {"compilemask": json.dumps(info)}} if fmt == "png" else {}
    fig.savefig(path, dpi=info["dpi"], format=fmt, **extra)
    return path
