"""Block-sparse tile lists (flash-attn-4 format) from the Tile-State Bitmaps.

The torch reference lists re-expand to the bitmap's states, and those agree with the dense mask;
the transposed forward bitmap gives the backward lists of the 128x128 tiling; TileLang's C target
(CPU, CI) writes the same lists bit for bit; the CUDA text compiles for sm_90a (nvcc, no GPU).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import compilemask as cm
from compilemask.blocksparse import (
    TILE_FULL,
    TILE_PARTIAL,
    BlockSparseLists,
    descriptor_lists,
    lists_from_bitmap,
    lists_from_states,
    to_dense_states,
)
from compilemask.descriptor import TileConfig
from compilemask.masks import EXAMPLES, random_meta
from compilemask.tiles import pack_bitmap, unpack_bitmap

from helpers import dense_tile_states

NAMES = sorted(EXAMPLES)
TILES_128 = TileConfig(128, 128)

# (B, Sq, Sk): one tile; seqlens not multiples of 128; Sq != Sk both ways; more than 16 tiles per
# row (one bitmap word); more than 256 tiles per row (forward and transposed: 313 kv tiles;
# backward: 258 q tiles of 64 rows)
SHAPES = [(1, 1, 1), (3, 200, 200), (2, 300, 517), (2, 517, 130), (1, 2100, 2100),
          (1, 64, 40000), (1, 16500, 300)]
# the shapes the C target runs for every mask (each list shape is one compile; the kernel's
# thread layouts are exercised on random bitmaps below)
TL_SHAPES = [(2, 2100, 2100), (2, 300, 517)]
# (backward, forward_tiling) of descriptor_lists
PASSES = [(False, False), (True, False), (True, True)]


@pytest.fixture(scope="module")
def masks():
    return {n: cm.compile_mask(EXAMPLES[n]()) for n in NAMES}


_DESCS: dict = {}


def descriptors(m, B, sq, sk):
    """(descriptor, the same with a 128x128 backward tiling) for one mask and shape (cached)."""
    key = (m.key, B, sq, sk)
    if key not in _DESCS:
        seed = hash(key) % 10_000
        meta = random_meta(m.spec, B, sq, torch.Generator().manual_seed(seed))
        d = m.preprocess(meta, sq, sk, backend="torch", batch_size=B)
        d128 = m.preprocess(meta, sq, sk, backend="torch", batch_size=B, bwd_tiles=TILES_128)
        _DESCS[key] = (d, d128)
    return _DESCS[key]


def shapes_for(m, shapes):
    # random_meta draws per-row arrays for square shapes only
    return [s for s in shapes if not (m.array_params and s[1] != s[2])]


def assert_lists_equal(ref: BlockSparseLists, out: BlockSparseLists, what: str):
    """Equal counts and equal first ``cnt`` entries of every row (the rest is unspecified)."""
    for name, (a, b) in zip(ref._fields, zip(ref, out)):
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, (what, name)
    assert ref.mask_idx.device == out.mask_idx.device
    slot = torch.arange(ref.num_cols, device=ref.mask_idx.device)
    for cnt, ra, oa, name in ((ref.mask_cnt, ref.mask_idx, out.mask_idx, "mask"),
                              (ref.full_cnt, ref.full_idx, out.full_idx, "full")):
        oc = out.mask_cnt if name == "mask" else out.full_cnt
        if not torch.equal(cnt, oc):
            bad = (cnt != oc).nonzero()[:5].tolist()
            raise AssertionError(f"{what}: {name}_cnt differs at {bad}")
        live = slot < cnt.unsqueeze(-1)
        if not torch.equal(torch.where(live, ra, 0), torch.where(live, oa, 0)):
            bad = (live & (ra != oa)).nonzero()[:5].tolist()
            raise AssertionError(f"{what}: {name}_idx differs at {bad}")


def check_well_formed(lists: BlockSparseLists):
    """Counts in range, listed columns ascending and in range, 0 past the count."""
    C = lists.num_cols
    slot = torch.arange(C)
    for cnt, idx in ((lists.mask_cnt, lists.mask_idx), (lists.full_cnt, lists.full_idx)):
        assert cnt.shape == idx.shape[:3] and idx.shape[1] == 1
        assert bool(((cnt >= 0) & (cnt <= C)).all())
        live = slot < cnt.unsqueeze(-1)
        assert bool(((idx >= 0) & (idx < C) | ~live).all())
        assert bool(((idx[..., 1:] > idx[..., :-1]) | ~live[..., 1:]).all())
        assert bool(((idx == 0) | live).all())


# ---------------------------------------------------------------------------------------------
# torch reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_reference_lists_match_bitmaps_and_dense_mask(masks, name):
    m = masks[name]
    empty_row = False
    for B, sq, sk in shapes_for(m, SHAPES):
        d, d128 = descriptors(m, B, sq, sk)
        what = f"{name} B={B} Sq={sq} Sk={sk}"
        dense = d.dense_mask()
        fwd = descriptor_lists(d)
        bwd = descriptor_lists(d, backward=True)
        bwd128 = descriptor_lists(d, backward=True, forward_tiling=True)
        for lists in (fwd, bwd, bwd128):
            check_well_formed(lists)
            empty_row |= bool(((lists.mask_cnt == 0) & (lists.full_cnt == 0)).any())
        n_m, n_n = d.fwd_tiles.num_blocks(sq, sk)
        assert fwd.mask_idx.shape == (B, 1, n_m, n_n) and bwd128.mask_idx.shape == (B, 1, n_n, n_m)
        # (a) the lists re-expand to the bitmaps' states exactly
        assert torch.equal(to_dense_states(fwd), d.tile_states()), what
        assert torch.equal(to_dense_states(bwd), d.tile_states(backward=True)), what
        # (d) the forward bitmap by columns = the backward bitmap of a 128x128 backward tiling
        assert torch.equal(to_dense_states(bwd128), d.tile_states().transpose(1, 2)), what
        assert_lists_equal(descriptor_lists(d128, backward=True), bwd128, what)
        # (b) the tile states against the dense mask: exact without fallback regions; with them
        # sound (a tile with a visible element is listed, a full tile is full in the dense mask)
        for lists, tm, tn, flip in ((fwd, 128, 128, False), (bwd, 64, 128, True),
                                    (bwd128, 128, 128, True)):
            want = dense_tile_states(dense, tm, tn)
            got = to_dense_states(lists)
            got = got.transpose(1, 2) if flip else got
            if not m.has_fallback:
                assert torch.equal(got, want), what
            else:
                assert bool(((want == 0) | (got != 0)).all()), what
                assert bool(((got != TILE_FULL) | (want == TILE_FULL)).all()), what
    if name not in ("causal", "sliding_window", "dilated_causal", "prefix_lm", "packed_documents"):
        assert empty_row, f"{name}: no row without visible tiles was drawn"


def test_reference_handmade_states():
    """Empty rows, full rows, the never-produced state 10 (in no list), dirty padding bits."""
    st = torch.tensor([[[0, 1, 3, 2, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [3, 0, 3, 0, 1]]],
                      dtype=torch.uint8)
    lists = lists_from_states(st)
    assert lists.mask_cnt.tolist() == [[[1, 0, 0, 2]]]
    assert lists.full_cnt.tolist() == [[[2, 0, 5, 1]]]
    assert lists.mask_idx[0, 0, 3, :2].tolist() == [0, 2]
    assert lists.full_idx[0, 0, 0, :2].tolist() == [1, 4]
    assert lists.full_idx[0, 0, 2].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(to_dense_states(lists), torch.where(st == 2, 0, st))
    words = pack_bitmap(st) | (-1 << 10)  # tiles 5..15 of the word: padding, all bits set
    assert torch.equal(unpack_bitmap(words, 5), st)
    assert all(torch.equal(a, b) for a, b in zip(lists_from_bitmap(words, 5), lists))
    t = lists_from_bitmap(words, 5, transpose=True)
    assert t.mask_idx.shape == (1, 1, 5, 4)
    assert all(torch.equal(a, b) for a, b in zip(t, lists_from_states(st.transpose(1, 2))))
    with pytest.raises(ValueError, match="packed_tiles=17 needs 2 words"):
        lists_from_bitmap(words, 17)
    with pytest.raises(ValueError, match="listed twice"):
        bad = lists._replace(full_cnt=lists.full_cnt.clone())
        bad.full_cnt[0, 0, 3] = 2  # row 3: full tile 4 and its unspecified entry 0, listed too
        to_dense_states(bad)
    assert (TILE_FULL, TILE_PARTIAL) == (1, 3)


# ---------------------------------------------------------------------------------------------
# TileLang (C target on CPU)
# ---------------------------------------------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from compilemask import codegen  # noqa: E402
from compilemask.codegen import blocksparse as tlb  # noqa: E402


@pytest.mark.parametrize("name", NAMES)
def test_c_target_equals_reference(masks, name):
    m = masks[name]
    for B, sq, sk in shapes_for(m, TL_SHAPES):
        d, _ = descriptors(m, B, sq, sk)
        for backward, fwd_tiling in PASSES:
            ref = descriptor_lists(d, backward, forward_tiling=fwd_tiling)
            out = descriptor_lists(d, backward, forward_tiling=fwd_tiling, backend="tilelang")
            assert_lists_equal(ref, out, f"{name} B={B} Sq={sq} Sk={sk} bwd={backward}/"
                                         f"{fwd_tiling}")


@pytest.mark.parametrize("name", ["hstu", "clear", "dilated_causal"])
def test_c_target_packed_equals_reference(masks, name):
    """Every kind in one launch (one flat buffer): each kind's views equal the torch reference,
    and the descriptor serves them from ``block_sparse(kind)``."""
    from compilemask.blocksparse import PackedLists, descriptor_packed_lists

    m = masks[name]
    for B, sq, sk in shapes_for(m, TL_SHAPES):
        d, _ = descriptors(m, B, sq, sk)
        packed = descriptor_packed_lists(d)
        assert packed.kinds == ("fwd", "bwd64", "bwd128") and packed.buffer.dim() == 1
        ends = []
        for kind, (backward, fwd_tiling) in zip(packed.kinds, PASSES):
            ref = descriptor_lists(d, backward, forward_tiling=fwd_tiling)
            got = packed.view(kind)
            assert_lists_equal(ref, got, f"{name} {kind} B={B} Sq={sq} Sk={sk}")
            assert all(t.is_contiguous() for t in got)
            ends.append(got.full_idx.data_ptr() + got.full_idx.numel() * 4)
        # the kinds tile the buffer: nothing allocated twice, nothing left over
        assert ends[-1] == packed.buffer.data_ptr() + packed.buffer.numel() * 4
        lone = dataclasses.replace(d, block_lists=dict.fromkeys(packed.kinds, packed))
        for kind, (backward, fwd_tiling) in zip(packed.kinds, PASSES):
            got = lone.block_sparse(kind)
            assert isinstance(got, BlockSparseLists) and not isinstance(
                lone.block_lists[kind], PackedLists)  # viewed once, then cached
            assert_lists_equal(descriptor_lists(d, backward, forward_tiling=fwd_tiling), got,
                               f"{name} {kind} via the descriptor")
        moved = dataclasses.replace(d, block_lists=dict.fromkeys(packed.kinds, packed)).to("cpu")
        assert_lists_equal(descriptor_lists(d), moved.block_sparse("fwd"), "moved")
    for kinds in (("bwd64",), ("bwd128", "fwd")):  # a subset: only the bitmaps it reads
        packed = descriptor_packed_lists(d, kinds)
        for kind in kinds:
            backward, fwd_tiling = dict(zip(("fwd", "bwd64", "bwd128"), PASSES))[kind]
            assert_lists_equal(descriptor_lists(d, backward, forward_tiling=fwd_tiling),
                               packed.view(kind), f"{name} {kinds} {kind}")
    with pytest.raises(ValueError, match="kind must be one of"):
        descriptor_packed_lists(d, ("fwd", "bwd32"))


def test_c_target_multi_plan_guards_and_layout():
    """Parts with fewer threads than the launch (guarded stages), a part per bitmap read both
    ways, rows not a multiple of a block's: each part equals the reference."""
    B = 2
    f = random_bitmap(B, 9, 37, seed=1)  # 9 row tiles x 37 column tiles
    g = random_bitmap(B, 37, 18, seed=2)
    mp = tlb.multi_plan([(9, 37, False, 0), (37, 18, False, 1), (37, 9, True, 0)], 2)
    assert len({pl.threads for pl, _ in mp.parts}) > 1  # some parts are guarded on CUDA
    buf = tlb.block_sparse_multi((f, g), mp)
    assert buf.numel() == B * mp.per_sequence
    refs = [lists_from_bitmap(f, 37), lists_from_bitmap(g, 18),
            lists_from_bitmap(f, 37, transpose=True)]
    from compilemask.blocksparse import PackedLists

    layout = {k: (offs, pl.rows, pl.cols) for k, offs, (pl, _) in zip("abc", mp.offsets(),
                                                                      mp.parts)}
    packed = PackedLists(buf, B, layout)
    for kind, ref in zip("abc", refs):
        assert_lists_equal(ref, packed.view(kind), f"part {kind}")
    src = tlb.multi_source(mp, "cuda")
    assert src.count("if tx < THREADS_") > 0 and "def block_sparse_multi(" in src
    for k in range(3):
        assert f"bx_{k} = gx - " in src and f"MASK_IDX_OFF_{k} = " in src
    with pytest.raises(ValueError, match="must read bitmaps"):
        tlb.multi_plan([(9, 37, False, 2)], 2)


def random_bitmap(B, N, T, seed, dirty=True):
    """Random states (10 included), some rows empty, padding bits of the last word set."""
    g = torch.Generator().manual_seed(seed)
    st = torch.randint(0, 4, (B, N, T), generator=g, dtype=torch.int64).to(torch.uint8)
    st[:, :: 3] = torch.where(torch.rand(B, (N + 2) // 3, T, generator=g) < 0.9, 0,
                              st[:, ::3])  # sparse rows
    st[:, 1 % N] = 0  # an empty row
    words = pack_bitmap(st)
    if dirty and T % 16:
        words[..., -1] |= -1 << (2 * (T % 16))
    return words


def test_c_target_thread_layouts():
    """Several chunks per row (small plans; the default one past 1024 tiles), one thread per row,
    rows not a multiple of the block's, the transposed read, zeros past the counts with
    ``fill``."""
    cases = [(2, 7, 100, False, True, dict(max_tpr=2, wpt=1)),  # 4 chunks of 32 tiles
             (2, 100, 7, True, False, dict(max_tpr=2, wpt=1)),
             (3, 5, 37, True, True, {}),  # TPR = 1; 37 rows over blocks of 16
             (1, 3, 1100, False, False, {})]  # 2 chunks of 1024 tiles
    for n, (B, N, T, transpose, fill, kw) in enumerate(cases):
        words = random_bitmap(B, N, T, seed=n)
        ref = lists_from_bitmap(words, T, transpose=transpose)
        rows, cols = (T, N) if transpose else (N, T)
        pl = tlb.plan(rows, cols, transpose, fill, **kw)
        out = tlb._launch(words, pl)
        assert_lists_equal(ref, out, f"{pl}")
        if fill:
            assert all(torch.equal(a, b) for a, b in zip(ref, out)), f"fill {pl}"
    assert tlb.plan(7, 100, max_tpr=2, wpt=1).chunks == 4
    assert tlb.plan(3, 1100).chunks == 2 and tlb.plan(37, 5, True).tpr == 1


def test_c_target_entry_point_and_cache():
    words = random_bitmap(2, 17, 17, seed=9)  # the list shape of TL_SHAPES[0]'s forward
    ref = lists_from_bitmap(words, 17)
    assert_lists_equal(ref, tlb.block_sparse_lists(words, 17), "entry point")
    assert_lists_equal(ref, codegen.block_sparse_lists(words, 17), "package export")
    before = tlb.compile_count()
    again = tlb.block_sparse_lists(words.flip(0).contiguous(), 17)
    assert tlb.compile_count() == before  # same shape, new values: no compile
    assert_lists_equal(lists_from_bitmap(words.flip(0), 17), again, "again")
    words = random_bitmap(2, 20, 300, seed=9)
    with pytest.raises(ValueError, match="packed_tiles=300 needs 19 words"):
        tlb.block_sparse_lists(words[..., :18].contiguous(), 300)
    with pytest.raises(ValueError, match="must be int32"):
        tlb.block_sparse_lists(words.to(torch.int64), 300)
    src = tlb.tilelang_source(tlb.plan(20, 300), "c")
    assert "T.get_thread_binding" not in src and "for tx in T.serial(THREADS):" in src
    src = tlb.tilelang_source(tlb.plan(300, 20, True), "cuda")
    assert src.startswith("# TileLang block-sparse lists")
    for role in ('bitmap: T.Tensor((B, NR, W), "int32")', "mask_cnt", "mask_idx", "full_cnt",
                 "full_idx", "# stage 1a", "# stage 4", "T.sync_threads()"):
        assert role in src
    with pytest.raises(ValueError):
        tlb.tilelang_source(tlb.plan(2, 2), "rocm")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("transpose", [False, True])
def test_cuda_source_compiles_sm90a(transpose):
    """The 128K-token shape of the forward (1024 x 1024 tiles) and of the transposed read."""
    kern = tlb.block_sparse_kernel(tlb.plan(1024, 1024, transpose), "cuda")
    src = kern.get_kernel_source()
    assert "__global__" in src and "__syncthreads" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("seqlen", [32768, 131072])
def test_cuda_multi_source_compiles_sm90a(seqlen):
    """The three kinds of one FA4 descriptor in one kernel, 32K and 128K tokens per sequence."""
    n, m = -(-seqlen // 128), -(-seqlen // 64)
    mp = tlb.multi_plan([(n, n, False, 0), (n, m, False, 1), (n, n, True, 0)], 2)
    src = tlb.multi_kernel(mp, "cuda").get_kernel_source()
    assert "__global__" in src and "__syncthreads" in src


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_equals_reference():
    for n, (B, N, T, transpose) in enumerate([(1, 1024, 1024, False), (1, 1024, 2048, False),
                                              (1, 1024, 1024, True), (3, 70, 3000, False),
                                              (3, 3000, 70, True)]):
        words = random_bitmap(B, N, T, seed=n).cuda()
        ref = lists_from_bitmap(words, T, transpose=transpose)
        for fill in (False, True):
            out = tlb.block_sparse_lists(words, T, transpose, fill=fill)
            assert out.mask_idx.is_cuda
            assert_lists_equal(ref, out, f"B={B} N={N} T={T} transpose={transpose}")
            if fill:
                assert all(torch.equal(a, b) for a, b in zip(ref, out))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_descriptor_packed_lists(masks, name):
    """A CUDA preprocess writes every kind in one launch; each equals the torch reference."""
    m = masks[name]
    if m.native_pattern is not None:
        pytest.skip("native masks take no lists")
    for B, S in ((2, 2100), (1, 32768)):
        meta = random_meta(m.spec, B, S, torch.Generator().manual_seed(S))
        meta = {k: v.cuda() for k, v in meta.items()}
        d = m.preprocess(meta, S, S, batch_size=B, device="cuda")  # no params: say where
        assert set(d.block_lists) == {"fwd", "bwd64", "bwd128"}
        for kind, (backward, fwd_tiling) in zip(("fwd", "bwd64", "bwd128"), PASSES):
            ref = descriptor_lists(d, backward, forward_tiling=fwd_tiling)
            assert_lists_equal(ref, d.block_sparse(kind), f"{name} {kind} B={B} S={S}")
