"""The masks a TorchTitan config names, and how each reads its metadata from a batch.

A TorchTitan batch is ``(input_dict, labels)``: ``input_dict["input"]`` the tokens ``[B, S]``,
``input_dict["positions"]`` (restarting at 0 where a packed sequence starts, as TorchTitan's
document masks read them) and, for masks with metadata, extra fields the dataset yields. Each
``MaskSource`` turns ``(positions, fields)`` into the compiled mask's metadata with tensor ops on
the batch's device (no host synchronization), and gives the same mask as a FlexAttention
``mask_mod`` for the Flex baseline.

Names (``CompileMaskAttention.Config.mask``; options in ``mask_options``):

* ``"causal"``; ``"block_causal"`` / ``"documents"``: causal within each packed document (the
  documents from ``positions``; TorchTitan calls this mask block-causal);
* ``"hstu"``: packed HSTU sequences (documents from ``positions``), each with its history and
  target metadata: fields ``hist_end``, ``ctx_end`` (optional, default 0) and ``group_size``,
  int ``[B, N]`` per sequence of the row (offsets from the sequence's start; padded past a row's
  last sequence) or ``[B]``;
* ``"hstu_row"``: one HSTU sequence per row (``masks.hstu``): fields ``ctx_end``,
  ``hist_end``, ``seq_end``, ``group_size`` ``[B]`` (its Flex mask_mod reads 1-D per-row
  values only, which FlexAttention's FLASH backend translates);
* ``"shared_prompt_rm"``: fields ``prompt_end``, ``r1_end`` .. ``r6_end`` ``[B]``;
* ``"clear"``: fields ``text_end``, ``img_rows`` ``[B]``; options ``radius``, ``width``;
* ``"prefix_lm"``: field ``prefix_len`` ``[B]``;
* ``"pkg.module:NAME"``: a ``MaskSpec``, a function of no arguments returning one, or a
  FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` (converted by ``cm.from_mask_mod``). A spec's
  params are read from batch fields of the same names (``[B]`` or per-row ``[B, S]``);
  ``doc_start`` / ``seq_start`` / ``seq_end`` not in the batch come from ``positions``.

Data for each: ``documents``/``block_causal`` and ``hstu`` read packed sequences
(``packed.PackedSequences``); the others take one sequence per row, and ``MaskSource.rows``
draws a row's fields for ``rows.RowSequences`` (the mask module's at-scale metadata where it
has one, else its random metadata; None for a spec whose metadata only the user's data has).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from compilemask import masks as cm_masks
from compilemask.dsl import MaskSpec
from compilemask.dsl.flex import from_mask_mod
from compilemask.dsl.packing import packed_hstu_spec
from compilemask.masks.shared_prompt_rm import ENDS as RM_ENDS

__all__ = ["MaskSource", "resolve_mask", "document_bounds", "MASK_NAMES"]

MASK_NAMES = ("causal", "block_causal", "documents", "hstu", "hstu_row", "shared_prompt_rm",
              "clear", "prefix_lm")


def document_bounds(positions: torch.Tensor):
    """Each row's packed document from ``positions [B, S]`` restarting at 0 (TorchTitan's rule;
    row 0 always starts one): ``(local_id, start, end)``, int64 ``[B, S]`` (``local_id`` counts
    the row's documents from 0; ``[start, end)`` the document's rows). Tensor ops only."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        raise ValueError("positions must be an int tensor [B, S] (restarting at 0 where a "
                         f"document starts), got {getattr(positions, 'shape', positions)!r}")
    B, S = positions.shape
    starts = positions == 0
    starts[:, 0] = True
    rows = torch.arange(S, device=positions.device, dtype=torch.int64).expand(B, S)
    local_id = torch.cumsum(starts.to(torch.int64), dim=1) - 1
    start = torch.cummax(torch.where(starts, rows, 0), dim=1).values
    nxt = torch.where(starts, rows, S)
    nxt = torch.cat([nxt[:, 1:], torch.full_like(nxt[:, :1], S)], dim=1)
    end = torch.flip(torch.cummin(torch.flip(nxt, [1]), dim=1).values, [1])
    return local_id, start, end


def _per_seq(value: torch.Tensor, local_id: torch.Tensor, name: str) -> torch.Tensor:
    """A per-sequence field ``[B, N]`` (or ``[B]``: one value per row) read at each row's
    sequence, ``[B, S]``; rows past the field's N read its last entry."""
    if (not isinstance(value, torch.Tensor) or value.is_floating_point()
            or value.dim() not in (1, 2)):
        raise ValueError(f"batch field {name!r} must be an int tensor [B, N] (one value per "
                         f"packed sequence) or [B], got {getattr(value, 'shape', value)!r}")
    v = value.to(device=local_id.device, dtype=torch.int64)
    if v.dim() == 1:
        return v.view(-1, 1).expand(local_id.shape)
    return torch.gather(v, 1, local_id.clamp(max=v.shape[1] - 1))


def _need(fields: Mapping, names, mask: str) -> None:
    missing = [n for n in names if n not in fields]
    if missing:
        raise KeyError(f"mask {mask!r} reads batch field(s) {missing}; the dataset must yield "
                       f"them in input_dict (got {sorted(fields)})")


@dataclass(frozen=True, eq=False)
class MaskSource:
    """A named mask: its ``spec``, the batch fields it reads (``fields``, required, and
    ``optional``), ``meta(positions, fields)`` -> the compiled mask's metadata, and
    ``flex(positions, fields)`` -> the same mask as a FlexAttention mask_mod (None where there
    is none)."""

    name: str
    spec: MaskSpec
    meta_fn: Callable
    flex_fn: Callable | None = None
    fields: tuple = ()
    optional: tuple = field(default=())
    rows: Callable | None = None
    """``rows(seqlen, seed)`` -> the fields of one row holding one sequence (``[1]`` int32
    tensors); None where the mask reads packed sequences or only the user's data has them."""

    def meta(self, positions: torch.Tensor, fields: Mapping) -> dict:
        _need(fields, self.fields, self.name)
        return self.meta_fn(positions, fields)

    def flex(self, positions: torch.Tensor, fields: Mapping):
        if self.flex_fn is None:
            raise NotImplementedError(f"mask {self.name!r} has no FlexAttention mask_mod")
        _need(fields, self.fields, self.name)
        return self.flex_fn(positions, fields)


# ---- built-in masks ----------------------------------------------------------------------

def _causal_flex(positions, fields):
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return causal


def _documents_meta(positions, fields):
    return {"doc_start": document_bounds(positions)[1]}


def _documents_flex(positions, fields):
    return cm_masks.flex_mask_mod(cm_masks.packed_documents(), _documents_meta(positions, fields))


def _hstu_meta(positions, fields):
    local_id, start, end = document_bounds(positions)

    def at(name, default=0):
        if name not in fields:
            return torch.full_like(start, default)
        return _per_seq(fields[name], local_id, name)

    size = at("group_size")
    # a position past its sequence never reaches the next one
    ctx = torch.minimum(start + at("ctx_end").clamp(min=0), end)
    hist = torch.minimum(start + at("hist_end").clamp(min=0), end)
    i = torch.arange(start.shape[1], device=start.device, dtype=torch.int64)
    # rows before the history end use no group; the sequence start keeps them in range
    group = hist + torch.div(i - hist, size.clamp(min=1), rounding_mode="floor") * size
    group_start = torch.where(i >= hist, group, start)
    return {"seq_start": start, "ctx_end": ctx, "hist_end": hist, "seq_end": end,
            "group_start": group_start}


def _hstu_flex(positions, fields):
    m = _hstu_meta(positions, fields)
    s, c, hi, e, g = (m[k] for k in ("seq_start", "ctx_end", "hist_end", "seq_end",
                                     "group_start"))

    def packed_hstu(b, h, q_idx, kv_idx):
        start, hist = s[b, q_idx], hi[b, q_idx]
        context = (q_idx < c[b, q_idx]) & (kv_idx >= start) & (kv_idx < hist)
        history = (q_idx >= c[b, q_idx]) & (q_idx < hist) & (kv_idx >= start) & (kv_idx <= q_idx)
        target = (q_idx >= hist) & (q_idx < e[b, q_idx]) & (
            ((kv_idx >= start) & (kv_idx < hist)) | ((kv_idx >= g[b, q_idx]) & (kv_idx <= q_idx)))
        return context | history | target
    return packed_hstu


def _row_fields(names):
    def meta(positions, fields):
        return {n: fields[n].to(positions.device).view(-1) for n in names}
    return meta


def _recipe_flex(spec, names):
    def flex(positions, fields):
        meta = _row_fields(names)(positions, fields)
        return cm_masks.flex_mask_mod(spec, meta, positions.shape[1])
    return flex


def _builtin(name: str, options: Mapping) -> MaskSource:
    opts = dict(options)

    def no_options():
        if opts:
            raise ValueError(f"mask {name!r} takes no mask_options, got {sorted(opts)}")

    if name == "causal":
        no_options()
        return MaskSource(name, cm_masks.causal(), lambda p, f: {}, _causal_flex,
                          rows=_no_fields)
    if name in ("block_causal", "documents"):
        no_options()
        return MaskSource(name, cm_masks.packed_documents(), _documents_meta, _documents_flex)
    if name == "hstu":
        no_options()
        return MaskSource(name, packed_hstu_spec(), _hstu_meta, _hstu_flex,
                          fields=("hist_end", "group_size"), optional=("ctx_end",))
    if name == "hstu_row":
        no_options()
        spec = cm_masks.hstu()
        names = ("ctx_end", "hist_end", "seq_end", "group_size")
        return MaskSource(name, spec, _row_fields(names), _recipe_flex(spec, names), fields=names,
                          rows=_bench_rows(spec))
    if name == "shared_prompt_rm":
        no_options()
        spec = cm_masks.shared_prompt_rm()
        ends = tuple(RM_ENDS)
        return MaskSource(name, spec, _row_fields(ends), _recipe_flex(spec, ends), fields=ends,
                          rows=_bench_rows(spec))
    if name == "clear":
        unknown = set(opts) - {"radius", "width"}
        if unknown:
            raise ValueError(f"mask 'clear' takes mask_options radius, width; got "
                             f"{sorted(unknown)}")
        spec = cm_masks.clear(int(opts.get("radius", 1)), int(opts.get("width", 16)))
        names = ("text_end", "img_rows")
        return MaskSource(name, spec, _row_fields(names), _recipe_flex(spec, names), fields=names,
                          rows=_bench_rows(spec))
    if name == "prefix_lm":
        no_options()
        spec = cm_masks.prefix_lm()
        names = ("prefix_len",)
        return MaskSource(name, spec, _row_fields(names), _recipe_flex(spec, names), fields=names,
                          rows=_prefix_rows)
    raise AssertionError(name)


def _no_fields(seqlen: int, seed: int) -> dict:
    return {}


def _bench_rows(spec: MaskSpec):
    """The mask module's at-scale metadata (``bench_meta``), else its random metadata (edge
    cases included), for one row; None for a spec no factory of ``compilemask.masks`` made."""
    try:
        recipes = cm_masks.recipes_for(spec)
    except KeyError:
        return None

    def rows(seqlen: int, seed: int) -> dict:
        if recipes.bench_meta is not None:
            meta = recipes.bench_meta(1, seqlen, seed)
        else:
            meta = recipes.random_meta(1, seqlen, torch.Generator().manual_seed(seed))
        return {k: v.to(torch.int32) for k, v in meta.items()}
    return rows


def _prefix_rows(seqlen: int, seed: int) -> dict:
    """A prefix of S/8 to S/2 tokens (a prompt before the continuation it conditions)."""
    g = torch.Generator().manual_seed(seed)
    lo = max(seqlen // 8, 1)
    return {"prefix_len": torch.randint(lo, max(seqlen // 2, lo) + 1, (1,), generator=g,
                                        dtype=torch.int32)}


# ---- masks by import path ------------------------------------------------------------------

def _import(path: str):
    mod, _, attr = path.partition(":")
    if not mod or not attr:
        raise ValueError(f"mask {path!r}: name a built-in mask {MASK_NAMES} or an import path "
                         "'pkg.module:NAME' (a MaskSpec, a function returning one, or a "
                         "FlexAttention mask_mod)")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _positional_arity(fn) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _from_path(path: str, options: Mapping) -> MaskSource:
    obj = _import(path)
    if callable(obj) and not isinstance(obj, MaskSpec) and _positional_arity(obj) != 4:
        obj = obj(**dict(options))  # a factory: its options are its keyword arguments
    elif options:
        raise ValueError(f"mask {path!r} is not a factory; mask_options {sorted(options)} "
                         "have nothing to go to")
    if isinstance(obj, MaskSpec):
        return _spec_source(path, obj)
    if callable(obj) and _positional_arity(obj) == 4:
        spec, const = from_mask_mod(obj)
        # the tensors it captured are the metadata of every batch (expanded to its size)
        return MaskSource(path, spec, _const_meta(const), lambda p, f, mm=obj: mm,
                          rows=_no_fields)
    raise TypeError(f"mask {path!r} is a {type(obj).__name__}: expected a MaskSpec, a function "
                    "of no arguments returning one, or a FlexAttention mask_mod(b, h, q_idx, "
                    "kv_idx)")


def _const_meta(const):
    def meta(positions, fields):
        B = positions.shape[0]
        out = {}
        for k, v in const.items():
            if isinstance(v, torch.Tensor):
                v = v.to(positions.device)
                out[k] = v.expand(B, *v.shape[1:]) if v.dim() and v.shape[0] == 1 else v
            else:
                out[k] = v
        return out
    return meta


def _spec_source(name: str, spec: MaskSpec) -> MaskSource:
    params = tuple(spec.params)
    derived = {"doc_start": 1, "seq_start": 1, "seq_end": 2}
    required = tuple(p for p in params if p not in derived)

    def meta(positions, fields):
        out, bounds = {}, None
        for p in params:
            if p in fields:
                v = fields[p].to(positions.device)
                out[p] = v
            else:
                bounds = document_bounds(positions) if bounds is None else bounds
                out[p] = bounds[derived[p]]
        return out
    rows = None  # documents from positions read packed data
    if not any(p in derived for p in params):
        rows = _bench_rows(spec) if required else _no_fields
    return MaskSource(name, spec, meta, None, fields=required, rows=rows)


@functools.lru_cache(maxsize=64)  # a job names a few masks; each entry holds its compiled spec
def _resolve(name: str, options: tuple) -> MaskSource:
    if name in MASK_NAMES:
        return _builtin(name, dict(options))
    return _from_path(name, dict(options))


def resolve_mask(name: str, options: Mapping | None = None) -> MaskSource:
    """The ``MaskSource`` of a mask name (see the module docstring); cached by name and
    options, so the spec (and its compiled mask) is made once per process."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"mask must be a non-empty str, got {name!r}")
    return _resolve(name, tuple(sorted(dict(options or {}).items())))
