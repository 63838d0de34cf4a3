"""Integrations with model libraries, each an optional extra whose library loads lazily.

``compilemask.integrations.transformers.register()``: CompileMask as a transformers attention
implementation (the ``[hf]`` extra)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

__all__ = ["check_kernels_not_hidden"]


def check_kernels_not_hidden() -> None:
    """Raise ImportError, saying what to do, where ``import kernels`` would load this project's
    folder ``kernels/`` (``compilemask.kernels``) instead of the installed PyPI package
    ``kernels`` that transformers imports: a checkout's root ahead of site-packages on
    ``sys.path`` (Python started there: ``python -m ...``, a REPL, a script) hides it. Without
    that package installed, transformers reads the folder as no ``kernels`` and goes on."""
    found = importlib.util.find_spec("kernels")
    ours = importlib.util.find_spec("compilemask.kernels")
    if found is None or found.origin is None or ours is None or ours.origin is None:
        return
    folder = Path(ours.origin).resolve().parent
    if Path(found.origin).resolve().parent != folder:
        return
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise ImportError(
        f"transformers imports the installed package 'kernels', but Python finds this "
        f"checkout's folder {folder} (CompileMask's engines, compilemask.kernels) under that "
        f"name first: {folder.parent} is on sys.path ahead of site-packages because Python was "
        f"started there. Start Python in another folder, or with -P (PYTHONSAFEPATH=1) so the "
        f"current folder is not searched first: python -P -m ...")
