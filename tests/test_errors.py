"""Every error message: clear, naming the argument or the region and the rule."""

import pytest
import torch

import compilemask as cm
from compilemask import masks

NOT_A_PARAM = "x"


def _compile(visible, when=lambda i: True, params=("a",)):
    return cm.compile_mask(cm.MaskSpec("bad", params=list(params), regions=[
        cm.Region("r0", when=when, visible=visible)]))


def test_unknown_name_names_region_function_name_and_line():
    with pytest.raises(ValueError, match=r"Region 'r0', visible function '<lambda>' "
                       r"\(.*test_errors.py:\d+\): name 'zz' is not a declared param"):
        _compile(lambda i, j: j < zz)  # noqa: F821


def test_non_int_global():
    with pytest.raises(ValueError, match="name 'NOT_A_PARAM' is bound to str"):
        _compile(lambda i, j: j < NOT_A_PARAM)


def test_unsupported_syntax_points_at_line():
    def loop(i, j):
        for _ in range(3):
            pass
        return j < i

    with pytest.raises(NotImplementedError,
                       match=r"test_errors.py:\d+\): unsupported statement 'For'"):
        _compile(loop)
    with pytest.raises(NotImplementedError, match="unsupported call to 'len'"):
        _compile(lambda i, j: j < len(i))
    with pytest.raises(NotImplementedError, match="true division"):
        _compile(lambda i, j: j < i / 2)
    with pytest.raises(NotImplementedError, match="unsupported syntax 'Attribute'"):
        _compile(lambda i, j: j < torch.pi)
    with pytest.raises(ValueError, match="divisor 0 must be positive"):
        _compile(lambda i, j: j // 0 == i)


def test_spec_validation():
    with pytest.raises(ValueError, match="regions must not be empty"):
        cm.MaskSpec("x", params=[], regions=[])
    with pytest.raises(ValueError, match="param 'i' is a reserved name"):
        cm.MaskSpec("x", params=["i"], regions=[cm.Region("r", lambda i: True, lambda i, j: True)])
    with pytest.raises(TypeError, match=r"Region 'r': visible must take 2 argument\(s\)"):
        cm.Region("r", when=lambda i: True, visible=lambda i: True)
    with pytest.raises(ValueError, match="region 'r' declared twice"):
        r = cm.Region("r", lambda i: True, lambda i, j: True)
        cm.MaskSpec("x", regions=[r, r])
    with pytest.raises(TypeError, match="must return a boolean"):
        _compile(lambda i, j: j + 1)
    with pytest.raises(ValueError,
                       match="when function '<lambda>'.*name 'j' is not a declared param"):
        _compile(lambda i, j: True, when=lambda i: j < 3)  # noqa: F821


def test_metadata_errors():
    mask = cm.compile_mask(masks.hstu())
    good = {"ctx_end": torch.tensor([1, 2]), "hist_end": torch.tensor([3, 4]),
            "seq_end": torch.tensor([5, 6]), "group_size": 2}
    with pytest.raises(ValueError, match=r"missing param\(s\) \['seq_end'\]"):
        mask.preprocess({k: v for k, v in good.items() if k != "seq_end"}, seqlen_q=8)
    with pytest.raises(ValueError, match=r"unknown param\(s\) \['oops'\]"):
        mask.preprocess({**good, "oops": 1}, seqlen_q=8)
    with pytest.raises(ValueError, match="param 'ctx_end': dtype must be an integer type"):
        mask.preprocess({**good, "ctx_end": torch.tensor([1.0, 2.0])}, seqlen_q=8)
    with pytest.raises(ValueError, match="param 'seq_end': batch size 3 != 2"):
        mask.preprocess({**good, "seq_end": torch.tensor([1, 2, 3])}, seqlen_q=8)
    with pytest.raises(ValueError, match="param 'hist_end' must be non-negative"):
        mask.preprocess({**good, "hist_end": torch.tensor([-1, 2])}, seqlen_q=8)
    with pytest.raises(ValueError,
                       match=r"param 'group_size' must be positive \(it is a divisor\)"):
        mask.preprocess({**good, "group_size": 0}, seqlen_q=8)
    with pytest.raises(TypeError, match="param 'group_size': expected an int or an integer tensor"):
        mask.preprocess({**good, "group_size": "2"}, seqlen_q=8)
    with pytest.raises(ValueError, match="seqlen_q must be a positive int"):
        mask.preprocess(good, seqlen_q=0)
    with pytest.raises(ValueError, match="fwd_tiles: tile sizes must be positive powers of two"):
        mask.preprocess(good, seqlen_q=8, fwd_tiles=(48, 64))
    with pytest.raises(ValueError, match="param 'ctx_end': expected shape \\[B\\]"):
        mask.preprocess({**good, "ctx_end": torch.zeros(2, 8, dtype=torch.int64)}, seqlen_q=8)


def test_per_row_array_errors():
    mask = cm.compile_mask(masks.packed_documents())
    with pytest.raises(ValueError, match="param 'doc_start' is a per-row array"):
        mask.preprocess({"doc_start": 3}, seqlen_q=8)
    with pytest.raises(ValueError, match="per-row array length 7 != seqlen_q 8"):
        mask.preprocess({"doc_start": torch.zeros(1, 7, dtype=torch.int64)}, seqlen_q=8)


def test_guard_overlap_is_no_error_in_check_mode():
    spec = cm.MaskSpec("overlap", params=["a"], regions=[
        cm.Region("lo", when=lambda i: i < a + 2, visible=lambda i, j: j <= i),  # noqa: F821
        cm.Region("hi", when=lambda i: i >= a, visible=lambda i, j: j >= i),  # noqa: F821
    ])
    mask = cm.compile_mask(spec)
    assert not mask.regions[1].exclusive_with["lo"]
    checked = mask.preprocess({"a": 3}, seqlen_q=8, check=True)  # first region wins, as ever
    assert torch.equal(checked.intervals, mask.preprocess({"a": 3}, seqlen_q=8).intervals)


def test_attention_argument_errors():
    mask = cm.compile_mask(masks.causal())
    desc = mask.preprocess({}, seqlen_q=8)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="desc must be an ExecutionDescriptor"):
        cm.attention(q, q, q, "nope")
    with pytest.raises(ValueError, match="q must be \\[B, S, H, D\\]"):
        cm.attention(q[0], q, q, desc)
    with pytest.raises(ValueError, match="num heads of q \\(2\\) must be a multiple"):
        kv = torch.randn(1, 8, 3, 16)
        cm.attention(q, kv, kv, desc)
    with pytest.raises(ValueError, match="desc was made for batch 1, seqlen_q 8"):
        q2 = torch.randn(1, 9, 2, 16)
        cm.attention(q2, q2, q2, desc)
    with pytest.raises(TypeError, match="deterministic must be a bool, got str"):
        cm.attention(q, q, q, desc, deterministic="yes")
    # the reference path (CPU) is deterministic anyway: the flag changes nothing there
    x = q.clone().requires_grad_()
    cm.attention(x, x, x, desc, deterministic=True).sum().backward()
    y = q.clone().requires_grad_()
    cm.attention(y, y, y, desc).sum().backward()
    assert torch.equal(x.grad, y.grad)
