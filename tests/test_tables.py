"""Table params: ``[B, Sq, M]`` metadata read in a rule as ``t[i, column]`` (draft-tree ancestors,
per-row key sets). The table's term stays a predicate; the intervals around it still skip tiles.
Every compiled mask equals the brute-force evaluation of the rules."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask.contract.descriptor import pack_table, unpack_table


def _tree_spec():
    """p prefix keys seen by every row, then n tree keys where the ancestor table says so."""
    return cm.MaskSpec("table_tree", params=["p", "n", "anc"], regions=[
        cm.Region("all", when=lambda i: True,
                  visible=lambda i, j: (j < p) | ((j >= p) & (j < p + n)  # noqa: F821
                                                  & anc[i, j - p]))])  # noqa: F821


def _banded_spec():
    """Two regions, a table read at a shifted column and an integer comparison of its entry."""
    return cm.MaskSpec("table_banded", params=["cut", "t"], regions=[
        cm.Region("head", when=lambda i: i < cut,  # noqa: F821
                  visible=lambda i, j: j <= i),
        cm.Region("tail", when=lambda i: i >= cut,  # noqa: F821
                  visible=lambda i, j: (j <= i) & ((t[i, i - j] == 1) | (j == i)))])  # noqa: F821


def _meta(spec_name, B, Sq, Sk, gen, M=None):
    if spec_name == "table_tree":
        p = torch.randint(0, Sk + 1, (B,), generator=gen)
        n = torch.randint(0, Sk + 1, (B,), generator=gen)
        M = M or int(torch.randint(1, Sk + 2, (1,), generator=gen))
        return {"p": p, "n": n, "anc": torch.rand(B, Sq, M, generator=gen) < 0.4}
    M = M or int(torch.randint(1, Sk + 2, (1,), generator=gen))
    return {"cut": torch.randint(0, Sq + 1, (B,), generator=gen),
            "t": (torch.rand(B, Sq, M, generator=gen) < 0.5).to(torch.int32)}


@pytest.mark.parametrize("factory", [_tree_spec, _banded_spec])
@pytest.mark.parametrize("Sq,Sk", [(1, 1), (7, 12), (33, 33), (130, 129), (200, 300)])
def test_table_masks_equal_brute_force(factory, Sq, Sk):
    """Random metadata: tables narrower and wider than the keys (columns outside the table read
    False), zero-length trees, rows that see nothing, lengths off the tile grid."""
    mask = cm.compile_mask(factory())
    assert mask.table_params and mask.has_fallback
    gen = torch.Generator().manual_seed(Sq * 1000 + Sk)
    for B in (1, 3):
        meta = _meta(mask.name, B, Sq, Sk, gen)
        desc = mask.preprocess(meta, seqlen_q=Sq, seqlen_k=Sk)
        want = mask.reference_mask(meta, Sq, Sk)
        assert torch.equal(desc.dense_mask(), want), (B, Sq, Sk)


def test_table_tiles_are_skipped_around_the_tree():
    """A long prefix and a short tree: prefix tiles full, tree tiles partial, none past it."""
    mask = cm.compile_mask(_tree_spec())
    Sq, p, n = 256, 4096, 256
    anc = torch.tril(torch.ones(1, Sq, n, dtype=torch.bool))
    desc = mask.preprocess({"p": p, "n": n, "anc": anc}, seqlen_q=Sq, seqlen_k=8192)
    lists = desc.block_sparse("fwd")
    assert lists.full_cnt.tolist() == [[[p // 128] * 2]]
    assert lists.mask_cnt.tolist() == [[[n // 128] * 2]]
    assert torch.equal(desc.dense_mask(), mask.reference_mask({"p": p, "n": n, "anc": anc},
                                                              Sq, 8192))


def test_table_words_round_trip():
    gen = torch.Generator().manual_seed(0)
    for M in (1, 31, 32, 33, 100):
        t = torch.rand(2, 5, M, generator=gen) < 0.5
        words = pack_table(t)
        assert words.dtype is torch.int32 and words.shape == (2, 5, -(-M // 32))
        back = unpack_table(words)
        assert torch.equal(back[..., :M], t.long()) and not back[..., M:].any()


def test_tilelang_preprocess_matches_the_reference_with_a_table():
    pytest.importorskip("tilelang")
    mask = cm.compile_mask(_tree_spec())
    meta = _meta(mask.name, 2, 70, 90, torch.Generator().manual_seed(3), M=40)
    ref = mask.preprocess(meta, seqlen_q=70, seqlen_k=90, backend="torch")
    tl = mask.preprocess(meta, seqlen_q=70, seqlen_k=90, backend="tilelang")
    for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap", "params", "row_params"):
        assert torch.equal(getattr(tl, f), getattr(ref, f)), f
    assert torch.equal(tl.dense_mask(), mask.reference_mask(meta, 70, 90))


def test_table_mask_through_the_bound_preprocessor_and_the_inspection_tools(tmp_path):
    pytest.importorskip("tilelang")
    mask = cm.compile_mask(_tree_spec())
    meta = _meta(mask.name, 2, 50, 80, torch.Generator().manual_seed(4), M=33)
    pre = mask.preprocessor(50, 80, batch_size=2, device="cpu")
    desc = pre(meta)
    assert torch.equal(desc.dense_mask(), mask.reference_mask(meta, 50, 80))
    assert "tables ['anc']" in mask.explain() and "anc[i, j - p] > 0" in mask.explain()
    assert desc.to_string()
    assert cm.visualize(desc, path=str(tmp_path / "tree.png"))


def test_table_mask_under_a_layer_window_and_warmup_metadata():
    """A model layer's window combined with a table mask (its metadata read back from the
    descriptor's words), and the metadata ``warmup`` builds for a table param."""
    from compilemask.api.warmup import zero_meta
    from compilemask.integrations.transformers import windowed_descriptor

    mask = cm.compile_mask(_tree_spec())
    meta = _meta(mask.name, 2, 50, 50, torch.Generator().manual_seed(1), M=70)
    desc = mask.preprocess(meta, 50, 50)
    i, j = torch.arange(50).view(50, 1), torch.arange(50).view(1, 50)
    got = windowed_descriptor(desc, 8).dense_mask()
    assert torch.equal(got, desc.dense_mask() & (j > i - 8))
    zeros = zero_meta(mask, 2, 50, "cpu")
    assert zeros["anc"].shape == (2, 50, 1)
    assert not mask.preprocess(zeros, 50).dense_mask().any()


def test_table_reads_are_refused_where_they_cannot_be_read():
    def spec(visible, when=lambda i: True, params=("t",)):
        return cm.MaskSpec("bad", params=list(params), regions=[
            cm.Region("r", when=when, visible=visible)])

    with pytest.raises(NotImplementedError, match="in a guard"):
        cm.compile_mask(spec(lambda i, j: j <= i, when=lambda i: t[i, i]))  # noqa: F821
    with pytest.raises(NotImplementedError, match="must depend on j"):
        cm.compile_mask(spec(lambda i, j: t[i, 3]))  # noqa: F821
    with pytest.raises(NotImplementedError, match="a table's row is i"):
        cm.compile_mask(spec(lambda i, j: t[j, i]))  # noqa: F821
    with pytest.raises(NotImplementedError, match="at most one table"):
        cm.compile_mask(spec(lambda i, j: t[i, j] & u[i, j], params=("t", "u")))  # noqa: F821
    with pytest.raises(ValueError, match="both as a per-row array and as a table"):
        cm.compile_mask(spec(lambda i, j: (t[i] == j) | t[i, j]))  # noqa: F821
    with pytest.raises(ValueError, match="is a table: write t\\[i, column\\]"):
        cm.compile_mask(spec(lambda i, j: t[i, j] & (t > j)))  # noqa: F821
    mask = cm.compile_mask(_tree_spec())
    with pytest.raises(ValueError, match=r"param 'anc' is a table: expected a \[B, Sq=8, M\]"):
        mask.preprocess({"p": 1, "n": 2, "anc": torch.ones(1, 8, dtype=torch.bool)}, 8)
    with pytest.raises(ValueError, match="param 'anc' is a table: pass a"):
        mask.preprocess({"p": 1, "n": 2, "anc": 1}, 8)


def test_table_masks_are_refused_by_the_cute_engine():
    from compilemask.kernels.dispatch import why_not

    mask = cm.compile_mask(_tree_spec())
    desc = mask.preprocess({"p": 1, "n": 2, "anc": torch.ones(1, 8, 2, dtype=torch.bool)}, 8)
    assert "fa4 engine only" in why_not(torch.empty(1, 8, 1, 64), desc, "cute")


def test_table_mask_attention_on_cpu_equals_dense():
    from compilemask.compiler.reference import attention_reference

    mask = cm.compile_mask(_tree_spec())
    meta = _meta(mask.name, 2, 40, 60, torch.Generator().manual_seed(5), M=30)
    desc = mask.preprocess(meta, seqlen_q=40, seqlen_k=60)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, 2, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 60, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    out = cm.attention(q, k, v, desc)
    torch.testing.assert_close(out, attention_reference(q, k, v, desc.dense_mask()))
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,Sk,M", [(256, 4352, 256), (200, 1000, 150)])
def test_gpu_table_mask_vs_float32_reference(Sq, Sk, M):
    """A draft tree after a prefix on the fa4 engine (its mask_mod reads the table's words),
    forward and backward within twice PyTorch's bf16 error."""
    from helpers import check_attention_vs_reference

    mask = cm.compile_mask(_tree_spec())
    gen = torch.Generator().manual_seed(Sq)
    meta = {"p": torch.tensor([Sk - M, Sk // 3]), "n": torch.tensor([M, M // 2]),
            "anc": torch.rand(2, Sq, M, generator=gen) < 0.3}
    meta = {k: v.cuda() for k, v in meta.items()}
    desc = mask.preprocess(meta, seqlen_q=Sq, seqlen_k=Sk)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, Sq, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, Sk, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    dense = mask.reference_mask({k: v.cpu() for k, v in meta.items()}, Sq, Sk)
    assert torch.equal(desc.dense_mask().cpu(), dense)
    check_attention_vs_reference(desc, q, k, v, "fa4", dense)


@pytest.mark.parametrize("test", ["==", "!=", "<", ">=", "reflected"])
def test_flex_tables_of_numbers_read_through_a_comparison(test):
    """``t[q_idx, kv_idx] == c`` of an integer (or float) table: the comparison made at
    conversion, the bool table a table param; equal to create_mask."""
    from torch.nn.attention.flex_attention import create_mask

    gen = torch.Generator().manual_seed(2)
    counts = torch.randint(0, 4, (2, 40, 40), generator=gen)
    weights = torch.rand(40, 40, generator=gen)

    def mm(b, h, q_idx, kv_idx):
        x = counts[b, q_idx, kv_idx]
        hit = {"==": x == 2, "!=": x != 0, "<": x < 1, ">=": x >= 3, "reflected": 2 <= x}[test]
        return hit & (weights[q_idx, kv_idx] > 0.25) | (q_idx == kv_idx)

    spec, meta = cm.from_mask_mod(mm)
    with pytest.raises(NotImplementedError, match="at most one table"):
        cm.compile_mask(spec)

    def one(b, h, q_idx, kv_idx):
        x = counts[b, q_idx, kv_idx]
        return {"==": x == 2, "!=": x != 0, "<": x < 1, ">=": x >= 3, "reflected": 2 <= x}[test]

    spec, meta = cm.from_mask_mod(one)
    got = cm.compile_mask(spec).preprocess(meta, seqlen_q=40).dense_mask()
    assert torch.equal(got, create_mask(one, 2, 1, 40, 40, device="cpu")[:, 0])


@pytest.mark.parametrize("S", [1, 33, 130])
def test_draft_tree_mask_module(S):
    """``masks.draft_tree``: equal to its rules by brute force and to its FlexAttention
    mask_mod on random trees (any depth), and to attention-gym's JetSpec tree on the draft
    rows of the same tree."""
    from torch.nn.attention.flex_attention import create_mask

    from compilemask import masks

    mask = cm.compile_mask(masks.draft_tree())
    gen = torch.Generator().manual_seed(S)
    meta = masks.random_meta(mask.spec, 3, S, gen)
    desc = mask.preprocess(meta, seqlen_q=S)
    assert torch.equal(desc.dense_mask(), mask.reference_mask(meta, S))
    mm = masks.flex_mask_mod(mask.spec, meta, S)
    assert torch.equal(desc.dense_mask(), create_mask(mm, 3, 1, S, S, device="cpu")[:, 0])
    am = pytest.importorskip("attn_gym.masks")
    parents, prefix = [-1, 0, 1, 1, 3, 0, 5][:max(0, S - 1)], 1
    if parents:
        tree = masks.draft_tree_meta(prefix, parents, S)
        rows = mask.preprocess(tree, seqlen_q=S).dense_mask()[0, prefix:prefix + len(parents)]
        anc = am.build_tree_ancestor_matrix(parents, device="cpu")
        jet = create_mask(am.generate_jetspec_tree_causal_mask_mod(prefix, anc), 1, 1,
                          len(parents), prefix + len(parents), device="cpu")[0, 0]
        assert torch.equal(rows[:, :prefix + len(parents)], jet)
        assert not rows[:, prefix + len(parents):].any()
