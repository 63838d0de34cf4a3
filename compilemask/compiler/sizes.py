"""Whether a batch's descriptor can be built at all: refused up front, naming the lengths and the
batch, where a tensor of it would pass the int32 indexing of the generated programs and kernels,
or where the CPU preprocess would need more than the machine's memory (instead of failing deep
in torch, or swapping, after minutes)."""

from __future__ import annotations

import math
import os

from compilemask.compiler.bounds import INT32_MAX
from compilemask.contract.descriptor import descriptor_shapes

__all__ = ["descriptor_bytes", "cpu_preprocess_bytes", "check_descriptor_fits"]

# the chunked tile states' temporaries (compiler.tiles, pack_bitmap): a constant per call
_CHUNK_BYTES = 256 << 20


def _shapes(mask, B: int, seqlen_q: int, seqlen_k: int, fwd, bwd) -> dict:
    # a table param adds at least one packed word per row
    R = len(mask.array_params) + len(mask.table_params)
    return descriptor_shapes(B, seqlen_q, seqlen_k, max(1, mask.num_intervals),
                             len(mask.scalar_params), R, fwd, bwd)


def descriptor_bytes(mask, B: int, seqlen_q: int, seqlen_k: int, fwd, bwd) -> int:
    """Bytes of a descriptor's tensors (int32 each), without lists or a column view."""
    return 4 * sum(math.prod(s) for s in _shapes(mask, B, seqlen_q, seqlen_k, fwd, bwd).values())


def cpu_preprocess_bytes(mask, B: int, seqlen_q: int, seqlen_k: int, fwd, bwd) -> int:
    """An upper estimate of the CPU (torch) preprocess's peak: the descriptor, the Interval
    Table's int64 columns and their temporaries (~64 bytes a slot), the tile states before
    packing (a byte a tile, the backward's twice: transposed) and the chunks' temporaries."""
    K = max(1, mask.num_intervals)
    tiles = 0
    for t, copies in ((fwd, 1), (bwd, 2)):
        nm, nn = t.num_blocks(seqlen_q, seqlen_k)
        tiles += copies * B * nm * nn
    return (descriptor_bytes(mask, B, seqlen_q, seqlen_k, fwd, bwd) + 64 * B * seqlen_q * K
            + tiles + _CHUNK_BYTES)


def _memory_bytes() -> int | None:
    """The machine's physical memory, None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_descriptor_fits(mask, B: int, seqlen_q: int, seqlen_k: int, fwd, bwd,
                          device_type: str) -> None:
    """Raise ``ValueError`` where a descriptor tensor of this batch would have more entries than
    int32 indexes, and ``MemoryError`` where the CPU preprocess would need more than the
    machine's physical memory; both name the lengths, the batch and what to change."""
    what = f"seqlen_q={seqlen_q}, seqlen_k={seqlen_k}, batch_size={B}"
    for field, shape in _shapes(mask, B, seqlen_q, seqlen_k, fwd, bwd).items():
        n = math.prod(shape)
        if n > INT32_MAX:
            raise ValueError(
                f"preprocess: {what}: the descriptor's {field} {list(shape)} would hold {n} "
                f"entries, past the int32 indexing (2**31 - 1) of the generated programs and "
                "kernels; use a smaller batch_size, or split the sequence across devices "
                "(compilemask.api.distributed)")
    if device_type != "cpu":
        return  # the device's allocator reports what it cannot hold, without swapping first
    need, have = cpu_preprocess_bytes(mask, B, seqlen_q, seqlen_k, fwd, bwd), _memory_bytes()
    if have is not None and need > have:
        raise MemoryError(
            f"preprocess: {what}: the CPU preprocess needs about {need / 2**30:.1f} GiB, more "
            f"than this machine's {have / 2**30:.1f} GiB; use a smaller batch_size, or "
            "preprocess on the GPU (device='cuda')")
