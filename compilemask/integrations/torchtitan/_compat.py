"""Everything that depends on TorchTitan's version, in one place (written for 0.3.0).

0.3.0 (this module):
* the inner attention is ``(B, L, N, H)``, one sequence per batch row; masks are made in
  ``Trainer.post_dataloading_process`` from ``positions`` restarting at 0;
* context parallelism on the ``partial_dtensor`` SPMD backend wraps the inner attention's
  forward (``apply_cp_to_forward``, which knows only Flex and SDPA) and shards inputs with
  torch's ``_context_parallel_shard`` and a ``_LoadBalancer``. CompileMask keeps that sharding
  (its CP plan as the load balancer) and gathers K/V itself at the attention boundary, so the
  model's parallelize function runs with CP hidden from ``apply_cp_to_forward`` only;
* the ``spmd_types`` and ``full_dtensor`` backends (0.3.0's default is ``spmd_types``) install
  DTensor/local-map wrappers around the inner attention; CompileMask runs on
  ``partial_dtensor``, which the config registry sets.

TorchTitan main differs: the batch is folded into the token axis (one packed ``(1, T)``
row: the descriptor is then one sequence of T rows, documents from ``positions``) and CP is
declared through ``spmd_types`` shardings (K/V replicated on the CP axis at the inner attention's
local map, where ``cp_attention``'s gather then becomes the framework's). Porting means
changing ``SPMD_BACKEND``, ``hide_cp`` and ``context_parallel_shard`` here.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["SPMD_BACKEND", "check_parallelism", "hide_cp", "wrap_parallelize",
           "context_parallel_shard", "plan_load_balancer", "replace_inner_attention"]

SPMD_BACKEND = "partial_dtensor"


def check_parallelism(parallelism) -> None:
    """Refuse the SPMD backends whose wrappers CompileMask does not run under."""
    if parallelism.spmd_backend != SPMD_BACKEND:
        raise ValueError(
            f"CompileMask runs on parallelism.spmd_backend={SPMD_BACKEND!r}, got "
            f"{parallelism.spmd_backend!r}; pass --parallelism.spmd_backend {SPMD_BACKEND} (the "
            "configs of compilemask.integrations.torchtitan.config_registry set it)")
    if parallelism.pipeline_parallel_degree > 1:
        raise NotImplementedError("CompileMask's TorchTitan trainer does not run pipeline "
                                  "parallelism yet (one descriptor per microbatch is not wired)")


class hide_cp:
    """``parallel_dims`` as the model's parallelize function should see it: CP off for
    ``apply_cp_to_forward`` (CompileMask's modules do their own K/V gather), every mesh and
    degree as they are (FSDP still shards over the CP ranks)."""

    def __init__(self, parallel_dims):
        object.__setattr__(self, "_dims", parallel_dims)

    @property
    def cp_enabled(self):
        return False

    def __getattr__(self, name):
        return getattr(self._dims, name)


def wrap_parallelize(parallelize_fn):
    """The model's parallelize function, with CompileMask's CP set up first: every
    ``CompileMaskAttention`` gets the CP group, and ``apply_cp_to_forward`` is skipped."""
    from .attention import CompileMaskAttention

    if getattr(parallelize_fn, "_compilemask", False):
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def parallelize(model, *, parallel_dims, **kwargs):
        if parallel_dims.cp_enabled:
            group = parallel_dims.get_mesh("cp").get_group()
            for m in model.modules():
                if isinstance(m, CompileMaskAttention):
                    m.cp_group = group
            parallel_dims = hide_cp(parallel_dims)
        return parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)

    parallelize._compilemask = True
    return parallelize


def _load_balancer_base():
    try:
        from torch.distributed.tensor.experimental._attention import _LoadBalancer
    except ImportError:  # older layouts
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _LoadBalancer,
        )
    return _LoadBalancer


@functools.cache
def _plan_balancer_cls():
    base = _load_balancer_base()

    class PlanLoadBalancer(base):
        """torch's CP load balancer from a ``compilemask.distributed`` plan: the rearranged
        sequence is every rank's rows in rank order, so torch's equal chunks are the plan's
        ranks."""

        def __init__(self, plan):
            self.plan = plan

        def _generate_indices(self, restore: bool = False):
            p = self.plan
            idx = p.inverse if restore else p.rows.reshape(-1)
            return idx.view(1, -1)

    return PlanLoadBalancer


def plan_load_balancer(plan):
    """A torch ``_LoadBalancer`` whose order is ``plan``'s (a plan without padding rows)."""
    if plan.world_size * plan.local_len != plan.seqlen:
        raise ValueError(
            f"context parallelism: seq_len {plan.seqlen} must be a multiple of cp_tile "
            f"({plan.tile}) x the CP degree ({plan.world_size})"
            + (" x 2 (head_tail)" if plan.kind == "head_tail" else "")
            + "; change training.seq_len or the inner attention's cp_tile")
    return _plan_balancer_cls()(plan)


def context_parallel_shard(mesh, buffers, plan):
    """torch's input sharding of ``[B, S, ...]`` tensors along the sequence, ordered by
    ``plan``."""
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard

    return _context_parallel_shard(mesh=mesh, buffers=list(buffers),
                                   seq_dims=tuple(1 for _ in buffers),
                                   load_balancer=plan_load_balancer(plan))


def replace_inner_attention(model_config, attn_config) -> int:
    """Make ``attn_config`` (a ``CompileMaskAttention.Config``) every layer's inner attention;
    returns how many were replaced. A layer's sharding config stays with it."""
    import copy

    from torchtitan.models.common.attention import BaseAttention

    n = 0
    for _, cfg, _, _ in model_config.traverse(BaseAttention.Config):
        new = copy.deepcopy(attn_config)
        old = cfg.inner_attention
        if getattr(old, "sharding_config", None) is not None and hasattr(new, "sharding_config"):
            new.sharding_config = old.sharding_config
        cfg.inner_attention = new
        n += 1
    if n == 0:
        raise ValueError("the model config has no attention layer to run CompileMask in")
    return n


def cpu_ok() -> bool:
    """Whether TorchTitan's Trainer can run here: 0.3.0 takes CUDA when no accelerator is
    found (``torchtitan.tools.utils.device_type``), so training needs a GPU."""
    return torch.cuda.is_available()
