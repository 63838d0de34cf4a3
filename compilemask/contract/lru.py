"""Bounded, thread-safe stores for the package's process-wide caches.

A long job whose masks, lengths or captured values change keeps meeting new keys: every cache
that lives as long as the process holds at most ``maxsize`` entries, the least recently used
dropped first (a dropped entry is computed again when asked for). docs/operations.md lists each
cache and its bound; tests/test_bounded_state.py requires every module-level store to be one
of these (or a weak or constant table)."""

from __future__ import annotations

import linecache
import threading
from collections import OrderedDict

__all__ = ["LRU", "LRUSet"]

_MISSING = object()


class LRU:
    """A dict of at most ``maxsize`` entries: storing one more drops the least recently used
    (read or stored). Each operation holds a lock, so threads may share it; a compute-then-store
    race stores one of the equal values twice, as a dict would."""

    __slots__ = ("maxsize", "_items", "_lock")

    def __init__(self, maxsize: int):
        if not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"LRU: maxsize must be a positive int, got {maxsize!r}")
        self.maxsize = maxsize
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, default=None):
        with self._lock:
            value = self._items.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._items.move_to_end(key)
            return value

    def __getitem__(self, key):
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)

    def setdefault(self, key, default=None):
        with self._lock:
            value = self._items.get(key, _MISSING)
            if value is _MISSING:
                value = self._items[key] = default
                while len(self._items) > self.maxsize:
                    self._items.popitem(last=False)
            else:
                self._items.move_to_end(key)
            return value

    def pop(self, key, default=_MISSING):
        with self._lock:
            if default is _MISSING:
                return self._items.pop(key)
            return self._items.pop(key, default)

    def __delitem__(self, key) -> None:
        with self._lock:
            del self._items[key]

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        with self._lock:
            return iter(list(self._items))

    def keys(self) -> list:
        with self._lock:
            return list(self._items)

    def values(self) -> list:
        with self._lock:
            return list(self._items.values())

    def items(self) -> list:
        with self._lock:
            return list(self._items.items())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __repr__(self) -> str:
        return f"LRU({len(self)}/{self.maxsize})"


class LRUSet:
    """A set of at most ``maxsize`` members (``add``, ``in``, ``discard``, ``clear``): adding one
    more drops the least recently added or tested."""

    __slots__ = ("_lru",)

    def __init__(self, maxsize: int):
        self._lru = LRU(maxsize)

    @property
    def maxsize(self) -> int:
        return self._lru.maxsize

    def add(self, item) -> None:
        self._lru[item] = None

    def __contains__(self, item) -> bool:
        return self._lru.get(item, _MISSING) is not _MISSING

    def discard(self, item) -> None:
        self._lru.pop(item, None)

    def remove(self, item) -> None:
        self._lru.pop(item)

    def clear(self) -> None:
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self):
        return iter(self._lru)

    def __repr__(self) -> str:
        return f"LRUSet({len(self)}/{self.maxsize})"


_SOURCES: OrderedDict = OrderedDict()  # generated files this package put in linecache, oldest first
_SOURCES_LOCK = threading.Lock()
MAX_SOURCES = 512


def register_source(filename: str, text: str) -> None:
    """``text`` in ``linecache`` under ``filename``, so that tracebacks show generated lines.
    Past ``MAX_SOURCES`` such entries the oldest leaves linecache: a job that generates code for
    every new mask does not grow (an old entry only served tracebacks)."""
    with _SOURCES_LOCK:
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        _SOURCES[filename] = None
        _SOURCES.move_to_end(filename)
        while len(_SOURCES) > MAX_SOURCES:
            old, _ = _SOURCES.popitem(last=False)
            linecache.cache.pop(old, None)
