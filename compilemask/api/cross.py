"""Cross-attention shapes: queries and keys of different sequences (text attending image tokens,
Flamingo-style), whose per-token metadata have their own lengths.

``cross_descriptor(mask, meta, seqlen_q, seqlen_k)`` takes each per-token array at its own
length: one the rules read at the key ``j`` covers at least ``seqlen_k`` tokens, one read at
the row ``i`` at least ``seqlen_q`` (one read at both, the longer); a FlexAttention
``mask_mod``'s ``from_mask_mod`` metadata, as captured, is such a dict. The arrays are brought
to the common length the descriptor is made for (entries past what a rule reads are never read),
so nothing is padded by hand.

With ``seqlen_q >= seqlen_k`` the descriptor is the batch's ``preprocess`` at ``seqlen_q``
rows. With fewer queries than keys and arrays read at ``j`` it is the descriptor of rows
``0..seqlen_q-1`` of a ``seqlen_k``-token sequence (``pipeline.rows``, as a served chunk's):
every array at ``seqlen_k`` entries, so that a rule's reads at any key are its own, and a
fallback predicate reads keys' arrays through ``key_params``.
"""

from __future__ import annotations

import torch

from compilemask.contract.descriptor import DEFAULT_BWD_TILES, DEFAULT_FWD_TILES
from compilemask.pipeline.compiled import CompiledMask
from compilemask.pipeline.rows import rows_descriptor

__all__ = ["cross_descriptor"]


def _lengths(mask, seqlen_q: int, seqlen_k: int) -> dict:
    """The tokens each per-token param must cover: ``seqlen_k`` for one a rule reads at ``j``,
    ``seqlen_q`` for the others (read at ``i``)."""
    keyed = set(mask.key_indexed_arrays)
    need = {a: seqlen_k if a in keyed else seqlen_q for a in mask.array_params}
    need.update({t: seqlen_q for t in mask.table_params})  # a table's entries are per row
    return need


def _fitted(mask, meta, seqlen_q: int, seqlen_k: int, length: int) -> dict:
    """``meta`` with every per-token array and table at ``length`` tokens: cut, or padded with
    zeros past what any rule reads; each checked to cover what its rules read."""
    out = dict(meta or {})
    for name, n in _lengths(mask, seqlen_q, seqlen_k).items():
        v = out.get(name)
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            continue  # preprocess names what is wrong with it
        axis = v.dim() - 2 if name in mask.table_params else v.dim() - 1
        if v.shape[axis] < n:
            what = "the key j (seqlen_k" if n == seqlen_k and name in mask.key_indexed_arrays \
                else "the row i (seqlen_q"
            raise ValueError(f"cross_descriptor: param {name!r} is read at {what} = {n}) and "
                             f"covers {v.shape[axis]} tokens; give it at least {n}")
        if v.shape[axis] > length:
            v = v.narrow(axis, 0, length)
        elif v.shape[axis] < length:
            pad = [0, 0] * (v.dim() - 1 - axis) + [0, length - v.shape[axis]]
            v = torch.nn.functional.pad(v, pad)
        out[name] = v
    return out


def cross_descriptor(mask, meta, seqlen_q: int, seqlen_k: int, *,
                     batch_size: int | None = None, device=None, fwd_tiles=DEFAULT_FWD_TILES,
                     bwd_tiles=DEFAULT_BWD_TILES, check: bool = False, backend: str = "auto"):
    """The descriptor of ``seqlen_q`` queries against ``seqlen_k`` keys of another sequence,
    row ``i`` and key ``j`` as the rules read them, with each per-token array at its own length
    (see the module docstring). Equal to the rules evaluated at every ``(i, j)``."""
    if not isinstance(mask, CompiledMask):
        raise TypeError(f"cross_descriptor: mask must be a compile_mask(...) result, got "
                        f"{type(mask).__name__}")
    for name, val in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"cross_descriptor: {name} must be a positive int, got {val!r}")
    if seqlen_q < seqlen_k and mask.key_indexed_arrays:
        # the keys' arrays are longer than the rows': rows 0.. of a seqlen_k-token sequence
        meta = _fitted(mask, meta, seqlen_q, seqlen_k, seqlen_k)
        return rows_descriptor(mask, meta, seqlen_k, torch.arange(seqlen_q),
                               batch_size=batch_size, fwd_tiles=fwd_tiles, bwd_tiles=bwd_tiles,
                               check=check, device=device, who="cross_descriptor",
                               backend=backend, q_offset=0)
    return mask.preprocess(_fitted(mask, meta, seqlen_q, seqlen_k, seqlen_q), seqlen_q, seqlen_k,
                           batch_size=batch_size, fwd_tiles=fwd_tiles, bwd_tiles=bwd_tiles,
                           check=check, device=device, backend=backend)
