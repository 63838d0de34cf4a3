"""The paper's single-operator workloads: our MaskSpecs, batch metadata at scale, and the
equivalent FlexAttention ``mask_mod`` (the peer), in one place for every benchmark; the metadata
recipes and mask_mods live with the masks (``compilemask/masks/<name>.py``).

128K tokens per batch: S = 1K .. 32K with B = 128 .. 4. Metadata differs per sequence (jittered
segment ends), so FlexAttention needs a BlockMask with B = batch, built per batch."""

from __future__ import annotations

import torch

from compilemask import masks

__all__ = ["WORKLOADS", "TOKENS_PER_BATCH", "batch_for", "make_meta", "flex_mask_mod"]

TOKENS_PER_BATCH = 128 * 1024
CLEAR_RADIUS, CLEAR_WIDTH = 2, 64
WORKLOADS = {
    "causal": masks.causal,
    "hstu": masks.hstu,
    "shared_prompt_rm": masks.shared_prompt_rm,
    "clear": lambda: masks.clear(CLEAR_RADIUS, CLEAR_WIDTH),
}


def batch_for(seqlen: int) -> int:
    return max(1, TOKENS_PER_BATCH // seqlen)


def make_meta(name: str, batch: int, seqlen: int, device="cpu", seed: int = 0) -> dict:
    """Realistic per-sequence metadata (the mask module's ``bench_meta``), int32 on ``device``."""
    meta = masks.recipes_for(WORKLOADS[name]()).bench_meta(batch, seqlen, seed)
    return {k: v.to(device=device, dtype=torch.int32) for k, v in meta.items()}


def flex_mask_mod(name: str, meta: dict):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx), written by hand."""
    return masks.flex_mask_mod(WORKLOADS[name](), meta)
