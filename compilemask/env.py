"""The environment variables compilemask reads: infrastructure only (where generated sources are
cached, the CuTe DSL's compile target). Kernel variants are :class:`compilemask.KernelOptions`,
never environment variables."""

from __future__ import annotations

import functools
import os
import tempfile

__all__ = ["CACHE_DIR_VAR", "cache_dir", "cute_dsl_arch"]

CACHE_DIR_VAR = "COMPILEMASK_CACHE_DIR"


@functools.cache
def cache_dir(kind: str) -> str:
    """The folder for generated ``kind`` sources ("tilelang", "predicates"): under
    ``$COMPILEMASK_CACHE_DIR``, else ``~/.cache/compilemask``; a fresh temporary folder when
    that cannot be created. Read once per process (the generated modules are imported from it)."""
    root = os.environ.get(CACHE_DIR_VAR) or os.path.join(
        os.path.expanduser("~"), ".cache", "compilemask")
    d = os.path.join(root, kind)
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
