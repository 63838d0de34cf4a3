"""Selective activation checkpointing that keeps CompileMask's attention output.

TorchTitan's ``SelectiveAC`` saves the outputs of the ops it knows (matmuls, SDPA, Flex, varlen)
and recomputes the rest; ``compilemask::attention_fwd`` is a custom op it does not know, so the
attention would run again in every layer's recomputation. This policy adds it to the saved ops
(its outputs, ``out`` and ``lse``, are what the backward op reads). ``CompileMaskTrainer``
upgrades a ``SelectiveAC`` config to this one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torchtitan.distributed.activation_checkpoint import SelectiveAC

import compilemask.kernels.autograd  # noqa: F401  (registers the ops)

__all__ = ["CompileMaskSelectiveAC", "compilemask_save_ops", "upgrade_ac_config"]


def compilemask_save_ops() -> set:
    """CompileMask's ops whose outputs selective AC saves."""
    return {torch.ops.compilemask.attention_fwd.default}


class CompileMaskSelectiveAC(SelectiveAC):
    """``SelectiveAC`` that also saves ``compilemask::attention_fwd``'s outputs."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return set(super().get_save_ops()) | compilemask_save_ops()


def upgrade_ac_config(ac_config):
    """A plain ``SelectiveAC.Config`` becomes ``CompileMaskSelectiveAC.Config`` with the same
    settings; any other (full, memory budget, none, a subclass) is kept."""
    if type(ac_config) is SelectiveAC.Config:
        return CompileMaskSelectiveAC.Config(
            **{f.name: getattr(ac_config, f.name) for f in fields(ac_config)})
    return ac_config
