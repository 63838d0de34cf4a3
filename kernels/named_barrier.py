"""Named barrier ids of the warp-specialized sm90 kernels (``bar.sync id, count``).

Id 0 is the whole CTA (``cute.arch.barrier()``). A member marked "+ w" is the first of one
barrier per warpgroup ``w``; the ids of one kernel must not overlap.
"""

from __future__ import annotations

import enum

__all__ = ["NamedBarrierFwd", "NamedBarrierBwd"]


class NamedBarrierFwd(enum.IntEnum):
    """``flash_fwd_sm90.FlashFwdSm90``."""

    Epilogue = 1  # + w: consumer warpgroup w's O tile is in shared memory (1, 2)
    WarpSchedulerWG1 = 3  # + w: consumer warpgroup w's turn to issue its GEMMs (pingpong: 3, 4)


class NamedBarrierBwd(enum.IntEnum):
    """``flash_bwd_sm90.FlashBwdSm90``."""

    Mma = 3  # the two wgmma warpgroups, once per q tile
    DqFull = 4  # + w: dQ half w written (wgmma warpgroup w -> the dQ writer warp: 4, 5)
    DqEmpty = 6  # + w: dQ half w read by its bulk add, free again (6, 7)
