"""Memory a request does not own never reaches its output: on the reference engine, pages and
rows past a request's keys (its last page's tail, pages its table row does not need, a packed
buffer's rows past the batch's keys) and query rows before a request's first position may hold
NaN or inf, and ``paged_attention`` / ``varlen_attention`` give exactly the output of clean
buffers (finite; rows that see nothing 0)."""

from __future__ import annotations

import functools

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.api.serving import paged_attention, query_descriptor, varlen_attention

NAMES = ["causal", "prefix_lm", "sliding_window", "packed_documents", "tree_verify", "hstu"]
JUNK = (float("nan"), float("inf"), float("-inf"))


@functools.lru_cache(maxsize=None)
def _mask(name):
    return cm.compile_mask(masks.EXAMPLES[name]())


def _junk(t, where, gen):
    """``t`` with ``where`` (a bool mask over its leading dims) filled by NaN / inf / -inf."""
    pick = torch.randint(len(JUNK), t.shape, generator=gen)
    junk = torch.tensor(JUNK, dtype=t.dtype)[pick]
    return torch.where(where.view(*where.shape, *(1,) * (t.dim() - where.dim())), junk, t)


def _case(gen):
    name = NAMES[int(torch.randint(len(NAMES), (), generator=gen))]
    B = int(torch.randint(1, 4, (), generator=gen))
    Sk = int(torch.randint(1, 41, (), generator=gen))
    Sq = int(torch.randint(1, Sk + 1, (), generator=gen))
    used = torch.randint(0, Sk + 1, (B,), generator=gen)
    used[int(torch.randint(B, (), generator=gen))] = int(torch.randint(0, 2, (), generator=gen))
    page = (1, 4, 8, 16)[int(torch.randint(4, (), generator=gen))]
    return name, B, Sk, Sq, used, page


def _pages(gen, B, Sk, page, used, Hkv, D, stale_tails=False):
    """A pool with a shuffled page table for keys ``[0, Sk)`` of each request (spare pages in
    the pool, table entries past a request's pages -1), clean and with everything a request
    does not own junk; with ``stale_tails`` the rows of a request's last page past its length
    hold other finite values instead (an earlier owner's keys), and only pages it does not
    need are junk."""
    per = -(-Sk // page)
    n = B * per + 3
    table = torch.randperm(n, generator=gen)[:B * per].view(B, per).to(torch.int32)
    need = (used + page - 1) // page
    owned = torch.zeros(n, page, dtype=torch.bool)
    for b in range(B):
        for p in range(int(need[b])):
            rows = min(page, int(used[b]) - p * page)
            owned[int(table[b, p]), :rows] = True
    unset = torch.arange(per).view(1, -1) >= need.view(-1, 1)
    dirty_table = torch.where(unset, torch.full_like(table, -1), table)
    needed = torch.zeros(n, dtype=torch.bool)
    for b in range(B):
        needed[table[b, :int(need[b])].long()] = True
    caches = []
    for _ in range(2):
        clean = torch.randn(n, page, Hkv, D, generator=gen)
        if stale_tails:
            stale = torch.where(owned.view(n, page, 1, 1), clean, torch.randn_like(clean))
            caches.append((clean, _junk(stale, ~needed, gen)))
        else:
            caches.append((clean, _junk(clean, ~owned, gen)))
    return table, dirty_table, caches


@pytest.mark.parametrize("seed", range(4))
def test_paged_decode_and_chunks_ignore_unowned_pages(seed):
    """[B, Sq] queries over paged keys with per-request lengths (some 0, some shorter than
    Sq): junk in unowned pages, tails and table entries, and in the query rows before a
    request's first position, changes nothing."""
    gen = torch.Generator().manual_seed(100 + seed)
    H, Hkv, D = 4, 2, 8
    for _ in range(60):
        name, B, Sk, Sq, used, page = _case(gen)
        mask = _mask(name)
        meta = masks.random_meta(mask.spec, B, Sk, gen)
        d = query_descriptor(mask, meta, Sk, Sq, batch_size=B, seqused_k=used)
        table, dirty_table, ((kc, kd), (vc, vd)) = _pages(gen, B, Sk, page, used, Hkv, D)
        q = torch.randn(B, Sq, H, D, generator=gen)
        before = (used.view(-1, 1) - Sq + torch.arange(Sq).view(1, -1)) < 0  # no position
        with torch.no_grad():
            want = paged_attention(q, kc, vc, table, d)
            got = paged_attention(_junk(q, before, gen), kd, vd, dirty_table, d)
        case = (name, B, Sk, Sq, used.tolist(), page)
        assert torch.isfinite(got).all(), case
        assert torch.equal(got, want), case
        assert not got[~d.dense_mask().any(-1)].any(), case  # rows that see nothing: 0


@pytest.mark.parametrize("seed", range(4))
def test_packed_batches_ignore_unowned_rows(seed):
    """Packed (varlen) queries over packed keys and over paged keys: junk in the key buffer's
    rows past the batch's keys, and in every unowned page, changes nothing."""
    gen = torch.Generator().manual_seed(200 + seed)
    H, Hkv, D = 2, 1, 8
    for _ in range(50):
        name, B, Sk, Sq, used, page = _case(gen)
        used_q = torch.minimum(torch.randint(0, Sq + 1, (B,), generator=gen), used)
        mask = _mask(name)
        meta = masks.random_meta(mask.spec, B, Sk, gen)
        d = query_descriptor(mask, meta, Sk, Sq, batch_size=B, seqused_k=used, seqused_q=used_q)
        spare = int(torch.randint(0, 5, (), generator=gen))
        total = int(used.sum())
        k, v = (torch.randn(total + spare, Hkv, D, generator=gen) for _ in range(2))
        tail = torch.arange(total + spare) >= total
        q = torch.randn(int(used_q.sum()), H, D, generator=gen)
        case = (name, B, Sk, Sq, used.tolist(), used_q.tolist(), page)
        with torch.no_grad():
            want = varlen_attention(q, k, v, d)
            got = varlen_attention(q, _junk(k, tail, gen), _junk(v, tail, gen), d)
            assert torch.isfinite(got).all(), case
            assert torch.equal(got, want), case
            table, dirty_table, ((kc, kd), (vc, vd)) = _pages(gen, B, Sk, page, used, Hkv, D)
            want = paged_attention(q, kc, vc, table, d)
            got = paged_attention(q, kd, vd, dirty_table, d)
        assert torch.isfinite(got).all(), case
        assert torch.equal(got, want), case


def test_attention_with_a_served_descriptor_ignores_unowned_rows_forward_and_backward():
    """``cm.attention`` on a ``[B, Sk]`` buffer with a ``query_descriptor(seqused_k=)``: junk in
    the rows past a request's keys and in query rows before its first position changes neither
    the output nor the gradients of the rows it owns (the dense path zeroes what no row sees,
    in the forward and the backward)."""
    gen = torch.Generator().manual_seed(7)
    H, Hkv, D = 4, 2, 8
    for _ in range(40):
        name, B, Sk, Sq, used, _ = _case(gen)
        mask = _mask(name)
        meta = masks.random_meta(mask.spec, B, Sk, gen)
        d = query_descriptor(mask, meta, Sk, Sq, batch_size=B, seqused_k=used)
        q, k, v = (torch.randn(B, S, h, D, generator=gen) for S, h in ((Sq, H), (Sk, Hkv),
                                                                       (Sk, Hkv)))
        past = torch.arange(Sk).view(1, -1) >= used.view(-1, 1)
        before = (used.view(-1, 1) - Sq + torch.arange(Sq).view(1, -1)) < 0
        dout = torch.randn(B, Sq, H, D, generator=gen)
        runs = []
        for qq, kk, vv in ((q, k, v), (_junk(q, before, gen), _junk(k, past, gen),
                                       _junk(v, past, gen))):
            leaves = [t.clone().requires_grad_(True) for t in (qq, kk, vv)]
            out = cm.attention(*leaves, d)
            out.backward(dout)
            runs.append((out.detach(), *(t.grad for t in leaves)))
        case = (name, B, Sk, Sq, used.tolist())
        (want, wq, wk, wv), (got, gq, gk, gv) = runs
        assert torch.isfinite(got).all() and torch.equal(got, want), case
        for w, g, own in ((wq, gq, ~before), (wk, gk, ~past), (wv, gv, ~past)):
            assert torch.isfinite(g).all(), case
            assert torch.allclose(g[own], w[own], rtol=1e-5, atol=1e-6), case


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "prefix_lm", "tree_verify", "hstu"])
def test_gpu_unowned_pages_and_rows_never_reach_the_output(name):
    """The GPU engines (FA4's paged and varlen kernels): NaN / inf in spare pages and in a packed
    key buffer's rows past the batch's keys, and other finite values in the tail of a request's
    last page, give the clean buffers' output, finite, bit for bit. (FA4 loads a page whole
    when the page is one key tile: its tail must be finite, ``paged_attention``'s contract.)"""
    gen = torch.Generator().manual_seed(11)
    mask = _mask(name)
    H, Hkv, D, page = 4, 2, 128, 128
    used_k, used_q = torch.tensor([300, 17, 1, 129]), torch.tensor([5, 17, 1, 0])
    B, Sk = len(used_k), int(used_k.max())
    meta = {k: v.cuda() for k, v in masks.random_meta(mask.spec, B, Sk, gen).items()} or None
    table, _, caches = _pages(gen, B, Sk, page, used_k, Hkv, D, stale_tails=True)
    (kc, kd), (vc, vd) = ((c.to("cuda", torch.bfloat16), d.to("cuda", torch.bfloat16))
                          for c, d in caches)
    table = table.cuda()
    with torch.no_grad():
        for Sq in (1, 6):  # a decode step and a chunk, [B, Sq] queries
            d = query_descriptor(mask, meta, Sk, Sq, batch_size=B, seqused_k=used_k.cuda())
            q = torch.randn(B, Sq, H, D, generator=gen).to("cuda", torch.bfloat16)
            want = paged_attention(q, kc, vc, table, d)
            got = paged_attention(q, kd, vd, table, d)
            assert torch.isfinite(want).all() and torch.isfinite(got).all(), (name, Sq)
            assert torch.equal(got, want), (name, Sq)
        d = query_descriptor(mask, meta, Sk, int(used_q.max()), batch_size=B,
                             seqused_k=used_k.cuda(), seqused_q=used_q.cuda())
        total = int(used_k.sum())
        k, v = (torch.randn(total + 7, Hkv, D, generator=gen) for _ in range(2))
        tail = torch.arange(total + 7) >= total
        q = torch.randn(int(used_q.sum()), H, D, generator=gen).to("cuda", torch.bfloat16)
        clean = [t.to("cuda", torch.bfloat16) for t in (k, v)]
        dirty = [_junk(t, tail, gen).to("cuda", torch.bfloat16) for t in (k, v)]
        want = varlen_attention(q, *clean, d)
        got = varlen_attention(q, *dirty, d)
        assert torch.isfinite(got).all() and torch.equal(got, want), name
        want = paged_attention(q, kc, vc, table, d)
        got = paged_attention(q, kd, vd, table, d)
        assert torch.isfinite(got).all() and torch.equal(got, want), name


def test_cpu_says_once_when_a_last_page_tail_is_not_finite(caplog):
    """The reference engine never reads a request's last page past its length, the GPU engines'
    page loads may: on the CPU a NaN there gives the exact output and a warning naming the
    cache, the page and the request; finite tails (an earlier owner's keys) give none."""
    from compilemask.contract.log import said

    gen = torch.Generator().manual_seed(5)
    mask = _mask("causal")
    used = torch.tensor([5, 8, 0])  # pages of 4: request 0 ends inside its second page
    d = query_descriptor(mask, None, 8, 2, batch_size=3, seqused_k=used)
    k, v = (torch.randn(7, 4, 1, 8, generator=gen) for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3], [4, -1]], dtype=torch.int32)
    q = torch.randn(3, 2, 2, 8, generator=gen)
    said.clear()
    with caplog.at_level("WARNING", logger="compilemask"):
        want = paged_attention(q, k, v, table, d)
        stale = v.clone()
        stale[1, 1:] = torch.randn(3, 1, 8, generator=gen)  # another owner's finite values
        assert torch.equal(paged_attention(q, k, stale, table, d), want)
        assert not [r for r in caplog.records if "past request" in r.getMessage()]
        dirty = v.clone()
        dirty[1, 2] = float("nan")
        dirty[5] = float("nan")  # a spare page: never read by any engine, no warning for it
        assert torch.equal(paged_attention(q, k, dirty, table, d), want)
    msgs = [r.getMessage() for r in caplog.records if "past request" in r.getMessage()]
    assert len(msgs) == 1 and "v_cache page 1" in msgs[0] and "request 0's 5 keys" in msgs[0]
