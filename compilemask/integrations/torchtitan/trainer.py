"""``CompileMaskTrainer``: TorchTitan's Trainer with one CompileMask descriptor per batch.

TorchTitan builds masks in ``post_dataloading_process`` only for Flex and varlen
(``Decoder.get_attention_masks``); this subclass builds the batch's descriptor there instead,
from the batch on the device (documents from ``positions`` restarting at 0, other metadata
from extra fields the dataset yields), with tensor ops only (no host synchronization), and
passes it to the model as ``attention_masks``: every layer, and its recomputation under
activation checkpointing, runs the same descriptor. Under context parallelism the batch is
sharded with torch's input sharding ordered by the project's CP plan
(``compilemask.distributed.make_plan``), and the descriptor is the rank's rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.trainer import Trainer

from compilemask.compiled import compile_mask
from compilemask.distributed import make_plan, shard_descriptor

from . import _compat
from .attention import CompileMaskAttention, CompileMaskBatch
from .masks import resolve_mask
from .sac import upgrade_ac_config

__all__ = ["CompileMaskTrainer", "BatchDescriptors", "attention_config_of", "flex_block_mask"]

# batch keys that are not mask metadata
_NOT_META = ("input", "positions")


def attention_config_of(model_config) -> CompileMaskAttention.Config | None:
    """The model's CompileMask inner-attention config (every layer shares one), or None."""
    found = [cfg for _, cfg, _, _ in model_config.traverse(CompileMaskAttention.Config)]
    if not found:
        return None
    first = found[0]
    key = (first.mask, tuple(sorted(first.mask_options.items())))
    for cfg in found[1:]:
        if (cfg.mask, tuple(sorted(cfg.mask_options.items()))) != key:
            raise NotImplementedError("CompileMaskTrainer: layers with different masks need a "
                                      "descriptor each (not wired); give every layer one mask")
    return first


class BatchDescriptors:
    """Batch -> (inputs, labels, model kwargs) with the batch's descriptor; the trainer's hook,
    usable on its own (tests, benches).

    ``cp_mesh``: the CP device mesh (None: no CP). ``fwd_tiles``/``bwd_tiles``: the
    descriptor's tilings (None: the defaults)."""

    def __init__(self, attn_config: CompileMaskAttention.Config, cp_mesh=None, *,
                 tiles: dict | None = None):
        self.config = attn_config
        self.source = resolve_mask(attn_config.mask, attn_config.mask_options)
        self.mask = compile_mask(self.source.spec)
        self.cp_mesh = cp_mesh
        self.tiles = dict(tiles or {})

    def meta(self, positions: torch.Tensor, fields: dict) -> dict:
        return self.source.meta(positions, fields)

    def __call__(self, input_dict: dict, labels: torch.Tensor):
        inputs = input_dict["input"]
        B, S = inputs.shape[:2]
        positions = input_dict.get("positions")
        if positions is None:  # one sequence per row
            positions = torch.arange(S, device=inputs.device).expand(B, S)
        fields = {k: v for k, v in input_dict.items() if k not in _NOT_META}
        meta = self.meta(positions, fields)
        if self.cp_mesh is None:
            desc = self.mask.preprocess(meta, seqlen_q=S, batch_size=B, **self.tiles)
            return inputs, labels, {"positions": positions,
                                    "attention_masks": CompileMaskBatch(desc)}
        W = self.cp_mesh.size()
        rank = self.cp_mesh.get_local_rank()
        plan = make_plan(self.mask, meta, S, W, self.config.cp_plan, self.config.cp_tile,
                         batch_size=B)
        inputs, labels, positions = _compat.context_parallel_shard(
            self.cp_mesh, (inputs, labels, positions), plan)
        desc = shard_descriptor(self.mask, meta, plan, rank, batch_size=B, **self.tiles)
        return inputs, labels, {"positions": positions,
                                "attention_masks": CompileMaskBatch(desc, plan)}


class CompileMaskTrainer(Trainer):
    """TorchTitan's Trainer, with CompileMask's descriptors, SAC policy and CP."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        flex_mask: str = ""
        """For a model on TorchTitan's FlexAttention (the baseline): the mask (a CompileMask
        mask name, see ``masks``) whose BlockMask is built per batch as TorchTitan builds its
        own; empty: TorchTitan's documents mask."""

        flex_mask_options: dict[str, int] = field(default_factory=dict)

    def __init__(self, config: Config):
        attn = attention_config_of(config.model_spec.model) if config.model_spec else None
        if attn is not None:
            _compat.check_parallelism(config.parallelism)
            config.activation_checkpoint = upgrade_ac_config(config.activation_checkpoint)
            config.model_spec = dataclasses.replace(
                config.model_spec,
                parallelize_fn=_compat.wrap_parallelize(config.model_spec.parallelize_fn))
        super().__init__(config)
        self.batch_descriptors = None
        if attn is not None:
            cp_mesh = (self.parallel_dims.get_mesh("cp") if self.parallel_dims.cp_enabled
                       else None)
            self.batch_descriptors = BatchDescriptors(attn, cp_mesh)

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor],
                                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                dict[str, Any]]:
        if self.batch_descriptors is None:
            if not self.config.flex_mask:
                return super().post_dataloading_process(input_dict, labels)
            return self._flex_baseline(input_dict, labels)
        inputs, labels, extra = self.batch_descriptors(input_dict, labels)
        # after CP sharding: the tokens this rank processes
        self.ntokens_seen += labels.numel()
        return inputs, labels, extra

    def _flex_baseline(self, input_dict, labels):
        """The Flex baseline: ``config.flex_mask``'s BlockMask, built as TorchTitan builds its
        document mask (``create_attention_mask`` with the layer's block size)."""
        if self.parallel_dims.cp_enabled:
            raise NotImplementedError("the Flex baseline of a named mask runs without CP")
        inputs = input_dict["input"]
        positions = input_dict.get("positions")
        if positions is None:
            B, S = inputs.shape[:2]
            positions = torch.arange(S, device=inputs.device).expand(B, S)
        fields = {k: v for k, v in input_dict.items() if k not in _NOT_META}
        source = resolve_mask(self.config.flex_mask, self.config.flex_mask_options)
        block_mask = flex_block_mask(source, positions, fields,
                                     self.model_config.first_attention)
        self.ntokens_seen += labels.numel()
        return inputs, labels, {"positions": positions, "attention_masks": block_mask}


def flex_block_mask(source, positions: torch.Tensor, fields: dict, attn_config):
    """A named mask's FlexAttention BlockMask for a batch, built as TorchTitan's
    ``Decoder._create_flex_attention_mask`` builds its own (``create_attention_mask``: the
    compiled ``create_block_mask``, the inner attention config's block size)."""
    from torchtitan.models.common.attention import FlexAttention, create_attention_mask

    inner = attn_config.inner_attention
    if not isinstance(inner, FlexAttention.Config):
        raise TypeError(f"flex_block_mask: the model's inner attention is "
                        f"{type(inner).__name__}, not FlexAttention")
    B, S = positions.shape
    return create_attention_mask(source.flex(positions, fields), B, None, S, S,
                                 device=positions.device, BLOCK_SIZE=inner.block_size)
