"""Block-sparse tile lists (flash-attn-4 format) from the Tile-State Bitmaps.

The torch reference lists re-expand to the bitmap's states, and those agree with the dense mask;
the transposed forward bitmap gives the backward lists of the 128x128 tiling; TileLang's C target
(CPU, CI) writes the same lists bit for bit, one compiled program for every shape (rows, columns
and batch are run-time arguments); the CUDA text compiles for sm_90a (nvcc, no GPU).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import compilemask as cm
from compilemask.compiler.blocksparse import (
    TILE_FULL,
    TILE_PARTIAL,
    BlockSparseLists,
    descriptor_lists,
    list_pass,
    lists_from_bitmap,
    lists_from_states,
    to_dense_states,
)
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    PackedLists,
    TileConfig,
    pack_bitmap,
    unpack_bitmap,
)
from compilemask.masks import EXAMPLES, random_meta
from compilemask.pipeline import pipeline

from helpers import assert_lists_equal, dense_tile_states, sweep

NAMES = sorted(EXAMPLES)
TILES_128 = TileConfig(128, 128)
KINDS = ("fwd", "bwd64", "bwd128")  # desc.block_sparse(kind): FA4's three list kinds

# (B, Sq, Sk): one tile; seqlens not multiples of 128; Sq != Sk both ways; more than 16 tiles per
# row (one bitmap word); more than 256 tiles per row (forward and transposed: 313 kv tiles;
# backward: 258 q tiles of 64 rows)
SHAPES = [(1, 1, 1), (3, 200, 200), (2, 300, 517), (2, 517, 130), (1, 2100, 2100),
          (1, 64, 40000), (1, 16500, 300)]
# the shapes the C target runs for every mask (its programs serve every shape; the thread
# layouts are exercised on random bitmaps below)
TL_SHAPES = [(2, 2100, 2100), (2, 300, 517)]


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


def kind_reference(kind: str, fwd_bitmap, bwd_bitmap, seqlen_q: int, seqlen_k: int,
                   fwd_tiles=DEFAULT_FWD_TILES, bwd_tiles=DEFAULT_BWD_TILES) -> BlockSparseLists:
    """The lists of ``kind`` from the bitmap ``list_pass`` names, by ``lists_from_bitmap``."""
    which, rows, cols, transpose = list_pass(kind, fwd_tiles, bwd_tiles, seqlen_q, seqlen_k)
    bitmap = fwd_bitmap if which == "fwd" else bwd_bitmap
    return lists_from_bitmap(bitmap, rows if transpose else cols, transpose=transpose)


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
        fwd, bwd, bwd128 = (descriptor_lists(d, kind) for kind in KINDS)
        for lists in (fwd, bwd, bwd128):
            check_well_formed(lists)
            empty_row |= bool(((lists.mask_cnt == 0) & (lists.full_cnt == 0)).any())
        assert all(torch.equal(a, b) for a, b in zip(descriptor_lists(d), fwd))  # the default
        n_m, n_n = d.fwd_tiles.num_blocks(sq, sk)
        assert fwd.mask_idx.shape == (B, 1, n_m, n_n) and bwd128.mask_idx.shape == (B, 1, n_n, n_m)
        # (a) the lists re-expand to the bitmaps' states exactly
        assert torch.equal(to_dense_states(fwd), d.tile_states()), what
        assert torch.equal(to_dense_states(bwd), d.tile_states(backward=True)), what
        # (d) the forward bitmap by columns = the backward bitmap of a 128x128 backward tiling
        assert torch.equal(to_dense_states(bwd128), d.tile_states().transpose(1, 2)), what
        n_m128, _ = d128.bwd_tiles.num_blocks(sq, sk)
        assert_lists_equal(lists_from_bitmap(d128.bwd_bitmap, n_m128), bwd128, what)
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
    if name not in ("causal", "sliding_window", "dilated_causal", "prefix_lm", "packed_documents",
                    "packed_prefix_lm", "tree_verify"):  # every row sees itself
        assert empty_row, f"{name}: no row without visible tiles was drawn"


def test_list_pass_rows_columns_and_errors(masks):
    """Which bitmap each kind reads, by rows or by columns, and its list shape; unknown kinds
    and a ``bwd64`` over other backward tiles are refused."""
    F, Bw = DEFAULT_FWD_TILES, DEFAULT_BWD_TILES
    # Sq = 300: 3 q tiles of 128, 5 of 64; Sk = 517: 5 kv tiles of 128
    assert list_pass("fwd", F, Bw, 300, 517) == ("fwd", 3, 5, False)
    assert list_pass("bwd64", F, Bw, 300, 517) == ("bwd", 5, 5, False)
    assert list_pass("bwd128", F, Bw, 300, 517) == ("fwd", 5, 3, True)
    assert list_pass("bwd128", F, TILES_128, 300, 517) == ("fwd", 5, 3, True)
    with pytest.raises(ValueError, match="kind must be one of"):
        list_pass("bwd32", F, Bw, 300, 517)
    with pytest.raises(ValueError, match="bwd64 lists need 64x128 backward tiles"):
        list_pass("bwd64", F, TILES_128, 300, 517)
    d, d128 = descriptors(masks["hstu"], 2, 300, 517)
    for kind in KINDS:
        _, rows, cols, _ = list_pass(kind, d.fwd_tiles, d.bwd_tiles, 300, 517)
        assert descriptor_lists(d, kind).mask_idx.shape == (2, 1, rows, cols)
    with pytest.raises(ValueError, match="kind must be one of"):
        descriptor_lists(d, "bwd32")
    with pytest.raises(ValueError, match="kind must be one of"):
        d.block_sparse("bwd32")
    with pytest.raises(ValueError, match="bwd64 lists need 64x128"):
        descriptor_lists(d128, "bwd64")


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

# 2 threads per row: 32-tile chunks, so that short rows take several chunks
SMALL = tlb.ListsConfig(tpr=2, tpr_transposed=2)
# the read by columns with fewer threads per block than the read by rows: in one launch, its
# stages run guarded by `tx < THREADS` on CUDA
GUARDED = tlb.ListsConfig(tpr=16, tpr_transposed=2)


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


def run_plan(words, pl, rows: int, cols: int) -> BlockSparseLists:
    """One kind through the one-part program of ``pl``, viewed as its four outputs."""
    mp = tlb.MultiPlan(((pl, 0),), 1)
    dims = ((rows, cols),)
    buf = tlb.block_sparse_multi((words,), mp, dims)
    return PackedLists(buf, words.shape[0], {"k": (mp.offsets(dims)[0], rows, cols)}).view("k")


@pytest.mark.slow  # one-kind programs of their own; the descriptor's are the packed test's
@pytest.mark.parametrize("name", NAMES)
def test_c_target_equals_reference(masks, name):
    for B, sq, sk in shapes_for(masks[name], TL_SHAPES):
        d, _ = descriptors(masks[name], B, sq, sk)
        for kind in KINDS:
            which, rows, cols, transpose = list_pass(kind, d.fwd_tiles, d.bwd_tiles, sq, sk)
            bitmap = d.fwd_bitmap if which == "fwd" else d.bwd_bitmap
            out = tlb.block_sparse_lists(bitmap, rows if transpose else cols, transpose)
            assert_lists_equal(descriptor_lists(d, kind), out, f"{name} B={B} Sq={sq} Sk={sk} "
                                                               f"{kind}")


@pytest.mark.parametrize("name", ["hstu", "clear", "dilated_causal"])
def test_c_target_packed_equals_reference(masks, name):
    """Every kind in one launch (one flat buffer): each kind's views equal the torch reference,
    and a descriptor carrying them serves ``block_sparse(kind)`` from them."""
    m = masks[name]
    for B, sq, sk in shapes_for(m, TL_SHAPES):
        d, _ = descriptors(m, B, sq, sk)
        what = f"{name} B={B} Sq={sq} Sk={sk}"
        # on the CPU the pipeline writes no lists: block_sparse computes them when asked
        assert d.lists is None and pipeline.with_lists(d) is d
        first, second = d.block_sparse("fwd"), d.block_sparse("fwd")
        assert first.mask_idx.data_ptr() != second.mask_idx.data_ptr()  # computed, not cached
        assert_lists_equal(descriptor_lists(d), first, what)
        packed = tlb.packed_lists(d.fwd_bitmap, d.bwd_bitmap, d.fwd_tiles, d.bwd_tiles, sq, sk)
        assert isinstance(packed, PackedLists) and packed.batch_size == B
        assert packed.kinds == KINDS and packed.buffer.dim() == 1
        ends = []
        for kind in KINDS:
            got = packed.view(kind)
            assert_lists_equal(descriptor_lists(d, kind), got, f"{what} {kind}")
            assert all(t.is_contiguous() for t in got)
            ends.append(got.full_idx.data_ptr() + got.full_idx.numel() * 4)
        # the kinds tile the buffer: nothing allocated twice, nothing left over
        assert ends[-1] == packed.buffer.data_ptr() + packed.buffer.numel() * 4
        lone = dataclasses.replace(d, lists=packed)
        storage = packed.buffer.untyped_storage().data_ptr()
        for kind in KINDS:
            got = lone.block_sparse(kind)
            assert isinstance(got, BlockSparseLists)
            # views of the one buffer the launch wrote: no copy, no second computation
            assert all(t.untyped_storage().data_ptr() == storage for t in got)
            assert_lists_equal(descriptor_lists(d, kind), got, f"{what} {kind} via the "
                                                               "descriptor")
        moved = lone.to("cpu")
        assert moved.lists is not None and moved.lists.kinds == KINDS
        assert torch.equal(moved.lists.buffer, packed.buffer)
        assert_lists_equal(descriptor_lists(d), moved.block_sparse("fwd"), "moved")
    for kinds in (("bwd64",), ("bwd128", "fwd")):  # a subset: only the bitmaps it reads
        packed = tlb.packed_lists(d.fwd_bitmap, d.bwd_bitmap, d.fwd_tiles, d.bwd_tiles, sq, sk,
                                  kinds=kinds)
        assert packed.kinds == kinds
        for kind in kinds:
            assert_lists_equal(descriptor_lists(d, kind), packed.view(kind),
                               f"{name} {kinds} {kind}")
        # a kind the lists lack: the descriptor computes it (torch reference)
        part = dataclasses.replace(d, lists=packed)
        for kind in set(KINDS) - set(kinds):
            assert_lists_equal(descriptor_lists(d, kind), part.block_sparse(kind),
                               f"{name} {kind} not in {kinds}")
    with pytest.raises(ValueError, match="kind must be one of"):
        tlb.packed_lists(d.fwd_bitmap, d.bwd_bitmap, d.fwd_tiles, d.bwd_tiles, sq, sk,
                         kinds=("fwd", "bwd32"))


@pytest.mark.slow  # its own program (SMALL); the default config's: test_c_target_packed_*
def test_c_target_packed_lists_every_length():
    """The pipeline's program (FA4's three kinds in one launch) at lengths that give 1x1 lists,
    shapes off the word size, several chunks per row (32-tile chunks) and other batch sizes:
    equal to the reference, compiled once for all of them."""
    F, Bw = DEFAULT_FWD_TILES, DEFAULT_BWD_TILES
    before = None
    for n, (B, sq, sk) in enumerate([(1, 1, 1), (2, 300, 517), (3, 2100, 5000),
                                     (1, 5000, 130)]):
        n_m, n_n = F.num_blocks(sq, sk)
        m_b, n_b = Bw.num_blocks(sq, sk)
        fwd = random_bitmap(B, n_m, n_n, seed=10 * n)
        bwd = random_bitmap(B, n_b, m_b, seed=10 * n + 1)
        packed = tlb.packed_lists(fwd, bwd, F, Bw, sq, sk, config=SMALL)
        for kind in KINDS:
            assert_lists_equal(kind_reference(kind, fwd, bwd, sq, sk), packed.view(kind),
                               f"B={B} Sq={sq} Sk={sk} {kind}")
        if before is None:
            before = tlb.compile_count()  # the first length may compile the program
    # Sq = 2100, Sk = 5000: a forward row has 40 kv tiles, a bwd64 row 33 q tiles: 2 chunks each
    assert tlb.plan(config=SMALL).chunks(F.num_blocks(2100, 5000)[1]) == 2
    assert tlb.compile_count() == before


@pytest.mark.parametrize("transpose", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_c_target_one_program_for_every_shape(transpose):
    """One compiled list program serves every (rows, columns) and batch: 1x1, rows and columns
    not multiples of 16, exactly one word, several chunks per row; each equals the reference,
    and no shape after the first compiles anything."""
    pl = tlb.plan(transpose, fill=True, config=SMALL)
    one = pack_bitmap(torch.tensor([[[TILE_FULL]], [[TILE_PARTIAL]]], dtype=torch.uint8))
    cases = [(one, 1)] + [(random_bitmap(B, N, T, seed=n), T) for n, (B, N, T) in
                          enumerate([(2, 5, 37), (3, 17, 16), (2, 40, 100), (1, 3, 300)])]
    before = None
    chunks = set()
    for words, T in cases:
        N = words.shape[1]
        rows, cols = (T, N) if transpose else (N, T)
        ref = lists_from_bitmap(words, T, transpose=transpose)
        out = run_plan(words, pl, rows, cols)
        # fill: every entry written, so all of them equal the reference's
        assert all(torch.equal(a, b) for a, b in zip(ref, out)), f"{rows}x{cols}"
        chunks.add(pl.chunks(cols))
        if before is None:
            before = tlb.compile_count()  # the first shape may compile the program
    assert tlb.compile_count() == before
    assert max(chunks) > 1 and 1 in chunks


@pytest.mark.slow  # its own program (GUARDED)
def test_c_target_multi_plan_guards_and_layout():
    """Parts with fewer threads than the launch (guarded stages), a part per bitmap read both
    ways, rows not a multiple of a block's: each part equals the reference."""
    B = 2
    f = random_bitmap(B, 9, 37, seed=1)  # 9 row tiles x 37 column tiles
    g = random_bitmap(B, 37, 18, seed=2)
    mp = tlb.multi_plan([(False, 0), (False, 1), (True, 0)], 2, GUARDED)
    dims = ((9, 37), (37, 18), (37, 9))
    assert len({pl.threads for pl, _ in mp.parts}) > 1  # some parts are guarded on CUDA
    buf = tlb.block_sparse_multi((f, g), mp, dims)
    assert buf.numel() == B * mp.per_sequence(dims) == B * sum(2 * r * (c + 1) for r, c in dims)
    assert [pl.rpb for pl, _ in mp.parts] == [16, 16, 16]  # 37 rows: 3 blocks, the last short
    refs = [lists_from_bitmap(f, 37), lists_from_bitmap(g, 18),
            lists_from_bitmap(f, 37, transpose=True)]
    layout = {k: (offs, r, c) for k, offs, (r, c) in zip("abc", mp.offsets(dims), dims)}
    packed = PackedLists(buf, B, layout)
    for kind, ref in zip("abc", refs):
        assert_lists_equal(ref, packed.view(kind), f"part {kind}")
    src = tlb.multi_source(mp, "cuda")
    assert src.count("if tx < THREADS_") > 0 and "def block_sparse_multi(" in src
    for k in range(3):
        assert f"bx_{k} = gx - " in src and f"MASK_IDX_OFF_{k} = " in src
        assert f"R_{k}: T.int32" in src and f"C_{k}: T.int32" in src  # run-time shapes
    with pytest.raises(ValueError, match="must read bitmaps"):
        tlb.multi_plan([(False, 2)], 2)
    with pytest.raises(ValueError, match=r"need \(rows >= 1, cols >= 1\) for each of 3 parts"):
        tlb.block_sparse_multi((f, g), mp, dims[:2])
    with pytest.raises(ValueError, match=r"need \(rows >= 1"):
        tlb.block_sparse_multi((f, g), mp, ((0, 37),) + dims[1:])


@pytest.mark.slow  # a program per thread layout
def test_c_target_thread_layouts():
    """Several chunks per row (small configs; the default one past 256 tiles), two words per
    thread, one thread per row, rows not a multiple of the block's, the transposed read, zeros
    past the counts with ``fill``."""
    one = tlb.ListsConfig(tpr_transposed=1)
    two_words = tlb.ListsConfig(tpr=2, wpt=2)
    cases = [(2, 7, 100, False, True, SMALL),  # 4 chunks of 32 tiles
             (2, 100, 7, True, True, SMALL),
             (2, 6, 150, False, False, two_words),  # 3 chunks of 64 tiles
             (3, 5, 37, True, True, one),  # TPR = 1; 37 rows over blocks of 16
             (1, 3, 1100, False, False, tlb.ListsConfig())]  # 5 chunks of 256 tiles
    for n, (B, N, T, transpose, fill, config) in enumerate(cases):
        words = random_bitmap(B, N, T, seed=n)
        ref = lists_from_bitmap(words, T, transpose=transpose)
        rows, cols = (T, N) if transpose else (N, T)
        pl = tlb.plan(transpose, fill, config)
        out = run_plan(words, pl, rows, cols)
        assert_lists_equal(ref, out, f"{pl}")
        if fill:
            assert all(torch.equal(a, b) for a, b in zip(ref, out)), f"fill {pl}"
    assert tlb.plan(config=SMALL).chunk == 32 and tlb.plan(config=SMALL).chunks(100) == 4
    assert tlb.plan(config=two_words).chunk == 64 and tlb.plan(config=two_words).chunks(150) == 3
    assert tlb.plan().chunks(1100) == 5
    pl = tlb.plan(True, config=one)
    assert (pl.tpr, pl.rpb, pl.threads) == (1, 16, 16)
    with pytest.raises(ValueError, match="power of 2"):
        tlb.plan(config=tlb.ListsConfig(tpr=3))
    with pytest.raises(ValueError, match="15 bits"):
        tlb.plan(config=tlb.ListsConfig(tpr=2048))
    small_smem = tlb.ListsConfig(tpr=64, smem_budget=16 * 1024)
    assert tlb.plan(config=small_smem).rpb < tlb.plan(config=tlb.ListsConfig(tpr=64)).rpb
    with pytest.raises(ValueError, match="bytes of shared memory"):
        tlb.plan(config=tlb.ListsConfig(smem_budget=100))


def test_c_target_entry_point_and_cache():
    words = random_bitmap(2, 17, 17, seed=9)  # the list shape of TL_SHAPES[0]'s forward
    ref = lists_from_bitmap(words, 17)
    assert_lists_equal(ref, tlb.block_sparse_lists(words, 17), "entry point")
    assert_lists_equal(ref, codegen.block_sparse_lists(words, 17), "package export")
    before = tlb.compile_count()
    again = tlb.block_sparse_lists(words.flip(0).contiguous(), 17)
    assert_lists_equal(lists_from_bitmap(words.flip(0), 17), again, "again")
    other = random_bitmap(3, 40, 300, seed=10)  # another shape and batch size
    assert_lists_equal(lists_from_bitmap(other, 300), tlb.block_sparse_lists(other, 300),
                       "another shape")
    assert tlb.compile_count() == before  # new values, shapes and batch: no compile
    words = random_bitmap(2, 20, 300, seed=9)
    with pytest.raises(ValueError, match="packed_tiles=300 needs 19 words"):
        tlb.block_sparse_lists(words[..., :18].contiguous(), 300)
    with pytest.raises(ValueError, match="must be int32"):
        tlb.block_sparse_lists(words.to(torch.int64), 300)
    pl = tlb.plan()
    src = tlb.tilelang_source(pl, "c")
    assert "T.get_thread_binding" not in src and "for tx in T.serial(THREADS_0):" in src
    assert src == tlb.multi_source(tlb.MultiPlan(((pl, 0),), 1), "c")  # a one-part program
    src = tlb.tilelang_source(tlb.plan(True), "cuda")
    assert src.startswith("# TileLang block-sparse lists")
    for role in ('bitmap0: T.Tensor((B, NR0, W0), "int32")', 'lists: T.Tensor((N,), "int32")',
                 "R_0: T.int32", "C_0: T.int32", "MASK_CNT_OFF_0", "MASK_IDX_OFF_0",
                 "FULL_CNT_OFF_0", "FULL_IDX_OFF_0", "# stage 1a", "# stage 4",
                 "T.sync_threads()"):
        assert role in src
    with pytest.raises(ValueError):
        tlb.tilelang_source(tlb.plan(), "rocm")


nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@nvcc
@pytest.mark.slow  # both reads are parts of the program test_cuda_multi_source_* compiles
@pytest.mark.parametrize("transpose", [False, True])
def test_cuda_source_compiles_sm90a(transpose):
    """One kind's program, for every shape (rows and columns are its arguments): the forward
    read and the transposed read."""
    kern = tlb.multi_kernel(tlb.multi_plan([(transpose, 0)], 1), "cuda")
    src = kern.get_kernel_source()
    assert "__global__" in src and "__syncthreads" in src


@nvcc
def test_cuda_list_programs_compile_sm90a():
    """The programs ``packed_lists`` runs for FA4's kinds at every length (one per read), compiled
    at once by ``prebuild`` as a descriptor's first use does; loading them compiles nothing
    more."""
    from compilemask.codegen import tilelang_build as tb

    progs = tlb.list_programs()
    assert len(progs) == 2
    tb.prebuild(progs)
    for p in progs:
        src = tb.compile_program(*p).get_kernel_source()
        assert "__global__" in src and "__syncthreads" in src


@nvcc
@sweep("config", [tlb.ListsConfig(), GUARDED], default=[])
def test_cuda_multi_source_compiles_sm90a(config):
    """The three kinds of one FA4 descriptor in one kernel, the one ``packed_lists`` runs at
    every length (with ``GUARDED``: parts of fewer threads than the launch)."""
    mp = tlb.multi_plan([(False, 0), (False, 1), (True, 0)], 2, config)
    before = tlb.compile_count()
    src = tlb.multi_kernel(mp, "cuda").get_kernel_source()
    assert "__global__" in src and "__syncthreads" in src
    assert tlb.multi_kernel(mp, "cuda") is tlb.multi_kernel(mp, "cuda")
    assert tlb.compile_count() <= before + 1


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_equals_reference():
    before = tlb.compile_count()
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
    # one program per (transpose, fill) served every shape
    assert tlb.compile_count() <= before + 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_gpu_descriptor_packed_lists(masks, name):
    """A CUDA preprocess writes every kind in one launch; each equals the torch reference, and
    one compiled list program serves both lengths."""
    m = masks[name]
    if m.native_pattern is not None:
        pytest.skip("native masks take no lists")
    counts = []
    for B, S in ((2, 2100), (1, 32768)):
        meta = random_meta(m.spec, B, S, torch.Generator().manual_seed(S))
        meta = {k: v.cuda() for k, v in meta.items()}
        d = m.preprocess(meta, S, S, batch_size=B, device="cuda")  # no params: say where
        assert d.lists is not None and d.lists.kinds == KINDS and d.lists.buffer.is_cuda
        storage = d.lists.buffer.untyped_storage().data_ptr()
        for kind in KINDS:
            got = d.block_sparse(kind)
            assert all(t.untyped_storage().data_ptr() == storage for t in got)  # views
            assert_lists_equal(descriptor_lists(d, kind), got, f"{name} {kind} B={B} S={S}")
        counts.append(tlb.compile_count())
    assert counts[1] == counts[0]  # the second length compiled nothing


def test_interval_coverage_equals_the_reach_iteration():
    """The union-measure coverage (sorted slots, cummax of ends) decides as the TileLang
    program's reach iteration does, on random overlapping and empty slots and partial tiles."""
    from compilemask.compiler.tiles import _covered

    def reach(starts, ends, col0, col1):
        B, Sq, K = starts.shape
        r = col0.expand(B, Sq, col0.numel()).clone()
        for _ in range(K):
            for k in range(K):
                sk, ek = starts[:, :, k : k + 1], ends[:, :, k : k + 1]
                r = torch.where((sk <= r) & (r < ek), ek.expand_as(r), r)
        return r >= col1

    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        K, Sk, tn = (int(torch.randint(lo, hi, (1,), generator=g))
                     for lo, hi in ((1, 7), (1, 300), (1, 70)))
        col0 = torch.arange(-(-Sk // tn)) * tn
        col1 = torch.clamp(col0 + tn, max=Sk)
        starts = torch.randint(0, Sk, (2, 5, K), generator=g)
        lens = torch.randint(0, Sk, (2, 5, K), generator=g) * (torch.rand(2, 5, K, generator=g)
                                                              < 0.8)
        ends = torch.minimum(starts + lens, torch.tensor(Sk))
        assert torch.equal(_covered(starts, ends, col0, col1), reach(starts, ends, col0, col1))
