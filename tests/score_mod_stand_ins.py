"""The generated CuTe score_mod run on the CPU: numpy float32 / int32 vectors stand in for
FA4's TensorSSA values (int32 arithmetic wraps, float32 rounds as the kernel's), so the code
the GPU runs is compared with the score_mod as written without a GPU."""

import types
import warnings

import numpy as np
import torch

from compilemask.codegen.cute_score_mod import score_mod_source
from compilemask.score_mod import compile_score_mod, kernel_table


class _Vec(np.ndarray):
    """A vector with the DSL's integer remainder (the dividend's sign) and ``.to``."""

    def __mod__(self, o):
        return np.fmod(np.asarray(self), np.asarray(o)).view(_Vec)

    def __rmod__(self, o):
        return np.fmod(np.asarray(o), np.asarray(self)).view(_Vec)

    def to(self, dtype):
        a = np.asarray(self)
        return (np.trunc(a) if dtype is np.int32 and a.dtype.kind == "f" else a).astype(
            dtype).view(_Vec)


class _Frag:
    def __init__(self, n, dtype):
        self.a = np.zeros(n, dtype=dtype)

    def __getitem__(self, i):
        return self.a[i]

    def __setitem__(self, i, v):
        self.a[i] = v

    def store(self, v):
        self.a[:] = np.asarray(v)

    def load(self):
        return self.a.copy().view(_Vec)


def _namespace() -> dict:
    def f32(fn):
        return lambda x, fastmath=True: fn(np.asarray(x, dtype=np.float32)).astype(
            np.float32).view(_Vec)

    def full_like(x, v):
        x = np.asarray(x)
        dt = np.int32 if x.dtype == np.int32 else np.float32
        return np.full(x.shape, v, dtype=dt).view(_Vec)

    def where(c, a, b):
        a, b = np.asarray(a), np.asarray(b)
        dt = np.result_type(a, b)
        return np.where(np.asarray(c), a, b).astype(
            np.float32 if dt == np.float64 else dt).view(_Vec)

    def recast(frag, dtype):
        out = _Frag(len(frag.a), dtype)
        out.a = frag.a.view(dtype)
        return out

    cute = types.SimpleNamespace(
        jit=lambda f: f, full_like=full_like, where=where, recast_tensor=recast,
        size=lambda x: int(np.prod(x)) if isinstance(x, tuple) else int(x),
        make_rmem_tensor=lambda n, dtype: _Frag(n if isinstance(n, int) else n[0], dtype))
    cute.math = types.SimpleNamespace(
        exp=f32(np.exp), log=f32(np.log), tanh=f32(np.tanh), sin=f32(np.sin), cos=f32(np.cos),
        exp2=f32(np.exp2), log2=f32(np.log2), sqrt=f32(np.sqrt), floor=f32(np.floor),
        rsqrt=f32(lambda x: np.float32(1) / np.sqrt(x)))
    return {"cute": cute, "cutlass": types.SimpleNamespace(cute=cute, range_constexpr=range),
            "Float32": np.float32, "Int32": np.int32, "Uint32": np.uint32}


def run_generated(fn, score, b, h, q_idx, kv_idx, grad: bool = False, index_bits=False):
    """The generated score_mod (or its derivative) of ``fn`` on 1-D inputs: float32 numpy."""
    sm, tables = compile_score_mod(fn)
    aux = [np.asarray(kernel_table(t.detach(), spec.is_float))
           for t, spec in zip(tables, sm.tables)]
    ns = _namespace()
    src = score_mod_source(sm, index_bits=index_bits)
    exec("\n".join(ln for ln in src.splitlines()  # noqa: S102 - generated test source
                   if not ln.startswith(("import", "from"))), ns)
    vec = [np.asarray(x, dtype=d).reshape(-1).view(_Vec) for x, d in
           ((score, np.float32), (b, np.int32), (h, np.int32), (q_idx, np.int32),
            (kv_idx, np.int32))]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        if grad:
            out = ns["score_mod_bwd"](np.ones_like(vec[0]).view(_Vec), *vec, None, aux)
        else:
            out = ns["score_mod"](*vec, None, aux)
    return np.asarray(out, dtype=np.float32)


def run_eager(fn, score, b, h, q_idx, kv_idx, grad: bool = False):
    """``fn`` as written, on int32 indices (FlexAttention's), float32 scores."""
    x = torch.as_tensor(np.asarray(score, dtype=np.float32)).clone().requires_grad_(grad)
    idx = [torch.as_tensor(np.asarray(v, dtype=np.int32)) for v in (b, h, q_idx, kv_idx)]
    out = torch.broadcast_to(fn(x, *idx), x.shape)
    if grad:
        out.float().sum().backward()
        return x.grad.numpy()
    return out.detach().to(torch.float32).numpy()
