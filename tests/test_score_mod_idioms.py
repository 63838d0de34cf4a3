"""FlexAttention score_mod idioms as published code writes them: T5's relative-position bucket
exactly as transformers computes it (every bucket of a full grid), ``torch.where(cond, score,
-inf)`` (a masked score: its condition joins the mask), and the reference engine calling a
score_mod per element where the broadcast call cannot (FlexAttention's own semantics)."""

import math
import warnings

import pytest
import torch

import compilemask as cm

T5Attention = pytest.importorskip("transformers.models.t5.modeling_t5").T5Attention


def _index_grid(H, Sq, Sk):
    return (torch.zeros((), dtype=torch.long), torch.arange(H).view(1, H, 1, 1),
            torch.arange(Sq).view(1, 1, Sq, 1), torch.arange(Sk).view(1, 1, 1, Sk))


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance",
                         [(True, 32, 128), (False, 32, 128), (True, 64, 256), (False, 16, 64),
                          (True, 32, 100)])
def test_t5_bucket_as_transformers_writes_it(bidirectional, num_buckets, max_distance):
    H = 2
    # table[bucket, h] = bucket * H + h: the score_mod's value says which bucket it read
    table = torch.arange(num_buckets * H, dtype=torch.float32).view(num_buckets, H)

    def t5_bias(score, b, h, q_idx, kv_idx):
        bucket = T5Attention._relative_position_bucket(
            kv_idx - q_idx, bidirectional=bidirectional, num_buckets=num_buckets,
            max_distance=max_distance)
        return score + table[bucket, h]

    sm, tensors = cm.compile_score_mod(t5_bias)
    L = 1200  # every relative position in [-L, L], far past max_distance
    b, h, _, _ = _index_grid(H, 1, 1)
    q = torch.full((1, 1, 1, 1), L)
    kv = torch.arange(2 * L + 1).view(1, 1, 1, -1)
    s = torch.zeros(1, H, 1, 2 * L + 1)
    got = sm.evaluate(s, b, h, q, kv, tensors)
    want = t5_bias(s, b, h, q, kv)
    assert torch.equal(got, want)
    # every bucket is reached (bidirectional: all but "kv_idx after q_idx by 0"), so the grid
    # covers every case of the bucket function
    assert len(torch.unique(want[0, 0])) == num_buckets - bidirectional


def test_min_reduction_refused():
    def sm(score, b, h, q_idx, kv_idx):
        return score + torch.min(kv_idx - q_idx, 0).values
    with pytest.raises(NotImplementedError, match="reduction"):
        cm.compile_score_mod(sm)
