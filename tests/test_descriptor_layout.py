"""The descriptor contract's layout helpers and its custom-op form (DescriptorArgs)."""

import torch

import compilemask as cm
from compilemask import masks
from compilemask.descriptor import (
    TILE_EMPTY,
    TILE_FULL,
    TILE_PARTIAL,
    TILES_PER_WORD,
    DescriptorArgs,
    bitmap_shape,
    bitmap_words,
    in_interval,
    is_partial,
    state_in_word,
    tile_word,
)
from compilemask.tiles import pack_bitmap


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
