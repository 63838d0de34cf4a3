"""Fallback predicates of a mask (the rules of its fallback regions) as the kernels take them:
generated ``@cute.jit`` sources, their hash (part of the compile-cache key) and the compiled
functions."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Fallback", "config_fields"]


@dataclass
class Fallback:
    """Fallback predicates for the kernel: one generated source per fallback region.

    Rows whose ``row_region`` equals ``regions[s]`` AND the interval test with predicate ``s``
    (in partial tiles; their tiles are never full). Every predicate takes all ``num_params``
    scalar params and all ``num_row_params`` per-row arrays of the descriptor, in order.
    """

    sources: tuple
    regions: tuple
    num_params: int
    num_row_params: int
    name: str = "fallback_predicate"
    _fns: Optional[tuple] = field(default=None, repr=False)

    @property
    def hash(self) -> str:
        h = hashlib.sha256()
        for src, reg in zip(self.sources, self.regions):
            h.update(f"{reg}:".encode() + src.encode())
        return h.hexdigest()[:16]

    def functions(self) -> tuple:
        if self._fns is None:
            compile_predicate = _codegen().compile_predicate
            self._fns = tuple(compile_predicate(src, self.name) for src in self.sources)
        return self._fns

    @staticmethod
    def from_expr(expr, scalar_params=(), array_params=(), regions=(0,)) -> "Fallback":
        """One predicate shared by all ``regions``."""
        src = _codegen().predicate_source(expr, scalar_params, array_params)
        regions = tuple(int(r) for r in regions)
        return Fallback(
            sources=(src,) * len(regions),
            regions=regions,
            num_params=len(tuple(scalar_params)),
            num_row_params=len(tuple(array_params)),
        )

    @staticmethod
    def from_mask(mask) -> Optional["Fallback"]:
        """From a ``CompiledMask``: the rule of each fallback region; None without fallback."""
        regs = [r for r in mask.regions if r.fallback]
        if not regs:
            return None
        ps = _codegen().predicate_source
        return Fallback(
            sources=tuple(ps(r.rule, mask.scalar_params, mask.array_params) for r in regs),
            regions=tuple(int(r.index) for r in regs),
            num_params=len(mask.scalar_params),
            num_row_params=len(mask.array_params),
        )


def config_fields(fallback: Optional[Fallback]) -> dict:
    """The fallback's fields of a forward or backward kernel config (none: no predicate)."""
    if fallback is None:
        return dict(has_fallback=False, fallback_hash="", fallback_regions=(), num_params=0,
                    num_row_params=0)
    return dict(has_fallback=True, fallback_hash=fallback.hash,
                fallback_regions=fallback.regions, num_params=fallback.num_params,
                num_row_params=fallback.num_row_params)


def _codegen():
    try:
        from ..codegen import cute_predicate  # as compilemask.kernels
    except (ImportError, ValueError):
        from codegen import cute_predicate  # from the repository root
    return cute_predicate
