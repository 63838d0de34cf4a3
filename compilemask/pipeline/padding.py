"""Padded batches: every sequence's real tokens are one contiguous run of the tensor, its keys
``[lo_b, hi_b)`` (left padding, as for generation, right padding, or both).

Coordinates stay the tensor's, as in FlexAttention: the mask's rules, its metadata and
``q_idx`` / ``kv_idx`` speak of positions in the padded tensor. A padded descriptor is the
mask's with every row's intervals clipped to its sequence's key range and the query rows
outside that range seeing nothing (region -1, empty slots: output 0), its tile bitmaps made
anew from the clipped table. Rows keep their own index, so a fallback region's predicate
(visible iff inside an interval AND the predicate) needs no change: clipping the intervals
clips it. Its ``q_offset`` is -1: the table alone (with the fallback predicates) is the mask,
so neither FA4's native kernels (they take no start offset) nor a mask_mod over the rules
alone run it; the block-sparse engines do.

The key range comes from a ``[B, S]`` bool or 0/1 padding mask (a tokenizer's
``attention_mask``), computed on the mask's device with no host synchronization: the first
real index is an argmax, the count a sum. That the real tokens are one run is checked at once
on the CPU (a ``ValueError`` naming the sequence) and with ``torch._assert_async`` on CUDA
(a device-side assert at a later launch: reading the answer would synchronize).
"""

from __future__ import annotations

import torch

from compilemask.compiler.tiles import bitmaps, visibility_only_slots
from compilemask.contract.descriptor import ExecutionDescriptor, make_descriptor
from compilemask.contract.lru import LRU

__all__ = ["key_range", "clip_rows", "padded_tables"]


def key_range(padding, batch_size: int, seqlen: int, *, device=None,
              name: str = "padding") -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` int64 ``[B]`` on ``device`` (default: the mask's): sequence ``b``'s real
    tokens are positions ``[lo[b], hi[b])`` of the ``[B, seqlen]`` padding mask ``padding``
    (nonzero: a real token); a sequence without any has ``lo == hi == 0``. ``name`` is the
    argument's name in errors."""
    if not isinstance(padding, torch.Tensor):
        raise TypeError(f"{name} must be a bool or 0/1 int tensor [B, S] (True / 1: a real "
                        f"token), got {type(padding).__name__}")
    if padding.is_floating_point() or padding.is_complex():
        raise TypeError(f"{name} must be a bool or 0/1 int tensor [B, S] (True / 1: a real "
                        f"token), got {padding.dtype} (an additive float mask has no "
                        "key-range meaning)")
    if padding.dim() != 2 or tuple(padding.shape) != (batch_size, seqlen):
        raise ValueError(f"{name} must be [B, S] = [{batch_size}, {seqlen}] (one entry per "
                         f"key), got {list(padding.shape)}")
    dev = padding.device if device is None else torch.device(device)
    valid = padding.to(dev) != 0
    count = valid.sum(dim=1)
    lo = torch.where(count > 0, valid.to(torch.int32).argmax(dim=1), 0).to(torch.int64)
    hi = lo + count
    pos = torch.arange(seqlen, device=dev).view(1, -1)
    run = (pos >= lo.view(-1, 1)) & (pos < hi.view(-1, 1))
    broken = (run != valid).any(dim=1)  # a gap inside the real tokens
    what = (f"{name}: the real tokens of every sequence must be one contiguous run (left or "
            "right padding, or both); a sequence has padding between real tokens")
    if dev.type == "cpu":
        if bool(broken.any()):
            b = int(broken.nonzero()[0, 0])
            raise ValueError(f"{what}: sequence {b}, real tokens at "
                             f"{valid[b].nonzero().view(-1).tolist()[:16]}. Pack such "
                             "sequences as documents (the mask's metadata) instead")
    else:
        torch._assert_async(~broken.any(), what)
    return lo, hi


def clip_rows(starts, lens, region, positions, lo, hi):
    """The table ``(starts, lens [B, n, K], region [B, n])`` of rows at ``positions`` (int
    ``[n]`` or ``[B, n]``) with every slot clipped to ``[lo_b, hi_b)`` and the rows outside it
    seeing nothing (empty slots, region -1); int64."""
    lo3, hi3 = lo.view(-1, 1, 1), hi.view(-1, 1, 1)
    starts, lens = starts.to(torch.int64), lens.to(torch.int64)
    s = torch.maximum(starts, lo3)
    e = torch.minimum(starts + lens, hi3)
    pos = positions.to(starts.device)
    pos = pos.view(1, -1) if pos.dim() == 1 else pos
    inside = (pos >= lo.view(-1, 1)) & (pos < hi.view(-1, 1))
    lens = torch.where(inside.unsqueeze(-1), (e - s).clamp(min=0), 0)
    starts = torch.where(lens > 0, s, 0)
    region = torch.where(inside, region.to(torch.int64), -1)
    return starts, lens, region


_SLOTS = LRU(256)  # (mask key, device) -> the over-approximating slots' table there


def _visibility_only(mask, region):
    """``visibility_only_slots`` without a host-to-device copy per call (that would wait for
    the GPU): the slots' table is copied to each device once per mask."""
    if not mask.has_fallback:  # every slot exact
        return torch.zeros(*region.shape, mask.num_intervals, dtype=torch.bool,
                           device=region.device)
    key = (mask.key, str(region.device))
    table = _SLOTS.get(key)
    if table is None:
        probe = torch.arange(-1, len(mask.regions), dtype=torch.int64).view(1, -1)
        table = _SLOTS[key] = visibility_only_slots(mask, probe)[0].to(region.device)
    return table[region + 1]


def padded_tables(desc: ExecutionDescriptor, lo, hi, positions=None,
                  row_start: int = -1) -> ExecutionDescriptor:
    """``desc`` with its rows clipped to the key ranges ``[lo_b, hi_b)`` (module docstring):
    the table clipped, both bitmaps made anew, ``q_offset`` -1; no lists (the caller adds
    them) and no segments. ``positions``: the rows' positions (int ``[Sq]`` or ``[B, Sq]``);
    by default ``q_offset + r`` for row ``r`` (rows 0.. of a square batch, the last rows of a
    served one). A descriptor of chosen rows (``q_offset`` -1) needs them given, and
    ``row_start`` where they are consecutive from one position in every sequence (recorded:
    a score_mod's ``q_idx``)."""
    Sq, Sk = desc.seqlen_q, desc.seqlen_k
    if positions is None and desc.q_offset >= 0:
        row_start = desc.q_offset
    if positions is None:
        if desc.q_offset < 0:
            raise ValueError("padding: this descriptor's rows are at positions it does not "
                             "record (q_offset -1: chosen rows, or already padded); pass the "
                             "padding where it is made (preprocess / rows_descriptor "
                             "padding=)")
        positions = torch.arange(desc.q_offset, desc.q_offset + Sq, device=desc.device)
    lo, hi = lo.to(desc.device).view(-1), hi.to(desc.device).view(-1)
    if lo.numel() != desc.batch_size:
        raise ValueError(f"padding: {lo.numel()} key ranges for a batch of {desc.batch_size}")
    iv = desc.intervals
    starts, lens, region = clip_rows(iv[..., 0], iv[..., 1], desc.row_region, positions, lo, hi)
    always = _visibility_only(desc.mask, region)
    fwd, bwd = bitmaps(starts, lens, always, desc.fwd_tiles, desc.bwd_tiles, Sq, Sk)
    intervals = torch.stack([starts, lens], dim=-1).to(torch.int32).contiguous()
    return make_descriptor(
        desc.mask, Sq, Sk, desc.fwd_tiles, desc.bwd_tiles, intervals=intervals,
        row_region=region.to(torch.int32).contiguous(), fwd_bitmap=fwd, bwd_bitmap=bwd,
        params=desc.params, row_params=desc.row_params, q_offset=-1, meta_max=desc.meta_max,
        seqused_k=desc.seqused_k, seqused_q=desc.seqused_q, positions=desc.positions,
        key_params=desc.key_params, row_start=row_start if row_start >= 0 else desc.row_start)
