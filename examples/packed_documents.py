"""Packed documents: several documents in one sequence, causal within each.

``doc_start`` is a per-row array (``[B, Sq]``): the first row of the document that row i is in.
Subscripting a param by ``i`` keeps the rule an interval rule (K = 1).

    python examples/packed_documents.py  # explain, check, picture in examples/out/
"""

from __future__ import annotations

import compilemask as cm
from compilemask.showcase import run_example

SPEC = cm.MaskSpec("packed_documents", params=["doc_start"], regions=[
    cm.Region("doc", when=lambda i: True,
              visible=lambda i, j: doc_start[i] <= j <= i),  # noqa: F821 (a per-row param)
])


def main(seqlen: int = 512, batch: int = 2, seed: int = 0, out_dir=None, show_code: bool = True):
    """Compile and explain SPEC, preprocess random metadata, check the descriptor's mask
    against the brute-force mask of the Python rules, save the picture, print the tiles."""
    return run_example(SPEC, __file__, seqlen=seqlen, batch=batch, seed=seed, out_dir=out_dir,
                       show_code=show_code)


if __name__ == "__main__":
    main()
