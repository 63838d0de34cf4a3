"""The descriptor contract's layout helpers, its packed tile lists (PackedLists, ``lists``) and
its custom-op form (DescriptorArgs)."""

import dataclasses

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.compiler import blocksparse, tiles
from compilemask.compiler.blocksparse import descriptor_lists, list_pass
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    LIST_KINDS,
    TILE_EMPTY,
    TILE_FULL,
    TILE_PARTIAL,
    TILES_PER_WORD,
    BlockSparseLists,
    DescriptorArgs,
    PackedLists,
    TileConfig,
    bitmap_shape,
    bitmap_words,
    in_interval,
    is_partial,
    pack_bitmap,
    state_in_word,
    tile_word,
    unpack_bitmap,
)


def _desc(B=2, S=40):
    spec = masks.hstu()
    meta = masks.random_meta(spec, B, S, gen=torch.Generator().manual_seed(3))
    return cm.compile_mask(spec).preprocess(meta, seqlen_q=S, fwd_tiles=(8, 8),
                                            bwd_tiles=(4, 8), backend="torch")


def test_word_arithmetic_matches_the_packed_bitmap():
    """The helpers the kernels use (shifts and masks) decode what ``pack_bitmap`` writes, on
    Python ints."""
    gen = torch.Generator().manual_seed(0)
    states = torch.tensor([TILE_EMPTY, TILE_FULL, TILE_PARTIAL])[
        torch.randint(0, 3, (1, 2, 37), generator=gen)].to(torch.uint8)
    words = pack_bitmap(states)
    assert words.shape == bitmap_shape(1, 2, 37) and bitmap_words(37) == -(-37 // TILES_PER_WORD)
    for r in range(2):
        for t in range(37):
            got = state_in_word(int(words[0, r, tile_word(t)]), t)
            assert got == int(states[0, r, t])
            assert is_partial(got) == (got == TILE_PARTIAL)
    assert [bitmap_words(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_in_interval_is_the_unsigned_compare():
    j = torch.arange(-3, 40)
    for start, length in ((0, 0), (5, 1), (7, 20), (0, 39)):
        want = ((j - start) % 2**32) < length
        assert torch.equal(in_interval(j, start, length), want)


def test_descriptor_args_round_trip():
    desc = _desc()
    d = DescriptorArgs.of(desc)
    args = d.to_op_args()
    assert DescriptorArgs.from_op_args(args + ("after",)) == d
    back = d.descriptor(desc.mask)
    assert torch.equal(back.dense_mask(), desc.dense_mask())
    assert (back.fwd_tiles, back.bwd_tiles) == (desc.fwd_tiles, desc.bwd_tiles)
    assert len(d.tensors()) == len(DescriptorArgs.tensor_fields())
    assert d.tensors() + d.scalars() == args


def test_op_schemas_list_the_descriptor_fields():
    import compilemask.kernels  # noqa: F401  (registers the ops)

    for op in (torch.ops.compilemask.attention_fwd, torch.ops.compilemask.attention_bwd):
        names = [a.name for a in op.default._schema.arguments]
        first = names.index(DescriptorArgs._fields[0])
        assert tuple(names[first:first + len(DescriptorArgs._fields)]) == DescriptorArgs._fields


def test_contract_homes():
    """The default tilings (FA4's) and the bitmap packing live in the contract; the modules that
    use them re-export the same objects."""
    assert (DEFAULT_FWD_TILES, DEFAULT_BWD_TILES) == (TileConfig(128, 128), TileConfig(64, 128))
    from compilemask.pipeline import compiled

    assert (compiled.DEFAULT_FWD_TILES, compiled.DEFAULT_BWD_TILES) == (DEFAULT_FWD_TILES,
                                                                        DEFAULT_BWD_TILES)
    assert tiles.pack_bitmap is pack_bitmap and tiles.unpack_bitmap is unpack_bitmap
    assert blocksparse.unpack_bitmap is unpack_bitmap
    assert blocksparse.BlockSparseLists is BlockSparseLists
    assert blocksparse.PackedLists is PackedLists
    assert set(LIST_KINDS) == {"fwd", "bwd64", "bwd128"}


def _fa4_desc(B=3, S=300):
    spec = masks.hstu()
    meta = masks.random_meta(spec, B, S, gen=torch.Generator().manual_seed(3))
    return cm.compile_mask(spec).preprocess(meta, seqlen_q=S, backend="torch")


def _packed(desc, kinds):
    """PackedLists of ``kinds`` laid out as the contract says (per kind mask_cnt, mask_idx,
    full_cnt, full_idx, each [B, ...] flat, back to back), from the torch reference."""
    parts, layout, at = [], {}, 0
    for kind in kinds:
        lists = descriptor_lists(desc, kind)
        R, C = lists.num_rows, lists.num_cols
        layout[kind] = ((at, at + R, at + R + R * C, at + 2 * R + R * C), R, C)
        at += 2 * (R + R * C)
        parts += [t.flatten() for t in lists]
    return PackedLists(torch.cat(parts), desc.batch_size, layout)


def test_packed_lists_views_and_the_descriptor():
    """``PackedLists.view`` gives each kind's four tensors as views of the one buffer; a
    descriptor carrying lists serves ``block_sparse`` from them (kinds it lacks are computed),
    ``to`` moves them; without lists every call computes the torch reference."""
    desc = _fa4_desc()  # FA4's tilings: every kind exists
    assert desc.lists is None  # the torch preprocess writes none
    a, b = desc.block_sparse("bwd64"), desc.block_sparse("bwd64")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a.mask_idx.data_ptr() != b.mask_idx.data_ptr()  # computed per call, not cached
    packed = _packed(desc, ("fwd", "bwd128"))
    assert packed.kinds == ("fwd", "bwd128") and packed.batch_size == 3
    storage = packed.buffer.untyped_storage().data_ptr()
    carrying = dataclasses.replace(desc, lists=packed)
    for kind in packed.kinds:
        view = packed.view(kind)
        _, rows, cols, _ = list_pass(kind, desc.fwd_tiles, desc.bwd_tiles, 300, 300)
        assert view.mask_cnt.shape == view.full_cnt.shape == (3, 1, rows)
        assert view.mask_idx.shape == view.full_idx.shape == (3, 1, rows, cols)
        assert all(t.untyped_storage().data_ptr() == storage for t in view)  # no copy
        got = carrying.block_sparse(kind)
        assert all(t.untyped_storage().data_ptr() == storage for t in got)
        assert all(torch.equal(x, y) for x, y in zip(got, descriptor_lists(desc, kind)))
    # bwd64 is not in the lists: computed from the backward bitmap
    got = carrying.block_sparse("bwd64")
    assert all(t.untyped_storage().data_ptr() != storage for t in got)
    assert all(torch.equal(x, y) for x, y in zip(got, a))
    moved = carrying.to("cpu")
    assert moved.lists is not None and moved.lists.layout == packed.layout
    assert torch.equal(moved.lists.buffer, packed.buffer)
    assert torch.equal(packed.to("cpu").buffer, packed.buffer)
    with pytest.raises(ValueError, match="kind must be one of"):
        carrying.block_sparse("bwd32")
