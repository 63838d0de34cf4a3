"""CompileMask as a transformers attention implementation.

    from compilemask.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())
    out = model(input_ids, labels=labels, compilemask_desc=desc)     # desc: one per batch

The model's forward passes unknown keyword arguments down to its attention function (the
``**kwargs`` of transformers' attention interface), so the descriptor travels with the call: one
``ExecutionDescriptor`` for every layer, or a dict keyed by layer type (``"full_attention"``,
``"sliding_attention"``, ...) for models whose layers attend differently.

The mask is the descriptor's, with two things the model has a say in:

* padding: ``register`` also registers a mask function, so a tokenizer's 2-D ``attention_mask``
  reaches every layer as a ``[B, Sk]`` key validity. Each sequence's real tokens must be one
  contiguous run (left or right padding, or both); the layers then run the descriptor padded
  (``compilemask.pipeline.padding``: every row's keys clipped to its sequence's real tokens,
  padded rows seeing nothing), made on the device once per model call and descriptor, so
  every engine runs it. Positions stay the tensor's: the mask's rules and metadata speak of
  padded positions. Under tracing (torch.compile, CUDA-graph capture) no descriptor is made per
  call: the reference path combines the padding with the dense mask, and a GPU engine takes a
  descriptor made with ``preprocess(..., padding=attention_mask)``. An all-ones mask is
  dropped before any layer (one look on the host, as transformers' own masks take; under
  tracing it cannot be looked at and reaches the layers). A 4-D mask is refused.
* softcapping (Gemma 2's ``attn_logit_softcapping``): the score_mod ``cap * tanh(s / cap)``
  (a multiply by ``1/cap`` and a tanh per score on the fa4 and native engines); gpt-oss's
  per-head sinks (``s_aux``): ``learnable_sink`` (FA4's on the GPU engines).
* sliding windows: a layer that attends within a window (``sliding_window`` of the module, of
  the call, or of a ``"sliding_attention"`` layer's config) runs the descriptor as it is where
  its mask is proven to stay within that window (``within_window``: its native pattern, else z3
  over its rules) or the sequence is no longer than the window; otherwise the mask and the
  window combined (``windowed_descriptor``: every rule also ``j > i - window``, preprocessed
  once per batch from the descriptor's own metadata and kept with it). Under torch.compile, or
  with queries and keys of different lengths, an unproven descriptor is refused, naming the
  layer. ``generate`` (``compilemask_mask``) runs a sliding layer past its window: its cache's
  keys at their positions (from ``position_ids``), the mask within the window.

Context parallelism: with ``compilemask_cp=(plan, group)`` (a ``compilemask.api.distributed``
plan and the process group, ``None`` for the world) every layer runs ``cp_attention`` on the
rank's shard of the sequence; the descriptor is the rank's ``shard_descriptor``. The rest of the
model is per token, so feeding it the rank's tokens with their global positions is exact::

    ids_l, pos_l = shard_inputs(input_ids, plan, rank)
    out = model(ids_l, position_ids=pos_l, compilemask_desc=desc_l, compilemask_cp=(plan, group))

``out.logits`` are the rank's rows (``cp.unshard`` of every rank's puts them back in order).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import torch

from compilemask.api.api import _validate, attention, select_engine
from compilemask.api.distributed import CPPlan, cp_attention, shard
from compilemask.api.serving import DecodeState, _snapshot, query_descriptor
from compilemask.compiler.compiler import first_match_rule
from compilemask.compiler.native import _run_axioms
from compilemask.compiler.prover import Prover
from compilemask.compiler.reference import attention_reference
from compilemask.contract.cache import CompileCache
from compilemask.contract.descriptor import ExecutionDescriptor, unpack_table
from compilemask.contract.lru import LRU
from compilemask.dsl import MaskSpec, Region, score_mods
from compilemask.dsl.frontend import rule_symbols
from compilemask.integrations import check_kernels_not_hidden
from compilemask.pipeline.compiled import CompiledMask, compile_mask
from compilemask.pipeline.heads import HeadGroups
from compilemask.pipeline.pipeline import padded

# before transformers loads: its ``import kernels`` must not find this project's folder kernels/
check_kernels_not_hidden()

__all__ = ["register", "attention_forward", "attention_forward_deterministic", "layer_type",
           "key_padding_mask", "layer_window", "within_window", "windowed_mask",
           "windowed_descriptor", "shard_inputs", "DESC_KWARG", "CP_KWARG", "MASK_KWARG",
           "META_KWARG"]

DESC_KWARG = "compilemask_desc"
CP_KWARG = "compilemask_cp"
# generation: the compiled mask and its metadata over every position the sequences reach; each
# call's descriptor is made from them for its queries (the last of the KV cache's keys)
MASK_KWARG = "compilemask_mask"
META_KWARG = "compilemask_meta"


def register(name: str = "compilemask", *, deterministic: bool = False) -> str:
    """Register CompileMask with ``transformers.AttentionInterface`` under ``name``, and
    ``key_padding_mask`` with ``AttentionMaskInterface`` (so a 2-D padding mask reaches the
    layers instead of being dropped); returns ``name``, for ``attn_implementation=``.
    ``deterministic``: as in ``cm.attention``."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError("compilemask.integrations.transformers needs transformers: "
                          f"pip install -e \".[hf]\" (importing it failed: {e})") from e
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    fn = attention_forward_deterministic if deterministic else attention_forward
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, key_padding_mask)
    _accept_generate_kwargs()
    return name


def _accept_generate_kwargs():
    """``generate`` refuses keyword arguments the model's forward does not name, except the
    attention kwargs transformers lists (``TransformersKwargs``); ours join that list, so
    ``model.generate(ids, compilemask_mask=..., compilemask_meta=...)`` reaches the layers."""
    try:
        from transformers.utils.generic import TransformersKwargs
    except ImportError:  # an older layout: generate then refuses them, naming them
        return
    keys = frozenset({DESC_KWARG, MASK_KWARG, META_KWARG})
    TransformersKwargs.__optional_keys__ = frozenset(TransformersKwargs.__optional_keys__) | keys


def key_padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                     mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask-function signature (``AttentionMaskInterface``): the padding of the
    call's 2-D ``attention_mask`` as bool ``[B, kv_length]`` (True: a real key), or None when
    there is none. The pattern (``mask_function``: causal, sliding, packed) is not read: the
    descriptor is the mask.

    An all-ones mask gives None, so the layers run as without it; telling that costs one look
    on the host per model call (as transformers' SDPA and FlashAttention masks take), and under
    tracing (torch.compile, CUDA-graph capture), where the host cannot look, the mask is
    returned as it is."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask  # 4-D masks never get here: transformers passes them on as given
    keep = attention_mask.to(torch.bool)
    # keys past the mask's end are padding, as transformers' own masks read them
    short = kv_offset + kv_length - keep.shape[-1]
    if short > 0:
        keep = torch.nn.functional.pad(keep, (0, short))
    keep = keep[:, kv_offset:kv_offset + kv_length]
    from transformers.utils.import_utils import is_tracing

    if not is_tracing(keep) and bool(keep.all()):
        return None
    return keep


def layer_window(module, kwargs: Mapping | None = None) -> int | None:
    """The sliding window a layer attends within (row ``i`` sees keys ``> i - window``), from
    wherever the model says it: the attention call's ``sliding_window`` (Mistral passes its
    config's there), the module's ``sliding_window``, or the config's for a layer of type
    ``"sliding_attention"``. None: no window."""
    window = (kwargs or {}).get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    if window is None and layer_type(module) == "sliding_attention":
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"compilemask attention: cannot read the sliding window {window!r} of "
                        f"layer {getattr(module, 'layer_idx', '?')}: expected an int or None")
    return window if window > 0 else None  # FlashAttention's convention: -1 is no window


def layer_type(module) -> str:
    """The layer type that picks a layer's descriptor from a dict, as the model picks its mask:
    ``config.layer_types[layer_idx]``, else the module's ``layer_type``, else
    ``"sliding_attention"`` if the module has a sliding window and ``"full_attention"`` if not."""
    types = getattr(getattr(module, "config", None), "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is not None and isinstance(idx, int) and 0 <= idx < len(types):
        return types[idx]
    kind = getattr(module, "layer_type", None)
    if isinstance(kind, str):
        return kind
    return "sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"


# (id(mask), id(meta), batch, device) -> (mask, meta, DecodeState): the current generation
_DECODE = LRU(1)  # one generation at a time (cleared before each store)


def _generation_descriptor(module, kwargs, query, key):
    """The descriptor of this call's queries, the last ``Sq`` of the sequence's keys (prefill and
    each decode step), from ``compilemask_mask`` and ``compilemask_meta``; made once per step
    shape and metadata and shared by the layers (the dict may be updated between calls:
    ``DecodeState`` sees a changed, replaced, added or removed entry). Returns it and how many
    of the sequence's first keys the layer's cache no longer holds (a sliding layer past its
    window; 0 otherwise): the caller places the keys it got at their positions."""
    mask, meta = kwargs[MASK_KWARG], kwargs.get(META_KWARG)
    if not isinstance(mask, CompiledMask):
        raise TypeError(f"{MASK_KWARG} must be a compile_mask(...) result, got "
                        f"{type(mask).__name__}")
    if kwargs.get(DESC_KWARG) is not None:
        raise ValueError(f"pass {DESC_KWARG} or {MASK_KWARG}, not both")
    Sq, Sk = query.shape[2], key.shape[2]
    window = layer_window(module, kwargs)
    dropped = 0
    if window is not None:
        dropped = _dropped_keys(module, kwargs, window, Sq, Sk)
        if Sk + dropped > window and not within_window(mask, window, True):  # rows: positions
            mask = windowed_mask(mask, window)  # the layer's own mask: the rules and its window
    k = (id(kwargs[MASK_KWARG]), id(meta), query.shape[0], query.device)
    entry = _DECODE.get(k)
    if entry is None or entry[0] is not kwargs[MASK_KWARG] or entry[1] is not meta:
        _DECODE.clear()
        entry = _DECODE[k] = (kwargs[MASK_KWARG], meta, {})
    state = entry[2].get(mask.key)
    if state is None:  # one per mask the layers run: the given one, a window's combined
        state = entry[2][mask.key] = _BeamState(
            mask, meta, batch_size=query.shape[0], device=query.device,
            repeat=_beam_factor(meta, query.shape[0]))
    return state.descriptor(Sq, Sk + dropped), dropped


# the last step's (weakref to position_ids, its version, the sequence's length): the layers of
# one step share it (tensors are not hashable by identity in a WeakKeyDictionary: == compares)
_TOTAL = threading.local()


def _dropped_keys(module, kwargs, window: int, Sq: int, Sk: int) -> int:
    """How many first keys of the sequence a sliding layer's cache has dropped: transformers'
    sliding caches keep the last ``window - 1`` keys and give them with the call's new ones, so
    ``Sk == window - 1 + Sq`` may be a longer sequence's tail. Its length is then read from the
    call's ``position_ids`` (the last query's position + 1; one host read per step, shared by
    the layers, as the same tensor reaches each), which must agree across the batch."""
    if Sk < window - 1 + Sq:
        return 0  # the cache has kept every key
    pos = kwargs.get("position_ids")
    where = (f"compilemask attention: layer {getattr(module, 'layer_idx', '?')} attends within a "
             f"sliding window of {window} keys and its KV cache holds the last {Sk} keys")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] != Sq:
        raise NotImplementedError(
            f"{where}; generating past the window with {MASK_KWARG} places them by the call's "
            f"position_ids [B, {Sq}], which this model does not pass to its attention (got "
            f"{type(pos).__name__}): pass position_ids to the layers, or generate at most "
            f"{window - 1} tokens in all")
    got = getattr(_TOTAL, "last", None)
    total = got[2] if got is not None and got[0]() is pos and got[1] == pos._version else None
    if total is None:
        last = pos[:, -1]
        if bool((last != last[0]).any()):
            raise NotImplementedError(
                f"{where}; the batch's position_ids end at different positions "
                f"{last.tolist()} (left padding), so the keys' positions are not known: "
                "generate past the window without padding (a batch of one length, or the "
                "lengths in the mask's metadata)")
        total = int(last[0]) + 1
        _TOTAL.last = (weakref.ref(pos), pos._version, total)
    if total < Sk:
        raise ValueError(f"{where}, but the call's position_ids end at {total - 1}: the "
                         "positions must be the keys' (0.. from the sequence's first token)")
    return total - Sk


def _beam_factor(meta, batch: int) -> int:
    """How many rows of the model's batch each sequence of ``meta`` has: ``generate`` repeats
    every sequence ``num_beams * num_return_sequences`` times (``repeat_interleave``, as it
    expands ``input_ids``); 1 where the metadata is the batch's own or has no batch."""
    sizes = {v.shape[0] for v in (meta or {}).values()
             if isinstance(v, torch.Tensor) and v.dim() >= 1}
    if not sizes or sizes == {batch}:
        return 1
    (n,) = sizes if len(sizes) == 1 else (None,)
    if n is None or batch % n:
        raise ValueError(f"{META_KWARG}: its tensors have batch size(s) {sorted(sizes)}, the "
                         f"model's batch is {batch}; give one value per sequence (generate "
                         "repeats each sequence num_beams * num_return_sequences times, and the "
                         "metadata with it)")
    return batch // n


class _BeamState(DecodeState):
    """A ``DecodeState`` whose metadata is per sequence while the model's batch holds each
    sequence ``repeat`` times in a row (beam search, ``num_return_sequences``): the metadata is
    repeated likewise when a descriptor is made. Beam search reorders the KV cache each step
    only among one sequence's beams, whose metadata rows are equal, so nothing follows it."""

    def __init__(self, mask, meta, *, repeat: int = 1, **kw):
        super().__init__(mask, meta, **kw)
        self.repeat = repeat

    def descriptor(self, seqlen_q: int, seqlen_k: int):
        if self.repeat == 1:
            return super().descriptor(seqlen_q, seqlen_k)
        desc = self._made_for(seqlen_q, seqlen_k)
        if desc is None:
            meta = {n: v.repeat_interleave(self.repeat, dim=0)
                    if isinstance(v, torch.Tensor) and v.dim() >= 1 else v
                    for n, v in self.meta.items()}
            desc = query_descriptor(self.mask, meta, seqlen_k, seqlen_q,
                                    batch_size=self.batch_size, device=self.device)
            self._last = (self._args(seqlen_q, seqlen_k), _snapshot(self.meta), desc)
        return desc


def _descriptor(module, desc) -> ExecutionDescriptor:
    if desc is None:
        raise ValueError(f"compilemask attention needs the batch's descriptor: call the model "
                         f"with {DESC_KWARG}=desc (an ExecutionDescriptor from "
                         f"CompiledMask.preprocess, or a dict of them keyed by layer type)")
    if isinstance(desc, Mapping):
        kind = layer_type(module)
        if kind not in desc:
            raise ValueError(f"{DESC_KWARG} has no descriptor for layer type {kind!r} (layer "
                             f"{getattr(module, 'layer_idx', '?')}); it has {sorted(desc)}")
        desc = desc[kind]
    if isinstance(desc, (ExecutionDescriptor, HeadGroups)):
        return desc
    raise TypeError(f"{DESC_KWARG} must be an ExecutionDescriptor (or HeadGroups) or a dict of "
                    f"them keyed by layer type, got {type(desc).__name__}")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention-function signature over ``cm.attention``: ``query [B, H, Sq, D]``,
    ``key, value [B, Hkv, Sk, D]`` (GQA without repeating k/v) -> ``(out [B, Sq, H, D], None)``.
    The descriptor is the ``compilemask_desc`` keyword; ``scaling`` is the softmax scale."""
    return _forward(module, query, key, value, attention_mask, dropout, scaling, kwargs, False)


def attention_forward_deterministic(module, query, key, value, attention_mask, dropout=0.0,
                                    scaling=None, **kwargs):
    """``attention_forward`` with ``cm.attention(..., deterministic=True)``."""
    return _forward(module, query, key, value, attention_mask, dropout, scaling, kwargs, True)


def shard_inputs(input_ids: torch.Tensor, plan, rank: int,
                 position_ids: torch.Tensor | None = None):
    """Rank ``rank``'s ``(input_ids, position_ids)`` for a context-parallel model call, each
    ``[B, plan.local_len]``: the token ids of its rows and their global positions (or the given
    ``[B or 1, S]`` ``position_ids`` at its rows, e.g. for packed sequences), so RoPE sees the
    positions of the unsharded sequence. Padding rows get token 0 and position 0: they see
    nothing and nobody sees them, so any valid id and position would do."""
    if input_ids.dim() != 2:
        raise ValueError(f"shard_inputs: input_ids must be [B, S], got {list(input_ids.shape)}")
    ids = shard(input_ids.unsqueeze(-1), plan, rank).squeeze(-1)
    if position_ids is None:
        rows = plan.rows[rank].to(input_ids.device)
        pos = torch.where(rows < plan.seqlen, rows, 0).expand(input_ids.shape[0], -1)
    else:
        pos = shard(position_ids.unsqueeze(-1), plan, rank).squeeze(-1)
        pos = pos.expand(input_ids.shape[0], -1)
    return ids, pos.contiguous()


def _cp_arg(cp):
    """``compilemask_cp`` as ``(plan, group)``: a plan alone means the default group."""
    if isinstance(cp, CPPlan):
        return cp, None
    if isinstance(cp, tuple) and len(cp) == 2 and isinstance(cp[0], CPPlan):
        return cp
    raise TypeError(f"{CP_KWARG} must be (plan, group) with a compilemask.api.distributed.CPPlan "
                    f"(or the plan alone for the default group), got {type(cp).__name__}")


def _key_validity(attention_mask) -> torch.Tensor | None:
    """bool ``[B, Sk]`` from the 2-D padding mask ``key_padding_mask`` passes on (or a model
    passes as FlashAttention takes it), None without one; any other mask is refused."""
    if attention_mask is None:
        return None
    if (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
            and not attention_mask.is_floating_point()):
        return attention_mask.to(torch.bool)
    what = (f"{attention_mask.dtype} attention_mask of shape {list(attention_mask.shape)}"
            if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__)
    raise ValueError(f"compilemask attention takes its mask from {DESC_KWARG}, and besides it "
                     f"only a 2-D 0/1 padding attention_mask [B, S]; got a {what} (leave it "
                     "out, or put it in the mask's rules)")


# (mask key, window, square) -> proven: each proof runs once, also when threads ask at once
_WITHIN = CompileCache("window_proof")


# dynamo runs it while tracing and keeps the answer (z3 cannot be traced): a fixed property of
# the compiled mask, the window and the shape's kind
@torch.compiler.assume_constant_result
def within_window(mask, window: int, square: bool) -> bool:
    """Whether ``mask`` shows row ``i`` only keys ``j > i - window`` (``i`` aligned to the last
    keys, ``i + seqlen_k - seqlen_q``, when not ``square``, as transformers aligns a cache), for
    every row, key and metadata value: from its native pattern, else a z3 proof over its rules.
    Unknown counts as not proven."""
    return _WITHIN.get((mask.key, window, square), lambda: _within_window(mask, window, square))


def _within_window(mask, window, square) -> bool:
    pat = mask.native_pattern
    if (pat is not None and pat.kind in ("window", "segments") and pat.window_left is not None
            and pat.window_left < window):
        if square or (pat.kind == "window" and pat.bottom_right):
            return True
    import sympy as sp

    syms = rule_symbols(mask.spec.params)
    row = syms["i"] if square else syms["i"] + syms["seqlen_k"] - syms["seqlen_q"]
    try:
        vis = first_match_rule(mask.regions)
        prover = Prover(_run_axioms(mask, syms), syms, mask.divisor_params)
        return prover.proves(sp.Or(sp.Not(vis), sp.Gt(syms["j"], row - window)))
    except (TypeError, ValueError):  # a rule z3 cannot take: not proven
        return False


def _check_window(module, desc, window, seqlen_q: int, seqlen_k: int):
    """The descriptor a sliding-window layer runs: ``desc`` where its mask is proven to stay
    within the window, else the descriptor of the mask and the window combined (the same rules
    and metadata, every region's rule also ``j > i - window``), made once per (descriptor,
    window) and kept with the descriptor. Under torch.compile, where no descriptor can be made,
    an unproven one is refused: the model would silently run as another model."""
    if window is None or max(seqlen_q, seqlen_k) <= window:
        return desc  # no key is ``window`` or more away from any row
    if within_window(desc.mask, window, seqlen_q == seqlen_k):
        return desc
    if seqlen_q == seqlen_k and not torch.compiler.is_compiling():
        return windowed_descriptor(desc, window)
    kind = layer_type(module)
    pat = desc.mask.native_pattern
    how = pat.describe() if pat is not None else "not a native pattern"
    raise ValueError(
        f"compilemask attention: layer {getattr(module, 'layer_idx', '?')} ({kind!r}) attends "
        f"within a sliding window of {window} keys (row i sees keys > i - {window}), and its "
        f"descriptor's mask {desc.mask.name!r} ({how}) is not proven to stay within it"
        f"{' (under torch.compile no combined descriptor is made)' if seqlen_q == seqlen_k else ''}"
        f". Give this layer a descriptor whose mask includes the window, e.g. {DESC_KWARG}="
        f"{{'{kind}': compile_mask(sliding_window({window})).preprocess(meta, seqlen_q=S), "
        f"...}} (one descriptor per layer type; sliding_window from compilemask.masks; a "
        f"custom mask takes the window as a rule, e.g. `and j > i - {window}`)")


_WINDOWED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WINDOWED_LOCK = threading.Lock()  # guards _WINDOWED (threads may share a descriptor)


_WINDOWED_MASKS = CompileCache("windowed_mask")  # (mask key, window) -> the compiled mask


def windowed_mask(mask, window: int):
    """``mask`` with every region's rule also ``j > i - window``, compiled once per (mask key,
    window)."""
    return _WINDOWED_MASKS.get((mask.key, window), lambda: _windowed_mask(mask, window))


def _windowed_mask(mask, window: int):
    def within(visible):
        def visible_in_window(i, j):
            return visible(i, j) and j > i - window
        return visible_in_window

    spec = mask.spec
    return compile_mask(MaskSpec(
        f"{spec.name}_window{window}", params=list(spec.params),
        regions=[Region(r.name, when=r.when, visible=within(r.visible)) for r in spec.regions]))


def windowed_descriptor(desc, window: int):
    """The descriptor of ``desc``'s mask within ``window`` for the same batch: its metadata
    read back from ``desc`` (its params and per-row arrays, on its device: no host sync)."""
    with _WINDOWED_LOCK:
        got = _WINDOWED.setdefault(desc, {}).get(window)
    if got is None:
        mask = desc.mask
        meta = {p: desc.params[:, n] for n, p in enumerate(mask.scalar_params)
                if p in mask.spec.params}
        meta.update({a: desc.row_params[:, :, n] for n, a in enumerate(mask.array_params)
                     if a in mask.spec.params})
        # a table's entries from its words (the padding entries read as the columns past it)
        meta.update({t: unpack_table(desc.row_params[:, :, len(mask.array_params):])
                     for t in mask.table_params})
        got = windowed_mask(mask, window).preprocess(
            meta, desc.seqlen_q, desc.seqlen_k, batch_size=desc.batch_size, device=desc.device)
        with _WINDOWED_LOCK:  # a thread that made it first keeps its descriptor
            got = _WINDOWED.setdefault(desc, {}).setdefault(window, got)
    return got


def _refuse_unproven_window(module, desc, window, seqlen):
    """Under context parallelism the rank's shard descriptor cannot be rebuilt here."""
    if window is not None and seqlen > window and not within_window(desc.mask, window, True):
        raise ValueError(f"compilemask attention: layer {getattr(module, 'layer_idx', '?')} "
                         f"attends within a sliding window of {window} keys and the shard "
                         f"descriptor's mask {desc.mask.name!r} is not proven to stay within it: "
                         f"shard a mask that includes the window (e.g. `and j > i - {window}`)")


# descriptor -> (the attention_mask it was padded for, its version, the padded descriptor): the
# layers of one model call share it (a call's mask is one tensor for all layers of a type)
_PADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PADDED_LOCK = threading.Lock()


def _padded_descriptor(desc, attention_mask):
    """``desc`` for the call's padding (``pipeline.padded``), made once per (descriptor,
    attention_mask); a descriptor with ``q_offset`` -1 (made with ``padding=``, or of chosen
    rows) is the batch's as it is."""
    if isinstance(desc, HeadGroups):
        if desc.folded:
            raise NotImplementedError(
                "compilemask attention: folded per-head masks (HeadGroups, a sequence per batch "
                "and head) with a padded attention_mask; preprocess(..., fold=False) runs it")
        groups = tuple((_padded_descriptor(d, attention_mask), h) for d, h in desc.groups)
        return HeadGroups(groups, desc.num_heads, folded=False)
    if desc.q_offset < 0:
        return desc
    with _PADDED_LOCK:
        got = _PADDED.get(desc)
    if got is not None and got[0]() is attention_mask and got[1] == attention_mask._version:
        return got[2]
    made = padded(desc, attention_mask, name="attention_mask")
    with _PADDED_LOCK:
        _PADDED[desc] = (weakref.ref(attention_mask), attention_mask._version, made)
    return made


def _padded_reference(query, key, value, desc, keep, scaling, deterministic, score_mod=None,
                      sink=None):
    """Under tracing, where no descriptor is made per call: attention with the padded keys
    hidden from every row, the descriptor's dense mask and the padding combined, on the
    reference path only (the GPU engines read the descriptor alone, and a dense mask per layer
    there is what they exist to avoid)."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    _validate(q, k, v, desc)
    if keep.shape != (q.shape[0], k.shape[1]):
        raise ValueError(f"attention_mask: the padding mask is {list(keep.shape)}, the keys "
                         f"[B, Sk] = {[q.shape[0], k.shape[1]]}")
    engine = select_engine(q, desc, "auto", deterministic)
    if engine != "reference":
        raise NotImplementedError(
            f"compilemask attention: the attention_mask has padding, and under torch.compile or "
            f"CUDA-graph capture the {engine!r} engine cannot have its padded descriptor made "
            f"per call: pass {DESC_KWARG}=mask.preprocess(meta, S, padding=attention_mask) "
            "(a descriptor made with padding= is taken as it is), or put the padding in the "
            "mask's metadata and leave attention_mask out. (Without padding an all-ones "
            "attention_mask is dropped before the layers, except under tracing, where it "
            "cannot be looked at: leave it out there.)")
    dense = desc.dense_mask()
    dense = dense & keep.to(dense.device)[:, None, :]
    return attention_reference(q, k, v, dense, softmax_scale=scaling, score_mod=score_mod,
                               learnable_sink=sink)


def _forward(module, query, key, value, attention_mask, dropout, scaling, kwargs, deterministic):
    cp = kwargs.get(CP_KWARG)
    if cp is not None and kwargs.get(DESC_KWARG) is None:
        raise ValueError(f"{CP_KWARG} needs the rank's row-sharded descriptor as well: call the "
                         f"model with {DESC_KWARG}=shard_descriptor(mask, meta, plan, rank)")
    if kwargs.get(MASK_KWARG) is not None:
        desc, dropped = _generation_descriptor(module, kwargs, query, key)
        if dropped:
            # the keys a sliding cache holds, at their positions: the descriptor's keys are the
            # sequence's, and those before the window are hidden from every row (zeros here)
            key, value = (torch.nn.functional.pad(t, (0, 0, dropped, 0)) for t in (key, value))
            if attention_mask is not None and attention_mask.dim() == 2:
                attention_mask = torch.nn.functional.pad(attention_mask, (dropped, 0))
    else:
        desc = _descriptor(module, kwargs.get(DESC_KWARG))
    keep = _key_validity(attention_mask)
    if dropout and getattr(module, "training", True):
        raise NotImplementedError(f"compilemask attention has no attention dropout (the model "
                                  f"asks for {dropout}): set the config's attention_dropout to 0")
    # features that change the scores: better an error than a silently different model
    for name in ("sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"compilemask attention does not support {name!r}")
    score_mod = _softcap(kwargs.get("softcap"))
    sink = kwargs.get("s_aux")  # gpt-oss's per-head sinks
    window = layer_window(module, kwargs)
    if cp is not None:
        plan, group = _cp_arg(cp)
        if keep is not None:
            raise NotImplementedError(
                f"{CP_KWARG}: the attention_mask has padding, and context parallelism reads the "
                f"mask from {DESC_KWARG} alone: put the padding in the mask's rules and metadata "
                "and leave attention_mask out")
        _refuse_unproven_window(module, desc, window, plan.seqlen)
        n = query.shape[2]
        if n != plan.local_len:
            raise ValueError(f"{CP_KWARG}: the model got {n} tokens, the plan gives each rank "
                             f"{plan.local_len} (shard the inputs with shard_inputs)")
        if desc.seqlen_q != n or desc.seqlen_k != plan.seqlen:
            raise ValueError(f"{DESC_KWARG} is for seqlen_q {desc.seqlen_q}, seqlen_k "
                             f"{desc.seqlen_k}; under {CP_KWARG} it must be the rank's "
                             f"shard_descriptor ({n} rows, {plan.seqlen} keys)")
        out = cp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           desc, plan, group, softmax_scale=scaling, deterministic=deterministic,
                           score_mod=score_mod, learnable_sink=sink)
        return out, None
    if isinstance(desc, HeadGroups):  # per-head masks: each group's descriptor as a layer's
        checked = tuple((_check_window(module, d, window, d.seqlen_q, d.seqlen_k), h)
                        for d, h in desc.groups)
        if any(a[0] is not b[0] for a, b in zip(checked, desc.groups)):  # a window combined
            desc = HeadGroups(checked, desc.num_heads, folded=desc.folded)
    elif kwargs.get(MASK_KWARG) is None:  # generation's descriptors include the window
        desc = _check_window(module, desc, window, desc.seqlen_q, desc.seqlen_k)
    if keep is not None:
        if torch.compiler.is_compiling():  # no descriptor is made while tracing
            if isinstance(desc, HeadGroups):
                raise NotImplementedError(
                    "compilemask attention: per-head masks (HeadGroups) with a padded "
                    "attention_mask under torch.compile; run it eagerly, or put the padding in "
                    "the masks' metadata")
            if desc.q_offset < 0:
                keep = None  # made with padding=: the batch's as it is
            else:
                return _padded_reference(query, key, value, desc, keep, scaling,
                                         deterministic, score_mod, sink), None
        else:
            desc = _padded_descriptor(desc, attention_mask)
    # [B, H, S, D] -> [B, S, H, D] as views: the layout cm.attention and FlashAttention take
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), desc,
                    softmax_scale=scaling, deterministic=deterministic, score_mod=score_mod,
                    learnable_sink=sink)
    return out, None


def _softcap(cap):
    """A layer's logit softcapping (Gemma 2) as the score_mod ``cap * tanh(score / cap)``."""
    return None if cap is None else score_mods.softcap(cap)
