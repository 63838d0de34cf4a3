"""CompileMask: compile custom attention masks to interval descriptors.

Declare a ``MaskSpec`` once, ``compile_mask`` it (offline), ``preprocess`` each batch's metadata
into an ``ExecutionDescriptor`` (online), and call ``attention`` per layer.
"""

from compilemask import distributed, packing
from compilemask.api import attention
from compilemask.compiled import CompiledMask, compile_mask
from compilemask.descriptor import ExecutionDescriptor, TileConfig
from compilemask.dsl import MaskSpec, Region
from compilemask.flex import from_mask_mod, from_mask_mod_heads
from compilemask.heads import HeadGroups, preprocess_heads
from compilemask.options import KernelOptions, default_options
from compilemask.pipeline import PipelineConfig
from compilemask.score_mod import compile_score_mod
from compilemask.warmup import warmup

__all__ = [
    "MaskSpec",
    "Region",
    "compile_mask",
    "from_mask_mod",
    "from_mask_mod_heads",
    "compile_score_mod",
    "CompiledMask",
    "ExecutionDescriptor",
    "TileConfig",
    "HeadGroups",
    "preprocess_heads",
    "attention",
    "KernelOptions",
    "default_options",
    "PipelineConfig",
    "warmup",
    "packing",
    "distributed",
    "visualize",
]

__version__ = "0.1.0"


def visualize(desc, batch: int = 0, path: str = "mask.png", **kw):
    """Picture one sequence's mask with its tile states (needs matplotlib: the [viz] extra)."""
    from compilemask.viz import visualize as _visualize  # needs matplotlib (the [viz] extra)

    return _visualize(desc, batch=batch, path=path, **kw)
