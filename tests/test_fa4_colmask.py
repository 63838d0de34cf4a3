"""The column view (``compiler.columns``) and the ``"columns"`` mask_mod variant that masks
FA4's transposed sm90 backward with it (``kernels/fa4_colmask.py``).

CPU: the compiled column view of every example mask against the brute-force mask, key by key,
on random metadata (ordered and not); the run merge; the kernel's test modelled on the CPU
(overflowing keys through the Interval Table); the pipeline option, the descriptor and op
plumbing, the variant's key and refusals, the FA4 internals relied on, a fake compile and its
unsigned compares. GPU: every example mask with a column view, head dims 128 and 64, and
metadata that overflow, against the float32 reference."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from test_fa4_engine import _gpu_case

import compilemask as cm
from compilemask import masks
from compilemask.codegen.cute_mask_mod import (
    COLUMNS_ATTR,
    forward_variant,
    mask_mod,
    mask_mod_source,
    mask_mod_variant,
)
from compilemask.compiler.columns import OVERFLOW, column_table, merge_runs
from compilemask.pipeline.pipeline import PipelineConfig

from helpers import check_attention_vs_reference

COLUMNS = PipelineConfig(column_view=True)
WITH_VIEW = sorted(n for n, f in masks.EXAMPLES.items()
                   if cm.compile_mask(f()).column_view is not None)


def _decode(table: torch.Tensor, seqlen_q: int) -> torch.Tensor:
    """bool [B, Sq, Sk] of a column table (overflowing keys: no rows)."""
    rows = torch.arange(seqlen_q).view(1, seqlen_q, 1)
    out = torch.zeros(table.shape[0], seqlen_q, table.shape[1], dtype=torch.bool)
    for s in range(table.shape[2]):
        lo, ln = (table[..., s, n].long().unsqueeze(1) for n in (0, 1))
        out |= (rows >= lo) & (rows < lo + ln)
    return out


def _split_columns():
    """K = 1 per row, 5 intervals per key (more than the view keeps, so it keeps K = 1 slot):
    a key in [p2, p) is seen by rows [0, a), [b, c) and [d, S), three runs, and overflows."""
    # noqa: F821 below: the metadata names are runtime params
    return cm.MaskSpec("split_columns", params=["a", "b", "c", "d", "p", "p2"], regions=[
        cm.Region("r0", when=lambda i: i < a, visible=lambda i, j: j < p),  # noqa: F821
        cm.Region("r1", when=lambda i: i < b, visible=lambda i, j: j < p2),  # noqa: F821
        cm.Region("r2", when=lambda i: i < c, visible=lambda i, j: j < p),  # noqa: F821
        cm.Region("r3", when=lambda i: i < d, visible=lambda i, j: j < p2),  # noqa: F821
        cm.Region("rest", when=lambda i: i >= 0, visible=lambda i, j: j < p),  # noqa: F821
    ])


def _split_meta(B: int, S: int, gen: torch.Generator) -> dict:
    ends = torch.randint(0, S + S // 4, (B, 4), generator=gen).sort(dim=1).values
    p = torch.randint(0, S + 1, (B, 2), generator=gen)
    return {"a": ends[:, 0], "b": ends[:, 1], "c": ends[:, 2], "d": ends[:, 3],
            "p": p.amax(dim=1), "p2": p.amin(dim=1)}


def test_every_view_names_its_masks():
    # which example masks have one, and why the others do not: guards against a silent loss
    assert WITH_VIEW == ["block_causal", "causal", "chunked_causal", "clear", "prefix_lm",
                         "shared_prompt_rm", "sink_window", "sliding_window"]
    reasons = {n: cm.compile_mask(f()).column_view_reason for n, f in masks.EXAMPLES.items()}
    assert "keep a predicate" in reasons["dilated_causal"]
    assert "exchanged rule keeps a predicate" in reasons["packed_prefix_lm"]
    rm = cm.compile_mask(masks.shared_prompt_rm()).column_view
    assert (rm.num_intervals, rm.slots) == (13, 2)  # 13 intervals, merged into K = 2 slots


@pytest.mark.parametrize("name", WITH_VIEW)
@pytest.mark.parametrize("S", [1, 37, 129, 300])
def test_column_table_equals_the_brute_force_mask(name, S):
    """Each key's runs are exactly the rows that see it (the user's rules evaluated at every
    (i, j)), for random metadata with empty segments and ends past the sequence; no key of these
    overflows."""
    spec = masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    for seed in range(3):
        meta = masks.random_meta(spec, 3, S, torch.Generator().manual_seed(seed)) or None
        desc = mask.preprocess(meta, S, batch_size=3, config=COLUMNS)
        assert desc.columns.shape == (3, S, mask.column_view.slots, 2)
        assert desc.columns.dtype == torch.int32
        assert (desc.columns[..., 1] >= 0).all()
        ref = mask.reference_mask(meta, S, batch_size=3)
        assert torch.equal(_decode(desc.columns, S), ref), (name, S, seed)


def test_overflowing_keys_are_flagged_and_the_rest_exact():
    """Keys with more runs than slots are flagged (slot 0 ``(0, OVERFLOW)``), every other key
    is exact, and the kernel's test (modelled below) is exact on all of them."""
    mask = cm.compile_mask(_split_columns())
    view = mask.column_view
    assert (mask.num_intervals, view.num_intervals, view.slots, view.can_overflow) == (
        1, 5, 1, True)
    S, B, flagged = 200, 8, 0
    for seed in range(4):
        meta = _split_meta(B, S, torch.Generator().manual_seed(seed))
        desc = mask.preprocess(meta, S, batch_size=B, config=COLUMNS)
        over = desc.columns[..., 0, 1] == OVERFLOW  # [B, Sk]
        flagged += int(over.sum())
        ref = mask.reference_mask(meta, S, batch_size=B)
        got = _decode(desc.columns, S)
        keep = ~over.unsqueeze(1).expand_as(ref)
        assert torch.equal(got[keep], ref[keep])
        assert torch.equal(_kernel_model(desc), ref)
    assert flagged > 0  # the fallback path was exercised


def test_shared_prompt_keys_stay_within_two_runs_in_any_order():
    """RM's ends in any order: a region's rows are one range past every earlier region's, so a
    key's rows are at most its own region's and the prompt's, and never overflow its 2 slots."""
    mask = cm.compile_mask(masks.shared_prompt_rm())
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        meta = masks.random_meta(mask.spec, 6, 200, gen)
        ends = torch.stack(list(meta.values()), dim=1)
        perm = torch.stack([torch.randperm(ends.shape[1], generator=gen) for _ in ends])
        meta = dict(zip(meta, ends.gather(1, perm).unbind(1)))
        desc = mask.preprocess(meta, 200, batch_size=6, config=COLUMNS)
        assert (desc.columns[..., 0, 1] != OVERFLOW).all()
        assert torch.equal(_decode(desc.columns, 200),
                           mask.reference_mask(meta, 200, batch_size=6))


def _kernel_model(desc) -> torch.Tensor:
    """``ColumnIntervalMask.apply_own``'s arithmetic on the CPU, every (row, key) of the
    sequence: per key, the unsigned test ``uint32(row - lo) < uint32(len)`` over its slots, or,
    flagged, the Interval Table's ``uint32(key - start) < uint32(len)`` over the row's K slots."""
    B, S = desc.batch_size, desc.seqlen_q
    rows = torch.arange(S).view(1, S, 1)
    keys = torch.arange(desc.seqlen_k).view(1, 1, -1)
    u32 = 0xFFFFFFFF
    vis = torch.zeros(B, S, desc.seqlen_k, dtype=torch.bool)
    for s in range(desc.columns.shape[2]):
        lo, ln = (desc.columns[..., s, n].long().unsqueeze(1) for n in (0, 1))
        vis |= ((rows - lo) & u32) < (ln & u32)
    table = torch.zeros_like(vis)
    for m in range(desc.intervals.shape[2]):
        st, ln = (desc.intervals[:, :, m, n].long().unsqueeze(2) for n in (0, 1))
        table |= ((keys - st) & u32) < (ln & u32)
    over = (desc.columns[..., 0, 1] == OVERFLOW).unsqueeze(1)
    return torch.where(over, table, vis)


def test_kernel_test_equals_the_mask_for_every_view():
    for name in WITH_VIEW:
        spec = masks.EXAMPLES[name]()
        mask = cm.compile_mask(spec)
        meta = masks.random_meta(spec, 2, 150, torch.Generator().manual_seed(5)) or None
        desc = mask.preprocess(meta, 150, batch_size=2, config=COLUMNS)
        assert torch.equal(_kernel_model(desc), mask.reference_mask(meta, 150, batch_size=2))


def test_explain_shows_the_column_view():
    rm = cm.compile_mask(masks.shared_prompt_rm()).explain(columns=True)
    assert "query rows q_idx that see key kv_idx" in rm and "into 2 slot(s)" in rm
    assert "interval 12:" in rm and "Interval Table test" in rm
    # in the mask's own names: the key's rows run to seqlen_q
    prefix = cm.compile_mask(masks.prefix_lm()).explain(columns=True)
    assert "interval 0: q_idx in [kv_idx, seqlen_q)" in prefix
    assert "interval 1: q_idx in [0, seqlen_q)  if kv_idx < prefix_len" in prefix
    hstu = cm.compile_mask(masks.hstu()).explain(columns=True)
    assert "column view: none (its exchanged rule keeps a predicate" in hstu
    assert "column view" not in cm.compile_mask(masks.hstu()).explain()


def test_merge_runs():
    """Runs of the union in order: overlapping and touching intervals merge, empty ones vanish,
    more runs than slots flag slot 0."""
    s = torch.tensor([[5, 0, 3, 20, 9, 40]])
    n = torch.tensor([[4, 0, 2, 5, 0, 1]])  # [5, 9), empty, [3, 5), [20, 25), empty, [40, 41)
    assert merge_runs(s, n, 3).tolist() == [[[3, 6], [20, 5], [40, 1]]]
    assert merge_runs(s, n, 2).tolist() == [[[0, OVERFLOW], [0, 0]]]
    assert merge_runs(s, torch.zeros_like(n), 2).tolist() == [[[0, 0], [0, 0]]]
    s, n = torch.tensor([[0, 2, 10]]), torch.tensor([[10, 3, 0]])  # nested, then an empty one
    assert merge_runs(s, n, 1).tolist() == [[[0, 10]]]


def test_column_view_pipeline_option():
    """Both producers write the same table; the descriptor moves it; masks and shapes without a
    view are refused by name."""
    mask = cm.compile_mask(masks.shared_prompt_rm())
    meta = masks.random_meta(mask.spec, 2, 100, torch.Generator().manual_seed(1))
    desc = mask.preprocess(meta, 100, config=COLUMNS)
    assert mask.preprocess(meta, 100).columns is None  # only when asked
    assert torch.equal(desc.to("cpu").columns, desc.columns)
    again = column_table(mask, desc.params, desc.row_params, 100)
    assert torch.equal(again, desc.columns)
    pytest.importorskip("tilelang")
    pre = mask.preprocessor(100, batch_size=2, device="cpu", config=COLUMNS)
    assert torch.equal(pre(meta).columns, desc.columns)
    assert set(cm.warmup(mask, [100], device="cpu", config=COLUMNS)) == {(100, None)}
    with pytest.raises(ValueError, match="'dilated_causal.*' has no column view .*predicate"):
        cm.compile_mask(masks.dilated_causal()).preprocess(None, 64, batch_size=1,
                                                          config=COLUMNS)
    with pytest.raises(ValueError, match="square attention"):
        mask.preprocess(meta, 100, 120, config=COLUMNS)
    with pytest.raises(TypeError, match="column_view must be None, True or False"):
        PipelineConfig(column_view="yes")


def test_column_view_by_default_only_where_a_batch_can_use_it(monkeypatch):
    """``column_view=None`` follows ``DEFAULT_COLUMN_VIEW`` for CUDA descriptors of square
    attention on the block-sparse engine; the CPU, native masks, rectangles and masks without a
    view get none, and nothing raises."""
    from compilemask.pipeline import pipeline

    wants = pipeline._wants_columns
    rm = cm.compile_mask(masks.shared_prompt_rm())
    causal = cm.compile_mask(masks.causal())
    hstu = cm.compile_mask(masks.hstu())
    auto, on, off = PipelineConfig(), COLUMNS, PipelineConfig(column_view=False)
    assert not pipeline.DEFAULT_COLUMN_VIEW  # until timed on the H200
    assert not wants(rm, auto, "cuda", False, True)
    monkeypatch.setattr(pipeline, "DEFAULT_COLUMN_VIEW", True)
    assert wants(rm, auto, "cuda", False, True)
    assert not wants(rm, auto, "cpu", False, True)
    assert not wants(causal, auto, "cuda", True, True)  # the native engine reads none
    assert not wants(rm, auto, "cuda", False, False)
    assert not wants(hstu, auto, "cuda", False, True)
    assert wants(hstu, on, "cpu", False, False) and not wants(rm, off, "cuda", False, True)
    meta = masks.random_meta(rm.spec, 2, 100, torch.Generator().manual_seed(1))
    assert rm.preprocess(meta, 100).columns is None  # the CPU: never by default


@pytest.mark.parametrize("name", [*WITH_VIEW, "split_columns"])
def test_column_table_program_equals_the_reference(name):
    """The generated TileLang program (C target) writes the torch reference's table bit for
    bit, overflow flags included."""
    pytest.importorskip("tilelang")
    from compilemask.codegen.column_table import tilelang_column_table

    spec = _split_columns() if name == "split_columns" else masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    for S in (1, 37, 300):
        gen = torch.Generator().manual_seed(S)
        meta = (_split_meta(3, S, gen) if name == "split_columns"
                else masks.random_meta(spec, 3, S, gen) or None)
        desc = mask.preprocess(meta, S, batch_size=3, config=COLUMNS)
        got = tilelang_column_table(mask, desc.params, desc.row_params, S)
        assert torch.equal(got, desc.columns), (name, S)


def test_column_table_program_compiles_for_cuda():
    pytest.importorskip("tilelang")
    from compilemask.codegen.column_table import column_table_program
    from compilemask.codegen.tilelang_build import compile_program

    mask = cm.compile_mask(masks.shared_prompt_rm())
    kern = compile_program(*column_table_program(mask, "cuda"))
    assert "column_table" in kern.get_kernel_source()


def test_a_first_batch_builds_the_column_program_with_the_others():
    from compilemask.pipeline.pipeline import first_use_programs

    mask = cm.compile_mask(masks.shared_prompt_rm())
    with_view = [p.attr for p in first_use_programs(mask, "cuda", config=COLUMNS)]
    assert with_view.count("column_table") == 1 and "preprocess" in with_view
    assert "column_table" not in [p.attr for p in first_use_programs(mask, "cuda")]
    assert "column_table" not in [p.attr for p in first_use_programs(mask, "cpu", config=COLUMNS)]


def test_columns_travel_with_the_op_for_head_dim_128():
    from compilemask.contract.descriptor import DescriptorArgs
    from compilemask.kernels.contract import LIST_SLOTS, OpSlots, mask_for_key

    mask = cm.compile_mask(masks.shared_prompt_rm())
    meta = masks.random_meta(mask.spec, 2, 100, torch.Generator().manual_seed(1))
    desc = mask.preprocess(meta, 100, config=COLUMNS)
    slots = OpSlots.of(desc, "fa4", 128)
    assert slots.columns is desc.columns
    # head dim 64 (a tile FA4 does not transpose): carried, and its mask_mod's own test runs
    assert OpSlots.of(desc, "fa4", 64).columns is desc.columns
    back = slots.descriptor(DescriptorArgs.of(desc), mask_for_key(mask.key))
    assert back.columns is desc.columns
    bwd = slots.lists(backward=True)
    assert all(a is getattr(slots, f) for a, f in zip(bwd, LIST_SLOTS["bwd"]))
    assert all(a.equal(b) for a, b in zip(bwd, desc.block_sparse("bwd64")))
    plain = dataclasses.replace(desc, columns=None)
    assert OpSlots.of(plain, "fa4", 128).columns is None


def test_columns_variant_key_marker_and_refusals():
    """A kernel key of its own, the (K, slots) marker the backward reads, the forward's default
    in its place, the backward's default where the descriptor carries the view, and refusals
    that say what is missing."""
    mask = cm.compile_mask(masks.shared_prompt_rm())
    cols, intervals = mask_mod(mask, "columns"), mask_mod(mask, "intervals")
    assert cols.__cute_hash__ != intervals.__cute_hash__
    assert getattr(cols, COLUMNS_ATTR) == (2, 2, True) and not hasattr(intervals, COLUMNS_ATTR)
    assert "COLUMNS = (2, 2, True)" in mask_mod_source(mask, "columns")
    # a view no larger than the table: every interval has its slot, no key can overflow
    causal = cm.compile_mask(masks.causal())
    assert getattr(mask_mod(causal, "columns"), COLUMNS_ATTR) == (1, 1, False)
    assert forward_variant(mask, "columns", backward=False) == "rows"
    assert forward_variant(mask, None, backward=True, columns=True) == "columns"
    assert forward_variant(mask, "columns", backward=True, columns=True) == "columns"
    assert forward_variant(mask, "intervals", backward=True, columns=True) == "intervals"
    assert forward_variant(mask, None, backward=True) == mask_mod_variant(mask)
    with pytest.raises(ValueError, match="column_view=True"):
        forward_variant(mask, "columns", backward=True)
    with pytest.raises(ValueError, match="'columns' mask_mod needs a column view"):
        mask_mod_source(cm.compile_mask(masks.hstu()), "columns")
    with pytest.raises(ValueError, match="not 4 heads folded"):
        mask_mod_source(mask, "columns", heads=4)
    assert cm.KernelOptions(mask_mod="columns").mask_mod == "columns"


def test_fa4_internals_the_column_mask_relies_on():
    """Fails when the pinned flash-attn-4 changes what ``ColumnIntervalMask`` overrides or
    reads: the backward module's ``AttentionMask`` global and the transposed tile it is built
    for, ``apply_mask``'s parameters, the transposing reshape."""
    bwd_mod = pytest.importorskip("flash_attn.cute.flash_bwd_sm90")
    from flash_attn.cute import mask as fa4_mask
    from quack import layout_utils

    from compilemask.kernels import fa4_colmask, fa4_lib
    from compilemask.kernels.fa4_colmask import ColumnIntervalMask

    assert bwd_mod.AttentionMask is fa4_mask.AttentionMask  # FA4's own outside our calls
    src = inspect.getsource(bwd_mod.FlashAttentionBackwardSm90)
    assert "AttentionMaskCls = partial(\n            AttentionMask," in src
    assert "swap_AB=self.SdP_swapAB," in src
    # the transposed tile is indexed (n, m): the key first
    assert "(self.tile_n, self.tile_m) if self.SdP_swapAB else (self.tile_m, self.tile_n)" in src
    params = list(inspect.signature(fa4_mask.AttentionMask.apply_mask).parameters)
    assert params == list(inspect.signature(ColumnIntervalMask.apply_mask).parameters)
    assert "transpose" in inspect.signature(layout_utils.reshape_acc_to_mn).parameters
    with fa4_lib.patched(fa4_colmask.PATCHES):
        assert bwd_mod.AttentionMask is ColumnIntervalMask
        with fa4_lib.patched(fa4_colmask.PATCHES):  # nested (or another thread's call): still ours
            assert bwd_mod.AttentionMask is ColumnIntervalMask
        assert bwd_mod.AttentionMask is ColumnIntervalMask
    assert bwd_mod.AttentionMask is fa4_mask.AttentionMask


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
@pytest.mark.parametrize("head_dim", [128, 64])
def test_columns_backward_compiles_in_fa4(head_dim):
    """FA4's sm90 backward with the column mask (head dim 128: the transposed tile it masks;
    64: FA4's own per-score path with the same mask_mod), fake tensors, no GPU."""
    from test_fa4_engine import _compiles_in_fa4

    mask = cm.compile_mask(masks.shared_prompt_rm())
    _compiles_in_fa4(mask, masks.random_meta(mask.spec, 2, 300, torch.Generator().manual_seed(0)),
                     head_dim, variant="columns", config=COLUMNS)


@pytest.mark.slow  # kernels of their own
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
def test_column_tests_compare_unsigned(tmp_path):
    """The column mask's tests ``uint(row - lo) < uint(len)`` compile to unsigned compares: 2
    keys x 16 rows per thread for causal (runs), every row and key for RM's flagged keys (the
    Interval Table branch). CuTe's layout integers stay signed under ``Uint32`` (also pinned
    here), so the kernel converts them first (``fa4_colmask._plain``); compiled signed, every
    row before a run's start was visible."""
    pytest.importorskip("flash_attn.cute")
    from test_fa4_unwrap import _ptx_counts

    ops = ("setp.lt.u32", "setp.gt.u32", "setp.lt.s32")
    c = _ptx_counts("sass_colmask.py", {"cols": ["causal", "columns"],
                                        "default": ["causal", "default"]}, tmp_path, ops)
    unsigned = c["cols", "bwd_sm90", "setp.lt.u32"] + c["cols", "bwd_sm90", "setp.gt.u32"]
    assert unsigned >= 32 + c["default", "bwd_sm90", "setp.lt.u32"]
    assert c["cols", "bwd_sm90", "setp.lt.s32"] <= c["default", "bwd_sm90", "setp.lt.s32"]


def test_layout_integers_stay_signed_under_uint32():
    """The CUTLASS DSL quirk ``fa4_colmask._plain`` works around: an IntValue (a layout
    coordinate's integer) ignores the signedness ``Uint32`` asks for."""
    pytest.importorskip("cutlass")
    import inspect as _inspect

    from cutlass.cute.core import IntValue

    src = _inspect.getsource(IntValue.__init__)
    assert "always signed" in src and "super().__init__(v, True" in src


@pytest.mark.gpu
@pytest.mark.parametrize("name", WITH_VIEW)
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_columns_vs_float32_reference(name, D):
    """Every example mask with a column view (random metadata with empty segments and rows
    that see nothing; 1000 rows, not a multiple of the tile), forward and backward through
    the op, the backward reading the view by default."""
    mask, _, q, k, v = _gpu_case(name, 2, 1000, 4, 2, D, seed=13)
    gen = torch.Generator().manual_seed(13)
    meta = {key: t.cuda() for key, t in masks.random_meta(mask.spec, 2, 1000, gen).items()}
    desc = mask.preprocess(meta or None, 1000, batch_size=2, device="cuda", config=COLUMNS)
    assert desc.columns is not None
    check_attention_vs_reference(desc, q, k, v, "fa4", desc.dense_mask())


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_columns_overflowing_keys(D):
    """Flagged keys take the Interval Table test in the kernel (the other keys here are seen
    by every row or by none, so this passes where the view's row test is wrong)."""
    mask = cm.compile_mask(_split_columns())
    meta = _split_meta(2, 1000, torch.Generator().manual_seed(3))
    desc = mask.preprocess({k: t.cuda() for k, t in meta.items()}, 1000, batch_size=2,
                           device="cuda", config=COLUMNS)
    assert (desc.columns[..., 0, 1] == OVERFLOW).any()
    q = torch.randn(2, 1000, 4, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1000, 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_attention_vs_reference(desc, q, k, v, "fa4", desc.dense_mask(),
                                 options=cm.KernelOptions(mask_mod="columns"))
