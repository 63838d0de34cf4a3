"""Which mask module a spec came from: every factory registers the name of the spec it returns
with its module's recipes, bound to the factory's arguments (a window, a grid width)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from compilemask.contract.lru import LRU
from compilemask.dsl import MaskSpec
from compilemask.pipeline.compiled import compile_mask

__all__ = ["Recipes", "register", "recipes_for", "show"]


@dataclass(frozen=True)
class Recipes:
    """A mask module's functions for one spec: ``random_meta(batch_size, seqlen, gen)``,
    ``flex_mask_mod(meta, seqlen)`` and ``bench_meta(batch, seqlen, seed)`` (None where the
    module has none)."""

    module: str
    random_meta: Callable
    flex_mask_mod: Callable | None = None
    bench_meta: Callable | None = None


# keyed by name, not by object: a spec that was copied or rebuilt under the same name (the
# name encodes the factory's arguments) still finds its recipes
_BY_NAME = LRU(4096)  # name -> Recipes (a few hundred bytes): a factory's arguments make new names


def register(spec: MaskSpec, recipes: Recipes) -> MaskSpec:
    """Record ``recipes`` for ``spec.name``; returns ``spec`` (a factory's last line)."""
    _BY_NAME[spec.name] = recipes
    return spec


def recipes_for(spec: MaskSpec) -> Recipes:
    """The recipes of the factory that built ``spec`` (KeyError for other specs)."""
    try:
        return _BY_NAME[spec.name]
    except KeyError:
        raise KeyError(f"no random metadata recipe for mask {spec.name!r} (the factories of "
                       f"compilemask.masks register theirs)") from None


def show(spec: MaskSpec, seqlen: int = 256, batch: int = 1, seed: int = 0,
         before: Callable | None = None):
    """A mask module's ``main()``: compile and explain ``spec``, preprocess random metadata,
    print the tiles; ``before(mask)`` prints more after the explanation."""
    import torch

    mask = compile_mask(spec)
    print(mask.explain(show_code=False))
    if before is not None:
        before(mask)
    meta = recipes_for(spec).random_meta(batch, seqlen, torch.Generator().manual_seed(seed))
    desc = mask.preprocess(meta, seqlen_q=seqlen, seqlen_k=seqlen, batch_size=batch,
                           fwd_tiles=(64, 64))
    if meta:
        print("metadata of sequence 0:",
              {k: (v[0].tolist() if v.dim() == 1 else "per-row array" if v.dim() == 2 else "table")
               for k, v in meta.items()})
    print(desc.to_string(batch=0))
    return desc
