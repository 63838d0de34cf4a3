"""The package's logger and its say-once warnings (a fallback taken, a slow path used)."""

from __future__ import annotations

import logging

import torch

from compilemask.contract.lru import LRUSet

__all__ = ["log", "say_once", "said"]

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
