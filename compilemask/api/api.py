"""cm.attention: validate, select the engine once (``kernels.dispatch``), run it."""

from __future__ import annotations

import math

import torch

from compilemask.compiler.reference import attention_reference, descriptor_dense_mask
from compilemask.contract.cache import mask_for_key
from compilemask.contract.descriptor import ExecutionDescriptor
from compilemask.contract.log import said
from compilemask.contract.options import KernelOptions
from compilemask.dsl.score_mod import (
    at_rows,
    compile_score_mod,
    score_mod_for_key,
    traced_score_args,
)
from compilemask.kernels.autograd import attention_op
from compilemask.kernels.dispatch import BACKENDS, select_engine
from compilemask.pipeline.heads import HeadGroups, attention_heads
from compilemask.pipeline.pipeline import on_device

__all__ = ["attention", "select_engine", "BACKENDS"]

_SAID = said  # the said-once messages under their older name here, which callers clear


def _validate(q, k, v, desc, heads: int = 1):
    if not isinstance(desc, ExecutionDescriptor):
        raise TypeError(f"desc must be an ExecutionDescriptor (from CompiledMask.preprocess), "
                        f"got {type(desc).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, S, H, D], got shape {list(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    B, Sq, H, D = q.shape
    if k.shape[:-1] != v.shape[:-1]:  # v's head dim may differ (MLA: 192 for q/k, 128 for v)
        raise ValueError(f"k and v must have the same shape but for the head dim, got "
                         f"{list(k.shape)} and {list(v.shape)}")
    Bk, Sk, Hkv, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} disagree on batch or head dim")
    # [B, H, S, D] tensors (SDPA's and FlexAttention's layout) show the sequence at axis 2:
    # say so before the head count or the lengths disagree in terms of the wrong axes
    swapped = [(names, t, S) for names, t, S in (("q", q, desc.seqlen_q),
                                                  ("k v", k, desc.seqlen_k))
               if t.shape[1] != S and t.shape[2] == S]
    if swapped:
        seen = "; ".join(f"{names[0]} {list(t.shape)} has desc's seqlen_{names[0]} ({S}) at "
                         "axis 2" for names, t, S in swapped)
        fix = ", ".join(f"{n}.transpose(1, 2)" for names, _, _ in swapped for n in names.split())
        raise ValueError(
            f"cm.attention takes [B, S, H, D] tensors (FlashAttention layout), and {seen}, not "
            f"at axis 1: these look like [B, H, S, D]; pass {fix} (the output is [B, S, H, D])")
    if H % Hkv:
        raise ValueError(f"num heads of q ({H}) must be a multiple of those of k/v ({Hkv})")
    if heads > 1:  # folded heads: a sequence per (batch, head)
        if H != heads:
            raise ValueError(f"cm.attention: q has {H} heads, the HeadGroups {heads}")
        B = B * heads
    if (desc.batch_size, desc.seqlen_q, desc.seqlen_k) != (B, Sq, Sk):
        # metadata without tensors (or no params at all) carries no batch size: preprocess
        # makes one sequence unless told otherwise
        hint = (f"; metadata without tensors gives batch 1: preprocess(..., batch_size={B})"
                if desc.batch_size == 1 and B != 1 else "")
        raise ValueError(
            f"desc was made for batch {desc.batch_size}, seqlen_q {desc.seqlen_q}, seqlen_k "
            f"{desc.seqlen_k}; q/k give batch {B}, seqlen_q {Sq}, seqlen_k {Sk}{hint}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_arguments(q, k, v, softmax_scale, who: str = "cm.attention") -> None:
    """What every engine needs of its arguments, said before any of them reads one: a finite
    ``softmax_scale`` (NaN or inf makes every score NaN), at least one head and a head dim, and
    q, k, v on one device."""
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"{who}: softmax_scale must be a float or None (1/sqrt(head dim)), "
                            f"got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"{who}: softmax_scale must be finite, got {softmax_scale}; pass "
                             "None for 1/sqrt(head dim)")
    ts = [(n, t) for n, t in (("q", q), ("k", k), ("v", v)) if isinstance(t, torch.Tensor)]
    for name, t in ts:
        if t.dim() >= 2 and (t.shape[-1] == 0 or t.shape[-2] == 0):
            raise ValueError(f"{who}: {name} {list(t.shape)} has no heads or a head dim of 0; "
                             "give at least one head of dim >= 1")
    devices = {t.device for _, t in ts}
    if len(devices) > 1:
        raise ValueError(f"{who}: q, k, v must be on one device, got "
                         + ", ".join(f"{n} on {t.device}" for n, t in ts)
                         + "; move them with .to(q.device)")


def _check_rows(desc, row_shift: str, return_lse: bool, sink: bool):
    """A descriptor of queries elsewhere in the sequence whose positions it does not hold
    (``_row_positions`` None: a context-parallel shard of an interval mask) runs only a
    score_mod that does not read q_idx, or one that a moved q_idx changes by a per-row
    constant where nothing else in the row's softmax stays put (no LSE returned, no learnable
    sink): the output is then the same."""
    if not desc.q_offset or row_shift == "none":
        return
    if row_shift == "row" and not return_lse and not sink:
        return
    fixed = "the LSE (return_lse=True)" if return_lse else "the learnable_sink's logit"
    why = {"any": "the score_mod reads q_idx in a way a moved q_idx does not shift by a per-row "
                  "constant",
           "row": "the score_mod reads q_idx, and a moved q_idx shifts each row's scores by a "
                  f"constant that {fixed} does not share"}[row_shift]
    raise NotImplementedError(
        "cm.attention: this descriptor's queries are not rows 0.. of the sequence and it does "
        f"not record their positions (a context-parallel shard of an interval mask), and {why}; "
        "served rows (query_descriptor) and rows of a mask with fallback regions record them, "
        "or fold the offset into the score_mod's own tables")


def _row_positions(desc, heads: int, batch: int):
    """``(per_row, int32 tensor)`` on the descriptor's device, where its rows are not positions
    ``0..`` of their sequences but it records where they are: ``[B, Sq]`` each row's position
    (``per_row``; rows of a mask with fallback regions), or ``[B]`` each sequence's position of
    its local row 0 (served rows: ``query_descriptor``'s last rows, requests of their own
    lengths; a padded batch). None: rows ``0..``, or positions not recorded (``_check_rows``).
    What the GPU engines read as the score_mod's last table (``at_rows``); made on the device
    (a fill, no copy from the host: this runs per layer)."""
    if not desc.q_offset:
        return None
    start = _row_start(desc)
    if start >= 0:
        return False, torch.full((batch,), start, dtype=torch.int32, device=desc.device)
    if heads != 1:  # a folded descriptor's b is a (batch, head)
        return None
    if desc.positions is not None:
        return True, desc.positions
    if desc.seqused_k is not None:
        used_q = desc.seqlen_q if desc.seqused_q is None else desc.seqused_q
        return False, (desc.seqused_k - used_q).to(torch.int32)
    return None


def _row_start(desc) -> int:
    """Every sequence's position of its local row 0 where it is one for all (``q_offset``, or
    a padded batch's ``row_start``), else -1."""
    return desc.q_offset if desc.q_offset >= 0 else desc.row_start


def _at_positions(score_mod, rows):
    """``score_mod`` given each row's position in the sequence as ``q_idx``
    (``_row_positions``; a packed batch's padding rows, which see nothing, read 0): the
    reference engine evaluates it as on the whole sequence's rows."""
    per_row, pos = rows
    pos = pos.long()
    if per_row:
        last = pos.shape[1] - 1

        def at_positions(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, pos[b, q_idx.clamp(max=last)].clamp(min=0), kv_idx)
    else:
        def at_positions(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, (pos[b] + q_idx).clamp(min=0), kv_idx)
    return at_positions


# a constant under torch.compile, called with strings only: the mask by its registry key (a
# frozen spec cannot be rebuilt as a constant by every torch release's dynamo)
@torch.compiler.assume_constant_result
def _check_masked_scores(name: str, key: str, mask_key: str | None) -> bool:
    """A score_mod that gives -inf (``torch.where(cond, score, -inf)``: a masked score) runs
    on the GPU engines as its finite value, on a mask that holds ``cond``
    (``from_mask_mod(..., score_mod=)``); with any other mask it is refused. ``name``: the
    score_mod's, for the message; ``key``: its converted key; ``mask_key``: the mask's."""
    sm = score_mod_for_key(key)
    spec = getattr(None if mask_key is None else mask_for_key(mask_key), "spec", None)
    if sm is None or sm.mask is None or (spec is not None and key in spec.masked_scores):
        return True
    raise NotImplementedError(
        f"cm.attention: score_mod {name!r} gives -inf (a masked score) unless {sm.mask}, which "
        "the GPU engines read from the mask: convert the mask with that condition, "
        "cm.from_mask_mod(mask_mod, score_mod=score_mod) (or from_mask_mod_heads), and pass its "
        "descriptor; backend='reference' runs the score_mod as written")


def attention(q, k, v, desc: ExecutionDescriptor | HeadGroups, *,
              softmax_scale: float | None = None,
              return_lse: bool = False, deterministic: bool = False, backend: str = "auto",
              options: KernelOptions | None = None, score_mod=None, learnable_sink=None):
    """Masked attention driven by an Execution Descriptor.

    Layouts follow FlashAttention: ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` with
    ``H % Hkv == 0`` (GQA/MQA); returns ``out [B, Sq, H, D]`` and, with ``return_lse``, the
    float32 log-sum-exp ``[B, H, Sq]`` (-inf for rows that see nothing; their output is 0).
    Autograd-capable, through the ``compilemask::attention_fwd/bwd`` custom ops (so
    ``torch.compile`` traces it without graph breaks).

    ``backend``: ``"auto"`` (see :func:`select_engine`), ``"native"`` (FA4's causal / window /
    varlen kernels, for masks the compiler proved to be one of those), ``"fa4"`` (FA4's
    block-sparse kernels driven by the descriptor), ``"cute"`` (this package's CuTe kernels) or
    ``"reference"`` (dense float32, any device). ``deterministic=True``: gradients identical run
    to run. ``options``: variants of the ``cute`` kernels (:class:`compilemask.KernelOptions`;
    None: ``default_options`` for the call) and the ``fa4`` engine's ``mask_mod`` variant; the
    other engines ignore them. ``score_mod``: a FlexAttention ``score_mod(score, b, h, q_idx,
    kv_idx)`` applied to the scaled scores before the mask, as written. On the reference engine
    it runs as it is (gradients flow into what it captures too); the fa4 and native engines
    run it compiled (``compilemask.dsl.score_mod``: its captured tensors are read in the kernel,
    on q's device, without gradients; a softcap ``c * tanh(score / c)`` multiplies by ``1/c``,
    or is FA4's own under ``KernelOptions(softcap="fa4")``), the
    cute engine refuses it. ``learnable_sink``: a per-head logit ``[H]`` in every row's softmax
    with no value (gpt-oss's sinks; LSE includes it; differentiable), FA4's ``learnable_sink``
    on the fa4 and native engines.
    ``desc`` may be ``HeadGroups`` (``preprocess_heads``: a mask per group of heads), each group
    run through its own descriptor, or all heads in one fa4 launch where they are folded."""
    check_arguments(q, k, v, softmax_scale)
    heads = 1
    if isinstance(desc, HeadGroups) and desc.folded:  # one launch: a sequence per batch x head
        desc, heads = desc.groups[0][0], desc.num_heads
    elif isinstance(desc, HeadGroups):  # a mask per group of heads: each group its own call
        return attention_heads(attention, q, k, v, desc, return_lse,
                               softmax_scale=softmax_scale, deterministic=deterministic,
                               backend=backend, options=options, score_mod=score_mod,
                               learnable_sink=learnable_sink)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if options is not None and not isinstance(options, KernelOptions):
        raise TypeError(f"options must be a compilemask.KernelOptions or None, got "
                        f"{type(options).__name__}")
    _validate(q, k, v, desc, heads)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a callable score_mod(score, b, h, q_idx, "
                        f"kv_idx), got {type(score_mod).__name__}")
    if learnable_sink is not None and not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a [H] tensor, got "
                        f"{type(learnable_sink).__name__}")
    desc = on_device(desc, q.device)  # a descriptor made elsewhere: its copy here, made once
    engine = select_engine(q, desc, backend, deterministic, heads,
                           score_mod=score_mod is not None, sink=learnable_sink is not None,
                           head_dim_v=v.shape[-1], kv_heads=v.shape[2])
    score = None
    rows = _row_positions(desc, heads, q.shape[0]) if score_mod is not None else None
    if rows is not None and engine == "reference":  # exact for any score_mod
        score_mod, rows = _at_positions(score_mod, rows), None
    elif score_mod is not None and engine == "reference" and desc.q_offset:
        try:
            row_shift = compile_score_mod(score_mod)[0].row_shift
        except (NotImplementedError, TypeError) as e:
            raise NotImplementedError(
                "cm.attention: this descriptor's queries are not rows 0.. of the sequence, "
                "where a score_mod runs only if its reading of q_idx is known, and this one "
                f"does not convert ({e})") from None
        _check_rows(desc, row_shift, return_lse, learnable_sink is not None)
    if score_mod is not None or learnable_sink is not None:
        if engine == "reference":
            return attention_reference(q, k, v, descriptor_dense_mask(desc, heads),
                                       softmax_scale=softmax_scale, return_lse=return_lse,
                                       score_mod=score_mod, learnable_sink=learnable_sink)
        if learnable_sink is not None:
            H = q.shape[2]
            if learnable_sink.shape != (H,) or learnable_sink.device != q.device:
                raise ValueError(f"learnable_sink must be [H] = [{H}] on {q.device}, got "
                                 f"{list(learnable_sink.shape)} on {learnable_sink.device}")
            if learnable_sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"learnable_sink must be float32, bfloat16 or float16 on the "
                                f"{engine} engine, got {learnable_sink.dtype}")
        if score_mod is None:
            pass
        else:
            if torch.compiler.is_compiling():  # converted outside the graph, tables read in it
                key, tables, row_shift = traced_score_args(score_mod)
            else:
                sm, tables = compile_score_mod(score_mod)
                key, tables, row_shift = sm.key, sm.aux_tensors(tables, q.device), sm.row_shift
            mask = getattr(desc, "mask", None)
            _check_masked_scores(getattr(score_mod, "__name__", "score_mod"), key,
                                 None if mask is None else str(mask.key))
            if row_shift == "none" or _row_start(desc) == 0:
                pass  # q_idx unread, or the local rows are the positions (a padded square batch)
            elif rows is not None:  # q_idx read at the rows' positions
                key = at_rows(key, rows[0])
                tables = [*tables, rows[1].contiguous()]
            else:
                _check_rows(desc, row_shift, return_lse, learnable_sink is not None)
            score = (key, tables)
    return attention_op(q, k, v, desc, softmax_scale=softmax_scale, return_lse=return_lse,
                        deterministic=deterministic, engine=engine, options=options, score=score,
                        sink=learnable_sink, heads=heads)
