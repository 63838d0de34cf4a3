"""One in-process cache for compiled kernels (CuTe, TileLang) and generated functions, and the
on-disk artefacts (generated program sources) behind them: each checked against its full
content before use, written atomically, under a cross-process lock, and run from the checked
text (never through the import system)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import linecache
import os
import sys
import tempfile
import threading
import types
import weakref
from collections import OrderedDict
from typing import Callable, Hashable

from compilemask.contract.env import cache_dir, ensure_dir
from compilemask.contract.log import log
from compilemask.contract.lru import LRU

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (each process may compile)
    fcntl = None

__all__ = ["CompileCache", "KeyedRegistry", "MASKS", "SCORE_MODS", "register_mask",
           "mask_for_key", "file_lock", "write_atomic", "verified_source_file", "exec_verified"]


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


class KeyedRegistry:
    """Objects by semantic key, for the ``compilemask::attention_*`` ops, which carry a key (a
    string) and find the object here, also when a traced graph replays them.

    Lifetime (bounded): an entry is held weakly while its object lives elsewhere (a
    ``CompiledMask`` held by its descriptors, a ``ScoreMod`` by its conversion cache), and
    strongly for the last ``keep`` registrations (an LRU of ``keep`` objects): so memory holds
    the live objects plus at most ``keep`` others. Equal keys name equal objects (their code
    is the same), so any live object of a key answers for it. A key whose every object is
    gone raises a ``KeyError`` naming the fix. Thread-safe."""

    def __init__(self, what: str, keep: int = 256):
        self.what, self.keep = what, keep
        self._weak: dict = {}  # key -> {id(obj): weakref}
        self._recent: dict = {}  # key -> obj, oldest first (the strong LRU)
        # keys whose objects died: a weakref callback runs inside whatever collected them
        # (here too, under the lock), so it only records the key; the next call sweeps
        self._dead: list = []
        self._lock = threading.Lock()

    def register(self, key: str, obj) -> str:
        key = str(key)
        with self._lock:
            self._sweep()
            refs = self._weak.setdefault(key, {})
            if id(obj) not in refs or refs[id(obj)]() is not obj:
                refs[id(obj)] = weakref.ref(obj, functools.partial(self._died, key))
            self._recent.pop(key, None)
            self._recent[key] = obj
            while len(self._recent) > self.keep:
                self._recent.pop(next(iter(self._recent)))
        return key

    def _died(self, key: str, _ref) -> None:
        self._dead.append(key)  # atomic; no lock (see __init__)

    def _sweep(self) -> None:
        """Drop the dead references of the keys recorded dead (under the lock)."""
        while self._dead:
            key = self._dead.pop()
            refs = self._weak.get(key)
            if refs is None:
                continue
            for ident in [i for i, r in refs.items() if r() is None]:
                del refs[ident]
            if not refs:
                del self._weak[key]

    def find(self, key: str):
        """The live object of ``key``, or None."""
        with self._lock:
            self._sweep()
            for ref in list(self._weak.get(key, {}).values()):
                obj = ref()
                if obj is not None:
                    return obj
        return None

    def get(self, key: str):
        obj = self.find(key)
        if obj is not None:
            return obj
        raise KeyError(f"no {self.what} with key {key!r} alive in this process (the ops find "
                       f"the objects their callers hold, and the last {self.keep} registered): "
                       f"keep the {self.what} referenced while a graph that uses it runs")

    def __contains__(self, key: str) -> bool:
        return self.find(key) is not None

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._weak)


# Compiled masks by semantic key (equal keys compile to equal code): ``compile_mask`` registers
# each mask it makes, and the op's entry point the mask of every call.
MASKS = KeyedRegistry("compiled mask")
# Converted score_mods by key (``compilemask.dsl.score_mod``): the conversion registers each.
SCORE_MODS = KeyedRegistry("score_mod")


def register_mask(mask) -> str:
    """Keep ``mask`` reachable from its semantic key (``MASKS``); returns the key."""
    return MASKS.register(str(mask.key), mask)


def mask_for_key(key: str):
    """The compiled mask of a semantic key (``MASKS``)."""
    return MASKS.get(key)


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
    linecache.cache[path] = entry = (len(text), None, text.splitlines(True), path)  # never stale
    mod = types.ModuleType(module_name)
    mod.__file__ = path
    # the checked text stays readable as long as the module lives (its kernels may be traced
    # again), and leaves with it: a job that builds a program per new mask does not grow here
    weakref.finalize(mod, _forget_source, path, entry)
    if register:
        with _REGISTERED_LOCK:
            sys.modules[module_name] = mod
            _REGISTERED[module_name] = weakref.ref(mod)
            _REGISTERED.move_to_end(module_name)
            while len(_REGISTERED) > MAX_REGISTERED:
                old, old_ref = _REGISTERED.popitem(last=False)
                if sys.modules.get(old) is old_ref():
                    del sys.modules[old]
    exec(compile(text, path, "exec", dont_inherit=True), mod.__dict__)
    return mod


# programs registered in sys.modules (TileLang reads a kernel's module there while it compiles
# it), oldest first; past the bound the oldest leave sys.modules, living on in the caches
# that hold their kernels
_REGISTERED: OrderedDict = OrderedDict()
_REGISTERED_LOCK = threading.Lock()
MAX_REGISTERED = 512


def _forget_source(path: str, entry) -> None:
    if linecache.cache.get(path) is entry:  # not a newer module's text for the same file
        linecache.cache.pop(path, None)
