"""Which engine runs a call: every engine's capability check and refusal reason, in one place.

Engines: ``native`` (FA4's causal / window / varlen kernels, for masks the compiler proved one
of those), ``fa4`` (FA4's block-sparse kernels with the interval mask_mod), ``cute`` (this
package's CuTe kernels) and ``reference`` (dense float32, any device). :func:`why_not` says why
an engine cannot run a call (None: it can); :func:`select_engine` picks one for
``cm.attention`` (see ``docs/decisions/engine.md``) and :func:`select_served_engine` for a
served batch (``compilemask.api.serving``); :func:`op_refusal` is the op's own check of a call
made without them. The engines trust the choice: none checks again.
"""

from __future__ import annotations

import torch

from compilemask.contract.log import say_once, warn_gpu_refusal

from . import fa4_lib
from .fa4 import BWD_TILE_M

__all__ = ["BACKENDS", "ENGINES", "why_not", "select_engine", "select_served_engine",
           "kernel_available", "cute_kernel_reason", "fa4_reason", "runs_native_served",
           "op_refusal", "head_dims_reason"]

BACKENDS = ("auto", "fa4", "native", "cute", "reference")
ENGINES = BACKENDS[1:]
# (q/k head dim, v head dim) of FA4's own sm90 kernels as the native engine runs them; MLA's
# (192, 128) with one kv head per query head only: FA4's sm90 GQA backward needs one head dim.
# The block-sparse lists are laid out for 64 and 128 only (BWD_TILE_M), and FA4's (192, 128)
# backward uses kv tiles of 96: the other engines run one head dim
NATIVE_HEAD_DIMS = ((64, 64), (128, 128), (192, 128))


def head_dims_reason(engine: str, head_dim: int, head_dim_v: int,
                     gqa: bool = False) -> str | None:
    """Why ``engine`` has no kernel for these head dims (q and k, v), or None; ``gqa``: fewer
    kv heads than query heads."""
    if engine == "reference":
        return None
    if engine == "native":
        if (head_dim, head_dim_v) not in NATIVE_HEAD_DIMS:
            return (f"head dims (q/k {head_dim}, v {head_dim_v}): the native engine runs "
                    f"{', '.join(f'({a}, {b})' for a, b in NATIVE_HEAD_DIMS)}")
        if gqa and head_dim != head_dim_v:
            return (f"head dims (q/k {head_dim}, v {head_dim_v}) with fewer kv heads than query "
                    "heads: FA4's sm90 GQA backward needs one head dim (repeat k and v per "
                    "query head, or backend='reference')")
        return None
    if head_dim_v != head_dim:
        return (f"v's head dim {head_dim_v} differs from q and k's {head_dim}: the {engine} "
                "engine runs one head dim (64 or 128); the native engine runs (192, 128) with "
                "a kv head per query head for masks the compiler proved causal, windowed or "
                "segments; backend='reference' runs any")
    if engine == "fa4" and head_dim not in BWD_TILE_M:
        return f"head dim {head_dim} (the fa4 engine: 64 or 128)"
    return None


def kernel_available(q, desc) -> bool:
    """True when the CuTe forward kernel can run this call (CUDA sm80+, bf16/fp16, D 64/128)."""
    try:
        import cutlass  # noqa: F401  (the CuTe kernels' DSL: optional, seconds to import)
    except ImportError:
        return False
    if cute_kernel_reason(q) is not None or not q.is_cuda:
        return False
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return False
    # the CuTe kernel modules need the CUTLASS DSL (checked above)
    from .config import FlashFwdConfig
    from .flash_fwd import FlashFwd  # (as the line above)

    tiles = desc.fwd_tiles
    cfg = FlashFwdConfig(dtype="bf16" if q.dtype == torch.bfloat16 else "fp16",
                         head_dim=q.shape[-1], tile_m=tiles.tile_m, tile_n=tiles.tile_n,
                         num_intervals=max(desc.num_intervals, 1), arch=90 if major == 9 else 80)
    return FlashFwd.can_implement(cfg)


def cute_kernel_reason(q) -> str | None:
    """Why the CuTe kernels (forward and backward) take no tensors like ``q`` (their dtypes and
    head dims), or None; the op's cute engine then runs the dense reference, said once."""
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return f"no CuTe kernel for {q.dtype}, head dim {q.shape[-1]}"
    return None


def fa4_reason(q, desc, engine: str, head_dim_v: int | None = None,
               kv_heads: int | None = None) -> str | None:
    """Why FA4's ``engine`` ("fa4" or "native") cannot run this call on these tensors, or None
    (device, FA4 itself, dtype, head dims, the descriptor's tiles or proof); ``head_dim_v``:
    v's head dim where it differs from q's; ``kv_heads``: k and v's head count."""
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    err = fa4_lib.unavailable_reason()
    if err:
        return err
    major, _ = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"FA4's block-sparse sm90 path needs compute capability 9.x, got {major}.x"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"FA4 runs bf16/fp16, got {q.dtype}"
    why = head_dims_reason(engine, q.shape[-1], head_dim_v or q.shape[-1],
                           gqa=kv_heads is not None and kv_heads != q.shape[2])
    if why:
        return why
    if engine == "native":
        pat = desc.native
        if pat is None:
            return "the compiler did not prove this mask a native pattern"
        if not desc.native_applies():
            return f"the proof ({pat.describe()}) does not cover seqlen_q != seqlen_k"
        if pat.kind == "segments" and desc.segments is None:
            return (f"{pat.segment_param} is not a segmentation for this batch (each row's "
                    f"start must be itself or its predecessor's start)")
    elif engine == "fa4":
        if desc.fwd_tiles.tile_m != 128 or desc.fwd_tiles.tile_n != 128:
            return f"fwd_tiles must be 128x128 for FA4's lists, got {desc.fwd_tiles}"
        if q.shape[-1] == 128 and (desc.bwd_tiles.tile_m, desc.bwd_tiles.tile_n) != (64, 128):
            return f"bwd_tiles must be 64x128 for FA4's head-dim-128 backward, got {desc.bwd_tiles}"
    else:
        return f"unknown engine {engine!r}"
    return None


def cute_call_refusal(q, desc, score_mod: bool = False, sink: bool = False,
                      head_dim_v: int | None = None) -> str | None:
    """Why the cute engine cannot run this call on any device, or None (what ``why_not`` checks
    before the device: the CPU says it of ``deterministic=True`` calls)."""
    if score_mod:
        return ("the cute engine has no score_mod; backend='fa4' or 'native' (sm90) or "
                "'reference' run it")
    if sink:
        return ("the cute engine has no learnable_sink; backend='fa4' or 'native' (sm90) "
                "or 'reference' run it")
    if desc.mask.table_params:
        return "a table param's predicate runs on the fa4 engine only"
    if getattr(desc, "positions", None) is not None:
        return ("its kernels read a fallback predicate's i as the local row; this "
                "descriptor's rows are chosen positions of their sequences (served or "
                "sharded rows): the fa4 engine runs it")
    return head_dims_reason("cute", q.shape[-1], head_dim_v or q.shape[-1])


def _say_deterministic_refusal(q, desc, heads, score_mod, sink, head_dim_v) -> None:
    """On the CPU: a ``deterministic=True`` call that CUDA's only deterministic engine (cute)
    would refuse is said once per reason, as the other GPU refusals are."""
    why = ("folded heads run on the fa4 engine only" if heads > 1
           else cute_call_refusal(q, desc, score_mod, sink, head_dim_v))
    if why is not None:
        warn_gpu_refusal(("deterministic", why),
                         "cm.attention: the reference engine runs this deterministic=True call, "
                         "which the GPU engines refuse (on CUDA only the cute engine is "
                         f"deterministic: {why}); deterministic=False runs it there",
                         stacklevel=4)


def why_not(q, desc, engine: str, deterministic: bool = False, heads: int = 1,
            score_mod: bool = False, sink: bool = False,
            head_dim_v: int | None = None, kv_heads: int | None = None) -> str | None:
    """None when ``engine`` can run this ``cm.attention`` call on CUDA, else the reason (for the
    error message); ``score_mod`` / ``sink``: the call has one; ``head_dim_v``: v's head dim
    (None: q's); ``kv_heads``: k and v's head count (None: q's)."""
    if heads > 1 and engine in ("native", "cute"):
        return ("folded heads (a sequence per batch and head) run on the fa4 engine; "
                "preprocess_heads(..., fold=False) keeps a descriptor per head group")
    if engine == "reference":
        return None
    if engine == "cute":
        why = cute_call_refusal(q, desc, score_mod, sink, head_dim_v)
        if why:
            return why
        return None if kernel_available(q, desc) else ("no CuTe kernel for this "
                                                       "device/dtype/head dim")
    if deterministic and engine == "fa4":
        return "FA4's deterministic block-sparse backward needs dQ write orders (not built)"
    why = fa4_reason(q, desc, engine, head_dim_v, kv_heads)
    if why is None and engine == "native" and score_mod and desc.native.kind == "segments":
        # FA4's varlen path numbers rows, keys and sequences per segment, not as the
        # score_mod's b, q_idx, kv_idx: the lists run it
        return ("it runs this mask as FA4 varlen segments, whose indices are not the "
                "score_mod's b, q_idx, kv_idx; backend='fa4' or 'auto' runs it")
    return why


def select_engine(q, desc, backend: str = "auto", deterministic: bool = False,
                  heads: int = 1, score_mod: bool = False, sink: bool = False,
                  head_dim_v: int | None = None, kv_heads: int | None = None) -> str:
    """The engine ``attention`` runs for these tensors (see ``docs/decisions/engine.md``).

    ``auto`` on CUDA: ``native`` when the compiler proved the mask a native FA4 pattern for this
    shape, else ``fa4`` (FA4's block-sparse kernels with the interval mask_mod); with
    ``deterministic=True`` the ``cute`` kernels (FA4's block-sparse backward has no
    deterministic mode here). On CPU: ``reference``. A CUDA call that no engine can run raises
    ``NotImplementedError`` with each engine's reason, unless ``backend="reference"``.
    ``score_mod`` / ``sink``: the call has a score_mod / a learnable sink (engines without them
    are passed over); ``head_dim_v`` / ``kv_heads``: v's head dim and k and v's head count
    where they differ from q's."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if not q.is_cuda:
        if backend != "auto":
            raise NotImplementedError(f"backend={backend!r} needs CUDA tensors, got "
                                      f"{q.device.type}; use backend='reference' or 'auto'")
        say_once(f"cm.attention: {q.device.type} tensors use the dense reference path (the "
                 "GPU engines need CUDA)")
        if deterministic:
            _say_deterministic_refusal(q, desc, heads, score_mod, sink, head_dim_v)
        return "reference"
    if backend != "auto":
        why = why_not(q, desc, backend, deterministic, heads, score_mod, sink, head_dim_v,
                      kv_heads)
        if why:
            raise NotImplementedError(f"cm.attention: backend={backend!r} cannot run this call: "
                                      f"{why}")
        return backend
    order = ("cute",) if deterministic else ("native", "fa4", "cute")
    reasons = []
    for engine in order:
        why = why_not(q, desc, engine, deterministic, heads, score_mod, sink, head_dim_v,
                      kv_heads)
        if why is None:
            return engine
        reasons.append(f"{engine}: {why}")
    raise NotImplementedError("cm.attention: no GPU engine runs this call (" + "; ".join(reasons)
                              + "); pass backend='reference' for the dense O(S^2) path")


def runs_native_served(desc) -> bool:
    """Whether FA4's own causal / window / full kernel, given each request's lengths
    (``seqused_k`` / ``cu_seqlens``), computes this served descriptor's mask."""
    pat = desc.native
    if desc.q_offset != -1:
        return desc.native_applies() and pat.kind != "segments"
    # the proof is over positions (a served rule reads the whole sequence), and FA4 puts each
    # request's rows at its last positions, as the descriptor does; [B, Sq]
    # queries of a request shorter than Sq have rows before its first key, which see nothing
    # only under a pattern with no keys to the right (FA4 would show them keys of a full or
    # two-sided window); packed queries have no such rows
    return (pat is not None and pat.kind != "segments"
            and (desc.seqused_q is not None
                 or (pat.kind == "window" and pat.window_right == 0)))


def select_served_engine(who: str, q, desc, backend: str) -> str:
    """The engine of a served batch (paged or packed keys, forward only): ``reference`` (CPU,
    or asked), ``native`` (a mask proven causal / windowed / full: FA4's own kernel with each
    request's lengths, bottom-right as the rows are) or ``fa4`` (the interval mask_mod on every
    tile)."""
    if backend not in BACKENDS:
        raise ValueError(f"{who}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cute":
        raise NotImplementedError(f"{who}: the cute engine has no paged or varlen keys; "
                                  "backend='auto', 'fa4', 'native' or 'reference'")
    if backend == "reference" or (backend == "auto" and not q.is_cuda):
        return select_engine(q, desc, backend)
    native = runs_native_served(desc)
    if backend == "native" and not native:
        raise NotImplementedError(f"{who}: backend='native' needs a mask proven causal, "
                                  "windowed or full (FA4 does not page varlen segments); "
                                  "backend='fa4' runs it")
    select_engine(q, desc, "fa4")  # CUDA, sm90, dtype, head dim: else the reason, raised
    return "native" if native and backend in ("auto", "native") else "fa4"


def op_refusal(engine: str, score_mod: bool, sink: bool, served: bool = False) -> str | None:
    """Why the op cannot run a call of ``engine`` with these inputs, or None: for calls made
    to the op directly (``kernels.autograd.attention_op``), past :func:`select_engine`."""
    if engine not in ENGINES:
        return f"unknown engine {engine!r} (one of {ENGINES})"
    if served and engine not in ("fa4", "native"):
        return (f"a served batch (paged or packed keys) runs on the fa4 and native engines, "
                f"not {engine!r}")
    if score_mod and engine not in ("fa4", "native"):
        return f"a score_mod runs on the fa4 and native engines, not {engine!r}"
    if sink and engine not in ("fa4", "native", "reference"):
        return f"no learnable sink on the {engine} engine"
    return None
