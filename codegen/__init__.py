"""Code generation from compiled masks: TileLang preprocess programs, CuTe predicates."""


def tilelang_source(mask, target: str = "cuda") -> str:
    from compilemask.codegen.preprocess import tilelang_source as _src

    return _src(mask, target=target)


def block_sparse_lists(bitmap, packed_tiles: int, transpose: bool = False, **kw):
    """flash-attn-4 block-sparse lists from a Tile-State Bitmap (see codegen.blocksparse)."""
    from compilemask.codegen.blocksparse import block_sparse_lists as _lists

    return _lists(bitmap, packed_tiles, transpose, **kw)


__all__ = ["tilelang_source", "block_sparse_lists"]
