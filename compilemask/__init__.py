"""CompileMask: compile custom attention masks to interval descriptors.

Declare a ``MaskSpec`` once, ``compile_mask`` it (offline), ``preprocess`` each batch's metadata
into an ``ExecutionDescriptor`` (online), and call ``attention`` per layer.
"""

from compilemask.api import distributed
from compilemask.api.api import attention
from compilemask.api.warmup import warmup
from compilemask.contract.descriptor import ExecutionDescriptor, TileConfig
from compilemask.contract.options import GpuRefusalWarning, KernelOptions, default_options
from compilemask.dsl import MaskSpec, Region, packing
from compilemask.dsl.flex import from_mask_mod, from_mask_mod_heads
from compilemask.dsl.score_mod import compile_score_mod
from compilemask.pipeline.compiled import CompiledMask, compile_mask
from compilemask.pipeline.heads import HeadGroups, preprocess_heads
from compilemask.pipeline.pipeline import PipelineConfig

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
    "GpuRefusalWarning",
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
    from compilemask.api.viz import visualize as _visualize  # needs matplotlib (the [viz] extra)

    return _visualize(desc, batch=batch, path=path, **kw)
