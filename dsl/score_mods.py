"""FlexAttention score_mods that models use, as factories (each returns a
``score_mod(score, b, h, q_idx, kv_idx)`` for ``cm.attention(..., score_mod=)``, FlexAttention
alike): ALiBi, logit softcapping, T5's bucketed relative bias, per-head temperature."""

from __future__ import annotations

import math

import torch

__all__ = ["alibi", "alibi_slopes", "softcap", "t5_bucket", "t5_bias", "temperature"]


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """ALiBi's geometric per-head slopes ``2 ** (-8 (h + 1) / H)``."""
    return torch.tensor([2.0 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)],
                        device=device)


def alibi(slopes: torch.Tensor):
    """``score + slopes[h] * (kv_idx - q_idx)``."""
    def alibi_score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi_score_mod


def softcap(cap: float):
    """``cap * tanh(score / cap)`` (Gemma 2's logit softcapping)."""
    cap = float(cap)

    def softcap_score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_score_mod


def t5_bucket(rel, num_buckets: int = 32, max_distance: int = 128):
    """T5's bidirectional relative-position bucket of ``rel = kv_idx - q_idx`` (torch ops)."""
    half = num_buckets // 2
    ret = (rel > 0).long() * half
    n = rel.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp(min=1) / exact)
                     / math.log(max_distance / exact) * (half - exact)).long()
    return ret + torch.where(n < exact, n, torch.clamp(large, max=half - 1))


def t5_bias(table: torch.Tensor, max_distance: int = 128):
    """``score + table[t5_bucket(kv_idx - q_idx), h]``, ``table`` ``[num_buckets, H]``."""
    num_buckets = table.shape[0]

    def t5_score_mod(score, b, h, q_idx, kv_idx):
        return score + table[t5_bucket(kv_idx - q_idx, num_buckets, max_distance), h]
    return t5_score_mod


def temperature(temps: torch.Tensor):
    """``score / temps[h]``."""
    def temperature_score_mod(score, b, h, q_idx, kv_idx):
        return score / temps[h]
    return temperature_score_mod
