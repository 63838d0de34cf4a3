"""One in-process cache for compiled kernels (CuTe, TileLang) and generated functions."""

from __future__ import annotations

import threading
from typing import Callable, Hashable

from compilemask.lru import LRU

__all__ = ["CompileCache", "register_mask", "mask_for_key"]


class CompileCache:
    """Built objects by semantic key (a config, the compile target, the kernel options...),
    each built at most once per process, thread-safe.

    Builds of different keys run in parallel (one at a time with ``serial``, for a compiler
    that is not thread-safe); a second caller of a key being built waits for that build
    instead of compiling it again. A build that raises stores nothing (the next caller
    retries)."""

    def __init__(self, name: str, serial: bool = False, maxsize: int = 256):
        self.name = name
        self._serial = threading.Lock() if serial else None
        self.builds = 0  # how many times a build ran (tests: no recompile)
        # the maxsize most recently used builds (a job of ever new masks would keep each kernel);
        # a dropped one is built again, from the compilers' disk caches where they have it
        self._items = LRU(maxsize)
        self._building: dict = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], object], use_cache: bool = True):
        """The object cached for ``key``, else ``build()`` (stored); ``use_cache=False``
        builds anew and stores nothing (e.g. to dump the compiler's intermediate files)."""
        if not use_cache:
            return self._build(build)
        with self._lock:
            if key in self._items:
                return self._items[key]
            key_lock = self._serial or self._building.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._items:
                    return self._items[key]
            value = self._build(build)
            with self._lock:
                self._items[key] = value
                self._building.pop(key, None)
        return value

    def _build(self, build):
        value = build()
        with self._lock:
            self.builds += 1
        return value

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def clear(self):
        with self._lock:
            self._items.clear()

    def __repr__(self) -> str:
        return f"CompileCache({self.name!r}, {len(self)} entries, {self.builds} builds)"


# The one registry of compiled masks: semantic key -> the first CompiledMask compiled with it
# (equal keys compile to equal code). ``compile_mask`` registers; the custom ops, which carry
# the key (a string), find the mask here, also when a traced graph replays them.
_MASKS: dict = {}


def register_mask(mask) -> str:
    """Keep ``mask`` reachable from its semantic key; returns the key."""
    key = str(mask.key)
    _MASKS.setdefault(key, mask)
    return key


def mask_for_key(key: str):
    """The compiled mask of a semantic key."""
    try:
        return _MASKS[key]
    except KeyError:
        raise KeyError(f"no compiled mask with key {key!r} in this process") from None
