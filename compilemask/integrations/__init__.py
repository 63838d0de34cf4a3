"""Integrations with model libraries, each an optional extra whose library loads lazily.

``compilemask.integrations.transformers.register()``: CompileMask as a transformers attention
implementation (the ``[hf]`` extra)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

__all__ = ["prefer_installed_kernels"]


def prefer_installed_kernels() -> None:
    """Make ``import kernels`` the installed PyPI package (which transformers imports), not this
    project's folder ``kernels/`` (``compilemask.kernels``): in a checkout, a ``sys.path`` entry
    at its root (``python -m ...`` or a REPL started there) resolves the bare name to that
    folder. Loads the distribution's package under its name when, and only when, the name
    would resolve to the folder; a no-op everywhere else."""
    if "kernels" in sys.modules:
        return
    found = importlib.util.find_spec("kernels")
    ours = importlib.util.find_spec("compilemask.kernels")
    if found is None or found.origin is None or ours is None or ours.origin is None:
        return
    if Path(found.origin).resolve().parent != Path(ours.origin).resolve().parent:
        return
    try:
        init = Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return  # transformers then sees no kernels package and imports none
    if not init.is_file():
        return
    spec = importlib.util.spec_from_file_location("kernels", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise


prefer_installed_kernels()
