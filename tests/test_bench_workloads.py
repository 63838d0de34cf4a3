"""The benchmark's FlexAttention mask_mods are the same masks as our MaskSpecs (CPU check)."""

import sys
from pathlib import Path

import pytest
import torch

import compilemask as cm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.workloads import WORKLOADS, flex_mask_mod, make_meta  # noqa: E402


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_flex_mask_mod_equals_compiled_mask(name):
    from torch.nn.attention.flex_attention import create_mask

    S, B = 200, 3
    meta = make_meta(name, B, S, seed=1)
    mask = cm.compile_mask(WORKLOADS[name]())
    ours = mask.preprocess(meta, seqlen_q=S, batch_size=B).dense_mask()
    flex = create_mask(flex_mask_mod(name, meta), B, None, S, S, device="cpu")[:, 0]
    assert torch.equal(ours, flex)
    assert ours.any() and not ours.all()
