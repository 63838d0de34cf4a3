"""Pictures (compilemask.api.viz) and the terminal rendering (ExecutionDescriptor.to_string)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import compilemask as cm
from compilemask.api import viz
from compilemask.contract.descriptor import TILE_MASKED, TILE_VISIBLE
from compilemask.masks import EXAMPLES, random_meta

pytest.importorskip("matplotlib")

FULL, PARTIAL = TILE_VISIBLE, TILE_VISIBLE | TILE_MASKED


def _desc(name, B=2, Sq=300, Sk=None, tiles=(32, 64), seed=0):
    spec = EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    meta = random_meta(spec, B, Sq, torch.Generator().manual_seed(seed))
    return mask.preprocess(meta, seqlen_q=Sq, seqlen_k=Sk or Sq, batch_size=B, fwd_tiles=tiles,
                           check=True)


def _dense_states(dense, tm, tn):
    """uint8 [n_m, n_n] tile states of one bool [Sq, Sk] mask, brute force."""
    Sq, Sk = dense.shape
    n_m, n_n = -(-Sq // tm), -(-Sk // tn)
    vis = torch.zeros(n_m * tm, n_n * tn, dtype=torch.bool)
    valid = torch.zeros_like(vis)
    vis[:Sq, :Sk] = dense
    valid[:Sq, :Sk] = True
    v = vis.view(n_m, tm, n_n, tn).any(3).any(1)
    m = (valid & ~vis).view(n_m, tm, n_n, tn).any(3).any(1) & v
    return v.to(torch.uint8) * TILE_VISIBLE + m.to(torch.uint8) * TILE_MASKED


def _tile_sums(dense, tm, tn):
    Sq, Sk = dense.shape
    n_m, n_n = -(-Sq // tm), -(-Sk // tn)
    x = torch.nn.functional.pad(dense, (0, n_n * tn - Sk, 0, n_m * tm - Sq))
    return x.view(n_m, tm, n_n, tn).sum((1, 3))


def _classify(rgb):
    """Tile state from the colour of a pixel (0-255 RGB)."""
    r, g, b = (int(round(x)) for x in rgb[:3])
    if g > r + 30:
        return FULL
    if r - b > 25:
        return PARTIAL
    assert abs(r - 236) <= 3 and abs(g - 236) <= 3 and abs(b - 236) <= 3, rgb
    return 0


def _read_back(path):
    """(RGB pixels 0-255 [H, W, 3], the drawing info stored in the PNG)."""
    from matplotlib.image import imread
    from PIL import Image

    img = imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    with Image.open(path) as im:
        info = json.loads(im.text["compilemask"])
    return img[..., :3] * 255.0, info


def _tile_centre_states(img, info, tm, tn):
    """States read from the centre pixel of every tile; 255 for edge tiles too thin on screen
    (under 5 pixels: the grid line would cover their centre)."""
    x0, y0, W, H = info["image_px"]
    Sq, Sk = info["seqlen_q"], info["seqlen_k"]
    n_m, n_n = -(-Sq // tm), -(-Sk // tn)
    out = torch.full((n_m, n_n), 255, dtype=torch.uint8)
    for m in range(n_m):
        r0, r1 = m * tm, min(Sq, (m + 1) * tm)
        y = int(y0 + (r0 + r1) / 2 * H / Sq)
        for n in range(n_n):
            c0, c1 = n * tn, min(Sk, (n + 1) * tn)
            x = int(x0 + (c0 + c1) / 2 * W / Sk)
            if (r1 - r0) * H / Sq >= 5 and (c1 - c0) * W / Sk >= 5:
                out[m, n] = _classify(img[y, x])
    return out


# ---- the picture -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,Sq,Sk,tiles,dense_limit", [
    ("hstu", 300, 300, (32, 64), viz.DENSE_LIMIT),           # one pixel per element
    ("shared_prompt_rm", 257, 411, (32, 32), viz.DENSE_LIMIT),  # not tile multiples, Sq != Sk
    ("clear", 200, 200, (16, 16), viz.DENSE_LIMIT),
    ("dilated_causal", 256, 256, (32, 32), viz.DENSE_LIMIT),  # fallback: never full
    ("hstu", 300, 300, (32, 64), 0),                         # forced tile-resolution mode
    ("packed_documents", 1000, 1000, (64, 64), 0),
])
def test_png_tile_tints_agree_with_tile_states(tmp_path, name, Sq, Sk, tiles, dense_limit):
    desc = _desc(name, Sq=Sq, Sk=Sk, tiles=tiles)
    for b in range(desc.batch_size):
        path = cm.visualize(desc, batch=b, path=str(tmp_path / f"{name}_{b}.png"),
                            dense_limit=dense_limit)
        assert path == str(tmp_path / f"{name}_{b}.png")
        img, info = _read_back(path)
        assert info["mode"] == ("dense" if dense_limit else "tiles")
        st = desc.tile_states()[b]
        got = _tile_centre_states(img, info, *tiles)
        seen = got != 255
        assert seen.float().mean() > 0.85
        assert torch.equal(got[seen], st[seen]), f"{name} sequence {b}: picture tiles != bitmap"
        counts = info["counts"]
        assert counts["full"] == int((st == FULL).sum())
        assert counts["partial"] == int((st == PARTIAL).sum())
        assert counts["empty"] == int((st == 0).sum())
        assert info["K"] == desc.num_intervals


def test_dense_mode_pixels_are_the_mask(tmp_path):
    """One pixel per element: visible elements are dark, masked ones light, in every tile."""
    desc = _desc("hstu", B=1, Sq=100, Sk=100, tiles=(16, 16), seed=3)
    path = cm.visualize(desc, path=str(tmp_path / "m.png"), width_px=400)
    img, info = _read_back(path)
    x0, y0, W, H = info["image_px"]
    assert (W, H) == (400, 400)
    dense = desc.dense_mask()[0]
    for r in range(2, 100, 7):
        for c in range(1, 100, 5):
            px = img[int(y0 + (r + 0.5) * H / 100), int(x0 + (c + 0.5) * W / 100)]
            visible = px.sum() < 600  # dark green / dark orange vs light grey / light orange
            assert visible == bool(dense[r, c]), (r, c, px)


def test_visualize_via_package_and_errors(tmp_path):
    desc = _desc("causal", B=1, Sq=64, tiles=(16, 16))
    p = tmp_path / "sub" / "dir" / "causal.png"  # folders are created
    assert cm.visualize(desc, path=str(p)) == str(p) and p.stat().st_size > 1000
    with pytest.raises(IndexError, match="out of range"):
        cm.visualize(desc, batch=3, path=str(tmp_path / "x.png"))
    # the backward tiling can be drawn too
    img, info = _read_back(cm.visualize(desc, path=str(tmp_path / "bwd.png"), backward=True))
    assert (info["tile_m"], info["tile_n"]) == (desc.bwd_tiles.tile_m, desc.bwd_tiles.tile_n)


def test_title_names_spec_seqlens_and_k():
    desc = _desc("hstu", B=2, Sq=130, Sk=150, tiles=(32, 32))
    fig, info = viz.figure(desc, batch=1)
    texts = " ".join(t.get_text() for t in fig.texts)
    assert "hstu" in texts and "seqlen_q=130" in texts and "seqlen_k=150" in texts
    assert f"K={desc.num_intervals}" in texts and "sequence 1 of 2" in texts
    # region bands: labels are region names (bands too thin on screen stay unlabelled)
    labels = {t.get_text() for t in fig.axes[1].texts}
    names = {r.name for r in desc.mask.regions} | {"(none)"}
    assert labels and labels <= names


def test_missing_matplotlib_names_the_extra(monkeypatch):
    desc = _desc("causal", B=1, Sq=16, tiles=(16, 16))
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)  # import of it raises ImportError
    with pytest.raises(ImportError, match=r"compilemask\[viz\]"):
        cm.visualize(desc, path="never.png")


# ---- per-tile visible counts (the tile-resolution path) ----------------------------------------
@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.parametrize("Sq,Sk", [(257, 411), (500, 130)])
def test_tile_counts_equal_dense_tile_sums(name, Sq, Sk):
    desc = _desc(name, B=2, Sq=Sq, Sk=Sk, tiles=(32, 64), seed=Sq + Sk)
    dense = desc.dense_mask()
    for b in range(desc.batch_size):
        assert torch.equal(viz.dense_rows(desc, b, 0, Sq), dense[b])
        assert torch.equal(viz.dense_rows(desc, b, 17, 60), dense[b, 17:60])
        assert torch.equal(viz.dense_rows(desc, b, 5, 99, 64, Sk - 3), dense[b, 5:99, 64:Sk - 3])
        c = viz.tile_visible_counts(desc, b, chunk_elems=1000)  # many small chunks
        assert torch.equal(c, _tile_sums(dense[b], 32, 64))


OVERLAP = cm.MaskSpec("overlap", params=["a", "b", "c"], regions=[
    cm.Region("all", when=lambda i: True,
              visible=lambda i, j: j < a or b <= j < c or i - 3 <= j <= i),  # noqa: F821
])


def test_tile_counts_union_of_overlapping_intervals():
    """Slots that overlap at run time are counted once (the union), not twice."""
    mask = cm.compile_mask(OVERLAP)
    assert mask.num_intervals >= 2
    gen = torch.Generator().manual_seed(0)
    B, S = 6, 200
    meta = {k: torch.randint(0, S + 20, (B,), generator=gen) for k in ("a", "b", "c")}
    desc = mask.preprocess(meta, seqlen_q=S, seqlen_k=S, fwd_tiles=(16, 32))
    iv = desc.intervals.long()
    s, e = iv[..., 0], iv[..., 0] + iv[..., 1]
    overlapping = ((s[..., :, None] < e[..., None, :]) & (s[..., None, :] < e[..., :, None])
                   & (iv[..., 1, None] > 0) & (iv[..., None, 1] > 0))
    assert int(overlapping.sum()) > 3 * B * S  # beyond the diagonal: real overlaps exist
    ref = mask.reference_mask(meta, seqlen_q=S, seqlen_k=S)
    for b in range(B):
        assert torch.equal(viz.tile_visible_counts(desc, b, chunk_elems=777),
                           _tile_sums(ref[b], 16, 32))


def test_tile_mode_never_builds_the_dense_mask(monkeypatch):
    """Interval-only masks: no [rows, Sk] block at all; fallback masks: bounded row chunks."""
    calls = []
    real = viz.dense_rows

    def spy(desc, b, r0, r1, c0=0, c1=None):
        calls.append((r1 - r0) * ((desc.seqlen_k if c1 is None else c1) - c0))
        return real(desc, b, r0, r1, c0, c1)

    monkeypatch.setattr(viz, "dense_rows", spy)
    monkeypatch.setattr(type(_desc("causal", B=1, Sq=8, tiles=(8, 8))), "dense_mask",
                        lambda self: pytest.fail("dense_mask() called"))
    desc = cm.compile_mask(EXAMPLES["hstu"]()).preprocess(
        {"ctx_end": 500, "hist_end": 3000, "seq_end": 4000, "group_size": 300},
        seqlen_q=4096, seqlen_k=4096)
    fig, info = viz.figure(desc)
    assert info["mode"] == "tiles" and calls == []
    desc = cm.compile_mask(EXAMPLES["dilated_causal"]()).preprocess({}, seqlen_q=4096,
                                                                   seqlen_k=4096)
    c = viz.tile_visible_counts(desc, 0, chunk_elems=1 << 20)
    assert calls and max(calls) <= 1 << 20
    assert int(c.sum()) == sum((i // 2) + 1 for i in range(4096))  # j <= i, (i - j) even


LONG = textwrap.dedent("""
    import resource, sys, time, json
    import torch
    import compilemask as cm
    from compilemask.masks import hstu
    from PIL import Image
    S = 32768
    mask = cm.compile_mask(hstu())
    desc = mask.preprocess({"ctx_end": 4000, "hist_end": 20000, "seq_end": 30000,
                            "group_size": 1500}, seqlen_q=S, seqlen_k=S)
    import compilemask.api.viz, matplotlib.figure, matplotlib.backends.backend_agg  # imported
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.time()
    path = cm.visualize(desc, path=sys.argv[1])
    dt = time.time() - t
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    info = json.loads(Image.open(path).text["compilemask"])
    print(json.dumps({"grew_kib": after - before, "seconds": dt, "mode": info["mode"],
                      "counts": info["counts"]}))
""")


def test_long_sequence_32k_memory_bounded(tmp_path):
    """32K x 32K (1G mask elements; a dense bool mask alone would be 1 GiB): tile mode, peak
    memory growth well under that."""
    out = tmp_path / "long.png"
    res = subprocess.run([sys.executable, "-c", LONG, str(out)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["mode"] == "tiles"
    assert rep["grew_kib"] < 300 * 1024, rep  # < 300 MiB (a dense mask: >= 1 GiB)
    assert out.stat().st_size > 1000
    assert sum(rep["counts"].values()) == 256 * 256


# ---- to_string ---------------------------------------------------------------------------------
_CH = {0: ".", FULL: "#", PARTIAL: "~"}


def _parse(text):
    lines = text.splitlines()
    m = re.match(r"full (\d+)  partial (\d+)  empty (\d+)  of (\d+) tiles; ([\d.]+)% of FLOPs",
                 lines[-1])
    assert m, lines[-1]
    return lines[0], lines[1:-1], [int(x) for x in m.groups()[:4]], float(m.group(5))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.parametrize("backward", [False, True])
def test_to_string_counts_equal_bitmap_counts(name, backward):
    desc = _desc(name, B=2, Sq=257, Sk=300, tiles=(32, 64), seed=5)
    dense = desc.dense_mask()
    tiles = desc.bwd_tiles if backward else desc.fwd_tiles
    for b in range(desc.batch_size):
        head, grid, (full, partial, empty, total), skipped = _parse(
            desc.to_string(batch=b, backward=backward))
        st = desc.tile_states(backward=backward)[b]
        if backward:
            st = st.t()
        assert f"{desc.mask.name}:" in head and "seqlen_q=257" in head and "seqlen_k=300" in head
        assert f"K={desc.num_intervals}" in head
        assert grid == ["".join(_CH[int(x)] for x in row) for row in st.tolist()]
        assert (full, partial, empty, total) == (
            int((st == FULL).sum()), int((st == PARTIAL).sum()), int((st == 0).sum()),
            st.numel())
        # the bitmap agrees with the mask it encodes (fallback rows: never full, by contract)
        want = _dense_states(dense[b], tiles.tile_m, tiles.tile_n)
        if not desc.has_fallback:
            assert torch.equal(st, want)
        else:
            assert torch.equal(st != 0, want != 0)
        # FLOPs skipped: the area of empty tiles over Sq * Sk
        area = _tile_sums(torch.ones(257, 300, dtype=torch.bool), tiles.tile_m, tiles.tile_n)
        frac = float(area[st == 0].sum()) / (257 * 300)
        assert abs(skipped - 100 * frac) < 0.051


def test_to_string_causal_picture():
    desc = cm.compile_mask(EXAMPLES["causal"]()).preprocess({}, seqlen_q=256, seqlen_k=256,
                                                            fwd_tiles=(64, 64))
    _, grid, counts, skipped = _parse(desc.to_string())
    assert grid == ["~...", "#~..", "##~.", "###~"]
    assert counts == [6, 4, 6, 16] and skipped == pytest.approx(37.5)


def test_to_string_blocks_for_large_grids():
    from compilemask.pipeline.render import descriptor_to_string

    desc = cm.compile_mask(EXAMPLES["causal"]()).preprocess({}, seqlen_q=1000, seqlen_k=1000,
                                                            fwd_tiles=(16, 16))  # 63 x 63 tiles
    exact = _parse(desc.to_string())
    head, grid, counts, skipped = _parse(descriptor_to_string(desc, max_size=20))
    assert "(each character: 4x4 tiles)" in head
    assert len(grid) == 16 and all(len(g) == 16 for g in grid)
    assert (counts, skipped) == (exact[2], exact[3])  # counts: always over every tile
    st = desc.tile_states()[0]
    for bm in range(16):
        for bn in range(16):
            blk = st[4 * bm:4 * bm + 4, 4 * bn:4 * bn + 4]
            want = "#" if bool((blk == FULL).all()) else "." if bool((blk == 0).all()) else "~"
            assert grid[bm][bn] == want
    assert descriptor_to_string(desc, max_size=100) == desc.to_string()
    with pytest.raises(IndexError, match="out of range"):
        desc.to_string(batch=1)
