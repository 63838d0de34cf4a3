"""Context parallelism on the CPU: plans, row-sharded descriptors, and cp_attention over gloo
against single-process cm.attention (outputs and gradients), and a transformers model run under a
plan against the same model in one process."""

import sys
from pathlib import Path

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.api import distributed as cp

from helpers import dense_tile_states

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after the installed packages
from bench.workloads import WORKLOADS, batch_for, make_meta  # noqa: E402

CP_MASKS = ("hstu", "packed_documents", "clear", "causal")
# (seqlen, tile): 100 rows are 7 tiles of 16, a partial last one, padded to 8 on every W here
CP_CASES = ((100, 16), (64, 16))


def _spec(name):
    return masks.EXAMPLES[name]()


def test_plan_is_a_permutation_with_equal_tiles_per_rank():
    mask = cm.compile_mask(_spec("hstu"))
    meta = masks.random_meta(mask.spec, 2, 150)
    for W in (2, 3, 4):
        for kind in cp.PLAN_KINDS:
            plan = cp.make_plan(mask, meta, 150, W, kind, tile=16)
            n_pad = plan.rows.numel()
            assert n_pad % (16 * W) == 0 and n_pad >= 150
            assert torch.equal(plan.rows.flatten().sort().values, torch.arange(n_pad))
            assert torch.equal(plan.rows.flatten()[plan.inverse], torch.arange(150))
            assert int(plan.work.sum()) == int(plan.tile_work.sum())
            assert (plan.tiles.diff(dim=1) > 0).all()  # local rows ascend
    x = torch.randn(2, 150, 3, 4)
    plan = cp.make_plan(mask, meta, 150, 4, tile=16)
    parts = [cp.shard(x, plan, r) for r in range(4)]
    assert all(p.shape == (2, plan.local_len, 3, 4) for p in parts)
    assert torch.equal(cp.unshard(parts, plan), x)
    pad = plan.rows >= 150
    assert all(not parts[r][:, pad[r]].any() for r in range(4))


@pytest.mark.parametrize("name", ["hstu", "packed_documents", "clear", "shared_prompt_rm",
                                  "prefix_lm"])
def test_shard_descriptor_is_the_global_mask_at_the_rows(name):
    mask = cm.compile_mask(_spec(name))
    S, B, W = 137, 3, 4
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(5))
    full = mask.preprocess(meta, seqlen_q=S, batch_size=B).dense_mask()
    for kind in cp.PLAN_KINDS:
        plan = cp.make_plan(mask, meta, S, W, kind, tile=16, batch_size=B)
        for r in range(W):
            d = cp.shard_descriptor(mask, meta, plan, r, batch_size=B, fwd_tiles=(32, 16),
                                    bwd_tiles=(16, 32))
            rows = plan.rows[r]
            valid = rows < S
            dense = d.dense_mask()
            assert dense.shape == (B, plan.local_len, S)
            assert torch.equal(dense[:, valid], full[:, rows[valid]])
            assert not dense[:, ~valid].any() and (d.row_region[:, ~valid] == -1).all()
            assert torch.equal(d.tile_states(), dense_tile_states(dense, 32, 16))
            assert torch.equal(d.tile_states(backward=True),
                               dense_tile_states(dense, 16, 32).transpose(1, 2))
            assert d.lists is None  # FA4's lists are written on CUDA only, for its tilings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["hstu", "packed_documents"])
def test_gpu_shard_descriptor_writes_the_lists(name):
    """On CUDA a rank's descriptor carries FA4's tile lists of its rows (one TileLang launch),
    equal to the torch reference from its bitmaps, which equal the CPU shard's."""
    from compilemask.compiler.blocksparse import descriptor_lists
    from compilemask.pipeline.pipeline import LIST_KINDS_FA4

    mask = cm.compile_mask(_spec(name))
    S, B, W = 1000, 2, 4
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(7))
    plan = cp.make_plan(mask, meta, S, W, batch_size=B)
    for r in range(W):
        cpu = cp.shard_descriptor(mask, meta, plan, r, batch_size=B)
        d = cp.shard_descriptor(mask, {k: v.cuda() for k, v in meta.items()}, plan, r,
                                batch_size=B)
        assert d.device.type == "cuda"
        assert torch.equal(d.fwd_bitmap.cpu(), cpu.fwd_bitmap)
        assert torch.equal(d.bwd_bitmap.cpu(), cpu.bwd_bitmap)
        assert d.lists is not None and d.lists.kinds == LIST_KINDS_FA4
        for kind in LIST_KINDS_FA4:
            ref, got = descriptor_lists(d, kind), d.block_sparse(kind)
            for cnt, a, oc, b in ((ref.mask_cnt, ref.mask_idx, got.mask_cnt, got.mask_idx),
                                  (ref.full_cnt, ref.full_idx, got.full_cnt, got.full_idx)):
                assert torch.equal(cnt, oc), (name, r, kind)
                live = torch.arange(a.shape[-1], device=a.device) < cnt.unsqueeze(-1)
                assert torch.equal(a[live], b[live]), (name, r, kind)


def test_shard_descriptor_of_a_fallback_mask():
    """A rank's predicates read i as the row's global position (tests/test_served_fallback.py
    has more masks)."""
    mask = cm.compile_mask(_spec("dilated_causal"))
    plan = cp.make_plan(mask, {}, 64, 2, tile=16)
    full = mask.preprocess(None, 64).dense_mask()
    for rank in range(2):
        rows = plan.rows[rank]
        d = cp.shard_descriptor(mask, {}, plan, rank)
        assert torch.equal(d.dense_mask()[:, rows < 64], full[:, rows[rows < 64]])


def test_plan_balance_on_the_paper_masks(capsys):
    """Balanced plans within 5 % of perfect at 32K tokens, tile 128 (head-tail for reference)."""
    S = 32768
    B = batch_for(S)
    lines = []
    for name in ("hstu", "shared_prompt_rm", "clear", "causal"):
        mask = cm.compile_mask(WORKLOADS[name]())
        meta = make_meta(name, B, S)
        for W in (2, 4):
            bal = cp.make_plan(mask, meta, S, W, "balanced", batch_size=B).balance()
            ht = cp.make_plan(mask, meta, S, W, "head_tail", batch_size=B).balance()
            lines.append(f"{name:18s} W={W}  balanced {bal:.4f}  head_tail {ht:.4f}")
            assert bal <= 1.05, lines[-1]
    with capsys.disabled():
        print("\nmax/mean visible pairs per rank, S=32K, tile 128:\n" + "\n".join(lines))


# ---- cp_attention over gloo --------------------------------------------------------------------

def _worker(rank, world_size, init_file):
    """W = 4 on the world, and W = 2 on the subgroups {0, 1} and {2, 3} of the same job (one
    spawn: each process pays torch's import once)."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 processes on a few cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
        for group in (None, pairs[rank // 2]):
            _check_group(group)
        dist.barrier()  # no rank tears down gloo while a peer still talks to it
    finally:
        dist.destroy_process_group()


def _check_group(group):
    import torch.distributed as dist

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    B, H, Hkv, D = 2, 2, 1, 8  # GQA: dK/dV sum over the q heads as well as over the ranks
    for name in CP_MASKS:
        mask = cm.compile_mask(_spec(name))
        for S, tile in CP_CASES:
            meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(S))
            gen = torch.Generator().manual_seed(S + 1)
            q, do = (torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
                     for _ in range(2))
            k, v = (torch.randn(B, S, Hkv, D, generator=gen, dtype=torch.float64)
                    for _ in range(2))
            ref = _single_process(mask, meta, S, B, q, k, v, do)
            for kind in cp.PLAN_KINDS:
                plan = cp.make_plan(mask, meta, S, W, kind, tile=tile, batch_size=B)
                desc = cp.shard_descriptor(mask, meta, plan, rank, batch_size=B)
                ql, kl, vl = (cp.shard(t, plan, rank).requires_grad_() for t in (q, k, v))
                out = cp.cp_attention(ql, kl, vl, desc, plan, group)
                out.backward(cp.shard(do, plan, rank))
                got = [_unshard(t, plan, group) for t in (out.detach(), ql.grad, kl.grad,
                                                          vl.grad)]
                for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11,
                                               msg=f"{name} S={S} {kind} W={W} {what}")
    _check_scores(group)


def _check_scores(group):
    """A softcap with a learnable sink (dsink: the ranks' shares summed) and ALiBi, whose
    moved q_idx shifts each row by a constant, equal one process's; ALiBi next to a sink does
    not (the sink's logit does not move with the row) and is refused."""
    import torch.distributed as dist

    from compilemask.dsl import score_mods

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    B, S, H, Hkv, D = 2, 100, 2, 1, 8
    mask = cm.compile_mask(_spec("hstu"))
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    q, do = (torch.randn(B, S, H, D, generator=gen, dtype=torch.float64) * 3 for _ in range(2))
    k, v = (torch.randn(B, S, Hkv, D, generator=gen, dtype=torch.float64) * 3 for _ in range(2))
    sink = torch.randn(H, generator=gen, dtype=torch.float64) + 2
    alibi = score_mods.alibi(score_mods.alibi_slopes(H).double())
    plan = cp.make_plan(mask, meta, S, W, tile=16, batch_size=B)
    desc = cp.shard_descriptor(mask, meta, plan, rank, batch_size=B)
    for kw in (dict(score_mod=score_mods.softcap(2.0), learnable_sink=sink),
               dict(score_mod=alibi)):
        ref = _single_process(mask, meta, S, B, q, k, v, do, **kw)
        ql, kl, vl = (cp.shard(t, plan, rank).requires_grad_() for t in (q, k, v))
        sl = kw.get("learnable_sink")
        sl = None if sl is None else sl.clone().requires_grad_()
        out = cp.cp_attention(ql, kl, vl, desc, plan, group, **{**kw, "learnable_sink": sl})
        out.backward(cp.shard(do, plan, rank))
        got = [_unshard(t, plan, group) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
        if sl is not None:
            dist.all_reduce(sl.grad, group=group)
            got.append(sl.grad)
        for what, a, b in zip(("out", "dq", "dk", "dv", "dsink"), got, ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11,
                                       msg=f"{list(kw)} W={W} {what}")
    ql, kl, vl = (cp.shard(t, plan, rank) for t in (q, k, v))
    with pytest.raises(NotImplementedError, match="learnable_sink"):
        cp.cp_attention(ql, kl, vl, desc, plan, group, score_mod=alibi, learnable_sink=sink)


def _single_process(mask, meta, S, B, q, k, v, do, score_mod=None, learnable_sink=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sink = None if learnable_sink is None else learnable_sink.clone().requires_grad_()
    desc = mask.preprocess(meta, seqlen_q=S, batch_size=B)
    out = cm.attention(q, k, v, desc, score_mod=score_mod, learnable_sink=sink)
    out.backward(do)
    return (out.detach(), q.grad, k.grad, v.grad) + (() if sink is None else (sink.grad,))


def _unshard(local, plan, group):
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(plan.world_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return cp.unshard(parts, plan)


def test_cp_attention_equals_single_process(tmp_path):
    """Outputs and dQ/dK/dV of cp_attention, unsharded, equal one process's cm.attention
    (float64) for every mask, both plan kinds, W = 2 and 4, sequences not divisible by W x tile;
    with a score_mod and a learnable sink too."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(4, str(tmp_path / "init")), nprocs=4, join=True)


# ---- a transformers model under a context-parallel plan ---------------------------------------

def _model_worker(rank, world_size, init_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        _check_model(None)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _tiny_qwen3():
    import transformers

    from compilemask.integrations.transformers import register

    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, use_cache=False)
    torch.manual_seed(0)  # the same weights on every rank
    return transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=register()).to(torch.float64)


def _loss_grads(model, ids, labels, valid=None, **kw):
    """Summed token loss (over ``valid`` rows only) and the parameter gradients."""
    model.zero_grad()
    logits = model(ids, **kw).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             reduction="none")
    (loss if valid is None else loss * valid.flatten()).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_model(group):
    import torch.distributed as dist

    from compilemask.integrations.transformers import shard_inputs

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    B, S, tile = 2, 100, 16  # 7 tiles of 16, the last partial, padded to 4 per rank
    mask = cm.compile_mask(_spec("hstu"))
    meta = masks.random_meta(mask.spec, B, S, torch.Generator().manual_seed(7))
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(8))
    labels = ids.roll(-1, dims=1)
    model = _tiny_qwen3()
    ref_logits, ref_grads = _loss_grads(model, ids, labels,
                                        compilemask_desc=mask.preprocess(meta, seqlen_q=S))

    plan = cp.make_plan(mask, meta, S, W, tile=tile, batch_size=B)
    desc = cp.shard_descriptor(mask, meta, plan, rank, batch_size=B)
    ids_l, pos_l = shard_inputs(ids, plan, rank)
    labels_l = cp.shard(labels[..., None], plan, rank)[..., 0]
    valid = (plan.rows[rank] < S).to(torch.float64).expand(B, -1)  # padding rows: no loss
    logits_l, grads = _loss_grads(model, ids_l, labels_l, valid, position_ids=pos_l,
                                  compilemask_desc=desc, compilemask_cp=(plan, group))
    tol = dict(rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(_unshard(logits_l, plan, group), ref_logits, **tol)
    for n, g in grads.items():  # every rank's loss terms: the sum of the ranks' gradients
        dist.all_reduce(g, group=group)
        torch.testing.assert_close(g, ref_grads[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
    _check_layer_scores(mask, meta, plan, desc, group, tol)


def _check_layer_scores(mask, meta, plan, desc_l, group, tol):
    """The layer function under compilemask_cp keeps what changes the scores: a softcap
    (Gemma 2) and per-head sinks (gpt-oss's s_aux) give one process's rows."""
    import types

    import torch.distributed as dist

    from compilemask.integrations.transformers import attention_forward

    rank, B, S, H, Hkv = dist.get_rank(group), 2, 100, 4, 2  # _check_model's batch
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(B, H, S, 8, generator=gen, dtype=torch.float64) * 3
    k, v = (torch.randn(B, Hkv, S, 8, generator=gen, dtype=torch.float64) * 3 for _ in "kv")
    layer = types.SimpleNamespace(layer_idx=0, training=False, config=None)
    local = [cp.shard(t.transpose(1, 2), plan, rank).transpose(1, 2) for t in (q, k, v)]
    desc = mask.preprocess(meta, seqlen_q=S)
    for kw in (dict(softcap=2.0), dict(s_aux=torch.randn(H, generator=gen, dtype=torch.float64))):
        want, _ = attention_forward(layer, q, k, v, None, scaling=0.3, compilemask_desc=desc, **kw)
        got, _ = attention_forward(layer, *local, None, scaling=0.3, compilemask_desc=desc_l,
                                   compilemask_cp=(plan, group), **kw)
        torch.testing.assert_close(_unshard(got, plan, group), want, **tol, msg=str(list(kw)))


def test_transformers_model_under_cp_equals_single_process(tmp_path):
    """A tiny Qwen3 (float64) called on each rank's shard with compilemask_cp: the unsharded
    logits and the all-reduced gradients of the summed token loss equal one process's run with
    the full descriptor (HSTU, S = 100 over W = 2 x tile 16); its layer function with a softcap
    and sinks gives one process's rows."""
    pytest.importorskip("transformers")
    import torch.multiprocessing as mp

    mp.spawn(_model_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)
