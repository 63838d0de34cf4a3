"""The ``compilemask::attention_*`` ops' contract: what crosses the op boundary, by name.

A call crosses as three typed groups, each one ``NamedTuple`` whose fields generate the ops'
schemas (:func:`schema_of`), so a field added to a group reaches both ops, their fake
implementations, the autograd formula and every reader:

* ``compilemask.contract.descriptor.DescriptorArgs``: the descriptor's core tensors and static ints;
* :class:`OpSlots`: every optional per-batch tensor as a named slot (``None`` where the call
  has none): a segments pattern's ``cu_seqlens``, the forward and backward block-sparse lists,
  the column table, a served batch's ``seqused_k`` / ``seqused_q`` / ``cu_seqlens_q`` /
  ``cu_seqlens_k`` / ``page_table``, the score_mod's tables and the learnable sink; a new slot
  (a padding mask, say) is one more field here;
* :class:`OpSettings`: the call's settings, frozen: the mask's and the score_mod's keys, the
  scale, the engine, the kernels' options.

Masks and score_mods cross as their semantic keys (custom ops take tensors and scalars only);
the ops find them in ``compilemask.contract.cache.MASKS`` / ``SCORE_MODS``, whose lifetime is
documented there (weak references plus an LRU of the last 256 registered).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compilemask.contract.cache import SCORE_MODS, mask_for_key, register_mask
from compilemask.contract.descriptor import BlockSparseLists, DescriptorArgs
from compilemask.contract.log import say_once

__all__ = ["OpSlots", "OpSettings", "schema_of", "args_schema", "op_args", "unpack",
           "register_mask", "mask_for_key", "score_mod_for_key", "fake_outputs", "LIST_SLOTS"]

# a field's annotation (text: this module postpones them) -> its schema type
_SCHEMA_TYPES = {"Optional[Tensor]": "Tensor?", "list[Tensor]": "Tensor[]", "SymInt": "SymInt",
                 "int": "int", "float": "float", "bool": "bool", "str": "str"}
SymInt = int  # an int the compiler may keep symbolic (a batch's longest segment)


def _annotation(cls, field: str) -> str:
    """A field's annotation as text (a string, or a ForwardRef to one)."""
    ann = cls.__annotations__[field]
    return getattr(ann, "__forward_arg__", ann)


def schema_of(cls) -> str:
    """``cls``'s fields as a ``torch.library`` schema fragment, from their annotations."""
    out = []
    for f in cls._fields:
        text = _annotation(cls, f)
        if text not in _SCHEMA_TYPES:
            raise TypeError(f"{cls.__name__}.{f}: annotation {text!r} has no schema type "
                            f"(one of {sorted(_SCHEMA_TYPES)})")
        out.append(f"{_SCHEMA_TYPES[text]} {f}")
    return ", ".join(out)


# the block-sparse list slots of each direction, in BlockSparseLists order
LIST_SLOTS = {d: tuple(f"{d}_{f}" for f in BlockSparseLists._fields) for d in ("fwd", "bwd")}


class OpSlots(NamedTuple):
    """The call's optional per-batch tensors, each in its named slot (None: absent)."""

    # a segments pattern's offsets over the batch's B * Sq rows (native engine), and its
    # longest segment (``ExecutionDescriptor.segments``)
    cu_seqlens: Optional[Tensor] = None
    max_seqlen: SymInt = 0
    # FA4's forward lists (q tiles x kv tiles) and backward lists (kv tiles x q tiles), fa4
    fwd_mask_cnt: Optional[Tensor] = None
    fwd_mask_idx: Optional[Tensor] = None
    fwd_full_cnt: Optional[Tensor] = None
    fwd_full_idx: Optional[Tensor] = None
    bwd_mask_cnt: Optional[Tensor] = None
    bwd_mask_idx: Optional[Tensor] = None
    bwd_full_cnt: Optional[Tensor] = None
    bwd_full_idx: Optional[Tensor] = None
    # the column view (``ExecutionDescriptor.columns``), which FA4's backward reads
    columns: Optional[Tensor] = None
    # a served batch (``compilemask.api.serving``), FA4's length arguments: keys per request (a
    # paged cache's), queries per request (the descriptor's), the packed queries' and keys'
    # offsets, the page table
    seqused_k: Optional[Tensor] = None
    seqused_q: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    page_table: Optional[Tensor] = None
    # a descriptor of chosen rows of a mask with fallback regions: its rows' positions and the
    # sequence's per-position arrays, which its predicates read (``ExecutionDescriptor``)
    positions: Optional[Tensor] = None
    key_params: Optional[Tensor] = None
    # the score_mod's tables as the kernels read them, and the learnable sink logit per head
    score_aux: list[Tensor] = []  # noqa: RUF012 (never mutated: a schema default)
    sink: Optional[Tensor] = None

    @classmethod
    def of(cls, desc, engine: str, head_dim: int, score_aux=(), sink=None,
           **served) -> OpSlots:
        """The slots of a call of ``engine``: the fa4 engine's lists (its backward's for
        ``head_dim``) and column view, a native segments pattern's offsets; ``served``: a
        served batch's slots by name."""
        kw = dict(served, score_aux=list(score_aux), sink=sink, positions=desc.positions,
                  key_params=desc.key_params)
        if engine == "fa4" and not served:
            if (desc.lists is None and desc.device.type == "cuda"
                    and not torch.compiler.is_compiling()):
                say_once(f"cm.attention: the fa4 engine builds mask {desc.mask.name!r}'s tile "
                         "lists in every call: its producer wrote none (a mask proved native "
                         "gets them only where the native engine cannot run the batch); "
                         "compilemask.pipeline.pipeline.with_lists(desc) writes them once")
            bwd = desc.block_sparse("bwd64" if head_dim == 128 else "bwd128")
            kw.update(zip(LIST_SLOTS["fwd"], desc.block_sparse("fwd")))
            kw.update(zip(LIST_SLOTS["bwd"], bwd))
            kw["columns"] = desc.columns
        elif engine == "native" and desc.segments is not None:
            kw.update(cu_seqlens=desc.segments[0], max_seqlen=int(desc.segments[1]))
        return cls(**kw)

    def lists(self, backward: bool) -> BlockSparseLists | None:
        """The forward or backward lists, or None where the call carries none."""
        got = [getattr(self, f) for f in LIST_SLOTS["bwd" if backward else "fwd"]]
        return None if got[0] is None else BlockSparseLists(*got)

    @property
    def served(self) -> bool:
        """A served batch (paged keys or packed requests): ``serving``'s forward."""
        return self.page_table is not None or self.cu_seqlens_k is not None

    def served_lengths(self, seqlen_q: int, seqlen_k: int) -> dict:
        """FA4's length arguments of a served call."""
        kw = {}
        if self.cu_seqlens_q is not None:
            kw.update(cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=seqlen_q)
        if self.page_table is not None:
            kw.update(seqused_k=self.seqused_k, page_table=self.page_table)
        else:
            kw.update(cu_seqlens_k=self.cu_seqlens_k, max_seqlen_k=seqlen_k)
        return kw

    def descriptor(self, d: DescriptorArgs, mask):
        """The descriptor the op reads: ``d``'s core with these slots' descriptor fields."""
        segments = None if self.cu_seqlens is None else (self.cu_seqlens, self.max_seqlen)
        return d.descriptor(mask, segments, columns=self.columns, seqused_k=self.seqused_k,
                            seqused_q=self.seqused_q, positions=self.positions,
                            key_params=self.key_params)

    # autograd keeps the tensors (saved for backward) apart from the structure (on ctx)
    def tensors(self) -> list:
        out = []
        for v in self:
            if isinstance(v, Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(v)
        return out

    def structure(self) -> tuple:
        """Per field: None (absent), "t" (a tensor), a list's length, or the int."""
        return tuple("t" if isinstance(v, Tensor) else len(v) if isinstance(v, (list, tuple))
                     else (v if f == "max_seqlen" else None)
                     for f, v in zip(self._fields, self))

    @classmethod
    def rebuild(cls, structure: tuple, tensors) -> OpSlots:
        it = iter(tensors)
        vals = []
        for f, s in zip(cls._fields, structure):
            if f == "max_seqlen":
                vals.append(s)
            elif s == "t":
                vals.append(next(it))
            elif _annotation(cls, f) == "list[Tensor]":
                vals.append([next(it) for _ in range(s)])
            else:
                vals.append(None)
        return cls(*vals)

    def grads(self, dsink, dtables=(), train: tuple = ()) -> tuple:
        """One gradient per slot: None (a list's a list of them) but the sink's ``dsink`` and
        the score_mod's tables at positions ``train``, ``dtables`` in that order."""
        got = dict(zip(train, dtables))
        return tuple([got.get(n) for n in range(len(v))] if f == "score_aux"
                     else [None] * len(v) if isinstance(v, (list, tuple))
                     else (dsink if f == "sink" and v is not None else None)
                     for f, v in zip(self._fields, self))


class OpSettings(NamedTuple):
    """The call's settings (frozen): what the op does with its tensors."""

    mask_key: str  # the CompiledMask's semantic key (``MASKS``)
    softmax_scale: float
    deterministic: bool
    engine: str  # "cute", "fa4", "native" or "reference" (``kernels.dispatch``)
    options: str  # the kernels' ``KernelOptions.to_str()`` ("" for the defaults)
    score_mod: str  # the converted score_mod's key (``SCORE_MODS``; "" for none)
    heads: int  # > 1: the descriptor's sequences are (batch, head) pairs, head-major per batch
    # bit n: the score_mod's table n takes a gradient (the backward adds into a float32 buffer
    # per such table, ``docs/decisions/trainable-score-tables.md``)
    train_tables: int = 0

    def trained(self) -> tuple:
        """The positions of the score_mod's tables that take a gradient."""
        return tuple(n for n in range(self.train_tables.bit_length())
                     if self.train_tables >> n & 1)


def unpack(args) -> tuple[DescriptorArgs, OpSlots, OpSettings]:
    """An op's arguments past its own tensors: the descriptor's, the slots', the settings'."""
    n, m = len(DescriptorArgs._fields), len(OpSlots._fields)
    return (DescriptorArgs.from_op_args(args), OpSlots(*args[n:n + m]),
            OpSettings(*args[n + m:n + m + len(OpSettings._fields)]))


def op_args(d: DescriptorArgs, slots: OpSlots, settings: OpSettings) -> tuple:
    """The op's arguments past its own tensors, in schema order."""
    return (*d.to_op_args(), *slots, *settings)


def args_schema() -> str:
    """The schema fragment of :func:`op_args`."""
    return ", ".join((DescriptorArgs.schema(), schema_of(OpSlots), schema_of(OpSettings)))


def score_mod_for_key(key: str):
    """The converted score_mod of a key (``SCORE_MODS``; the conversion registers it)."""
    return SCORE_MODS.get(key)


def fake_outputs(q: Tensor, slots: OpSlots):
    """The forward's (out, lse) shapes: ``lse [B, H, Sq]``, or ``[H, total_q]`` for packed
    queries (a served batch's ``[total_q, H, D]``)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.dim() == 3:
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=acc)
    B, Sq, H, _ = q.shape
    return out, q.new_empty((B, H, Sq), dtype=acc)
