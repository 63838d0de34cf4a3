"""MaskSpec and Region: what the user declares, once per mask pattern."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Region", "MaskSpec", "RESERVED_NAMES"]

# Names a rule may use without declaring them: the row, the key and the two lengths.
RESERVED_NAMES = ("i", "j", "seqlen_q", "seqlen_k")


@dataclass(frozen=True)
class Region:
    """Rows where ``when(i)`` holds see the keys where ``visible(i, j)`` holds.

    ``when`` and ``visible`` are plain Python functions or lambdas of ``(i)`` and ``(i, j)``.
    A row belongs to the first region (in declaration order) whose guard holds; rows covered by
    no guard see nothing.
    """

    name: str
    when: Callable
    visible: Callable

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"Region name must be an identifier string, got {self.name!r}")
        for role, fn, nargs in (("when", self.when, 1), ("visible", self.visible, 2)):
            if not callable(fn) or not hasattr(fn, "__code__"):
                raise TypeError(
                    f"Region {self.name!r}: {role} must be a plain Python function or lambda, "
                    f"got {type(fn).__name__}"
                )
            if fn.__code__.co_argcount != nargs:
                want = "(i)" if nargs == 1 else "(i, j)"
                raise TypeError(
                    f"Region {self.name!r}: {role} must take {nargs} argument(s) {want}, "
                    f"{fn.__name__} takes {fn.__code__.co_argcount}"
                )


@dataclass(frozen=True)
class MaskSpec:
    """A named attention mask: per-sequence integer metadata ``params`` and ordered ``regions``."""

    name: str
    params: Sequence[str] = field(default_factory=tuple)
    regions: Sequence[Region] = field(default_factory=tuple)
    # keys of the score_mods whose -inf condition the rules hold (``from_mask_mod(...,
    # score_mod=)``): the GPU engines run those score_mods' finite value on this mask
    masked_scores: frozenset = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "masked_scores", frozenset(self.masked_scores))
        for arg in ("params", "regions"):
            got = getattr(self, arg)
            if isinstance(got, (str, bytes, Region)) or not hasattr(got, "__iter__"):
                # a bare string would iterate to one-letter params
                fix = f"[{got!r}]" if isinstance(got, (str, Region)) else "a list"
                raise TypeError(f"MaskSpec {self.name!r}: {arg} must be a list, got "
                                f"{type(got).__name__} {got!r}; pass {fix}")
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "regions", tuple(self.regions))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"MaskSpec name must be a non-empty string, got {self.name!r}")
        seen = set()
        for p in self.params:
            if not isinstance(p, str) or not p.isidentifier():
                raise ValueError(f"MaskSpec {self.name!r}: param {p!r} is not an identifier")
            if p in RESERVED_NAMES:
                raise ValueError(f"MaskSpec {self.name!r}: param {p!r} is a reserved name")
            if p in seen:
                raise ValueError(f"MaskSpec {self.name!r}: param {p!r} declared twice")
            seen.add(p)
        if not self.regions:
            raise ValueError(f"MaskSpec {self.name!r}: regions must not be empty")
        names = set()
        for r in self.regions:
            if not isinstance(r, Region):
                raise TypeError(f"MaskSpec {self.name!r}: regions must be Region, got {r!r}")
            if r.name in names:
                raise ValueError(f"MaskSpec {self.name!r}: region {r.name!r} declared twice")
            names.add(r.name)


def canonical_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
