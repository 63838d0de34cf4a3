"""The Execution Descriptor as the kernels take it: one argument, the tensors one kernel reads.

:class:`DescriptorTensors` holds them as CuTe tensors (what ``__call__`` and the ``@cute.kernel``
functions declare; the DSL flattens it, in field order, into the kernel's parameters);
:class:`DescriptorTensorsTorch` is its torch twin, what a launch passes (the TVM-FFI call takes
the torch tensors of a tuple argument as they are). One kernel reads one bitmap: the forward
``fwd_bitmap`` or the backward ``bwd_bitmap`` of ``compilemask/descriptor.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import cutlass.cute as cute
from cutlass import Int32

from .common import fake_tensor

if TYPE_CHECKING:
    import torch

__all__ = ["DescriptorTensors", "DescriptorTensorsTorch"]


class DescriptorTensors(NamedTuple):
    """The descriptor tensors of one kernel launch (CuTe side)."""

    intervals: cute.Tensor  # (B, Sq, 2K) int32: (start, len) per interval slot
    bitmap: cute.Tensor  # (B, rows, words) int32: the forward or backward Tile-State Bitmap
    row_region: cute.Tensor  # (B, Sq) int32: the row's region, -1 if none
    params: cute.Tensor  # (B, max(P, 1)) int32: per-sequence scalar params
    row_params: cute.Tensor  # (B, Sq, max(R, 1)) int32: per-row params

    @staticmethod
    def fake(B, Sq, num_intervals: int) -> DescriptorTensors:
        """Fake (shape-symbolic) tensors, for compiling without a GPU; ``B``, ``Sq`` are the
        symbolic sizes the other launch arguments share."""
        sym = cute.sym_int
        return DescriptorTensors(
            intervals=fake_tensor(Int32, (B, Sq, 2 * num_intervals), 1, 4),
            bitmap=fake_tensor(Int32, (B, sym(), sym()), 1, 4),
            row_region=fake_tensor(Int32, (B, Sq), 1, 4),
            params=fake_tensor(Int32, (B, sym()), 1, 4),
            row_params=fake_tensor(Int32, (B, Sq, sym()), 1, 4),
        )


class DescriptorTensorsTorch(NamedTuple):
    """The torch twin of :class:`DescriptorTensors` (same fields, same order)."""

    intervals: torch.Tensor
    bitmap: torch.Tensor
    row_region: torch.Tensor
    params: torch.Tensor
    row_params: torch.Tensor

    @staticmethod
    def of(batch: int, intervals, bitmap, row_region=None, params=None, row_params=None
           ) -> DescriptorTensorsTorch:
        """The launch tensors from the descriptor's: int32, contiguous, intervals ``[B', Sq, K,
        2]`` viewed as ``[B', Sq, 2K]``; a descriptor made for batch ``B' = 1`` is broadcast to
        ``batch`` (a view, no copy). Without a fallback ``row_region`` (None: all -1),
        ``params`` and ``row_params`` (None or empty: one zero column) are never read, but the
        kernel still takes a tensor for each."""
        import torch

        dev = intervals.device
        Sq, K = intervals.shape[1], intervals.shape[2]
        if row_region is None:
            row_region = torch.full((batch, Sq), -1, dtype=torch.int32, device=dev)
        if params is None or params.numel() == 0:
            params = torch.zeros(batch, 1, dtype=torch.int32, device=dev)
        if row_params is None or row_params.numel() == 0:
            row_params = torch.zeros(batch, Sq, 1, dtype=torch.int32, device=dev)
        return DescriptorTensorsTorch(
            intervals=intervals.to(torch.int32).contiguous().view(-1, Sq, 2 * K)
            .expand(batch, -1, -1),
            bitmap=bitmap.to(torch.int32).contiguous().expand(batch, -1, -1),
            row_region=row_region.to(torch.int32).contiguous().expand(batch, -1),
            params=params.to(torch.int32).contiguous().expand(batch, -1),
            row_params=row_params.to(torch.int32).contiguous().expand(batch, -1, -1),
        )


# the launch passes the twin where the kernel declares the CuTe tuple: positions must agree
assert DescriptorTensorsTorch._fields == DescriptorTensors._fields
