"""Mask factories with readable names: the paper's masks and the common ones.

One module per mask (``compilemask.masks.hstu``, ...) holds its factory (a MaskSpec), its
metadata recipe ``random_meta(batch_size, seqlen, gen)``, its FlexAttention equivalent
``flex_mask_mod(meta, seqlen)`` and a ``main()`` that shows it (``python -m
compilemask.masks.hstu``). Here: the factories, ``EXAMPLES``, and ``random_meta(spec, ...)``,
which finds the recipe of the factory that built ``spec``.

The factories are bound here under their modules' names, so ``compilemask.masks.hstu`` is the
factory; ``importlib.import_module("compilemask.masks.hstu")`` is the module."""

from __future__ import annotations

import warnings

import torch

from compilemask.dsl import MaskSpec
from compilemask.masks._registry import Recipes, recipes_for
from compilemask.masks.block_causal import block_causal
from compilemask.masks.causal import causal
from compilemask.masks.chunked_causal import chunked_causal
from compilemask.masks.clear import clear
from compilemask.masks.dilated_causal import dilated_causal
from compilemask.masks.draft_tree import draft_tree, draft_tree_meta
from compilemask.masks.hstu import hstu
from compilemask.masks.packed_documents import packed_documents
from compilemask.masks.packed_prefix_lm import packed_prefix_lm
from compilemask.masks.prefix_lm import prefix_lm
from compilemask.masks.shared_prompt_rm import shared_prompt_rm
from compilemask.masks.sink_window import sink_window
from compilemask.masks.sliding_window import sliding_window
from compilemask.masks.tree_verify import tree_meta, tree_verify

__all__ = [
    "causal",
    "sliding_window",
    "prefix_lm",
    "packed_documents",
    "packed_prefix_lm",
    "hstu",
    "shared_prompt_rm",
    "clear",
    "dilated_causal",
    "chunked_causal",
    "block_causal",
    "sink_window",
    "tree_verify",
    "tree_meta",
    "draft_tree",
    "draft_tree_meta",
    "random_meta",
    "flex_mask_mod",
    "recipes_for",
    "Recipes",
    "EXAMPLES",
]

# `python -m compilemask.masks.hstu` imports this package, which has imported the module, before
# running it as __main__; that is intended here (the __main__ copy registers its own recipes)
warnings.filterwarnings("ignore", category=RuntimeWarning,
                        message=r"'compilemask\.masks\.\w+' found in sys\.modules")

EXAMPLES = {
    "causal": causal,
    "sliding_window": lambda: sliding_window(7),
    "prefix_lm": prefix_lm,
    "packed_documents": packed_documents,
    "packed_prefix_lm": packed_prefix_lm,
    "hstu": hstu,
    "shared_prompt_rm": shared_prompt_rm,
    "clear": lambda: clear(1, 8),
    "dilated_causal": dilated_causal,
    "chunked_causal": lambda: chunked_causal(48),
    "block_causal": lambda: block_causal(16),
    "sink_window": lambda: sink_window(40, 3),
    "tree_verify": lambda: tree_verify(3),
}


def random_meta(spec: MaskSpec, batch_size: int, seqlen: int, gen: torch.Generator | None = None):
    """Random metadata for a spec built by one of the factories above, with degenerate cases
    (empty segments, segments past the end of the sequence)."""
    return recipes_for(spec).random_meta(batch_size, seqlen, gen)


def flex_mask_mod(spec: MaskSpec, meta: dict, seqlen: int | None = None):
    """The FlexAttention mask_mod(b, h, q_idx, kv_idx) of a factory-built spec, over ``meta``."""
    fn = recipes_for(spec).flex_mask_mod
    if fn is None:
        raise KeyError(f"mask {spec.name!r} has no FlexAttention mask_mod")
    return fn(meta, seqlen)
