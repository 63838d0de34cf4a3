"""Training configs: ``python -m torchtitan.train --module compilemask.integrations.torchtitan
--config NAME`` (TorchTitan 0.3.0 imports ``<module>.config_registry`` and calls ``NAME()``;
any ``--section.key value`` after it overrides the config).

* ``compilemask_qwen3_debug_hstu``: Qwen3's debug model (8 layers, dim 256, 16 heads, 8 kv
  heads) on packed variable-length HSTU sequences (``data.PackedSequences``), CompileMask's
  packed HSTU mask;
* ``compilemask_qwen3_debug_documents``: the same data, causal within each packed sequence
  (TorchTitan's block-causal documents), CompileMask;
* ``flex_qwen3_debug_documents`` / ``flex_qwen3_debug_hstu``: the Flex baselines, the BlockMask
  built as TorchTitan builds it (``create_attention_mask``, its block size);
* ``compilemask_qwen3_8b_hstu``: Qwen3-8B's shape, 32K tokens per row, packed HSTU;
* ``compilemask_qwen3_debug`` / ``flex_qwen3_debug`` (debug model) and ``compilemask_qwen3_8b``
  / ``flex_flash_qwen3_8b`` (8B shape, 8 layers, 32K tokens, compiled; the Flex one on
  TorchTitan's ``flex_flash``, FlexAttention's FA4 backend): any mask, named on the command
  line (``--mask clear --mask_options radius 1 width 64``; default: packed documents).

``--mask`` picks every layer's mask for any of these configs (``CompileMaskTrainer.Config``),
and the packaged data follows it: packed sequences for documents and HSTU, one sequence per
row with the mask's metadata for the others (``data.PackedSequenceDataLoader``).
"""

from __future__ import annotations

from dataclasses import fields

from torchtitan.models.qwen3 import model_registry
from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

from . import _compat
from .attention import CompileMaskAttention
from .data import PackedSequenceDataLoader, SyntheticTokenizer
from .trainer import CompileMaskTrainer

__all__ = ["compilemask_config", "compilemask_qwen3_debug_hstu",
           "compilemask_qwen3_debug_documents", "flex_qwen3_debug_documents",
           "flex_qwen3_debug_hstu", "compilemask_qwen3_8b_hstu", "compilemask_qwen3_debug",
           "flex_qwen3_debug", "compilemask_qwen3_8b", "flex_flash_qwen3_8b"]


def compilemask_config(*, mask: str | None = "block_causal", mask_options: dict | None = None,
                       flavor: str = "debugmodel", flex_mask: str = "", seq_len: int = 2048,
                       local_batch_size: int = 2, steps: int = 10, backend: str = "auto",
                       deterministic: bool = False, n_layers: int | None = None,
                       flex_backend: str = "flex",
                       flex_mask_options: dict | None = None) -> CompileMaskTrainer.Config:
    """A ``CompileMaskTrainer.Config`` for Qwen3 ``flavor`` (TorchTitan's registry) on packed
    HSTU data: CompileMask attention with ``mask`` in every layer, or, with ``mask=None``,
    TorchTitan's Flex attention (``flex_backend``: flex or flex_flash) with ``flex_mask``'s
    BlockMask (built as TorchTitan does)."""
    base = qwen3_debugmodel()
    config = CompileMaskTrainer.Config(**{f.name: getattr(base, f.name) for f in fields(base)})
    spec = model_registry(flavor, attn_backend=flex_backend)
    if n_layers is not None:
        spec.model.layers = spec.model.layers[:n_layers]
    if mask is not None:
        _compat.replace_inner_attention(spec.model, CompileMaskAttention.Config(
            mask=mask, mask_options=dict(mask_options or {}), backend=backend,
            deterministic=deterministic))
    config.model_spec = spec
    config.flex_mask = flex_mask
    config.flex_mask_options = dict(flex_mask_options or {})
    vocab = spec.model.vocab_size
    config.tokenizer = SyntheticTokenizer.Config(vocab_size=vocab)
    config.dataloader = PackedSequenceDataLoader.Config(vocab_size=vocab)
    config.training.seq_len = seq_len
    config.training.local_batch_size = local_batch_size
    config.training.steps = steps
    config.parallelism.spmd_backend = _compat.SPMD_BACKEND
    config.checkpoint.enable = False
    return config


def compilemask_qwen3_debug_hstu() -> CompileMaskTrainer.Config:
    return compilemask_config(mask="hstu")


def compilemask_qwen3_debug_documents() -> CompileMaskTrainer.Config:
    return compilemask_config(mask="block_causal")


def flex_qwen3_debug_documents() -> CompileMaskTrainer.Config:
    return compilemask_config(mask=None, flex_mask="block_causal")


def flex_qwen3_debug_hstu() -> CompileMaskTrainer.Config:
    return compilemask_config(mask=None, flex_mask="hstu")


def compilemask_qwen3_8b_hstu() -> CompileMaskTrainer.Config:
    config = compilemask_config(mask="hstu", flavor="8B", seq_len=32768, local_batch_size=1,
                                n_layers=4)
    config.compile.enable = True
    return config


def compilemask_qwen3_debug() -> CompileMaskTrainer.Config:
    return compilemask_config(mask="block_causal")


def flex_qwen3_debug() -> CompileMaskTrainer.Config:
    return compilemask_config(mask=None)


def compilemask_qwen3_8b() -> CompileMaskTrainer.Config:
    config = compilemask_config(mask="block_causal", flavor="8B", seq_len=32768,
                                local_batch_size=1, n_layers=8)
    config.compile.enable = True
    return config


def flex_flash_qwen3_8b() -> CompileMaskTrainer.Config:
    config = compilemask_config(mask=None, flavor="8B", seq_len=32768, local_batch_size=1,
                                n_layers=8, flex_backend="flex_flash")
    config.compile.enable = True
    return config
