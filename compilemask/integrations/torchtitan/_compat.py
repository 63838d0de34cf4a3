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

TorchTitan 0.2.x (``legacy()``; it runs on torches that 0.3.0 does not import on) has no
``torchtitan.models.common``: a model is built from ``Qwen3ModelArgs`` flavors, the
attention module (``torchtitan.models.attention``) hands its inner attention ``(B, N, L, H)``
tensors with a per-type call (``block_mask=`` for Flex, positional metadata for varlen, none for
SDPA), there is no FLASH-backend Flex, and selective AC is ``apply_ac`` with a save list. The
helpers at the end of this module (the model, its inner attentions, SAC, the masks' metadata)
give both versions one calling convention, 0.3.0's: ``inner(q_BLNH, k_BLNH, v_BLNH, *,
attention_masks, scale, enable_gqa)``. The trainer, config registry and context parallelism are
0.3.0 only.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
from dataclasses import dataclass, field

import torch

import compilemask.kernels.autograd  # noqa: F401  (registers the ops the SAC policy names)
from compilemask.kernels import fa4_lib

__all__ = ["SPMD_BACKEND", "check_parallelism", "hide_cp", "wrap_parallelize",
           "context_parallel_shard", "plan_load_balancer", "replace_inner_attention",
           "legacy", "module_base", "qwen3_config", "build_qwen3", "split_head", "apply_sac",
           "attention_dims", "varlen_masks", "flex_block_size", "create_attention_mask",
           "document_mask_mod", "method_unavailable"]

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
    if getattr(parallelize_fn, "_compilemask", False):
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def parallelize(model, *, parallel_dims, **kwargs):
        if parallel_dims.cp_enabled:
            group = parallel_dims.get_mesh("cp").get_group()
            for m in model.modules():
                if getattr(m, "is_compilemask_attention", False):  # no import: attention imports us
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
        """torch's CP load balancer from a ``compilemask.api.distributed`` plan: the rearranged
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


# ---- both versions: the model, its inner attentions, SAC, masks' metadata ----------------------

@functools.cache
def legacy() -> bool:
    """Whether the installed TorchTitan has 0.2.x's layout (no ``torchtitan.models.common``)."""
    import torchtitan.models  # noqa: F401  (a clear ImportError without TorchTitan)

    return importlib.util.find_spec("torchtitan.models.common") is None


class _LegacyModule(torch.nn.Module):
    """0.3.0's ``Module`` protocol where TorchTitan has none (0.2.x): a nested ``Config``
    dataclass whose ``build()`` makes the module."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        def build(self, **kwargs):
            return self._owner(self, **kwargs)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "Config" in cls.__dict__:
            cls.Config._owner = cls


def module_base():
    """The base class of a configurable inner attention in this TorchTitan."""
    if legacy():
        return _LegacyModule
    from torchtitan.protocols.module import Module

    return Module


class LegacyFlexAttention(_LegacyModule):
    """0.2.x's compiled ``flex_attention`` (its ``FlexAttentionWrapper``'s, same inductor
    options) behind 0.3.0's inner-attention call; ``kernel_options={"BACKEND": "FLASH"}`` is
    0.3.0's ``flex_flash``, which 0.2.x does not have."""

    @dataclass(kw_only=True, slots=True)
    class Config(_LegacyModule.Config):
        block_size: int | tuple[int, int] = 128
        kernel_options: dict = field(default_factory=dict)

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.kernel_options = dict(config.kernel_options)

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None,
                enable_gqa=False, **kwargs):
        from torch.nn.attention.flex_attention import BlockMask
        from torchtitan.models.attention import FlexAttentionWrapper

        if not isinstance(attention_masks, BlockMask):
            raise TypeError(f"LegacyFlexAttention: attention_masks must be a BlockMask, got "
                            f"{type(attention_masks).__name__}")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        kw = {"kernel_options": self.kernel_options} if self.kernel_options else {}
        out = FlexAttentionWrapper._compiled_flex_attn(q, k, v, block_mask=attention_masks,
                                                       scale=scale, enable_gqa=enable_gqa, **kw)
        return out.transpose(1, 2)


class LegacyVarlenAttention(_LegacyModule):
    """0.2.x's compiled ``varlen_attn`` (causal within each document) behind 0.3.0's
    inner-attention call; bf16 inputs as 0.3.0's ``VarlenAttention`` casts them."""

    @dataclass(kw_only=True, slots=True)
    class Config(_LegacyModule.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None,
                enable_gqa=False, **kwargs):
        from torch.nn.attention.varlen import varlen_attn
        from torchtitan.models.attention import VarlenAttentionWrapper, VarlenMetadata

        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(f"LegacyVarlenAttention: attention_masks must be VarlenMetadata, "
                            f"got {type(attention_masks).__name__}")
        B, L = q_BLNH.shape[:2]
        q, k, v = (t.reshape(B * L, t.shape[2], t.shape[3]).to(torch.bfloat16)
                   for t in (q_BLNH, k_BLNH, v_BLNH))
        kw = {}
        if enable_gqa and "enable_gqa" in inspect.signature(varlen_attn).parameters:
            kw["enable_gqa"] = True  # older torches take GQA from the head counts
        m = attention_masks
        out = VarlenAttentionWrapper._compiled_varlen_attn(
            q, k, v, m.cu_seq_q, m.cu_seq_k, m.max_q, m.max_k, scale=scale,
            window_size=(-1, 0), **kw)
        return out.view(B, L, out.shape[-2], out.shape[-1])


@functools.cache
def _legacy_attention_cls():
    """0.2.x's Qwen3 ``Attention`` whose forward calls its inner attention as 0.3.0 does."""
    from torchtitan.models.qwen3.model.model import Attention, apply_rotary_emb

    class Attention022(Attention):
        def forward(self, x, rope_cache, attention_masks, positions=None):
            bs, seqlen, _ = x.shape
            xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
            xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
            xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
            if self.q_norm:
                xq = self.q_norm(xq)
            if self.k_norm:
                xk = self.k_norm(xk)
            xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)
            out = self.inner_attention(xq, xk, xv, attention_masks=attention_masks,
                                       scale=self.scaling, enable_gqa=self.enable_gqa)
            return self.wo(out.reshape(bs, seqlen, -1))

    return Attention022


@dataclass
class _LegacySpec:
    args: object  # Qwen3ModelArgs
    inner: object  # the inner attention's config


def qwen3_config(flavor: str, layers: int, seq_len: int, backend: str, inner=None):
    """``(model config, inner-attention config)`` of TorchTitan's Qwen3 ``flavor`` with its
    first ``layers`` decoder layers: every layer's inner attention is ``inner`` (a config, e.g.
    ``CompileMaskAttention.Config``) or else TorchTitan's ``backend`` (flex, flex_flash,
    varlen)."""
    if backend not in ("flex", "flex_flash", "varlen"):
        raise ValueError(f"qwen3_config: backend must be flex, flex_flash or varlen, got "
                         f"{backend!r}")
    if not legacy():
        from torchtitan.models.qwen3 import model_registry

        spec = model_registry(flavor, attn_backend=backend)
        spec.model.layers = spec.model.layers[:layers]
        if inner is not None:
            replace_inner_attention(spec.model, inner)
            return spec.model, inner
        return spec.model, spec.model.first_attention.inner_attention
    from torchtitan.models.qwen3 import qwen3_args

    if flavor not in qwen3_args:
        raise ValueError(f"qwen3_config: unknown flavor {flavor!r}; one of {sorted(qwen3_args)}")
    args = copy.deepcopy(qwen3_args[flavor])
    args.n_layers = layers
    args.max_seq_len = max(args.max_seq_len, seq_len)  # the RoPE cache's length
    args.attn_type = "sdpa"  # replaced below; builds no compiled wrapper
    if inner is None:
        inner = {"flex": LegacyFlexAttention.Config(),
                 "flex_flash": LegacyFlexAttention.Config(block_size=(256, 128),
                                                          kernel_options={"BACKEND": "FLASH"}),
                 "varlen": LegacyVarlenAttention.Config()}[backend]
    return _LegacySpec(args, inner), inner


def build_qwen3(model_config, device, seed: int):
    """The model on ``device``, built on the meta device and initialised from ``seed``."""
    torch.manual_seed(seed)
    if not legacy():
        with torch.device("meta"):
            model = model_config.build()
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_states(buffer_device=device)
        return model
    from torchtitan.models.qwen3.model.model import Qwen3Model

    cls = _legacy_attention_cls()
    with torch.device("meta"):
        model = Qwen3Model(model_config.args)
        for block in model.layers.values():
            # same parameters, 0.3.0's inner-attention call (0.2.x dispatches per attn_type)
            block.attention.__class__ = cls
            block.attention.inner_attention = model_config.inner.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def split_head(model):
    """Make the model return the final norm's output (no logits) and give back its output
    projection, for a loss that applies it per chunk of tokens."""
    if not legacy():
        model._skip_lm_head = True
        return model.lm_head
    head = model.output
    model.output = None  # 0.2.x's forward skips a None output
    model.lm_head = head  # still the model's (its parameters, FSDP's)
    return head


def apply_sac(model, *, save_compilemask: bool, compiled: bool) -> None:
    """TorchTitan's selective (per-op) activation checkpointing on every block; with
    ``save_compilemask`` CompileMask's attention output is saved too."""
    if not legacy():
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        from .sac import CompileMaskSelectiveAC  # 0.3.0 only: sac subclasses its SelectiveAC

        policy = CompileMaskSelectiveAC if save_compilemask else SelectiveAC
        policy(policy.Config()).apply(model)
        return
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

    save = set(_op_sac_save_list)
    if save_compilemask:
        save.add(torch.ops.compilemask.attention_fwd.default)
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"),
             model_compile_enabled=compiled, op_sac_save_list=save)


def attention_dims(model) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` of the model's first attention layer."""
    if not legacy():
        cfg = model.config.layers[0].attention
        return cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    a = model.model_args
    return a.n_heads, a.n_kv_heads or a.n_heads, a.head_dim


def varlen_masks(positions: torch.Tensor):
    """TorchTitan's varlen metadata of the documents in ``positions`` (restarting at 0)."""
    if not legacy():
        from torchtitan.models.common.attention import create_varlen_metadata_for_document

        return create_varlen_metadata_for_document(positions)
    from torchtitan.models.attention import VarlenMetadata

    B, S = positions.shape
    starts = positions == 0
    starts[:, 0] = True
    idx = (torch.arange(B * S, device=positions.device).view(B, S)[starts]).to(torch.int32)
    cu = torch.cat([idx, idx.new_tensor([B * S])])
    longest = int(cu.diff().max())  # one host sync per batch, as TorchTitan's
    return VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=longest, max_k=longest)


def flex_block_size(inner):
    """The BlockMask block size of a Flex inner-attention config (TypeError for others)."""
    if legacy():
        ok = isinstance(inner, LegacyFlexAttention.Config)
    else:
        from torchtitan.models.common.attention import FlexAttention

        ok = isinstance(inner, FlexAttention.Config)
    if not ok:
        raise TypeError(f"flex_block_mask: the model's inner attention is "
                        f"{type(inner).__name__}, not FlexAttention")
    return inner.block_size


def create_attention_mask(mask_mod, B, S, device, block_size):
    """A BlockMask as TorchTitan builds its own (its compiled ``create_block_mask``)."""
    if legacy():
        from torchtitan.models.attention import create_attention_mask as create
    else:
        from torchtitan.models.common.attention import create_attention_mask as create
    return create(mask_mod, B, None, S, S, device=device, BLOCK_SIZE=block_size)


def document_mask_mod(positions: torch.Tensor):
    """TorchTitan's own causal-within-document mask_mod from ``positions``, or None where it
    has none (0.2.x finds documents from EOS tokens)."""
    if legacy():
        return None
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.common.attention import (
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    return and_masks(get_causal_mask_mod(),
                     get_efficient_causal_mask_mod_for_packed_document(positions))


def method_unavailable(backend: str) -> str | None:
    """Why TorchTitan's ``backend`` (flex, flex_flash, varlen) cannot run with this torch, or
    None."""
    if backend == "varlen" and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if backend == "flex_flash":
        why = fa4_lib.unavailable_reason()
        if why is not None:
            return f"FlexAttention's FLASH backend needs flash-attn-4: {why}"
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
            return "FlexAttention's FLASH backend needs Hopper or Blackwell"
    return None
