"""Layer 2, the middle end: a MaskSpec's rules -> interval descriptors (compiler,
prover, segments, native patterns, columns, tiles, bounds, block-sparse lists) and the
reference paths. Imports contract and dsl."""
