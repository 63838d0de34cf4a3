"""Per-head masks: one compiled mask per group of heads (per-head windows, DuoAttention-style
retrieval heads next to streaming heads).

``preprocess_heads(head_masks, meta, seqlen_q)`` takes one ``CompiledMask`` per query head;
heads whose masks have the same semantic key share one descriptor (heads with equal rules
share intervals, lists and the native dispatch), so ``[causal] * 6 + [sink_window] * 2`` is
two preprocesses, whatever the head count. ``cm.attention(q, k, v, groups)`` runs each group's
heads through its descriptor's engine (the native path for a proven group, FA4's lists for the
others) and puts the outputs back in head order; with GQA a group that holds every query head
of its kv heads keeps GQA, otherwise its kv heads are gathered per query head.
``groups.dense_mask()`` is ``[B, H, Sq, Sk]``.

Every mask reads the same metadata dict (each takes the params it names), or each head its
own (``from_mask_mod_heads``' metas). Heads that share one compiled mask with metadata of their
own are *folded* by default: one descriptor of ``B * H`` sequences, sequence ``b * H + h``
holding head ``h`` of batch ``b``, and one FA4 launch over every head with per-head tile lists
(FlexAttention's own structure for a per-head BlockMask), instead of a launch per group: per-head
windows train 1.08-1.10x Flex-FA4's kernel folded, 0.96-1.03x as four native groups (H200,
``docs/performance.md``). ``fold=False`` keeps a descriptor per group (the native and cute
engines, deterministic backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compilemask.compiler.reference import descriptor_dense_mask
from compilemask.contract.descriptor import ExecutionDescriptor
from compilemask.contract.lru import LRU
from compilemask.pipeline.pipeline import DEFAULT_CONFIG, with_lists

__all__ = ["HeadGroups", "preprocess_heads"]

_HEAD_AXIS = {"scalar": (2, "[B, H]"), "array": (3, "[B, H, Sq]"), "table": (4, "[B, H, Sq, M]")}


def _kind(mask, p: str) -> str:
    return ("table" if p in mask.table_params else "array" if p in mask.array_params
            else "scalar")


def head_count(mask, meta, num_heads) -> int | None:
    """The head count of a per-head preprocess: ``num_heads`` (None for a mask of every head),
    checked against the metadata's head axes (a scalar param ``[B, H]``, an array ``[B, H,
    Sq]``, a table ``[B, H, Sq, M]``). The count is never inferred from a shape: a ``[B, Sq]``
    tensor passed for a scalar by mistake would read as Sq heads; it stays a shape error."""
    if num_heads is not None and (not isinstance(num_heads, int) or isinstance(num_heads, bool)
                                  or num_heads < 1):
        raise ValueError(f"preprocess: num_heads must be a positive int, got {num_heads!r}")
    h = mask.head_param
    if h is not None and meta and h in meta:
        if num_heads is not None:
            raise ValueError(f"preprocess: mask {mask.name!r} reads the head index {h!r}, which "
                             f"num_heads={num_heads} sets per head; leave {h!r} out of the "
                             "metadata")
        return None  # one head's descriptor, at the head the caller chose
    if h is not None and num_heads is None:
        raise ValueError(f"preprocess: mask {mask.name!r} reads the head index {h!r}: pass "
                         f"num_heads=H (or meta[{h!r}] = a head for that head's descriptor)")
    if num_heads is None:
        return None
    for p, v in (meta or {}).items():
        if p not in mask.spec.params or not isinstance(v, torch.Tensor):
            continue
        ndim, shape = _HEAD_AXIS[_kind(mask, p)]
        if v.dim() == ndim and v.shape[1] != num_heads:
            raise ValueError(f"preprocess: num_heads={num_heads}, but param {p!r} (a value per "
                             f"head is {shape}) has {v.shape[1]} heads: {list(v.shape)}")
    return num_heads


def per_head_meta(mask, meta, heads: int) -> list[dict]:
    """Each head's metadata: params with a head axis sliced at the head (views), the others
    as given, the head index param set to the head."""
    metas = []
    for h in range(heads):
        own = {}
        for p, v in (meta or {}).items():
            ndim, _ = _HEAD_AXIS[_kind(mask, p)] if p in mask.spec.params else (None, None)
            own[p] = v[:, h] if isinstance(v, torch.Tensor) and v.dim() == ndim else v
        if mask.head_param is not None:
            own[mask.head_param] = h
        metas.append(own)
    return metas


_INDICES = LRU(256)  # (groups' heads, G, device) -> index tensors, shared by HeadGroups


@dataclass(frozen=True)
class HeadGroups:
    """Descriptors by group of query heads: ``groups[g] = (desc, heads)``, heads ascending,
    every head of ``range(num_heads)`` in exactly one group."""

    groups: tuple
    num_heads: int
    folded: bool = False  # one group, its descriptor a sequence per (batch, head)

    def __post_init__(self):
        seen = sorted(h for _, heads in self.groups for h in heads)
        if seen != list(range(self.num_heads)):
            raise ValueError(f"HeadGroups: the groups' heads {seen} are not each of "
                             f"0..{self.num_heads - 1} once")
        for _, heads in self.groups:
            if list(heads) != sorted(heads):  # a group's kv heads pair with them in order
                raise ValueError(f"HeadGroups: a group's heads {tuple(heads)} are not "
                                 "ascending")
        first = self.groups[0][0]
        for desc, _ in self.groups:
            if not isinstance(desc, ExecutionDescriptor):
                raise TypeError(f"HeadGroups: a group's descriptor is a "
                                f"{type(desc).__name__}, not an ExecutionDescriptor")
            if (desc.batch_size, desc.seqlen_q, desc.seqlen_k) != (
                    first.batch_size, first.seqlen_q, first.seqlen_k):
                raise ValueError("HeadGroups: the groups' descriptors disagree on batch size or "
                                 "lengths")
        if self.folded and (len(self.groups) != 1 or first.batch_size % self.num_heads):
            raise ValueError("HeadGroups: folded heads are one group whose descriptor holds "
                             "batch x heads sequences")

    def indices(self, G: int, device) -> tuple:
        """Per group ``(q heads, kv heads)`` as index tensors on ``device``, and the inverse
        order of the concatenated groups: computed on the host from the head tuples and made
        once per (grouping, G, device) for every ``HeadGroups`` of that grouping (a host list
        to a GPU tensor synchronizes), so a batch's new groups neither synchronize nor copy."""
        key = (tuple(heads for _, heads in self.groups), G, str(device))
        got = _INDICES.get(key)
        if got is None:
            per, order = [], []
            for _, heads in self.groups:
                kv = [h // G for h in heads]
                whole = sorted(set(kv))
                # every query head of these kv heads: still GQA; else gathered per query head
                kv = whole if len(heads) == len(whole) * G else kv
                per.append((torch.tensor(heads, device=device), torch.tensor(kv, device=device)))
                order += list(heads)
            inv = [0] * self.num_heads
            for pos, h in enumerate(order):
                inv[h] = pos
            got = (per, torch.tensor(inv, device=device))
            _INDICES[key] = got
        return got

    def split_sizes(self, G: int):
        """``(q head counts, kv head counts)`` per group when the groups are consecutive runs of
        heads in order, each holding whole kv heads: the heads then split into views (no
        copies; the backward one concatenation), else None."""
        q_sizes, kv_sizes, nxt = [], [], 0
        for _, heads in self.groups:
            if heads != tuple(range(nxt, nxt + len(heads))) or nxt % G or len(heads) % G:
                return None
            q_sizes.append(len(heads))
            kv_sizes.append(len(heads) // G)
            nxt += len(heads)
        return q_sizes, kv_sizes

    @property
    def seqlen_q(self) -> int:
        return self.groups[0][0].seqlen_q

    @property
    def seqlen_k(self) -> int:
        return self.groups[0][0].seqlen_k

    @property
    def batch_size(self) -> int:
        B = self.groups[0][0].batch_size
        return B // self.num_heads if self.folded else B

    def dense_mask(self) -> torch.Tensor:
        """bool ``[B, H, Sq, Sk]``."""
        first = self.groups[0][0]
        if self.folded:
            return descriptor_dense_mask(first, self.num_heads)
        out = torch.zeros(first.batch_size, self.num_heads, first.seqlen_q, first.seqlen_k,
                          dtype=torch.bool, device=first.device)
        for desc, heads in self.groups:
            out[:, list(heads)] = desc.dense_mask().unsqueeze(1)
        return out

    def explain(self) -> str:
        if self.folded:
            desc = self.groups[0][0]
            return (f"heads {list(range(self.num_heads))} folded: mask {desc.mask.name!r} (key "
                    f"{desc.mask.key}), a sequence per (batch, head), one launch")
        return "\n".join(f"heads {list(heads)}: mask {desc.mask.name!r} (key {desc.mask.key})"
                         for desc, heads in self.groups)


def preprocess_heads(head_masks, meta=None, seqlen_q: int | None = None,
                     seqlen_k: int | None = None, *, fold: bool | None = None,
                     **kwargs) -> HeadGroups:
    """One mask per query head -> ``HeadGroups`` (one ``preprocess`` per distinct mask and
    metadata, with ``kwargs`` as ``CompiledMask.preprocess`` takes them). ``meta``: one dict
    every mask reads, or a list of one per head (``from_mask_mod_heads``' metas); heads with
    the same mask that read the same tensors share a descriptor. Where every head has the same
    compiled mask and their metadata differ, the heads are folded (``fold=None``, the default,
    or True): one descriptor of a sequence per (batch, head) and one launch for all heads (the
    fa4 engine; see the module docstring); ``fold=False``: a descriptor per group."""
    head_masks = list(head_masks)
    if not head_masks:
        raise ValueError("preprocess_heads: head_masks is empty (one mask per query head)")
    for h, m in enumerate(head_masks):
        if not (callable(getattr(m, "normalize_meta", None)) and hasattr(m, "key")):
            raise TypeError(f"preprocess_heads: head {h}'s mask is a {type(m).__name__}, not a "
                            "compile_mask(...) result")
    if isinstance(meta, (list, tuple)):
        if len(meta) != len(head_masks):
            raise ValueError(f"preprocess_heads: meta is a list of {len(meta)}, the heads "
                             f"{len(head_masks)} (one dict per head, or one dict for all)")
        metas = list(meta)
    else:
        metas = [meta] * len(head_masks)
    by_key: dict = {}
    owns = [{p: mh[p] for p in m.spec.params} if mh else {}
            for m, mh in zip(head_masks, metas)]
    for h, (m, own) in enumerate(zip(head_masks, owns)):
        # the same tensors, or equal ints: per-head selections are views of their own
        read = tuple((p, ("t", v.data_ptr(), v.shape, v.stride(), v.dtype)
                      if isinstance(v, torch.Tensor) else ("v", v)) for p, v in own.items())
        by_key.setdefault((m.key, read), (m, own, []))[2].append(h)
    if fold not in (None, True, False):
        raise TypeError(f"preprocess_heads: fold must be None, True or False, got {fold!r}")
    if (fold is not False and len(by_key) > 1
            and len({m.key for m, _, _ in by_key.values()}) == 1):
        return _folded(head_masks[0], owns, seqlen_q, seqlen_k, kwargs)
    groups = []
    for m, own, heads in by_key.values():
        groups.append((m.preprocess(own or None, seqlen_q, seqlen_k, **kwargs), tuple(heads)))
    return HeadGroups(tuple(groups), len(head_masks))


def _folded(mask, metas, seqlen_q, seqlen_k, kwargs) -> HeadGroups:
    """Every head's metadata stacked into one batch of ``B * H`` sequences (``b * H + h``),
    preprocessed once."""
    if seqlen_q is None:
        raise ValueError("preprocess_heads: seqlen_q is required")
    Sk = seqlen_q if seqlen_k is None else seqlen_k
    H = len(metas)
    batch_size = kwargs.pop("batch_size", None)
    device = kwargs.get("device")
    per = [mask.normalize_meta(m or None, seqlen_q, Sk, batch_size, device, check_values=False)
           for m in metas]
    B = max(b for b, *_ in per)
    if any(b not in (1, B) for b, *_ in per):
        raise ValueError(f"preprocess_heads: the heads' metadata give batch sizes "
                         f"{sorted({b for b, *_ in per})}")
    stacked = {}
    for p in mask.spec.params:
        got = [scal[p] if p in scal else arrs[p] for _, scal, arrs, _ in per]
        vals = [v.expand(B, *v.shape[1:]) for v in got]
        if p in mask.table_params:  # entries past a head's table read False either way
            M = max(v.shape[-1] for v in vals)
            vals = [torch.nn.functional.pad(v.to(torch.uint8), (0, M - v.shape[-1]))
                    for v in vals]
        v = torch.stack(vals, dim=1)  # [B, H, ...]
        v = v.reshape(B * H, *v.shape[2:])
        stacked[p] = v.reshape(B * H) if p in mask.scalar_params else v
    desc = mask.preprocess(stacked or None, seqlen_q, Sk, batch_size=B * H, **kwargs)
    # folded heads run on FA4's lists even where the mask is native (a native kernel takes one
    # pattern for every head): made with the descriptor, not per call
    if desc.lists is None:
        desc = with_lists(desc, kwargs.get("config") or DEFAULT_CONFIG)
    return HeadGroups(((desc, tuple(range(H))),), H, folded=True)


def _global_heads(score_mod, heads):
    """``score_mod`` seeing the model's head index where a group's call has its own."""
    if score_mod is None:
        return None
    at = heads

    def per_group(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, at[h], q_idx, kv_idx)

    return per_group


def attention_heads(attention, q, k, v, groups: HeadGroups, return_lse: bool, score_mod=None,
                    learnable_sink=None, **kwargs):
    """``attention`` (``cm.attention``) per group of heads, outputs in head order; a score_mod
    sees the model's head index, a learnable sink is taken per head."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    if H != groups.num_heads:
        raise ValueError(f"cm.attention: q has {H} heads, the HeadGroups {groups.num_heads}")
    if H % Hkv:
        raise ValueError(f"cm.attention: {H} query heads are not a multiple of {Hkv} kv heads")
    G = H // Hkv
    sizes = groups.split_sizes(G)
    if sizes is not None and score_mod is None and learnable_sink is None:
        per, inv = [(None, None)] * len(groups.groups), None  # views need no index tensors
    else:
        per, inv = groups.indices(G, q.device)
    heads = [idx for idx, _ in per]
    if sizes is not None:  # consecutive runs: views in, one concatenation out, no reordering
        qs, ks, vs = q.split(sizes[0], 2), k.split(sizes[1], 2), v.split(sizes[1], 2)
        inv = None
    else:
        qs = [q.index_select(2, idx) for idx in heads]
        ks = [k.index_select(2, kv_idx) for _, kv_idx in per]
        vs = [v.index_select(2, kv_idx) for _, kv_idx in per]
    if learnable_sink is not None and (not isinstance(learnable_sink, torch.Tensor)
                                       or learnable_sink.shape != (H,)):
        raise ValueError(f"learnable_sink must be [H] = [{H}], got "
                         f"{list(getattr(learnable_sink, 'shape', [type(learnable_sink)]))}")
    outs, lses = [], []
    for (desc, _), qg, kg, vg, idx in zip(groups.groups, qs, ks, vs, heads):
        sink = None if learnable_sink is None else learnable_sink.index_select(
            0, idx.to(learnable_sink.device))
        res = attention(qg, kg, vg, desc, return_lse=True,
                        score_mod=_global_heads(score_mod, idx), learnable_sink=sink, **kwargs)
        outs.append(res[0])
        lses.append(res[1])
    out = torch.cat(outs, dim=2)
    lse = torch.cat(lses, dim=1)
    if inv is not None:
        out, lse = out.index_select(2, inv), lse.index_select(1, inv)
    return (out, lse) if return_lse else out
