"""Compile-time configurations of the CuTe kernels (each one a compile-cache key) and the default
forward tiles."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass

__all__ = ["DTYPES", "FlashFwdConfig", "FlashBwdConfig", "default_tiles"]

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


@dataclass(frozen=True)
class FlashFwdConfig:
    """Everything that is compile-time for one kernel build (the compile-cache key)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    tile_m: int
    tile_n: int
    num_intervals: int  # K: interval slots per row
    has_fallback: bool = False
    fallback_hash: str = ""  # hash of the generated predicate source ("" without fallback)
    fallback_regions: tuple = ()  # region ids whose rows evaluate the fallback predicate
    num_params: int = 0  # P (scalar params the predicate takes, in order)
    num_row_params: int = 0  # R (per-row arrays the predicate takes, in order)
    arch: int = 90  # 80: mma.sync path (sm80-sm89); 90: wgmma path (sm90a)
    warp_specialized: bool = True  # sm90: TMA producer warp + wgmma consumers (flash_fwd_sm90)
    intra_wg_overlap: bool = True  # sm90 warp-specialized: softmax(i) overlaps P(i-1) V and QK(i)
    pingpong: bool = True  # sm90 warp-specialized, 2 consumer warpgroups: alternate their GEMMs
    # partial tiles: the interval test once per row, as a word of the thread's column bits, then
    # one bit test per element (KernelOptions.fwd_mask: "bits", the default on sm90, or "compare")
    mask_bits: bool = False

    @property
    def cutlass_dtype(self):
        return DTYPES[self.dtype]

    @property
    def num_threads(self) -> int:
        if self.arch < 90:
            return 128
        return (self.tile_m // 64 + (1 if self.warp_specialized else 0)) * 128


def default_tiles(head_dim: int, arch: int) -> tuple[int, int]:
    if arch >= 90:
        return (128, 128) if head_dim <= 128 else (64, 64)
    return (128, 64) if head_dim >= 128 else (128, 128)


@dataclass(frozen=True)
class FlashBwdConfig:
    """Everything that is compile-time for one backward kernel build (the compile-cache key)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    tile_m: int  # q rows per tile   (desc.bwd_tiles.tile_m)
    tile_n: int  # kv rows per tile  (desc.bwd_tiles.tile_n)
    num_intervals: int  # K
    has_fallback: bool = False
    fallback_hash: str = ""
    fallback_regions: tuple = ()
    num_params: int = 0
    num_row_params: int = 0
    arch: int = 80  # 80: mma.sync (runs on sm80..sm90a); 90: wgmma (sm90a)
    num_threads: int = 256
    # dQ accumulation: "atomic" (one float32 atomic per element), "red2" (red.global.add.v2.f32
    # on the two adjacent columns an accumulator fragment holds; sm_90 PTX): the mma.sync
    # kernel; "bulk" (fragment-ordered tile halves through shared memory, one bulk reduce-add
    # each): the sm90 kernel, which needs it
    dq_reduce: str = ""  # "": the kernel's own (bulk for arch 90, atomic for arch 80)
    # arch 90: the kv tiles add to each dQ tile in a fixed order (run-to-run identical
    # dQ) through per-tile semaphores (flash_bwd(deterministic=True))
    deterministic: bool = False
    # arch 90: the next q tile's row metadata goes global -> shared by per-thread cp.async
    # (finished in place before the item's barrier) instead of through registers held across
    # the whole item (KernelOptions.bwd_meta: "async", the default for K > 2, or "regs")
    meta_async: bool = False
    # arch 90: the CTA's bitmap row is copied to shared memory once (up to BITMAP_SMEM_WORDS
    # words: q tiles <= 16 x that), so that the per-item scans of the consumers, the producer
    # and the dQ writer read shared memory instead of rebuilding the row's global address from
    # kernel parameters at every item (flash_bwd sets it False for longer rows;
    # KernelOptions(bwd_bitmap="global") forces the global reads)
    bitmap_smem: bool = True

    def __post_init__(self):
        if not self.dq_reduce:
            object.__setattr__(self, "dq_reduce", "bulk" if self.arch >= 90 else "atomic")

    @property
    def cutlass_dtype(self):
        return DTYPES[self.dtype]
