"""A batch's attention metadata for TorchTitan models, without TorchTitan's trainer: the
hook ``CompileMaskTrainer.post_dataloading_process`` runs (``BatchDescriptors``) and the Flex
baseline's BlockMask built as TorchTitan builds its own (``flex_block_mask``). Importing this
module loads TorchTitan's model code only (no datasets, metrics or checkpointing)."""

from __future__ import annotations

import torch

from compilemask.api.distributed import make_plan, shard_descriptor
from compilemask.pipeline.compiled import compile_mask
from compilemask.pipeline.pipeline import with_lists

from . import _compat
from .attention import CompileMaskAttention, CompileMaskBatch
from .masks import resolve_mask

__all__ = ["BatchDescriptors", "attention_config_of", "flex_block_mask", "NOT_META"]

# batch keys that are not mask metadata
NOT_META = ("input", "positions")


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
        fields = {k: v for k, v in input_dict.items() if k not in NOT_META}
        meta = self.meta(positions, fields)
        if self.cp_mesh is None:
            desc = self._lists(self.mask.preprocess(meta, seqlen_q=S, batch_size=B, **self.tiles))
            return inputs, labels, {"positions": positions,
                                    "attention_masks": CompileMaskBatch(desc)}
        W = self.cp_mesh.size()
        rank = self.cp_mesh.get_local_rank()
        plan = make_plan(self.mask, meta, S, W, self.config.cp_plan, self.config.cp_tile,
                         batch_size=B)
        inputs, labels, positions = _compat.context_parallel_shard(
            self.cp_mesh, (inputs, labels, positions), plan)
        desc = self._lists(shard_descriptor(self.mask, meta, plan, rank, batch_size=B,
                                            **self.tiles))
        return inputs, labels, {"positions": positions,
                                "attention_masks": CompileMaskBatch(desc, plan)}

    def _lists(self, desc):
        # the producer writes FA4's lists only where the native engine cannot run the batch; a
        # layer forced onto the fa4 engine reads them once per batch, not once per layer
        return with_lists(desc) if self.config.backend == "fa4" else desc


def flex_block_mask(source, positions: torch.Tensor, fields: dict, attn_config):
    """A named mask's FlexAttention BlockMask for a batch, built as TorchTitan's
    ``Decoder._create_flex_attention_mask`` builds its own (``create_attention_mask``: the
    compiled ``create_block_mask``, the inner attention config's block size). ``attn_config``:
    the attention layer's config or its inner attention's."""
    block_size = _compat.flex_block_size(getattr(attn_config, "inner_attention", attn_config))
    B, S = positions.shape
    mask_mod = None
    if source.name in ("block_causal", "documents"):  # TorchTitan's own document mask_mods
        mask_mod = _compat.document_mask_mod(positions)
    if mask_mod is None:
        mask_mod = source.flex(positions, fields)
    return _compat.create_attention_mask(mask_mod, B, S, positions.device, block_size)
