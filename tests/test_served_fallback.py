"""Descriptors of chosen rows of masks with fallback regions (a rule kept as a predicate): a
served request's last rows (decode, chunked prefill, requests of their own lengths, a packed
batch) and context-parallel shards equal the corresponding rows of the whole sequence's
square mask, and attention on them the whole recomputation's rows. The predicates read ``i``
as the row's position and arrays at the keys' positions (``ExecutionDescriptor.positions`` /
``key_params``)."""

from __future__ import annotations

import importlib

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.api import distributed as cp
from compilemask.api import viz
from compilemask.api.serving import paged_attention, query_descriptor, varlen_attention
from compilemask.compiler.reference import attention_reference

SK, B = 40, 4


def _mask_mods(gen):
    """FlexAttention mask_mods whose rules keep predicates, over random metadata of ``B``
    sequences of ``SK`` tokens: documents by segment id, a DFS-ordered tree (node ``j`` is an
    ancestor of ``i`` iff ``j <= i < j + size[j]``), Longformer with scattered global tokens,
    a chat by turn id (a turn sees its own turn and every system token), axial."""
    seg = torch.randint(0, 3, (B, SK), generator=gen)  # interleaved: spans over-approximate
    size = torch.randint(1, 7, (B, SK), generator=gen)
    glob = torch.rand(B, SK, generator=gen) < 0.15
    turn = torch.sort(torch.randint(0, 4, (B, SK), generator=gen), dim=1).values
    system = torch.randint(0, 2, (B, SK), generator=gen)

    def packed_by_segment_id(b, h, q, kv):
        return (seg[b, q] == seg[b, kv]) & (kv <= q)

    def dfs_tree(b, h, q, kv):
        return (kv <= q) & (q < kv + size[b, kv])

    def longformer_globals(b, h, q, kv):
        return glob[b, q] | glob[b, kv] | ((q - kv).abs() <= 3)

    def chat_by_turn(b, h, q, kv):
        return (kv <= q) & ((turn[b, kv] == turn[b, q]) | (system[b, kv] == 0))

    def axial(b, h, q, kv):
        return (kv <= q) & (((q - kv) % 8 == 0) | (q // 8 == kv // 8))

    return [packed_by_segment_id, dfs_tree, longformer_globals, chat_by_turn, axial]


def _cases():
    """(name, compiled mask, metadata of B x SK): every example mask with fallback regions,
    and the mask_mods above."""
    out = []
    for name, f in masks.EXAMPLES.items():
        mask = cm.compile_mask(f())
        if mask.has_fallback:
            meta = masks.random_meta(mask.spec, B, SK, torch.Generator().manual_seed(3))
            out.append((name, mask, meta or None))
    # speculative decoding's tree of any depth: an ancestor table read at the row
    tree = importlib.import_module("compilemask.masks.draft_tree")
    mask = cm.compile_mask(tree.draft_tree())
    out.append(("draft_tree", mask, masks.random_meta(mask.spec, B, SK,
                                                      torch.Generator().manual_seed(5))))
    for mm in _mask_mods(torch.Generator().manual_seed(7)):
        spec, meta = cm.from_mask_mod(mm, batch_size=B)
        out.append((mm.__name__, cm.compile_mask(spec), meta or None))
    return out


CASES = _cases()
NAMES = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def squares():
    """name -> the whole sequences' square mask, checked against the rules called on every
    (i, j) (the oracle)."""
    out = {}
    for name, mask, meta in CASES:
        full = mask.preprocess(meta, SK, batch_size=B).dense_mask()
        assert torch.equal(full, mask.reference_mask(meta, SK, batch_size=B)), name
        out[name] = full
    return out


def test_cases_keep_predicates_on_keys():
    """The cases are what they are meant to be: fallback masks, most reading arrays at j."""
    assert "dilated_causal" in NAMES and len(CASES) >= 7
    assert _case("draft_tree")[1].table_params
    for name, mask, _ in CASES:
        assert mask.has_fallback, name
    keyed = [n for n, m, _ in CASES if m.key_indexed_arrays]
    assert {"packed_by_segment_id", "dfs_tree", "longformer_globals", "chat_by_turn"} <= set(keyed)


def _case(name):
    return next(c for c in CASES if c[0] == name)


@pytest.mark.parametrize("name", NAMES)
def test_last_rows_equal_the_square_mask(name, squares):
    """Decode (Sq 1), a prefill chunk (Sq 7) and the whole prompt: the rows of the square."""
    _, mask, meta = _case(name)
    full = squares[name]
    for Sq in (1, 7, SK):
        d = query_descriptor(mask, meta, SK, Sq, batch_size=B)
        assert d.positions is not None and d.key_params.shape[:2] == (B, SK)
        assert torch.equal(d.positions, torch.arange(SK - Sq, SK, dtype=torch.int32).expand(B, -1))
        assert torch.equal(d.dense_mask(), full[:, SK - Sq:]), (name, Sq)
    # the pictures' row reader: a window of a chunk's rows and keys of one sequence
    d = query_descriptor(mask, meta, SK, 7, batch_size=B)
    assert torch.equal(viz.dense_rows(d, 2, 1, 6, 5, 38), full[2, SK - 6:SK - 1, 5:38]), name
    # a shorter sequence of the same metadata: its own square, not the longer one's
    d = query_descriptor(mask, meta, 23, 7, batch_size=B)
    assert torch.equal(d.dense_mask(), full[:, 16:23, :23]), name


def _expected_rows(full, rows, used):
    """bool [B, Sq, SK]: request b's rows at positions ``rows[b]`` (-1 or negative: none),
    keys below ``used[b]`` only."""
    Bq, Sq = rows.shape
    out = torch.zeros(Bq, Sq, SK, dtype=torch.bool)
    for b in range(Bq):
        u = int(used[b])
        for r in range(Sq):
            p = int(rows[b, r])
            if p >= 0:
                out[b, r, :u] = full[b, p, :u]
    return out


@pytest.mark.parametrize("name", NAMES)
def test_requests_of_their_own_lengths(name, squares):
    """One KV buffer, request b holding seqused_k[b] keys (some 0), queries its last
    positions; and a packed batch (seqused_q), rows past a request's queries padding."""
    _, mask, meta = _case(name)
    full = squares[name]
    used = torch.tensor([SK, 0, 5, 23])
    for Sq in (1, 7):
        d = query_descriptor(mask, meta, SK, Sq, batch_size=B, seqused_k=used)
        rows = used.view(-1, 1) - Sq + torch.arange(Sq)
        assert torch.equal(d.dense_mask(), _expected_rows(full, rows, used)), (name, Sq)
    used_q = torch.tensor([7, 0, 3, 1])
    d = query_descriptor(mask, meta, SK, 7, batch_size=B, seqused_k=used,
                         seqused_q=used_q)
    local = torch.arange(7).view(1, -1)
    rows = torch.where(local < used_q.view(-1, 1), used.view(-1, 1) - used_q.view(-1, 1) + local,
                       -1)
    assert torch.equal(d.dense_mask(), _expected_rows(full, rows, used)), name


@pytest.mark.parametrize("name", ["dilated_causal", "packed_by_segment_id", "dfs_tree",
                                  "longformer_globals", "chat_by_turn", "draft_tree"])
def test_attention_equals_the_whole_recomputation(name, squares):
    """cm.attention of the last rows (reference engine) equals the whole sequence's
    attention at those rows; paged_attention and varlen_attention equal each request's rows
    of its own whole recomputation."""
    _, mask, meta = _case(name)
    full = squares[name]
    gen = torch.Generator().manual_seed(11)
    H, Hkv, D = 4, 2, 16
    q_all = torch.randn(B, SK, H, D, generator=gen)
    k, v = (torch.randn(B, SK, Hkv, D, generator=gen) for _ in range(2))
    whole = cm.attention(q_all, k, v, mask.preprocess(meta, SK, batch_size=B))
    for Sq in (1, 7):
        d = query_descriptor(mask, meta, SK, Sq, batch_size=B)
        got = cm.attention(q_all[:, SK - Sq:], k, v, d)
        torch.testing.assert_close(got, whole[:, SK - Sq:], rtol=1e-5, atol=1e-5)
    # requests of their own lengths: paged keys, then a packed batch
    from test_serving import _paged

    used, used_q = torch.tensor([SK, 0, 5, 23]), torch.tensor([7, 0, 3, 1])
    k_cache, v_cache, table = _paged((k, v), 16, gen)
    d = query_descriptor(mask, meta, SK, 7, batch_size=B, seqused_k=used)
    q = torch.randn(B, 7, H, D, generator=gen)
    paged = paged_attention(q, k_cache, v_cache, table, d)
    dp = query_descriptor(mask, meta, SK, 7, batch_size=B, seqused_k=used, seqused_q=used_q)
    qp = torch.cat([q[b, 7 - int(n):] for b, n in enumerate(used_q)])
    kp, vp = (torch.cat([t[b, :int(u)] for b, u in enumerate(used)]) for t in (k, v))
    packed = varlen_attention(qp, kp, vp, dp)
    qo = 0
    for b in range(B):
        u, n = int(used[b]), int(used_q[b])
        rows = [u - 7 + r for r in range(7)]
        if not u:  # no keys: output 0
            assert torch.equal(paged[b], torch.zeros_like(paged[b])) and not n
            continue
        # request b alone: its whole recomputation over its u keys, at its last rows
        want = attention_reference(q[b:b + 1], k[b:b + 1, :u], v[b:b + 1, :u],
                                   _expected_rows(full[b:b + 1], torch.tensor([rows]),
                                                  [u])[..., :u])
        torch.testing.assert_close(paged[b], want[0], rtol=1e-5, atol=1e-5)
        if n:
            torch.testing.assert_close(packed[qo:qo + n], want[0, 7 - n:], rtol=1e-5,
                                       atol=1e-5)
        qo += n


@pytest.mark.parametrize("name", ["dilated_causal", "dfs_tree", "longformer_globals"])
def test_context_parallel_shards_equal_the_square_rows(name, squares):
    _, mask, meta = _case(name)
    plan = cp.make_plan(mask, meta, SK, 3, tile=8, batch_size=B)
    for rank in range(3):
        d = cp.shard_descriptor(mask, meta, plan, rank, batch_size=B)
        rows = plan.rows[rank]
        want = torch.zeros(B, len(rows), SK, dtype=torch.bool)
        real = rows < SK
        want[:, real] = squares[name][:, rows[real]]
        assert torch.equal(d.dense_mask(), want), (name, rank)


def test_fa4_mask_mod_reads_the_rows_positions():
    """The generated FA4 mask_mod of such a descriptor: the predicates (the square path's
    sources) called at the row's position, arrays through the sequence's key_params; the
    square descriptor's mask_mod does not read them."""
    from compilemask.codegen.cute_mask_mod import (
        aux_layout,
        aux_tensors,
        mask_mod_source,
        variant_for_call,
    )

    _, mask, meta = _case("dfs_tree")
    d = query_descriptor(mask, meta, SK, 7, batch_size=B)
    assert variant_for_call(d, None, backward=False) == "intervals"
    assert variant_for_call(d, None, backward=False, served=True) == "intervals"
    with pytest.raises(ValueError, match="chosen positions"):
        variant_for_call(d, "predicate", backward=False)
    assert aux_layout(mask, "intervals", True) == ("intervals", "row_region", "positions",
                                                   "key_params")
    aux = aux_tensors(d, "intervals")
    assert aux[2] is d.positions and aux[3] is d.key_params
    src = mask_mod_source(mask, "intervals", positions=True)
    square = mask_mod_source(mask, "intervals")
    assert "pos = positions[b, row]" in src and "predicate_0(pos, col, key_params[b, pos, 0]" in src
    assert "positions" not in square and "key_params" not in square
    head = square[:square.index("@cute.jit\ndef mask_mod")]
    assert src.startswith(head)  # the same predicates
    square_desc = mask.preprocess(meta, SK, batch_size=B)
    assert square_desc.positions is None and len(aux_tensors(square_desc, "intervals")) == 3
    with pytest.raises(ValueError, match="'intervals' mask_mod"):
        mask_mod_source(mask, "predicate", positions=True)


def test_cute_engine_refuses_chosen_rows_with_predicates():
    from compilemask.kernels.dispatch import why_not

    _, mask, meta = _case("dfs_tree")
    d = query_descriptor(mask, meta, SK, 1, batch_size=B)
    why = why_not(torch.zeros(B, 1, 2, 64, dtype=torch.bfloat16), d, "cute")
    assert "fa4 engine runs it" in why


def test_descriptor_fields_travel_with_it():
    """positions and key_params survive the op's slots, a move and with_fields."""
    from compilemask.contract.descriptor import DescriptorArgs, with_fields
    from compilemask.kernels.contract import OpSlots

    _, mask, meta = _case("chat_by_turn")
    d = query_descriptor(mask, meta, SK, 3, batch_size=B)
    back = OpSlots.of(d, "reference", 16).descriptor(DescriptorArgs.of(d), mask)
    assert back.positions is d.positions and back.key_params is d.key_params
    assert torch.equal(back.dense_mask(), d.dense_mask())
    assert d.to("cpu").positions is not None
    assert with_fields(d, meta_max=0).key_params is d.key_params


# ---- GPU (fa4 engine) ---------------------------------------------------------------------
def _gpu_case(name, Sk):
    gen = torch.Generator().manual_seed(5)
    if name == "dilated_causal":
        return cm.compile_mask(masks.dilated_causal()), None
    if name == "draft_tree":
        spec = importlib.import_module("compilemask.masks.draft_tree").draft_tree()
        meta = masks.random_meta(spec, 2, Sk, gen)
        return cm.compile_mask(spec), {k: v.cuda() for k, v in meta.items()}
    seg = torch.sort(torch.randint(0, 9, (2, Sk), generator=gen), dim=1).values.cuda()
    glob = (torch.rand(2, Sk, generator=gen) < 0.02).cuda()
    size = torch.randint(1, 300, (2, Sk), generator=gen).cuda()

    def packed_by_segment_id(b, h, q, kv):
        return (seg[b, q] == seg[b, kv]) & (kv <= q)

    def longformer_globals(b, h, q, kv):
        return glob[b, q] | glob[b, kv] | ((q - kv).abs() <= 64)

    def dfs_tree(b, h, q, kv):
        return (kv <= q) & (q < kv + size[b, kv])

    mm = {"packed_by_segment_id": packed_by_segment_id, "dfs_tree": dfs_tree,
          "longformer_globals": longformer_globals}[name]
    spec, meta = cm.from_mask_mod(mm, batch_size=2)
    return cm.compile_mask(spec), meta


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dilated_causal", "packed_by_segment_id", "dfs_tree",
                                  "longformer_globals", "draft_tree"])
def test_gpu_fa4_decode_and_chunk_with_predicates(name):
    """A decode step and a prefill chunk of a fallback mask on the fa4 engine (the mask_mod
    reads the rows' positions), forward and backward within twice PyTorch's bf16 error; the
    dense mask is the square's rows."""
    from helpers import check_attention_vs_reference

    Sk = 1000
    mask, meta = _gpu_case(name, Sk)
    square = mask.preprocess(meta, Sk, batch_size=2, backend="torch").dense_mask()
    for Sq in (1, 77):
        d = query_descriptor(mask, meta, Sk, Sq, batch_size=2, device="cuda")
        assert torch.equal(d.dense_mask().cpu(), square[:, Sk - Sq:].cpu())
        q = torch.randn(2, Sq, 4, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, Sk, 2, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        assert cm.api.api.select_engine(q, d) == "fa4"
        check_attention_vs_reference(d, q, k, v, "fa4", d.dense_mask())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["packed_by_segment_id", "dfs_tree", "draft_tree"])
def test_gpu_fa4_served_requests_with_predicates(name):
    """Requests of their own lengths (paged keys) and a packed batch on the fa4 engine."""
    from test_serving import _paged

    from helpers import check_output_vs_reference

    Sk = 1000
    mask, meta = _gpu_case(name, Sk)
    used, used_q = torch.tensor([1000, 517]), torch.tensor([64, 5])
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, Sk, 2, 128, generator=gen).to("cuda", torch.bfloat16)
            for _ in range(2))
    k_cache, v_cache, table = _paged((k, v), 128, gen)
    d = query_descriptor(mask, meta, Sk, 64, batch_size=2, seqused_k=used.cuda())
    q = torch.randn(2, 64, 4, 128, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        out = paged_attention(q, k_cache, v_cache, table, d, backend="fa4")
    check_output_vs_reference(out, q, k, v, d.dense_mask())
    dp = query_descriptor(mask, meta, Sk, 64, batch_size=2, seqused_k=used.cuda(),
                          seqused_q=used_q.cuda())
    qp = torch.cat([q[b, 64 - int(n):] for b, n in enumerate(used_q)])
    kp, vp = (torch.cat([t[b, :int(u)] for b, u in enumerate(used)]) for t in (k, v))
    with torch.no_grad():
        packed = varlen_attention(qp, kp, vp, dp, backend="fa4")
    qo = 0
    for b, n in enumerate(used_q.tolist()):
        check_output_vs_reference(packed[None, qo:qo + n], q[b:b + 1, 64 - n:], k[b:b + 1],
                                  v[b:b + 1], dp.dense_mask()[b:b + 1, :n])
        qo += n


def test_generate_with_segment_ids_equals_greedy_by_recomputation():
    """transformers generate with documents by segment id written as a mask_mod (its rule a
    predicate): every decode step token-identical to recomputing the whole sequence."""
    pytest.importorskip("transformers")
    from test_serving import VOCAB, _greedy_by_recomputation, _models

    ref, mod = _models()
    Bq, P, N = 2, 11, 4
    total = P + N
    gen = torch.Generator().manual_seed(2)
    # documents of the prompt (the second interleaved), the generated tokens in the last one
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2] + [2] * N,
                        [0, 1, 0, 1, 1, 0, 2, 2, 0, 2, 2] + [2] * N])  # interleaved
    spec, meta = cm.from_mask_mod(lambda b, h, q, kv: (seg[b, q] == seg[b, kv]) & (kv <= q),
                                  batch_size=Bq)
    mask = cm.compile_mask(spec)
    assert mask.has_fallback
    ids = torch.randint(0, VOCAB, (Bq, P), generator=gen)
    dense = mask.preprocess(meta, total, batch_size=Bq).dense_mask()
    want = _greedy_by_recomputation(ref, ids, N, dense)
    got = mod.generate(ids, max_new_tokens=N, do_sample=False, compilemask_mask=mask,
                       compilemask_meta=meta, attention_mask=torch.ones_like(ids),
                       pad_token_id=0)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("name", ["longformer_globals",  # a TileLang C build per mask
                                  pytest.param("dilated_causal", marks=pytest.mark.slow),
                                  pytest.param("draft_tree", marks=pytest.mark.slow)])
def test_row_descriptor_program_equals_the_reference(name):
    """The preprocess program's rows variant (TileLang's C target here; CUDA on the GPU, where
    it makes served descriptors) writes the torch reference's descriptor of a fallback mask
    field by field, its positions and key_params included."""
    pytest.importorskip("tilelang")
    from compilemask.pipeline.rows import rows_descriptor

    _, mask, meta = _case(name)
    gen = torch.Generator().manual_seed(2)
    for rows in (torch.arange(SK - 5, SK), torch.randint(-3, SK + 4, (B, 9), generator=gen)):
        for limit in (None, torch.tensor([SK, 0, 3, 23])):
            want, got = (rows_descriptor(mask, meta, SK, rows, key_limit=limit, batch_size=B,
                                         backend=b) for b in ("torch", "tilelang"))
            for f in ("intervals", "row_region", "fwd_bitmap", "bwd_bitmap", "params",
                      "row_params", "positions", "key_params"):
                assert torch.equal(getattr(got, f), getattr(want, f)), (f, rows.shape, limit)
            assert torch.equal(got.dense_mask(), want.dense_mask())


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
@pytest.mark.parametrize("name", ["dfs_tree",
                                  pytest.param("dilated_causal", marks=pytest.mark.slow),
                                  pytest.param("draft_tree", marks=pytest.mark.slow)])
def test_positions_mask_mod_compiles_in_fa4(name):
    """The mask_mod that reads the rows' positions and key_params compiles inside FA4's
    forward and backward (CPU, fake tensors): a prefill chunk's descriptor of 300 keys."""
    pytest.importorskip("flash_attn.cute")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask.kernels import fa4

    from helpers import fake_on_cuda

    S, Sq, D = 300, 77, 128
    gen = torch.Generator().manual_seed(0)
    size = torch.randint(1, 60, (2, S), generator=gen)
    if name == "dfs_tree":
        spec, meta = cm.from_mask_mod(lambda b, h, q, kv: (kv <= q) & (q < kv + size[b, kv]),
                                      batch_size=2)
    elif name == "draft_tree":  # a table read through key_params at the row's position
        spec = importlib.import_module("compilemask.masks.draft_tree").draft_tree()
        meta = masks.random_meta(spec, 2, S, gen)
    else:
        spec, meta = masks.dilated_causal(), None
    mask = cm.compile_mask(spec)
    desc = query_descriptor(mask, meta, S, Sq, batch_size=2)
    lists = {k: desc.block_sparse(k) for k in ("fwd", "bwd64")}
    with FakeTensorMode():
        q = torch.empty(2, Sq, 4, D, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(2, S, 2, D, dtype=torch.bfloat16, device="cuda")
        fdesc, flists, _ = fake_on_cuda(desc, lists)
        assert fdesc.positions is not None
        out, lse = fa4.fwd(q, kv, kv, fdesc, D**-0.5, "fa4", lists=flists["fwd"])
        assert out.shape == q.shape and lse.shape == (2, 4, Sq)
        dq, dk, dv = fa4.bwd(q, q, kv, kv, out, lse, fdesc, D**-0.5, "fa4",
                             lists=flists["bwd64"])[:3]
        assert dq.shape == q.shape and dk.shape == kv.shape


@pytest.mark.slow  # a kernel of its own
@pytest.mark.skipif(torch.cuda.is_available(), reason="fake-tensor compile is the CPU check")
def test_positions_mask_mod_compiles_in_fa4_served_forward():
    """The same mask_mod in FA4's varlen forward of a packed batch (``varlen_attention``'s
    kernel: every tile masked, each request's own q_idx / kv_idx)."""
    pytest.importorskip("flash_attn.cute")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask.kernels import fa4

    from helpers import fake_on_cuda

    S, Sq, D = 300, 7, 128
    size = torch.randint(1, 60, (2, S), generator=torch.Generator().manual_seed(0))
    spec, meta = cm.from_mask_mod(lambda b, h, q, kv: (kv <= q) & (q < kv + size[b, kv]),
                                  batch_size=2)
    desc = query_descriptor(cm.compile_mask(spec), meta, S, Sq, batch_size=2,
                            seqused_k=torch.tensor([300, 100]), seqused_q=torch.tensor([7, 3]))
    with FakeTensorMode():
        fdesc, _, _ = fake_on_cuda(desc, {})
        q = torch.empty(10, 4, D, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(400, 2, D, dtype=torch.bfloat16, device="cuda")
        cu_q, cu_k = (torch.empty(3, dtype=torch.int32, device="cuda") for _ in range(2))
        out, lse = fa4.fwd_served(q, kv, kv, fdesc, D**-0.5, "fa4", cu_seqlens_q=cu_q,
                                  max_seqlen_q=Sq, cu_seqlens_k=cu_k, max_seqlen_k=S)
        assert out.shape == q.shape and lse.shape == (4, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dfs_tree", "draft_tree"])
def test_gpu_fa4_context_parallel_shard_with_predicates(name):
    """A balanced plan's rank rows (scattered q tiles) of a fallback mask on the fa4 engine,
    forward and backward within twice PyTorch's bf16 error."""
    from helpers import check_attention_vs_reference

    S = 1024
    mask, meta = _gpu_case(name, S)
    square = mask.preprocess(meta, S, batch_size=2, backend="torch").dense_mask()
    plan = cp.make_plan(mask, meta, S, 4, batch_size=2)
    rows = plan.rows[1]
    d = cp.shard_descriptor(mask, meta, plan, 1, batch_size=2)
    real = (rows < S).cpu()
    assert torch.equal(d.dense_mask().cpu()[:, real], square.cpu()[:, rows.cpu()[real]])
    q = torch.randn(2, len(rows), 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, S, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_attention_vs_reference(d, q, k, v, "fa4", d.dense_mask())
