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
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from compilemask.api import attention
from compilemask.descriptor import ExecutionDescriptor

__all__ = ["register", "attention_forward", "attention_forward_deterministic", "layer_type",
           "DESC_KWARG"]

DESC_KWARG = "compilemask_desc"


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


def _forward(module, query, key, value, attention_mask, dropout, scaling, kwargs, deterministic):
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
    # [B, H, S, D] -> [B, S, H, D] as views: the layout cm.attention and FlashAttention take
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), desc,
                    softmax_scale=scaling, deterministic=deterministic)
    return out, None
