"""Bad input refused with a message naming the argument and the fix, never silently reshaped,
ignored or answered with NaN, and never an error from deep inside torch, sympy or NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.api.cli import run
from compilemask.api.serving import paged_attention, query_descriptor


def _causal_desc(S=8, B=1):
    return cm.compile_mask(masks.causal()).preprocess(None, seqlen_q=S, batch_size=B)


def test_params_given_as_a_string_are_refused():
    with pytest.raises(TypeError, match=r"params must be a list, got str 'ab'; pass \['ab'\]"):
        cm.MaskSpec("x", params="ab", regions=[cm.Region("all", lambda i: True,
                                                          lambda i, j: j <= i)])
    with pytest.raises(TypeError, match="regions must be a list"):
        cm.MaskSpec("x", params=[], regions=cm.Region("all", lambda i: True,
                                                       lambda i, j: j <= i))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_softmax_scale_is_refused(scale):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="softmax_scale must be finite.*pass None"):
        cm.attention(q, q, q, _causal_desc(), softmax_scale=scale)
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        cm.attention(q, q, q, _causal_desc(), softmax_scale="0.1")
    mask = cm.compile_mask(masks.causal())
    d = query_descriptor(mask, None, 8, 1, batch_size=1)
    cache = torch.randn(2, 4, 2, 16)
    with pytest.raises(ValueError, match="paged_attention: softmax_scale must be finite"):
        paged_attention(q[:, :1], cache, cache, torch.tensor([[0, 1]], dtype=torch.int32), d,
                        softmax_scale=scale)
    # a finite scale, 0 included, runs
    assert torch.isfinite(cm.attention(q, q, q, _causal_desc(), softmax_scale=0.0)).all()


def test_a_count_per_request_must_be_one_dimensional():
    mask = cm.compile_mask(masks.causal())
    with pytest.raises(ValueError, match=r"seqused_k must be 1-D \[B\].*\[1, 2\]"):
        query_descriptor(mask, None, 8, 1, seqused_k=[[3, 4]])
    with pytest.raises(ValueError, match=r"seqused_q must be 1-D"):
        query_descriptor(mask, None, 8, 2, seqused_k=[3, 4], seqused_q=[[1, 2]])
    assert query_descriptor(mask, None, 8, 1, seqused_k=[3, 4]).batch_size == 2


SEG = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
SHARED = torch.tensor([0, 0, 1, 1])


def _same_segment(b, h, q_idx, kv_idx):
    return SEG[b, q_idx] == SEG[b, kv_idx]


def _shared_segment(b, h, q_idx, kv_idx):
    return SHARED[q_idx] == SHARED[kv_idx]


def test_from_mask_mod_batch_size_must_agree_with_the_tensors_read_at_b():
    with pytest.raises(ValueError, match=r"param 'SEG' \(\[2, 4\]\) at b, a batch of 2, but "
                                         r"batch_size=4; pass batch_size=2"):
        cm.from_mask_mod(_same_segment, batch_size=4)
    spec, meta = cm.from_mask_mod(_same_segment, batch_size=2)
    assert meta["SEG"].shape == (2, 4)
    for bad, kind in ((True, TypeError), (0, ValueError), (2.0, TypeError)):
        with pytest.raises(kind, match="from_mask_mod: batch_size must be a positive int"):
            cm.from_mask_mod(_same_segment, batch_size=bad)


def test_a_tensor_shared_by_every_sequence_says_how_to_give_the_batch():
    spec, meta = cm.from_mask_mod(_shared_segment)
    mask = cm.compile_mask(spec)
    with pytest.raises(ValueError, match=r"batch size 1 != 2.*from_mask_mod\(\.\.\., "
                                         r"batch_size=2\)"):
        mask.preprocess(meta, seqlen_q=4, batch_size=2)
    spec, meta = cm.from_mask_mod(_shared_segment, batch_size=2)
    assert cm.compile_mask(spec).preprocess(meta, seqlen_q=4, batch_size=2).batch_size == 2


def test_preprocess_batch_size_and_empty_metadata():
    mask = cm.compile_mask(masks.causal())
    with pytest.raises(TypeError, match="batch_size must be a positive int .* got True"):
        mask.preprocess(None, seqlen_q=8, batch_size=True)
    with pytest.raises(ValueError, match="batch_size must be a positive int .* got 0"):
        mask.preprocess(None, seqlen_q=8, batch_size=0)
    plm = cm.compile_mask(masks.prefix_lm())
    with pytest.raises(ValueError, match=r"param 'prefix_len' is an empty tensor \[0\]: give a "
                                         "value per sequence"):
        plm.preprocess({"prefix_len": torch.tensor([], dtype=torch.int64)}, seqlen_q=8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_without_cuda_is_one_clear_line(capsys):
    mask = cm.compile_mask(masks.causal())
    with pytest.raises(ValueError, match=r"preprocess: device='cuda', but CUDA is not "
                                         r"available.*use device='cpu'"):
        mask.preprocess(None, seqlen_q=8, device="cuda")
    with pytest.raises(ValueError, match="query_descriptor: device='cuda'"):
        query_descriptor(mask, None, 8, 1, device="cuda")
    rc = run("warmup", ["compilemask/masks/causal.py:causal", "--seqlens", "128",
                        "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "CUDA is not available" in err and "Traceback" not in err


def test_head_dim_zero_and_tensors_on_two_devices():
    d = _causal_desc()
    z = torch.randn(1, 8, 2, 0)
    with pytest.raises(ValueError, match=r"q \[1, 8, 2, 0\] has no heads or a head dim of 0"):
        cm.attention(z, z, z, d)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="q, k, v must be on one device, got q on cpu, k on "
                                         r"meta, v on cpu; move them with .to\(q.device\)"):
        cm.attention(q, q.to("meta"), q, d)


def test_a_rule_of_2000_terms_is_refused_naming_region_and_rule(tmp_path):
    src = ("def visible(i, j):\n    return " + " | ".join(f"(j == i - {k})" for k in range(2000))
           + "\n")
    path = tmp_path / "deep_rule.py"
    path.write_text(src)
    ns: dict = {}
    exec(compile(src, str(path), "exec"), ns)  # noqa: S102 - a test's generated rule
    spec = cm.MaskSpec("deep", params=[], regions=[cm.Region("all", lambda i: True,
                                                             ns["visible"])])
    with pytest.raises(NotImplementedError, match=r"MaskSpec 'deep', Region 'all': the visible "
                                                  r"rule nests deeper.*ranges"):
        cm.compile_mask(spec)


ARR = np.array([0, 0, 1, 1])


def _numpy_mask_mod(b, h, q_idx, kv_idx):
    return ARR[q_idx] >= ARR[kv_idx]


def test_a_captured_numpy_array_is_refused_naming_it():
    with pytest.raises(NotImplementedError, match=r"reads the NumPy array\(s\) \['ARR'\]: "
                                                  r"capture torch tensors instead "
                                                  r"\(torch.from_numpy\(ARR\)\)"):
        cm.from_mask_mod(_numpy_mask_mod)
    local = np.array([3])

    def closure(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx - local[b]

    with pytest.raises(NotImplementedError, match=r"\['local'\]"):
        cm.from_mask_mod(closure)
