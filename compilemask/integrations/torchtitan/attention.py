"""CompileMask as a TorchTitan inner attention (the type of a layer's ``inner_attention``).

TorchTitan's ``GQAttention`` calls ``inner_attention(q, k, v, *, attention_masks, scale,
enable_gqa)`` with ``(B, L, N, H)`` tensors (q, k, v first, so a context-parallel wrapper can
take them). ``attention_masks`` is the batch's ``CompileMaskBatch`` (one descriptor, built once
per batch by ``CompileMaskTrainer`` and passed to every layer, as Flex's BlockMask is; the
recomputation under activation checkpointing gets the same object). With ``out_transform`` set
the LSE goes to it as ``(B, L, N)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from compilemask.api.api import BACKENDS, attention
from compilemask.api.distributed import PLAN_KINDS, CPPlan, cp_attention
from compilemask.contract.descriptor import ExecutionDescriptor

from ._compat import module_base

Module = module_base()  # TorchTitan's configurable Module (a stand-in on 0.2.x)

__all__ = ["CompileMaskAttention", "CompileMaskBatch"]


@dataclass(frozen=True, eq=False)
class CompileMaskBatch:
    """A batch's attention metadata: the descriptor every layer runs (this rank's rows under
    context parallelism) and the context-parallel plan (None without CP)."""

    desc: ExecutionDescriptor
    plan: CPPlan | None = None


class CompileMaskAttention(Module):
    """Masked attention driven by the batch's CompileMask descriptor."""

    is_compilemask_attention = True  # how _compat.wrap_parallelize finds these modules

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        mask: str = "block_causal"
        """A built-in mask (causal, block_causal, documents, hstu, shared_prompt_rm, clear,
        prefix_lm) or an import path 'pkg.module:NAME' (a MaskSpec, a function returning one,
        or a FlexAttention mask_mod)."""

        mask_options: dict[str, int] = field(default_factory=dict)
        """Keyword arguments of the mask's factory (clear: radius, width)."""

        backend: str = "auto"
        """cm.attention's engine: auto, fa4, native, cute or reference."""

        deterministic: bool = False
        """Gradients identical run to run (the cute engine on CUDA)."""

        cp_plan: str = "balanced"
        """Context parallelism's load balancer: balanced (visible pairs per q tile, dealt
        snake-wise) or head_tail."""

        cp_tile: int = 128
        """Rows per q tile of the context-parallel plan; seq_len must be a multiple of
        cp_tile x the CP degree (x 2 for head_tail)."""

        def __post_init__(self):
            if self.backend not in BACKENDS:
                raise ValueError(f"CompileMaskAttention.Config: backend must be one of "
                                 f"{BACKENDS}, got {self.backend!r}")
            if self.cp_plan not in PLAN_KINDS:
                raise ValueError(f"CompileMaskAttention.Config: cp_plan must be one of "
                                 f"{PLAN_KINDS}, got {self.cp_plan!r}")
            if self.cp_tile < 1:
                raise ValueError(f"CompileMaskAttention.Config: cp_tile must be positive, got "
                                 f"{self.cp_tile}")

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.mask = config.mask
        self.backend = config.backend
        self.deterministic = config.deterministic
        # the context-parallel process group; set by compilemask_parallelize when CP is on
        self.cp_group = None

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: CompileMaskBatch | ExecutionDescriptor,
                scale: float | None = None, enable_gqa: bool = False,
                out_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                **kwargs) -> torch.Tensor:
        # GQA needs no flag: cm.attention reads it from the head counts
        if kwargs.get("score_mod") is not None:
            raise NotImplementedError("CompileMaskAttention: pass a score_mod in the mask's "
                                      "rules or through cm.attention; none via TorchTitan")
        if isinstance(attention_masks, ExecutionDescriptor):
            desc, plan = attention_masks, None
        elif isinstance(attention_masks, CompileMaskBatch):
            desc, plan = attention_masks.desc, attention_masks.plan
        else:
            raise TypeError(
                "CompileMaskAttention: attention_masks must be the batch's CompileMaskBatch "
                f"(built by CompileMaskTrainer.post_dataloading_process), got "
                f"{type(attention_masks).__name__}; train with the compilemask config registry "
                "(--module compilemask.integrations.torchtitan)")
        want_lse = out_transform is not None
        if plan is not None:
            if self.cp_group is None:
                raise RuntimeError("CompileMaskAttention: the batch was sharded for context "
                                   "parallelism but this module has no CP group "
                                   "(compilemask_parallelize sets it)")
            res = cp_attention(q_BLNH, k_BLNH, v_BLNH, desc, plan, self.cp_group,
                               softmax_scale=scale, return_lse=want_lse,
                               deterministic=self.deterministic, backend=self.backend)
        else:
            res = attention(q_BLNH, k_BLNH, v_BLNH, desc, softmax_scale=scale,
                            return_lse=want_lse, deterministic=self.deterministic,
                            backend=self.backend)
        if not want_lse:
            return res
        out, lse = res
        return out_transform(out, lse.transpose(1, 2))  # [B, N, L] -> [B, L, N]
