"""``CompileMaskTrainer``: TorchTitan's Trainer with one CompileMask descriptor per batch.

TorchTitan builds masks in ``post_dataloading_process`` only for Flex and varlen
(``Decoder.get_attention_masks``); this subclass builds the batch's descriptor there instead,
from the batch on the device (documents from ``positions`` restarting at 0, other metadata
from extra fields the dataset yields), with tensor ops only (no host synchronization), and
passes it to the model as ``attention_masks``: every layer, and its recomputation under
activation checkpointing, runs the same descriptor. Under context parallelism the batch is
sharded with torch's input sharding ordered by the project's CP plan
(``compilemask.api.distributed.make_plan``), and the descriptor is the rank's rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.trainer import Trainer

from . import _compat
from .batch import NOT_META, BatchDescriptors, attention_config_of, flex_block_mask
from .data import PackedSequenceDataLoader
from .masks import resolve_mask
from .sac import upgrade_ac_config

__all__ = ["CompileMaskTrainer", "BatchDescriptors", "attention_config_of", "flex_block_mask",
           "choose_mask"]

class CompileMaskTrainer(Trainer):
    """TorchTitan's Trainer, with CompileMask's descriptors, SAC policy and CP."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        mask: str = ""
        """The mask of every layer, from the command line (``--mask clear --mask_options radius
        1 width 64``): a name in ``masks.MASK_NAMES`` or an import path; it replaces the
        CompileMask attention's mask, or a Flex model's ``flex_mask``. Empty: the config's."""

        mask_options: dict[str, int] = field(default_factory=dict)

        flex_mask: str = ""
        """For a model on TorchTitan's FlexAttention (the baseline): the mask (a CompileMask
        mask name, see ``masks``) whose BlockMask is built per batch as TorchTitan builds its
        own; empty: TorchTitan's documents mask."""

        flex_mask_options: dict[str, int] = field(default_factory=dict)

    def __init__(self, config: Config):
        choose_mask(config)
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
        fields = {k: v for k, v in input_dict.items() if k not in NOT_META}
        source = resolve_mask(self.config.flex_mask, self.config.flex_mask_options)
        block_mask = flex_block_mask(source, positions, fields,
                                     self.model_config.first_attention)
        self.ntokens_seen += labels.numel()
        return inputs, labels, {"positions": positions, "attention_masks": block_mask}


def choose_mask(config: CompileMaskTrainer.Config) -> str:
    """Apply ``config.mask`` (if set) to the model's attention, and give the packaged
    dataloader the mask whose fields it draws; returns the mask the run trains."""
    attn = attention_config_of(config.model_spec.model) if config.model_spec else None
    if config.mask:
        resolve_mask(config.mask, config.mask_options)  # a bad name fails here, not in a step
        if attn is not None:
            attn = dataclasses.replace(attn, mask=config.mask,
                                       mask_options=dict(config.mask_options))
            _compat.replace_inner_attention(config.model_spec.model, attn)
        else:
            config.flex_mask = config.mask
            config.flex_mask_options = dict(config.mask_options)
    if attn is not None:
        name, options = attn.mask, attn.mask_options
    else:
        name, options = config.flex_mask, config.flex_mask_options
    loader = config.dataloader
    if isinstance(loader, PackedSequenceDataLoader.Config) and not loader.mask:
        loader.mask, loader.mask_options = name, dict(options)
    return name
