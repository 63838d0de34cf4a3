"""Context parallelism: one long sequence sharded by q tiles across a group of W ranks.

Each rank owns the q rows of some q tiles (and the K/V rows of the same tiles). Per layer,
``cp_attention`` all-gathers K/V over the group, puts the gathered rows back into global order
and runs ``cm.attention`` of the rank's q rows against all keys, driven by a row-sharded
descriptor; the backward reduce-scatters dK/dV to the ranks that own the rows.

A *plan* assigns q tiles to ranks:

* ``"balanced"``: every q tile's work is the number of visible (q, k) pairs of its rows, summed
  over the slots' interval lengths and over the batch (slots the compiler could not prove
  disjoint count twice where they overlap; padding rows count 0). Tiles are sorted by work on the
  device and dealt in snake order (rank 0..W-1, then W-1..0, ...), a vectorized stand-in for
  greedy longest-first: on the paper's masks at 32K tokens both are within 0.2 % of perfect
  (``bench/cp_balance.py``);
* ``"head_tail"``: the load-balanced causal sharding (rank r gets chunks r and 2W-1-r of 2W
  contiguous chunks of tiles), the baseline.

Every rank gets the same number of q tiles: the tile sequence is padded with tiles past the
sequence (and the last real tile may be partial); padding rows are zeros in ``shard``, see
nothing in the descriptor and are dropped by ``unshard``. A rank's rows are its tiles in
ascending order, concatenated: local row r is global row ``plan.rows[rank, r]``.

Usage (one process per rank, ``torch.distributed`` initialised)::

    plan = make_plan(mask, meta, seqlen=S, world_size=W)         # same on every rank
    desc = shard_descriptor(mask, meta, plan, rank)              # this rank's q rows, all keys
    q_l, k_l, v_l = (shard(t, plan, rank) for t in (q, k, v))    # [B, n_local, H, D]
    out_l = cp_attention(q_l, k_l, v_l, desc, plan, group)       # autograd-capable
    out = unshard(parts, plan)          # parts: every rank's out_l (e.g. dist.all_gather)

The plan and the descriptor are built with tensor ops on the metadata's device; nothing here
synchronizes with the device except ``CPPlan.balance()`` (it returns a Python float) and the
value checks that ``check=True`` (or CPU metadata) asks for. K/V travel through the functional
collectives (``torch.distributed._functional_collectives``: an all-gather, a reduce-scatter in
its backward, traceable by ``torch.compile``), so the same code runs on gloo and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compilemask.api.api import attention
from compilemask.contract.descriptor import ExecutionDescriptor
from compilemask.pipeline.compiled import DEFAULT_BWD_TILES, DEFAULT_FWD_TILES
from compilemask.pipeline.rows import normalized, rows_descriptor, rows_table

__all__ = ["CPPlan", "make_plan", "shard_descriptor", "shard", "unshard", "cp_attention",
           "PLAN_KINDS", "rows_descriptor"]

PLAN_KINDS = ("balanced", "head_tail")


@dataclass(frozen=True, eq=False)
class CPPlan:
    """Which q tiles (and rows) each rank of a context-parallel group owns.

    ``tiles`` int64 ``[W, T]``: global q tile ids per rank, ascending; ``rows`` int64
    ``[W, T * tile]``: their global rows (``>= seqlen``: padding); ``inverse`` int64
    ``[seqlen]``: where global row g lies in the ranks' local rows concatenated (rank-major);
    ``tile_work`` int64 ``[n_tiles]`` the work per tile of the padded tile sequence and ``work``
    int64 ``[W]`` per rank (visible pairs, see the module docstring)."""

    kind: str
    seqlen: int
    world_size: int
    tile: int
    tiles: torch.Tensor
    rows: torch.Tensor
    inverse: torch.Tensor
    tile_work: torch.Tensor
    work: torch.Tensor

    @property
    def tiles_per_rank(self) -> int:
        return self.tiles.shape[1]

    @property
    def local_len(self) -> int:
        """Rows per rank (padding included): the local sequence length of q, k, v."""
        return self.rows.shape[1]

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def balance(self) -> float:
        """max / mean work over the ranks (1.0 is perfect); synchronizes with the device."""
        w = self.work.to(torch.float64)
        return float(w.max() / w.mean().clamp_min(1e-30))

    def to(self, device) -> CPPlan:
        return CPPlan(self.kind, self.seqlen, self.world_size, self.tile,
                      *(t.to(device) for t in (self.tiles, self.rows, self.inverse,
                                               self.tile_work, self.work)))


# ---- plans ------------------------------------------------------------------------------------

def make_plan(mask, meta, seqlen: int, world_size: int, kind: str = "balanced", tile: int = 128,
              *, batch_size: int | None = None, check: bool = False) -> CPPlan:
    """The sharding plan of a ``seqlen``-token self-attention over ``world_size`` ranks (see the
    module docstring); computed on the metadata's device, identically on every rank."""
    if kind not in PLAN_KINDS:
        raise ValueError(f"make_plan: kind must be one of {PLAN_KINDS}, got {kind!r}")
    for name, val in (("seqlen", seqlen), ("world_size", world_size), ("tile", tile)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"make_plan: {name} must be a positive int, got {val!r}")
    B, scal, arrs, dev = normalized(mask, meta, seqlen, batch_size, check)
    n_real = -(-seqlen // tile)
    chunks = world_size if kind == "balanced" else 2 * world_size
    n_tiles = -(-n_real // chunks) * chunks
    per_rank = n_tiles // world_size
    rows_all = torch.arange(n_tiles * tile, device=dev, dtype=torch.int64)
    _, lens, _, _ = rows_table(mask, B, scal, arrs, seqlen, rows_all)
    tile_work = lens.sum(dim=(0, 2)).view(n_tiles, tile).sum(dim=1)
    if kind == "balanced":
        order = torch.argsort(tile_work, descending=True, stable=True)
        deal = order.view(per_rank, world_size)
        # snake: odd rounds go W-1..0, so a heavy round's first rank gets the next round's light
        deal = torch.where((torch.arange(per_rank, device=dev) % 2 == 1).view(-1, 1),
                           deal.flip(1), deal)
        tiles = deal.t().sort(dim=1).values
    else:
        chunk = n_tiles // chunks
        ids = torch.arange(n_tiles, device=dev, dtype=torch.int64).view(chunks, chunk)
        r = torch.arange(world_size, device=dev)
        tiles = torch.cat([ids[r], ids[chunks - 1 - r]], dim=1)
    tiles = tiles.contiguous()
    rows = (tiles.unsqueeze(-1) * tile
            + torch.arange(tile, device=dev, dtype=torch.int64)).reshape(world_size, -1)
    inverse = torch.empty(n_tiles * tile, device=dev, dtype=torch.int64)
    inverse[rows.reshape(-1)] = torch.arange(rows.numel(), device=dev, dtype=torch.int64)
    work = tile_work[tiles].sum(dim=1)
    return CPPlan(kind, seqlen, world_size, tile, tiles, rows, inverse[:seqlen].contiguous(),
                  tile_work, work)


# ---- row-sharded descriptors -----------------------------------------------------------------

def shard_descriptor(mask, meta, plan: CPPlan, rank: int, *, batch_size: int | None = None,
                     fwd_tiles=DEFAULT_FWD_TILES, bwd_tiles=DEFAULT_BWD_TILES,
                     check: bool = False, padding=None) -> ExecutionDescriptor:
    """The descriptor of rank ``rank``'s q rows (``plan.rows[rank]``, in that order) against
    all ``plan.seqlen`` keys: the generated torch interval table evaluated at those global rows
    only, per-row metadata gathered at them, and both bitmaps recomputed for the local row set
    (``seqlen_q = plan.local_len``). Padding rows see nothing.

    Built with the torch preprocess on the metadata's device; a TileLang preprocess for a row
    list is not written yet. A mask with fallback regions gets the rows' global positions and
    the sequence's arrays (``ExecutionDescriptor.positions`` / ``key_params``), which its
    predicates read (fa4 and reference engines; the cute engine refuses it). The descriptor
    carries no segments (FA4's varlen path needs rows in global order). ``padding``: a bool or
    0/1 ``[B, seqlen]`` mask of the real tokens of the whole sequence, one contiguous run per
    sequence (``compilemask.pipeline.padding``). Made by ``compilemask.pipeline.rows``."""
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"shard_descriptor: rank {rank} is not in [0, {plan.world_size})")
    return rows_descriptor(mask, meta, plan.seqlen, plan.rows[rank], batch_size=batch_size,
                           fwd_tiles=fwd_tiles, bwd_tiles=bwd_tiles, check=check,
                           padding=padding)


# ---- tensors ----------------------------------------------------------------------------------

def shard(x: torch.Tensor, plan: CPPlan, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a ``[B, S, ...]`` tensor: ``[B, plan.local_len, ...]``, zeros in
    padding rows (differentiable)."""
    if x.shape[1] != plan.seqlen:
        raise ValueError(f"shard: dim 1 of x is {x.shape[1]}, the plan is for {plan.seqlen}")
    rows = plan.rows[rank].to(x.device)
    valid = (rows < plan.seqlen).view((1, -1) + (1,) * (x.dim() - 2))
    picked = x.index_select(1, rows.clamp(max=plan.seqlen - 1))
    return torch.where(valid, picked, torch.zeros((), dtype=x.dtype, device=x.device))


def unshard(parts, plan: CPPlan) -> torch.Tensor:
    """The global ``[B, S, ...]`` tensor from every rank's part (a list in rank order, e.g. from
    an all_gather, or their concatenation along dim 1); differentiable."""
    cat = torch.cat(list(parts), dim=1) if not isinstance(parts, torch.Tensor) else parts
    if cat.shape[1] != plan.world_size * plan.local_len:
        raise ValueError(f"unshard: {cat.shape[1]} rows, the plan has "
                         f"{plan.world_size} x {plan.local_len}")
    return cat.index_select(1, plan.inverse.to(cat.device))


# ---- attention ---------------------------------------------------------------------------------

def _gather_global(x, plan, group):
    """All-gather a rank-local ``[B, n, ...]`` tensor to the global ``[B, S, ...]``. Autograd:
    the backward reduce-scatters, so each rank receives the summed gradient of its own rows."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    # all_gather_single has autograd from torch 2.13; all_gather_tensor_autograd before that
    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    # rows first: the gather concatenates along dim 0, i.e. the ranks' rows in rank order
    rows = gather(x.transpose(0, 1).contiguous(), 0, dist.group.WORLD if group is None else group)
    return rows.index_select(0, plan.inverse.to(x.device)).transpose(0, 1)


def cp_attention(q_local, k_local, v_local, desc_local: ExecutionDescriptor, plan: CPPlan,
                 group=None, *, softmax_scale: float | None = None, return_lse: bool = False,
                 deterministic: bool = False, backend: str = "auto", score_mod=None,
                 learnable_sink=None):
    """Context-parallel ``cm.attention`` on one rank of ``group`` (default: the world).

    ``q_local, k_local, v_local``: this rank's rows ``[B, plan.local_len, H(kv), D]`` (from
    ``shard``); ``desc_local`` from ``shard_descriptor`` for this rank. K/V are all-gathered and
    reordered to global order; returns this rank's output rows (and LSE ``[B, H, local_len]``),
    zeros in padding rows. ``backend="auto"`` on CUDA takes the descriptor-driven engines
    (``fa4``, or ``cute`` with ``deterministic=True``): the native FA4 kernels would read the
    local row index as the global one. ``score_mod`` and ``learnable_sink`` as in
    ``cm.attention``; the score_mod sees this rank's row index, so one that reads ``q_idx``
    runs only where a moved ``q_idx`` shifts a row by a constant (ALiBi without a sink or the
    LSE); the sink's gradient is this rank's rows' share (summed over the group like any
    weight's)."""
    import torch.distributed as dist


    W = dist.get_world_size(group)
    if W != plan.world_size:
        raise ValueError(f"cp_attention: the group has {W} ranks, the plan {plan.world_size}")
    for name, t in (("q_local", q_local), ("k_local", k_local), ("v_local", v_local)):
        if t.dim() != 4 or t.shape[1] != plan.local_len:
            raise ValueError(f"cp_attention: {name} must be [B, {plan.local_len}, H, D] (the "
                             f"plan's local rows), got {list(t.shape)}")
    if desc_local.seqlen_q != plan.local_len or desc_local.seqlen_k != plan.seqlen:
        raise ValueError(f"cp_attention: desc_local is for seqlen_q {desc_local.seqlen_q}, "
                         f"seqlen_k {desc_local.seqlen_k}; the plan needs {plan.local_len}, "
                         f"{plan.seqlen} (use shard_descriptor)")
    if backend == "native":
        raise NotImplementedError("cp_attention: the native engines need rows in global order")
    if backend == "auto" and q_local.is_cuda:
        backend = "cute" if deterministic else "fa4"
    k = _gather_global(k_local, plan, group)
    v = _gather_global(v_local, plan, group)
    return attention(q_local, k, v, desc_local, softmax_scale=softmax_scale,
                     return_lse=return_lse, deterministic=deterministic, backend=backend,
                     score_mod=score_mod, learnable_sink=learnable_sink)
