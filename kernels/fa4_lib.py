"""flash-attn-4 behind one adapter: the only module of this package that imports it.

Everything the engines take from FA4 goes through here: whether it is usable
(:func:`unavailable_reason`: importable, and a version these calls are verified against),
its modules (:func:`module`, for the mask classes that extend its kernels), its forward and
backward (:func:`fwd`, :func:`bwd`, :func:`varlen_fwd`) and its block-sparse lists
(:func:`block_sparse_tensors`).

The forward calls ``interface._flash_attn_fwd``, the function FA4's ``flash_attn_func`` runs
below its autograd.Function (whose bookkeeping is about a tenth of the host time of one
generated token; these calls run inside this package's op or without grad, and never need
it). FA4 has no public backward entry point besides its autograd functions, and re-running
the forward under autograd would cost a third of a train step, so the backward calls
``interface._flash_attn_bwd``. Both private names are confined to this module, pinned to
``TESTED_VERSIONS`` and tested on the GPU.

This package's masks and score_mod calls enter FA4's sm90 kernels by replacing a few of its
module globals (``fa4_rowmask``, ``fa4_colmask``, ``fa4_unwrap``: each module's ``PATCHES``,
which ``kernels.fa4`` hands to every call here). :func:`patched` is the one entry point: it
checks that each global is still FA4's own, sets them for the duration of this package's calls
into FA4 (which trace its kernels then) and puts FA4's back after, so other FA4 users in the
process run FA4's code. A call of another thread that overlaps one of ours sees the
replacements, which act only on the functions this package generates (marked by attribute)
and run FA4's own code for every other.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import threading

import torch

from compilemask.contract.env import configure_compile_caches

__all__ = ["TESTED_VERSIONS", "unavailable_reason", "version", "module", "fwd", "bwd",
           "varlen_fwd", "block_sparse_tensors", "patched"]

DISTRIBUTION = "flash-attn-4"
# the releases whose private entry points and patched globals these calls are verified against
# (tests/test_fa4_unwrap.py, test_fa4_rowmask.py, test_fa4_colmask.py pin the internals)
TESTED_VERSIONS = ("4.0.0b40",)


def version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


@torch.compiler.assume_constant_result  # read once by a compiled call: it reads files
def unavailable_reason() -> str | None:
    """None when FA4 can run this package's calls, else why (for the engines' refusals)."""
    return _unavailable_reason()


@functools.lru_cache(maxsize=None)
def _unavailable_reason() -> str | None:
    configure_compile_caches()  # before FA4's first import: its kernel cache is set up then
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA/cutlass mismatch at import time
        return f"flash-attn-4 is not importable ({type(e).__name__}: {e})"
    got = version()
    if got not in TESTED_VERSIONS:
        return (f"flash-attn-4 {got or '(version unknown)'} is installed; these calls are "
                f"verified against {', '.join(TESTED_VERSIONS)} (pip install "
                f"{DISTRIBUTION}=={TESTED_VERSIONS[-1]})")
    return None


def module(name: str):
    """FA4's module ``flash_attn.cute.<name>``."""
    return importlib.import_module(f"flash_attn.cute.{name}")


def block_sparse_tensors(lists, block_size):
    """FA4's block-sparse argument of a ``BlockSparseLists``."""
    return module("block_sparsity").BlockSparseTensorsTorch(
        mask_block_cnt=lists.mask_cnt, mask_block_idx=lists.mask_idx,
        full_block_cnt=lists.full_cnt, full_block_idx=lists.full_idx, block_size=block_size)


def fwd(q, k, v, *, patches=(), window_size=(None, None), **kwargs):
    """FA4's forward below its autograd.Function (``flash_attn_func``'s own call, same kernels),
    with ``patches`` (see :func:`patched`). Returns (out, lse)."""
    with patched(patches):
        out, lse, *_ = module("interface")._flash_attn_fwd(
            q, k, v, window_size_left=window_size[0], window_size_right=window_size[1],
            return_lse=True, **kwargs)
    return out, lse


def bwd(*args, patches=(), **kwargs):
    """FA4's backward (``interface._flash_attn_bwd``), with ``patches``."""
    with patched(patches):
        return module("interface")._flash_attn_bwd(*args, **kwargs)


def varlen_fwd(*args, patches=(), **kwargs):
    """FA4's ``flash_attn_varlen_func``, with ``patches``."""
    with patched(patches):
        return importlib.import_module("flash_attn.cute").flash_attn_varlen_func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# The patches: one checked entry point, scoped to this package's calls
# ----------------------------------------------------------------------------------------------
_LOCK = threading.Lock()
_DEPTH = 0  # calls into FA4 under way (all threads): the globals are ours while > 0
_SAVED: list = []  # (module, name, FA4's value) while they are


def _apply(patches) -> None:
    saved = []
    for target, name, (home, own), new in patches:
        mod = module(target)
        expected = getattr(module(home), own)
        now = getattr(mod, name, None)
        if now is not expected:
            for m, n, v in reversed(saved):
                setattr(m, n, v)
            raise RuntimeError(
                f"flash_attn.cute.{target}.{name} is not FA4's own "
                f"(flash_attn.cute.{home}.{own}) but {now!r}: something else replaced it, or "
                f"flash-attn-4 {version()} moved it; this package's kernels need "
                f"{DISTRIBUTION} {' or '.join(TESTED_VERSIONS)} unpatched")
        saved.append((mod, name, now))
        setattr(mod, name, new)
    _SAVED[:] = saved


def _restore() -> None:
    for mod, name, value in reversed(_SAVED):
        setattr(mod, name, value)
    _SAVED.clear()


@contextlib.contextmanager
def patched(patches=()):
    """FA4's globals replaced by ``patches`` (``(FA4 module, global, (FA4 module, name) of
    FA4's own value, replacement)`` each: the ``PATCHES`` of ``fa4_rowmask``, ``fa4_colmask``,
    ``fa4_unwrap``, which ``kernels.fa4`` passes on every call), each checked to be FA4's own
    first, while the block runs; FA4's own again after the last overlapping call ends (the
    first call's patches serve the calls that overlap it: the engine passes the same ones)."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            _apply(patches)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _restore()
