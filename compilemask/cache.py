"""One in-process cache for compiled kernels (CuTe, TileLang) and generated functions, and the
on-disk artefacts (generated program sources) behind them: each checked against its full
content before use, written atomically, under a cross-process lock, and run from the checked
text (never through the import system)."""

from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import sys
import tempfile
import threading
import types
from typing import Callable, Hashable

from compilemask.env import cache_dir, ensure_dir
from compilemask.log import log
from compilemask.lru import LRU

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (each process may compile)
    fcntl = None

__all__ = ["CompileCache", "register_mask", "mask_for_key", "file_lock", "write_atomic",
           "verified_source_file", "exec_verified"]


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


# ---- on-disk artefacts ---------------------------------------------------------------------------


@contextlib.contextmanager
def file_lock(path: str):
    """Hold the cross-process lock of the artefact ``path`` (``fcntl.flock`` on ``path.lock``):
    one process (or thread) writes or compiles it, the others wait, then find it done."""
    folder = os.path.dirname(path)
    why = ensure_dir(folder)  # also where the folder was deleted while running
    if why is not None:
        raise OSError(f"compilemask: cache folder {folder}: {why}")
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_atomic(path: str, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never a part: a private temporary file in
    the same folder, flushed to disk, then renamed over it (and the rename made durable)."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # not every file system syncs a folder
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verified_source_file(kind: str, name: str, text: str) -> str:
    """The path of ``name`` in ``cache_dir(kind)``, holding exactly ``text``: a file that is
    missing, or whose content is not ``text`` (an edit, a truncation, a file put there under
    this name), is written anew, atomically, under the artefact's lock; a replaced file is
    logged. Callers run ``text`` (``exec_verified``), never the file."""
    path = os.path.join(cache_dir(kind), name)
    want = text.encode()
    with file_lock(path):
        try:
            with open(path, "rb") as f:
                have = f.read()
        except FileNotFoundError:
            have = None
        if have != want:
            if have is not None:
                log.warning("compilemask: cache file %s does not hold the program its name says "
                            "(sha256 %s, expected %s): written again", path, _sha(have)[:16],
                            _sha(want)[:16])
            write_atomic(path, want)
    return path


def exec_verified(text: str, path: str, module_name: str, register: bool = False):
    """A fresh module running ``text`` (``compile`` + ``exec``), as if loaded from ``path``:
    never imported from the file (which the import system would run from a ``.pyc`` beside
    it, checked by time and size only). The text is what ``inspect`` reads back for its
    functions (TileLang's parser, the CuTe DSL's preprocessor read their source).
    ``register``: also in ``sys.modules``."""
    linecache.cache[path] = (len(text), None, text.splitlines(True), path)  # None: never stale
    mod = types.ModuleType(module_name)
    mod.__file__ = path
    if register:
        sys.modules[module_name] = mod
    exec(compile(text, path, "exec", dont_inherit=True), mod.__dict__)
    return mod
