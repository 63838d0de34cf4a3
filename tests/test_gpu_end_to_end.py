"""The product path on a GPU: TileLang preprocess, then cm.attention forward and backward with the
default engine and with this package's CuTe kernels."""

import pytest
import torch

import compilemask as cm
from compilemask import masks

from helpers import check_attention_vs_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["hstu", "shared_prompt_rm", "clear"])
def test_attention_forward_backward_vs_float32_reference(name):
    spec = masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    B, S, H, Hkv, D = 2, 1000, 4, 2, 128
    gen = torch.Generator().manual_seed(7)
    meta = {k: v.cuda() for k, v in masks.random_meta(spec, B, S, gen).items()}
    desc = mask.preprocess(meta, seqlen_q=S, seqlen_k=S, batch_size=B)  # TileLang on CUDA
    ref_desc = mask.preprocess(meta, seqlen_q=S, seqlen_k=S, batch_size=B, backend="torch")
    assert torch.equal(desc.intervals, ref_desc.intervals)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for engine in ("auto", "cute"):
        check_attention_vs_reference(desc, q, k, v, engine, desc.dense_mask())
