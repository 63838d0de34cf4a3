"""Code generation from compiled masks: the TileLang preprocess and tile-list programs
(``preprocess``, ``blocksparse``, on the shared ``tilelang_build``), the CuTe predicates and
flash-attn-4 ``mask_mod`` (``cute_predicate``, ``cute_mask_mod``)."""

from compilemask.codegen.blocksparse import block_sparse_lists
from compilemask.codegen.preprocess import tilelang_source

__all__ = ["tilelang_source", "block_sparse_lists"]
