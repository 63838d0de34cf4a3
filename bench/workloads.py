"""The paper's single-operator workloads: our MaskSpecs, batch metadata at scale, and the
equivalent FlexAttention ``mask_mod`` (the peer), in one place for every benchmark.

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
    """Realistic per-sequence metadata, jittered so that every sequence differs."""
    g = torch.Generator().manual_seed(seed)
    S = seqlen

    def jitter(frac, spread=0.05):
        base = torch.full((batch,), frac * S)
        noise = (torch.rand(batch, generator=g) - 0.5) * 2 * spread * S
        return torch.clamp(base + noise, 0, S).to(torch.int64)

    if name == "causal":
        meta = {}
    elif name == "hstu":
        ctx = jitter(0.05, 0.02)
        hist = torch.maximum(jitter(0.7), ctx)
        meta = {"ctx_end": ctx, "hist_end": hist, "seq_end": torch.full((batch,), S),
                "group_size": torch.full((batch,), 64)}
    elif name == "shared_prompt_rm":
        prompt = jitter(0.25, 0.05)
        ends = [prompt]
        for r in range(1, 7):
            ends.append(torch.maximum(jitter(0.25 + 0.75 * r / 6, 0.02), ends[-1]))
        ends[-1] = torch.full((batch,), S)
        keys = ["prompt_end", "r1_end", "r2_end", "r3_end", "r4_end", "r5_end", "r6_end"]
        meta = dict(zip(keys, ends))
    elif name == "clear":
        rows = torch.full((batch,), max(1, (S * 15 // 16) // CLEAR_WIDTH))
        text = torch.clamp(S - rows * CLEAR_WIDTH - torch.randint(0, 16, (batch,), generator=g),
                           min=0)
        meta = {"text_end": text, "img_rows": rows}
    else:
        raise KeyError(name)
    return {k: v.to(device=device, dtype=torch.int32) for k, v in meta.items()}


def flex_mask_mod(name: str, meta: dict):
    """The same mask as a FlexAttention mask_mod(b, h, q_idx, kv_idx), written by hand."""
    if name == "causal":
        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
        return causal
    if name == "hstu":
        ctx, hist, seq, gs = (meta[k] for k in ("ctx_end", "hist_end", "seq_end", "group_size"))

        def hstu(b, h, q_idx, kv_idx):
            c, hi, s, g = ctx[b], hist[b], seq[b], gs[b]
            context = (q_idx < c) & (kv_idx < hi)
            history = (q_idx >= c) & (q_idx < hi) & (kv_idx <= q_idx)
            group_start = hi + (q_idx - hi) // g * g
            target = (q_idx >= hi) & (q_idx < s) & (
                (kv_idx < hi) | ((kv_idx >= group_start) & (kv_idx <= q_idx)))
            return context | history | target
        return hstu
    if name == "shared_prompt_rm":
        ends = [meta[k] for k in ("prompt_end", "r1_end", "r2_end", "r3_end", "r4_end", "r5_end",
                                  "r6_end")]

        # no torch.where and no 2-D metadata: FlexAttention's FLASH backend (CuTe) translates
        # only elementwise comparisons and &/| of 1-D per-batch loads
        def rm(b, h, q_idx, kv_idx):
            e = [t[b] for t in ends]
            prompt = e[0]
            in_prompt = (q_idx < prompt) & (kv_idx <= q_idx)
            # kv_idx is in q_idx's response iff no response end lies in (kv_idx, q_idx]
            same = kv_idx >= prompt
            for r in range(1, 6):
                same = same & ((kv_idx >= e[r]) | (e[r] > q_idx))
            resp = (q_idx >= prompt) & (q_idx < e[6]) & (
                (kv_idx < prompt) | (same & (kv_idx <= q_idx)))
            return in_prompt | resp
        return rm
    if name == "clear":
        text, rows = meta["text_end"], meta["img_rows"]
        W, R = CLEAR_WIDTH, CLEAR_RADIUS

        def clear(b, h, q_idx, kv_idx):
            t = text[b]
            end = t + rows[b] * W
            text_row = (q_idx < t) & (kv_idx < end)
            qi, kj = q_idx - t, kv_idx - t
            near = ((kj // W - qi // W).abs() <= R) & ((kj % W - qi % W).abs() <= R)
            image_row = (q_idx >= t) & (q_idx < end) & (
                (kv_idx < t) | ((kv_idx >= t) & (kv_idx < end) & near))
            return text_row | image_row
        return clear
    raise KeyError(name)
