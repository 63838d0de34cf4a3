"""The environment variables compilemask reads: infrastructure only (where generated sources are
cached, the CuTe DSL's compile target). Kernel variants are :class:`compilemask.KernelOptions`,
never environment variables."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import threading

from compilemask.contract.log import log

__all__ = ["CACHE_DIR_VAR", "cache_root", "cache_dir", "in_private_fallback",
           "ensure_dir", "unsafe_reason", "cute_dsl_arch", "configure_compile_caches"]

CACHE_DIR_VAR = "COMPILEMASK_CACHE_DIR"


def cache_root() -> str:
    """``$COMPILEMASK_CACHE_DIR`` (``~`` expanded), else ``~/.cache/compilemask``."""
    return os.path.abspath(os.path.expanduser(
        os.environ.get(CACHE_DIR_VAR) or os.path.join("~", ".cache", "compilemask")))


def unsafe_reason(path: str) -> str | None:
    """Why another user could change what ``path`` (an existing folder) holds, or None: it is
    owned by someone else, or group or others may write it. What runs from a cache folder runs
    as this user, so only this user may write it."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # no POSIX owners (Windows): the user's profile folder is private
        return None
    st = os.stat(path)
    if st.st_uid != getuid():
        return f"it is owned by uid {st.st_uid}, not this user (uid {getuid()})"
    if st.st_mode & 0o022:
        return (f"group or others may write it (mode {oct(st.st_mode & 0o777)}; "
                f"`chmod go-w {path}` makes it private)")
    return None


def _writable(path: str) -> bool:
    """Whether a file can be created in ``path`` (permissions, a read-only file system)."""
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _makedirs_private(path: str) -> None:
    """``os.makedirs`` giving every folder it creates mode 0o700 (``makedirs`` gives only the
    last one its mode)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not os.path.isdir(d):
                raise


def ensure_dir(path: str) -> str | None:
    """Create ``path`` (private: mode 0o700) where it is missing, also when it was deleted while
    running; returns why it cannot hold cached programs, or None."""
    try:
        _makedirs_private(path)
    except OSError as e:
        return f"it cannot be created ({e.strerror or e})"
    why = unsafe_reason(path)
    if why is None and not _writable(path):
        why = "it is not writable (permissions or a read-only file system)"
    return why


_FALLBACK: dict = {}  # "root": this process's private temporary folder, once made
_FALLBACK_LOCK = threading.Lock()


def _fallback_root() -> str:
    with _FALLBACK_LOCK:
        if "root" not in _FALLBACK:
            root = tempfile.mkdtemp(prefix="compilemask-")  # mode 0o700, a fresh name
            atexit.register(shutil.rmtree, root, ignore_errors=True)
            _FALLBACK["root"] = root
        return _FALLBACK["root"]


@functools.cache
def cache_dir(kind: str) -> str:
    """The folder for generated ``kind`` sources and builds ("tilelang", "predicates",
    "tilelang-builds", "fa4"): ``<cache_root>/<kind>``, created with mode 0o700.

    Where the cache root or that folder cannot be used (it cannot be created, is not writable,
    or another user owns it or can write it: what is loaded from it runs as this user), one
    warning names it and why, and this process uses a private temporary folder instead,
    removed when it exits: nothing compiled then is reused by a later process. Read once per
    process; a folder deleted while running is created again at its next write."""
    root = cache_root()
    why = ensure_dir(root)
    d = os.path.join(root, kind)
    where = root
    if why is None:
        why, where = ensure_dir(d), d
    if why is None:
        return d
    fallback = os.path.join(_fallback_root(), kind)
    _makedirs_private(fallback)
    log.warning("compilemask: cache folder %s is not used: %s. Using %s, private to this process "
                "and removed when it exits: programs compiled now are compiled again by later "
                "processes. Set %s to a folder only you can write to keep them.",
                where, why, fallback, CACHE_DIR_VAR)
    return fallback


def in_private_fallback(path: str) -> bool:
    """Whether ``path`` lies in this process's private fallback folder (see :func:`cache_dir`):
    what is cached there is not reused by later processes."""
    root = _FALLBACK.get("root")
    return root is not None and os.path.abspath(path).startswith(root + os.sep)


@functools.cache
def cute_dsl_arch() -> str:
    """``CUTE_DSL_ARCH`` (e.g. "sm_90a"), "" when unset: the target the CuTe DSL compiles for.
    Read once, as the DSL itself reads it once when first imported."""
    return os.environ.get("CUTE_DSL_ARCH", "")


# the compilers' own on-disk caches, pointed under the compilemask cache folder (unless the
# user chose a folder for them): TileLang's builds and flash-attn-4's CuTe kernels
_COMPILER_CACHES = (("TILELANG_CACHE_DIR", "tilelang-builds"),
                    ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "fa4"))


@functools.cache
def configure_compile_caches() -> None:
    """Before TileLang or flash-attn-4 is first imported: keep their compiled kernels on disk
    under :func:`cache_root` (checked as :func:`cache_dir` checks it: only this user can write
    there), so a second process loads instead of compiling. Both read these variables once, at
    import; a variable the user set is left as it is, with a warning where another user can
    write that folder (what loads from it runs as this user)."""
    for var, kind in _COMPILER_CACHES:
        if var not in os.environ:
            os.environ[var] = cache_dir(kind)
            continue
        path = os.path.expanduser(os.environ[var])
        why = unsafe_reason(path) if os.path.isdir(path) else None
        if why is not None:
            log.warning("compilemask: %s=%s: %s; kernels loaded from it run as this user",
                        var, path, why)
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
