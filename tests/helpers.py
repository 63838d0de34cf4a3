"""Shared test helpers: tile states from a brute-force dense mask; attention against the float32
reference within PyTorch's own bf16 error."""

import pytest
import torch

from compilemask.contract.descriptor import TILE_MASKED, TILE_VISIBLE, BlockSparseLists


def dense_tile_states(dense: torch.Tensor, tile_m: int, tile_n: int) -> torch.Tensor:
    """uint8 [B, n_m, n_n] states of the tiles of a bool [B, Sq, Sk] mask (edges: valid part)."""
    B, Sq, Sk = dense.shape
    n_m, n_n = -(-Sq // tile_m), -(-Sk // tile_n)
    vis = torch.zeros(B, n_m * tile_m, n_n * tile_n, dtype=torch.bool)
    valid = torch.zeros_like(vis)
    vis[:, :Sq, :Sk] = dense
    valid[:, :Sq, :Sk] = True
    v = vis.view(B, n_m, tile_m, n_n, tile_n).any(4).any(2)
    m = (valid & ~vis).view(B, n_m, tile_m, n_n, tile_n).any(4).any(2) & v
    return v.to(torch.uint8) * TILE_VISIBLE + m.to(torch.uint8) * TILE_MASKED


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_attention_vs_reference(desc, q, k, v, engine, dense, options=None, score_mod=None,
                                 ref_score_mod=None):
    """cm.attention's output and gradients against a float32 reference, within twice PyTorch's
    own bf16 error; rows that see nothing give exact zeros. ``dense``: ``[B, Sq, Sk]``, or
    ``[B, H, Sq, Sk]`` for ``HeadGroups``. ``score_mod``: FlexAttention's, on
    every path (PyTorch's bf16 rounds its result to bf16); ``ref_score_mod``: the references'
    own where they differ (rows elsewhere in the sequence: the score_mod at their positions)."""
    ref_score_mod = score_mod if ref_score_mod is None else ref_score_mod
    import compilemask as cm
    from compilemask.compiler.reference import apply_score_mod, attention_reference

    B, Sq, H, D = q.shape
    G = H // k.shape[2]
    dense = dense.to(q.device)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    do = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)  # out's shape
    out = cm.attention(q, k, v, desc, backend=engine, options=options, score_mod=score_mod)
    out.backward(do)
    got = (out, q.grad, k.grad, v.grad)

    def ref(dtype):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        o = attention_reference(qq, kk, vv, dense, score_mod=ref_score_mod)
        o.backward(do.to(dtype))
        return o, qq.grad, kk.grad, vv.grad

    def torch_bf16():
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        kr, vr = (t.repeat_interleave(G, dim=2).transpose(1, 2) for t in (kk, vv))
        s = torch.matmul(qq.transpose(1, 2), kr.transpose(-1, -2)) * D**-0.5
        if ref_score_mod is not None:
            s = apply_score_mod(s, ref_score_mod)
        m = dense if dense.dim() == 4 else dense.unsqueeze(1)  # [B, H, Sq, Sk]: per head
        empty_row = ~m.any(-1, keepdim=True)
        s = torch.where(m, s, float("-inf"))
        s = torch.where(empty_row, torch.zeros_like(s), s)
        p = torch.softmax(s, dim=-1) * (~empty_row)
        o = torch.matmul(p, vr).transpose(1, 2)
        o.backward(do)
        return o, qq.grad, kk.grad, vv.grad

    exact, bf16 = ref(torch.float32), torch_bf16()
    for what, o, e, t in zip(("out", "dq", "dk", "dv"), got, exact, bf16):
        assert torch.isfinite(o).all(), (engine, what)
        assert _rel(o, e) <= 2 * _rel(t, e) + 1e-4, (engine, what, _rel(o, e), _rel(t, e))
    empty = ~dense.any(-1)  # [B, Sq], or [B, H, Sq] for a mask per head
    rows = out if dense.dim() == 3 else out.transpose(1, 2)
    assert torch.equal(rows[empty], torch.zeros_like(rows[empty])), engine


def check_output_vs_reference(out, q, k, v, dense):
    """A forward's ``out`` against a float32 reference on the same q, k, v (``[B, S, H, D]``),
    within twice PyTorch's own bf16 error; rows that see nothing give exact zeros."""
    from compilemask.compiler.reference import attention_reference

    D, G = q.shape[-1], q.shape[2] // k.shape[2]
    dense = dense.to(q.device)
    exact = attention_reference(q.float(), k.float(), v.float(), dense)
    kr, vr = (t.repeat_interleave(G, dim=2).transpose(1, 2) for t in (k, v))
    s = torch.matmul(q.transpose(1, 2), kr.transpose(-1, -2)) * D**-0.5
    m = dense.unsqueeze(1)
    empty_row = ~m.any(-1, keepdim=True)
    s = torch.where(empty_row, torch.zeros_like(s), torch.where(m, s, float("-inf")))
    bf16 = torch.matmul(torch.softmax(s, dim=-1) * (~empty_row), vr).transpose(1, 2)
    assert torch.isfinite(out).all()
    assert _rel(out, exact) <= 2 * _rel(bf16, exact) + 1e-4, (_rel(out, exact), _rel(bf16, exact))
    empty = ~dense.any(-1)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


def fake_on_cuda(desc, lists: dict):
    """``desc`` and its ``lists`` (kind -> BlockSparseLists) as fake CUDA tensors, for a
    compile of FA4's kernels on a machine without a GPU; call inside a ``FakeTensorMode``."""
    dev = torch.device("cuda")

    def fake(t):  # contents do not matter for compilation
        return torch.empty(t.shape, dtype=t.dtype, device=dev)

    fdesc = type(desc)(**{f: (fake(getattr(desc, f)) if isinstance(getattr(desc, f), torch.Tensor)
                              else getattr(desc, f)) for f in desc.__dataclass_fields__})
    return fdesc, {k: type(v)(*(fake(t) for t in v)) for k, v in lists.items()}, fake


def sweep(argnames: str, cases, default):
    """``pytest.mark.parametrize(argnames, cases)`` where the cases not in ``default`` are marked
    ``slow``: the default run keeps a representative subset, ``-m slow`` runs the rest."""
    multi = "," in argnames
    values = [c if c in default else
              pytest.param(*(c if multi else (c,)), marks=pytest.mark.slow) for c in cases]
    return pytest.mark.parametrize(argnames, values)


def compile_in_range(spec):
    """``compile_mask`` for a randomly drawn spec; a spec refused because its terms may pass the
    generated code's integers (a correct refusal, tested in test_bounds.py) is not an example."""
    import compilemask as cm

    try:
        return cm.compile_mask(spec)
    except ValueError as e:
        if "-bit integers the generated code computes in" not in str(e):
            raise
        from hypothesis import reject

        reject()


class HostCopies:
    """Records every copy between devices made inside its ``with`` block (a dispatch mode).
    On the ``meta`` device a host read (``.item()``, ``.tolist()``) raises too, so code that
    runs there on meta tensors with no copy recorded neither copies nor syncs on a GPU (what a
    CUDA-graph capture needs)."""

    def __init__(self):
        self.found: list[str] = []

    def __enter__(self):
        import traceback

        import torch.utils._pytree as pytree
        from torch.utils._python_dispatch import TorchDispatchMode

        copies = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        found = self.found

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in copies:
                    ts = [t for t in pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
                    if len({t.device.type for t in ts}) > 1:
                        found.append("".join(traceback.format_stack(limit=6)[:-1]))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def assert_lists_equal(ref: BlockSparseLists, out: BlockSparseLists, what: str):
    """Equal counts and equal first ``cnt`` entries of every row (the rest is unspecified)."""
    for name, (a, b) in zip(ref._fields, zip(ref, out)):
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, (what, name)
    assert ref.mask_idx.device == out.mask_idx.device
    slot = torch.arange(ref.num_cols, device=ref.mask_idx.device)
    for cnt, ra, oa, name in ((ref.mask_cnt, ref.mask_idx, out.mask_idx, "mask"),
                              (ref.full_cnt, ref.full_idx, out.full_idx, "full")):
        oc = out.mask_cnt if name == "mask" else out.full_cnt
        if not torch.equal(cnt, oc):
            bad = (cnt != oc).nonzero()[:5].tolist()
            raise AssertionError(f"{what}: {name}_cnt differs at {bad}")
        live = slot < cnt.unsqueeze(-1)
        if not torch.equal(torch.where(live, ra, 0), torch.where(live, oa, 0)):
            bad = (live & (ra != oa)).nonzero()[:5].tolist()
            raise AssertionError(f"{what}: {name}_idx differs at {bad}")
