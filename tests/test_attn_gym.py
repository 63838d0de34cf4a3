"""The attention-gym catalogue as its package writes it (``attn-gym``, a test dependency):
every mask_mod converts and equals FlexAttention's ``create_mask`` element by element on CPU
(JetSpec's tree, a 2-D table read at a token pair, as a table param)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, noop_mask

import compilemask as cm

am = pytest.importorskip("attn_gym.masks")
from attn_gym.masks.document_mask import (  # noqa: E402
    generate_random_lengths,
    length_to_offsets,
)
from attn_gym.masks.vsa import generate_vsa_padding_mask_mod  # noqa: E402

B = 2
LENGTHS = (1, 100, 129, 257, 1000)
# canvases of those areas (257 is prime: a strip)
CANVAS = {1: (1, 1), 100: (10, 10), 129: (43, 3), 257: (257, 1), 1000: (40, 25)}


def _offsets(S, ndocs):
    random.seed(S)
    return length_to_offsets(generate_random_lengths(S, min(ndocs, S)), "cpu")


def _global(S):
    g = torch.rand(S, generator=torch.Generator().manual_seed(S)) < 0.05
    g[0] = True
    return g


def _vsa_padding(S):
    md = am.create_vsa_tile_metadata((max(1, S // 16), 4, 4), (4, 4, 4))
    return generate_vsa_padding_mask_mod(md.variable_block_sizes, md.tile_numel), \
        md.padded_seq_length


def _shared_prefix(S):
    nd = min(6, S)
    return am.generate_shared_prefix_mask_mod(_offsets(S, nd),
                                              torch.tensor([d - d % 3 for d in range(nd)]))


# name -> S -> (mask_mod, seqlen): masks defined at any length
ANY_LENGTH = {
    "noop": lambda S: noop_mask,
    "causal": lambda S: am.causal_mask,
    "sliding_window": lambda S: am.generate_sliding_window(16),
    "prefix_lm": lambda S: am.generate_prefix_lm_mask(32),
    "document_causal": lambda S: am.generate_doc_mask_mod(am.causal_mask, _offsets(S, 4)),
    "document_noop": lambda S: am.generate_doc_mask_mod(noop_mask, _offsets(S, 4)),
    "packed_causal_document": lambda S: am.generate_packed_causal_doc_mask_mod(_offsets(S, 4)),
    "dilated_sliding_window": lambda S: am.generate_dilated_sliding_window(8, 2),
    "global_sliding_window": lambda S: am.generate_global_sliding_window(4, _global(S)),
    "natten": lambda S: am.generate_natten(*CANVAS[S], min(3, CANVAS[S][0]),
                                           min(3, CANVAS[S][1])),
    "tiled_natten": lambda S: am.generate_tiled_natten(
        *CANVAS[S], min(3, CANVAS[S][0]), min(3, CANVAS[S][1]),
        *{1: (1, 1), 100: (2, 2), 129: (1, 3), 257: (1, 1), 1000: (4, 5)}[S]),
    "shared_prefix": _shared_prefix,
    "batchify_causal": lambda S: am.batchify_mask_mod(am.causal_mask, 16),
    "batchify_noop": lambda S: am.batchify_mask_mod(noop_mask, 16),
}
# the Morton layout needs a power-of-two square canvas
MORTON = {n: am.generate_morton_natten(n, n, min(3, n), min(3, n)) for n in (1, 8, 16, 32)}

# name -> [(mask_mod, Sq, Sk)]: masks whose arguments set the lengths
FIXED = {
    "block_diffusion": lambda: [(am.generate_block_diffusion_mask(n, bs), 2 * n, 2 * n)
                                for n, bs in ((1, 1), (50, 4), (64, 16), (500, 16))],
    "jetspec_training": lambda: [(am.generate_jetspec_training_mask_mod(p, bs), nb * bs,
                                  p + nb * bs)
                                 for p, bs, nb in ((0, 1, 1), (0, 257, 1), (5, 4, 2),
                                                   (100, 16, 3), (257, 32, 4))],
    "sta_2d": lambda: [(am.generate_sta_mask_mod_2d(c, k, t, x), c[0] * c[1] + x,
                        c[0] * c[1] + x)
                       for c, k, t, x in (((1, 1), (1, 1), (1, 1), 0),
                                          ((8, 8), (4, 4), (2, 2), 36),
                                          ((24, 24), (12, 12), (4, 4), 424))],
    "sta_3d": lambda: [(am.generate_sta_mask_mod_3d(c, k, t, x), c[0] * c[1] * c[2] + x,
                        c[0] * c[1] * c[2] + x)
                       for c, k, t, x in (((4, 4, 4), (2, 2, 2), (2, 2, 2), 36),
                                          ((8, 8, 8), (4, 4, 4), (4, 4, 4), 488))],
    "svg_spatial": lambda: [(am.generate_spatial_head_mask_mod(p, f, t, 2, sink, 4), p + f * t,
                             p + f * t) for p, f, t in ((2, 7, 14), (10, 10, 99))
                            for sink in (True, False)],
    "svg_temporal": lambda: [(am.generate_temporal_head_mask_mod(p, f, t, 2), p + f * t,
                              p + f * t) for p, f, t in ((2, 7, 14), (10, 10, 99))],
    "vsa_padding": lambda: [(mm, S, S) for mm, S in map(_vsa_padding, (16, 100, 256))],
    "morton_natten": lambda: [(mm, n * n, n * n) for n, mm in MORTON.items()],
}


def _equal_create_mask(mask_mod, Sq, Sk):
    spec, meta = cm.from_mask_mod(mask_mod, batch_size=B, seqlen=Sq)
    desc = cm.compile_mask(spec).preprocess(meta, seqlen_q=Sq, seqlen_k=Sk, batch_size=B)
    want = create_mask(mask_mod, B, 1, Sq, Sk, device="cpu")[:, 0]
    got = desc.dense_mask()
    assert torch.equal(got, want), (spec.name, Sq, Sk, int((got != want).sum()))


@pytest.mark.parametrize("S", LENGTHS)
@pytest.mark.parametrize("name", sorted(ANY_LENGTH))
def test_any_length_mask_mods_equal_create_mask(name, S):
    mm = ANY_LENGTH[name](S)
    _equal_create_mask(mm, S, S)


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_length_mask_mods_equal_create_mask(name):
    for mm, Sq, Sk in FIXED[name]():  # jetspec_training: more keys than queries
        _equal_create_mask(mm, Sq, Sk)


@pytest.mark.parametrize("canvas,top_k", [((4, 8, 4), 2), ((8, 8, 8), 3), ((16, 16, 8), 5)])
@pytest.mark.parametrize("padded", [False, True])
def test_vsa_per_head_top_k_equals_create_mask(canvas, top_k, padded):
    """VSA reads the head index and a row of top-k tile ids per query tile (``topk[b, h,
    q_tile]`` compared with the key's tile, ``.any(-1)``): one spec per head
    (``from_mask_mod_heads``), the top-k ids as k intervals per row, the padded tiles' sizes a
    predicate; equal to create_mask over every head."""
    md = am.create_vsa_tile_metadata(canvas, (4, 4, 4))
    S, nh = md.padded_seq_length, 2
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, nh, S, 8, generator=g) for _ in range(2))
    topk = am.compute_vsa_topk_indices(q, k, tile_numel=md.tile_numel, top_k=top_k)
    mm = am.generate_vsa_mask_mod(topk, md.tile_numel,
                                  md.variable_block_sizes if padded else None)
    specs, metas = cm.from_mask_mod_heads(mm, num_heads=nh, batch_size=B, seqlen=S)
    compiled = [cm.compile_mask(s) for s in specs]
    assert len({c.key for c in compiled}) == 1 and compiled[0].has_fallback is padded
    groups = cm.preprocess_heads(compiled, metas, seqlen_q=S, batch_size=B)
    assert torch.equal(groups.dense_mask(), create_mask(mm, B, nh, S, S, device="cpu"))


def test_rows_of_values_key_the_conversion_by_their_length():
    """A row of m values becomes m arrays: the same code with another m converts again."""
    def make(topk):
        def mm(b, h, q_idx, kv_idx):
            return (topk[b, q_idx // 4] == (kv_idx // 4)).any(dim=-1)
        return mm

    for m in (2, 3, 1):
        topk = torch.randint(0, 8, (B, 8, m), generator=torch.Generator().manual_seed(m))
        _equal_create_mask(make(topk), 32, 32)


@pytest.mark.parametrize("Sq", [48, 100, 129, 257])
def test_flamingo_table_columns_convert(Sq):
    """Flamingo's cross attention reads a [num_images, 2] table's columns at the image of
    kv_idx (``intervals[image_idx][0]``): gathered per-token arrays. They are read at kv_idx,
    so the descriptor takes them over seqlen_q >= seqlen_k rows (padded here)."""
    from torch.nn.attention.flex_attention import create_mask

    intervals = torch.tensor([[0, 40], [20, 60], [60, 100]], dtype=torch.int32)
    mm = am.generate_vision_cross_attention_mask_mod(intervals, 16)
    spec, meta = cm.from_mask_mod(mm, batch_size=B, seqlen=48)
    padded = {k: torch.nn.functional.pad(v, (0, Sq - v.shape[1])) for k, v in meta.items()}
    got = cm.compile_mask(spec).preprocess(padded, seqlen_q=Sq, seqlen_k=48,
                                           batch_size=B).dense_mask()
    assert torch.equal(got, create_mask(mm, B, 1, Sq, 48, device="cpu")[:, 0])


# draft trees: (parents, prefix keys); node 0 the root, -1 its parent
TREES = [([-1], 0), ([-1], 3), ([-1, 0, 1, 1, 3, 3, 0], 0), ([-1, 0, 1, 1, 3, 3, 0], 5),
         ([-1, 0, 0, 1, 2], 130), ([-1] + [random.Random(7).randrange(n) for n in range(1, 100)],
                                   257)]


@pytest.mark.parametrize("parents,prefix", TREES)
def test_jetspec_tree_table_converts(parents, prefix):
    """JetSpec's tree mask reads a 2-D ancestor table at a token pair
    (``anc[q_idx, clamp(kv_idx - prefix)]``): a table param (the rows the queries read, packed
    to bits), the prefix an exact interval and the tree keys' interval a predicate."""
    anc = am.build_tree_ancestor_matrix(parents, device="cpu")
    mm = am.generate_jetspec_tree_causal_mask_mod(prefix, anc)
    n = len(parents)
    _equal_create_mask(mm, n, prefix + n)
    spec, _ = cm.from_mask_mod(mm)
    mask = cm.compile_mask(spec)
    if n > 1:
        assert mask.table_params and mask.num_intervals == (2 if prefix else 1)
