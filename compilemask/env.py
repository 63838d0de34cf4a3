"""The environment variables compilemask reads: infrastructure only (where generated sources are
cached, the CuTe DSL's compile target). Kernel variants are :class:`compilemask.KernelOptions`,
never environment variables."""

from __future__ import annotations

import functools
import os
import tempfile

__all__ = ["CACHE_DIR_VAR", "cache_root", "cache_dir", "cute_dsl_arch", "configure_compile_caches"]

CACHE_DIR_VAR = "COMPILEMASK_CACHE_DIR"


def cache_root() -> str:
    """``$COMPILEMASK_CACHE_DIR``, else ``~/.cache/compilemask``."""
    return os.environ.get(CACHE_DIR_VAR) or os.path.join(
        os.path.expanduser("~"), ".cache", "compilemask")


@functools.cache
def cache_dir(kind: str) -> str:
    """The folder for generated ``kind`` sources and builds ("tilelang", "predicates",
    "tilelang-builds", "fa4"): under :func:`cache_root`; a fresh temporary folder when that
    cannot be created. Read once per process (the generated modules are imported from it)."""
    d = os.path.join(cache_root(), kind)
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:
        d = tempfile.mkdtemp(prefix=f"compilemask-{kind}-")
    return d


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
    under :func:`cache_root`, so a second process loads instead of compiling. Both read these
    variables once, at import; a variable the user set is left as it is."""
    for var, kind in _COMPILER_CACHES:
        if var not in os.environ:
            os.environ[var] = cache_dir(kind)
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
