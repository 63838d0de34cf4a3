"""FA4's index wrap skipped for the generated mask_mods and score_mods
(``kernels/fa4_unwrap.py``): the FA4 internals relied on, and fake compiles (sm90 PTX, no GPU)
showing the wrap's fast divisions gone. That the generated functions need no wrap is tested
where they are generated (``test_cute_predicate.py``: no read past a table at padded indices;
``test_score_mod.py``: unwrapped score_mods finite there); the GPU tests of the mask_mods and
score_mods run them unwrapped."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_fa4_score_mod_wrap_as_relied_on():
    """``fa4_unwrap`` replaces FA4's sm90 module globals ``apply_score_mod_inner`` /
    ``apply_score_mod_bwd_inner`` and passes their parameters through by position, with no
    divisors for an unwrapped score_mod: fail loudly if the pinned FA4 changes any of it."""
    pytest.importorskip("flash_attn.cute")
    from flash_attn.cute import flash_bwd_sm90, flash_fwd_sm90, softmax

    from compilemask.kernels import fa4_lib, fa4_unwrap

    for theirs, ours in ((softmax.apply_score_mod_inner, fa4_unwrap.apply_score_mod_inner),
                         (softmax.apply_score_mod_bwd_inner,
                          fa4_unwrap.apply_score_mod_bwd_inner)):
        src = inspect.getsource(theirs)
        head = src[src.index("(") + 1:src.index(")")]
        assert [p.split(":")[0].split("=")[0].strip() for p in head.split(",") if p.strip()] \
            == list(inspect.signature(ours).parameters)
        # no divisors: FA4 indexes directly
        assert "aux_data.tensors is not None and fastdiv_mods is not None" in src
    for mod, names in ((flash_fwd_sm90, ["apply_score_mod_inner"]),
                       (flash_bwd_sm90, ["apply_score_mod_inner", "apply_score_mod_bwd_inner"])):
        src = inspect.getsource(mod)
        for n in names:
            assert f"        {n}(" in src  # called through the module global
    with fa4_lib.patched(fa4_unwrap.PATCHES):
        assert flash_fwd_sm90.apply_score_mod_inner is fa4_unwrap.apply_score_mod_inner
        assert flash_bwd_sm90.apply_score_mod_inner is fa4_unwrap.apply_score_mod_inner
        assert flash_bwd_sm90.apply_score_mod_bwd_inner is fa4_unwrap.apply_score_mod_bwd_inner
    # FA4's own again outside this package's calls
    assert flash_fwd_sm90.apply_score_mod_inner is softmax.apply_score_mod_inner
    assert flash_bwd_sm90.apply_score_mod_bwd_inner is softmax.apply_score_mod_bwd_inner


def test_fa4_mask_wrap_as_relied_on():
    """``UnwrappedMask`` hands FA4's ``apply_mask`` ``(None, None)`` as divisors, which its
    mask_mod path reads as "no wrap"; both installed masks derive from it. The backward's
    drops the seqlen test for interval mask_mods as FA4's own masks do: keys only, its padded
    query rows' LSE +inf (and their Q / dO rows zero-filled)."""
    pytest.importorskip("flash_attn.cute")
    from flash_attn.cute import flash_bwd_preprocess
    from flash_attn.cute import mask as fa4_mask

    from compilemask.kernels.fa4_colmask import ColumnIntervalMask
    from compilemask.kernels.fa4_rowmask import RowIntervalMask
    from compilemask.kernels.fa4_unwrap import UnwrappedMask

    src = inspect.getsource(fa4_mask.AttentionMask.apply_mask)
    assert "fastdiv_mods is not None\n                and fastdiv_mods[0] is not None" in src
    # 4.0.0b36 wraps aux indices (divmod), 4.0.0b40 clamps them: both only with divisors
    assert ("if const_expr(wrap_aux_indices):" in src
            or "if const_expr(bound_aux_indices):" in src)
    assert list(inspect.signature(fa4_mask.AttentionMask.apply_mask).parameters) \
        == list(inspect.signature(UnwrappedMask.apply_mask).parameters)
    assert issubclass(RowIntervalMask, UnwrappedMask)
    assert issubclass(ColumnIntervalMask, UnwrappedMask)
    assert ColumnIntervalMask.KEYS_ONLY_SEQLEN and not RowIntervalMask.KEYS_ONLY_SEQLEN
    # FA4's own seqlen test without a mask_mod: the keys' limit alone
    branch = src[src.index("mask_mod is None):"):src.index("# FlexAttention mask mod")]
    assert "seqlenk_col_limit" in branch and "seqlen_q" not in branch
    pre = inspect.getsource(flash_bwd_preprocess)
    assert "lse = Float32.inf" in pre and "use_padded_offsets: bool = True" in pre


def _ptx_counts(script: str, args_by_name: dict, tmp_path, ops=("mul.hi",)) -> dict:
    """How many of each PTX op in ``ops`` per kernel, for each variant (``script --child
    *args``); ``mul.hi`` is the fast division's multiply."""
    sys.path.append(str(ROOT))  # after the installed packages
    from bench.sass import compile_in_child

    counts = {}
    for name, args in args_by_name.items():
        dump = tmp_path / name
        dump.mkdir()
        assert compile_in_child(str(ROOT / "bench" / script), args, dump)
        for kernel in ("fwd_sm90", "bwd_sm90"):
            ptx = next(dump.glob(f"*{kernel}*.ptx")).read_text()
            for op in ops:
                counts[name, kernel, op] = ptx.count(op)
    return counts


@pytest.mark.slow  # two kernels of their own
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
def test_alibi_kernels_have_no_index_wrap(tmp_path):
    """ALiBi on FA4's causal kernels: no fast division beyond those of the kernel without a
    score_mod (FA4's wrap is two per score)."""
    pytest.importorskip("flash_attn.cute")
    c = _ptx_counts("sass_score_mod.py", {"none": ["none"], "alibi": ["bits"]}, tmp_path)
    assert c["alibi", "fwd_sm90", "mul.hi"] == c["none", "fwd_sm90", "mul.hi"]
    assert c["alibi", "bwd_sm90", "mul.hi"] == c["none", "bwd_sm90", "mul.hi"]


@pytest.mark.slow  # two kernels of their own
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
def test_interval_backward_has_no_wrap_nor_seqlen_test(tmp_path):
    """Shared-prompt RM's backward on the block-sparse engine (the Interval Table test): no
    fast division and one select per score fewer than FA4's wrap and seqlen test of the same
    mask_mod."""
    pytest.importorskip("flash_attn.cute")
    c = _ptx_counts("sass_colmask.py", {"fa4": ["shared_prompt_rm", "default (wrapped)"],
                                        "ours": ["shared_prompt_rm", "default"]},
                    tmp_path, ("mul.hi", "selp.f32"))
    assert c["fa4", "bwd_sm90", "mul.hi"] > 0
    assert c["ours", "bwd_sm90", "mul.hi"] == 0
    assert c["ours", "bwd_sm90", "selp.f32"] < c["fa4", "bwd_sm90", "selp.f32"]
