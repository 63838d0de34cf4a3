"""The package's logger and its say-once warnings (a fallback taken, a slow path used, a call
the GPU engines would refuse)."""

from __future__ import annotations

import logging
import warnings

import torch

from compilemask.contract.lru import LRUSet
from compilemask.contract.options import GpuRefusalWarning

__all__ = ["log", "say_once", "said", "warn_gpu_refusal"]

log = logging.getLogger("compilemask")

# the messages already logged; clearing it makes them heard again (as in a fresh process);
# bounded: a message naming a mask or a length is new in a loop of them (the 1024 most recent)
said = LRUSet(1024)


def say_once(msg: str) -> None:
    """Log ``msg`` as a warning the first time it comes; later calls with it are silent."""
    if torch.compiler.is_compiling():  # dynamo does not trace logging; eager calls say it
        return
    if msg not in said:
        said.add(msg)
        log.warning(msg)


_REFUSALS_SAID = LRUSet(1024)  # the keys already warned about


def warn_gpu_refusal(key, msg: str, stacklevel: int) -> None:
    """A ``GpuRefusalWarning`` the first time ``key`` comes: what the CPU ran, the GPU engines
    would refuse. ``stacklevel`` counts from the caller of this function."""
    if key in _REFUSALS_SAID or torch.compiler.is_compiling():
        return
    _REFUSALS_SAID.add(key)
    warnings.warn(f"{msg}; silence with warnings.filterwarnings('ignore', "
                  "category=cm.GpuRefusalWarning)", GpuRefusalWarning, stacklevel=stacklevel + 1)
