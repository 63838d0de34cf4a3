"""CompileMask as a transformers attention implementation.

    from compilemask.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())
    out = model(input_ids, labels=labels, compilemask_desc=desc)     # desc: one per batch

The model's forward passes unknown keyword arguments down to its attention function (the
``**kwargs`` of transformers' attention interface), so the descriptor travels with the call: one
``ExecutionDescriptor`` for every layer, or a dict keyed by layer type (``"full_attention"``,
``"sliding_attention"``, ...) for models whose layers attend differently. The mask comes only from
the descriptor: transformers builds no mask for an implementation it has no mask function for,
so a 2-D padding ``attention_mask`` is dropped before it gets here (put padding in the mask's
metadata, e.g. HSTU's ``seq_end``), and a 4-D one is refused.

Context parallelism: with ``compilemask_cp=(plan, group)`` (a ``compilemask.distributed``
plan and the process group, ``None`` for the world) every layer runs ``cp_attention`` on the
rank's shard of the sequence; the descriptor is the rank's ``shard_descriptor``. The rest of the
model is per token, so feeding it the rank's tokens with their global positions is exact::

    ids_l, pos_l = shard_inputs(input_ids, plan, rank)
    out = model(ids_l, position_ids=pos_l, compilemask_desc=desc_l, compilemask_cp=(plan, group))

``out.logits`` are the rank's rows (``cp.unshard`` of every rank's puts them back in order).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from compilemask.api import attention
from compilemask.descriptor import ExecutionDescriptor
from compilemask.distributed import CPPlan, cp_attention, shard

__all__ = ["register", "attention_forward", "attention_forward_deterministic", "layer_type",
           "shard_inputs", "DESC_KWARG", "CP_KWARG"]

DESC_KWARG = "compilemask_desc"
CP_KWARG = "compilemask_cp"


def register(name: str = "compilemask", *, deterministic: bool = False) -> str:
    """Register CompileMask with ``transformers.AttentionInterface`` under ``name``; returns
    ``name``, for ``attn_implementation=``. ``deterministic``: as in ``cm.attention``."""
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("compilemask.integrations.transformers needs transformers: "
                          "pip install -e \".[hf]\"") from e
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    fn = attention_forward_deterministic if deterministic else attention_forward
    AttentionInterface.register(name, fn)
    return name


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
    if isinstance(desc, ExecutionDescriptor):
        return desc
    raise TypeError(f"{DESC_KWARG} must be an ExecutionDescriptor or a dict of them keyed by "
                    f"layer type, got {type(desc).__name__}")


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
    raise TypeError(f"{CP_KWARG} must be (plan, group) with a compilemask.distributed.CPPlan "
                    f"(or the plan alone for the default group), got {type(cp).__name__}")


def _forward(module, query, key, value, attention_mask, dropout, scaling, kwargs, deterministic):
    cp = kwargs.get(CP_KWARG)
    if cp is not None and kwargs.get(DESC_KWARG) is None:
        raise ValueError(f"{CP_KWARG} needs the rank's row-sharded descriptor as well: call the "
                         f"model with {DESC_KWARG}=shard_descriptor(mask, meta, plan, rank)")
    desc = _descriptor(module, kwargs.get(DESC_KWARG))
    if attention_mask is not None:
        raise ValueError("compilemask attention takes its mask from compilemask_desc; got an "
                         f"attention_mask of shape {list(attention_mask.shape)} as well (leave it "
                         "out, or put it in the mask's rules)")
    if dropout and getattr(module, "training", True):
        raise NotImplementedError(f"compilemask attention has no attention dropout (the model "
                                  f"asks for {dropout}): set the config's attention_dropout to 0")
    # features that change the scores: better an error than a silently different model
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"compilemask attention does not support {name!r}")
    if cp is not None:
        plan, group = _cp_arg(cp)
        n = query.shape[2]
        if n != plan.local_len:
            raise ValueError(f"{CP_KWARG}: the model got {n} tokens, the plan gives each rank "
                             f"{plan.local_len} (shard the inputs with shard_inputs)")
        if desc.seqlen_q != n or desc.seqlen_k != plan.seqlen:
            raise ValueError(f"{DESC_KWARG} is for seqlen_q {desc.seqlen_q}, seqlen_k "
                             f"{desc.seqlen_k}; under {CP_KWARG} it must be the rank's "
                             f"shard_descriptor ({n} rows, {plan.seqlen} keys)")
        out = cp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           desc, plan, group, softmax_scale=scaling, deterministic=deterministic)
        return out, None
    # [B, H, S, D] -> [B, S, H, D] as views: the layout cm.attention and FlashAttention take
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), desc,
                    softmax_scale=scaling, deterministic=deterministic)
    return out, None
