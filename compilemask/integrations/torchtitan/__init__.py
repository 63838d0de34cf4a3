"""CompileMask in TorchTitan (0.3.0): an inner attention, a trainer that builds one descriptor
per batch, a selective-AC policy that keeps CompileMask's attention output, context parallelism
through TorchTitan's own input sharding with CompileMask's CP plan, named masks, a packed
variable-length dataset and one of a sequence per row with each mask's metadata.

    python -m torchtitan.train --module compilemask.integrations.torchtitan \\
        --config compilemask_qwen3_debug_hstu

TorchTitan is imported by the submodules only (``config_registry``, ``attention``, ``trainer``,
``sac``, ``data``; ``masks`` needs none): ``import compilemask`` never loads it. See
``docs/torchtitan.md``.
"""

from __future__ import annotations

import importlib

__all__ = ["CompileMaskAttention", "CompileMaskBatch", "CompileMaskTrainer", "BatchDescriptors",
           "CompileMaskSelectiveAC", "resolve_mask", "PackedSequences", "RowSequences",
           "PackedSequenceDataLoader"]

_WHERE = {"CompileMaskAttention": "attention", "CompileMaskBatch": "attention",
          "CompileMaskTrainer": "trainer", "BatchDescriptors": "trainer",
          "CompileMaskSelectiveAC": "sac", "resolve_mask": "masks",
          "PackedSequences": "data", "RowSequences": "rows",
          "PackedSequenceDataLoader": "data"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
