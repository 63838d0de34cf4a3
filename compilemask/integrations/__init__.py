"""Integrations with model libraries, each an optional extra whose library loads lazily.

``compilemask.integrations.transformers.register()``: CompileMask as a transformers attention
implementation (the ``[hf]`` extra)."""

__all__: list[str] = []
