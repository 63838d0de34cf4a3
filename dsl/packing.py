"""Packed inputs: several sequences in one row, as FlashAttention varlen and transformers pack them.

A packing is given either as ``cu_seqlens`` (int ``[N + 1]``, FlashAttention's cumulative
sequence lengths, starting at 0; one packed row) or as ``position_ids`` (``[B, S]`` or ``[S]``,
restarting at 0 where a sequence starts; a sequence starts wherever a position is not its
predecessor's plus one, the rule transformers uses to detect packing). Per-sequence metadata
(``[N]`` tensors, or ints shared by all sequences) become the per-row ``[B, S]`` arrays of a
packed MaskSpec, whose rules subscript them by ``i``.

Everything here is torch ops on the inputs' device, without host synchronization (no ``.item()``,
no Python loop over sequences), so it runs inside a compiled or graph-captured training step.
``cu_seqlens`` on the CPU is checked in eager mode (free there); on CUDA it is not (reading it
would synchronize every step).

    meta = packed_hstu_meta(hist_end=h, group_size=g, cu_seqlens=cu, seqlen=S)   # h, g: [N]
    desc = cm.compile_mask(packed_hstu_spec()).preprocess(meta, seqlen_q=S)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from compilemask.dsl import MaskSpec, Region

__all__ = ["sequence_bounds", "packed_meta", "packed_hstu_spec", "packed_hstu_meta"]


def sequence_bounds(cu_seqlens: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, seqlen: int | None = None):
    """Each row's packed sequence: ``(seq_id, seq_start, seq_end)``, int64 ``[B, S]``.

    ``seq_id`` counts sequences from 0 over the whole batch (row-major for ``position_ids
    [B, S]``: it indexes the ``[N]`` metadata); ``[seq_start, seq_end)`` are the rows of the
    row's sequence. With ``cu_seqlens`` (B = 1) ``seqlen`` is the packed length S and is required
    (``cu_seqlens[-1]`` is on the device); rows at or past ``cu_seqlens[-1]`` are padding, with
    ``seq_start = seq_end = cu_seqlens[-1]`` and ``seq_id = N`` (one past the last sequence).
    ``cu_seqlens`` must start at 0, never decrease and end at most at ``seqlen`` (checked where it
    is on the CPU, see the module docstring)."""
    if (cu_seqlens is None) == (position_ids is None):
        raise ValueError("give exactly one of cu_seqlens or position_ids")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
                cu_seqlens.shape[0] < 2 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be an int tensor [N + 1] with N >= 1")
        if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1:
            raise ValueError(f"cu_seqlens needs seqlen, the packed length (a positive int), "
                             f"got {seqlen!r}")
        cu = cu_seqlens.to(torch.int64).contiguous()
        if cu.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_cu_seqlens(cu, seqlen)
        n = cu.shape[0] - 1
        rows = torch.arange(seqlen, device=cu.device, dtype=torch.int64)
        seq_id = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, n)
        # one more bound equal to the last: padding rows get an empty sequence at the end
        bounds = torch.cat([cu, cu[-1:]])
        return (seq_id.unsqueeze(0), bounds[seq_id].unsqueeze(0),
                bounds[seq_id + 1].unsqueeze(0))
    pos = position_ids
    if not isinstance(pos, torch.Tensor) or pos.dim() not in (1, 2) or pos.is_floating_point():
        raise ValueError("position_ids must be an int tensor [S] or [B, S]")
    pos = pos.to(torch.int64)
    pos = pos.unsqueeze(0) if pos.dim() == 1 else pos
    B, S = pos.shape
    if seqlen is not None and seqlen != S:
        raise ValueError(f"seqlen {seqlen} != position_ids length {S}")
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    rows = torch.arange(S, device=pos.device, dtype=torch.int64).expand(B, S)
    seq_id = torch.cumsum(starts.reshape(-1), 0).reshape(B, S) - 1
    seq_start = torch.cummax(torch.where(starts, rows, 0), dim=1).values
    # the next start after each row (S if none): a suffix minimum
    nxt = torch.where(starts, rows, S)
    nxt = torch.cat([nxt[:, 1:], torch.full_like(nxt[:, :1], S)], dim=1)
    seq_end = torch.flip(torch.cummin(torch.flip(nxt, [1]), dim=1).values, [1])
    return seq_id, seq_start, seq_end


def _check_cu_seqlens(cu: torch.Tensor, seqlen: int) -> None:
    """Host ``cu_seqlens``: 0 first, non-decreasing, at most ``seqlen``. Read on the CPU only,
    and not while compiling: on CUDA the check would synchronize every training step."""
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {int(cu[0])}")
    drop = (cu[1:] < cu[:-1]).nonzero().view(-1)
    if drop.numel():
        k = int(drop[0])
        raise ValueError(f"cu_seqlens must be non-decreasing: cu_seqlens[{k + 1}] = "
                         f"{int(cu[k + 1])} < cu_seqlens[{k}] = {int(cu[k])}")
    if int(cu[-1]) > seqlen:
        raise ValueError(f"cu_seqlens[-1] = {int(cu[-1])} exceeds seqlen ({seqlen}), the packed "
                         "length")


def _per_row(value, seq_id, n_seq, name):
    """A per-sequence value ([N] tensor or int) read at each row's sequence."""
    dev = seq_id.device
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value.to(device=dev, dtype=torch.int64).expand(seq_id.shape)
        if value.dim() != 1 or value.is_floating_point():
            raise ValueError(f"{name}: per-sequence metadata must be an int tensor [N] or an "
                             f"int, got shape {list(value.shape)} dtype {value.dtype}")
        if n_seq is not None and value.shape[0] != n_seq:
            raise ValueError(f"{name}: {value.shape[0]} per-sequence values, cu_seqlens has "
                             f"{n_seq} sequences")
        idx = seq_id if n_seq is None else seq_id.clamp(max=n_seq - 1)  # padding: the last one
        return value.to(device=dev, dtype=torch.int64)[idx]
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.full(seq_id.shape, value, dtype=torch.int64, device=dev)
    raise TypeError(f"{name}: expected an int tensor [N] or an int, got {type(value).__name__}")


def packed_meta(meta: Mapping | None = None, *, positions: Iterable[str] = (),
                values: Iterable[str] = (), cu_seqlens: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, seqlen: int | None = None) -> dict:
    """Per-sequence metadata -> per-row arrays of a packed MaskSpec, int64 ``[B, S]``.

    Returns ``seq_start`` and ``seq_end`` (each row's packed sequence, see ``sequence_bounds``)
    and every entry of ``meta``: the names in ``positions`` are offsets from their sequence's
    start (``hist_end``, ``prefix_len``, ...) and come back as absolute positions, clamped to the
    sequence's ``[seq_start, seq_end]`` so that a value past a sequence's end never reaches the
    next one (no row of the sequence compares differently); the names in ``values`` (sizes,
    counts) are copied to each row. Every key of ``meta`` must be in exactly one of the two.
    Padding rows (past ``cu_seqlens[-1]``) get positions equal to ``seq_start`` and the last
    sequence's values. For ``masks.packed_documents`` pass ``seq_start`` as ``doc_start``.

    What padding rows see is the mask's: a mask bounded by ``seq_end`` (``packed_hstu_spec``)
    shows them nothing; ``masks.packed_documents`` and ``masks.packed_prefix_lm`` (no end bound)
    make the padding one more document, causal over the padding keys only. Real rows never see
    padding keys either way, and the padding stays a segment, so FA4's varlen path still runs
    ``packed_documents`` (a row seeing nothing is no segment: ``compilemask.compiler.native``)."""
    meta = dict(meta or {})
    positions, values = set(positions), set(values)
    both = positions & values
    if both:
        raise ValueError(f"names both in positions and values: {sorted(both)}")
    unsorted = [k for k in meta if k not in positions and k not in values]
    if unsorted:
        raise ValueError(f"say whether {unsorted} are positions (shifted to absolute) or "
                         f"values (copied): pass positions=[...] or values=[...]")
    clash = [k for k in meta if k in ("seq_start", "seq_end")]
    if clash:
        raise ValueError(f"{clash}: seq_start and seq_end come from the packing")
    seq_id, seq_start, seq_end = sequence_bounds(cu_seqlens, position_ids, seqlen)
    n_seq = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else None
    out = {"seq_start": seq_start, "seq_end": seq_end}
    for name, v in meta.items():
        row = _per_row(v, seq_id, n_seq, name)
        if name in positions:
            row = torch.minimum(torch.maximum(seq_start + row, seq_start), seq_end)
        out[name] = row
    return out


def packed_hstu_spec() -> MaskSpec:
    """HSTU (``masks.hstu``) over packed sequences, every param a per-row array: a row of a
    sequence ``[seq_start[i], seq_end)`` is context (``i < ctx_end[i]``: sees the context and
    the history), history (``i < hist_end[i]``: causal from the sequence start) or target
    (``i < seq_end[i]``: the context and history plus its own group causally, from
    ``group_start[i]``). The group start is a per-row array because the rules divide only by
    constants and scalar params; ``packed_hstu_meta`` computes it from each sequence's group
    size."""

    def when_context(i):
        return i < ctx_end[i]  # noqa: F821 (per-row params)

    def context_sees(i, j):
        return seq_start[i] <= j < hist_end[i]  # noqa: F821

    def when_history(i):
        return ctx_end[i] <= i < hist_end[i]  # noqa: F821

    def history_sees(i, j):
        return seq_start[i] <= j <= i  # noqa: F821

    def when_target(i):
        return hist_end[i] <= i < seq_end[i]  # noqa: F821

    def target_sees(i, j):
        return seq_start[i] <= j < hist_end[i] or group_start[i] <= j <= i  # noqa: F821

    return MaskSpec("packed_hstu",
                    params=["seq_start", "ctx_end", "hist_end", "seq_end", "group_start"],
                    regions=[
                        Region("context", when=when_context, visible=context_sees),
                        Region("history", when=when_history, visible=history_sees),
                        Region("target", when=when_target, visible=target_sees),
                    ])


def packed_hstu_meta(*, hist_end, group_size, ctx_end=0, seq_end=None,
                     cu_seqlens: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None,
                     seqlen: int | None = None) -> dict:
    """The per-row arrays of ``packed_hstu_spec`` from per-sequence HSTU metadata.

    ``ctx_end``, ``hist_end`` and ``seq_end`` are offsets from each sequence's start, as in
    ``masks.hstu`` for that sequence alone (``seq_end`` defaults to the packed sequence's
    length; rows after it see nothing); ``group_size`` must be positive. Each is an ``[N]``
    tensor or an int shared by all sequences."""
    meta = {"ctx_end": ctx_end, "hist_end": hist_end, "group_size": group_size}
    if seq_end is not None:
        meta["target_end"] = seq_end  # "seq_end" of packed_meta is the packed sequence's end
    rows = packed_meta(meta, positions=("ctx_end", "hist_end", "target_end"),
                       values=("group_size",), cu_seqlens=cu_seqlens,
                       position_ids=position_ids, seqlen=seqlen)
    start, hist, size = rows["seq_start"], rows["hist_end"], rows["group_size"]
    end = rows["seq_end"] if seq_end is None else rows["target_end"]
    i = torch.arange(start.shape[1], device=start.device, dtype=torch.int64)
    # rows before the history end use no group; the sequence start keeps them in range
    group = hist + torch.div(i - hist, size, rounding_mode="floor") * size
    group_start = torch.where(i >= hist, group, start)
    return {"seq_start": start, "ctx_end": rows["ctx_end"], "hist_end": hist, "seq_end": end,
            "group_start": group_start}
