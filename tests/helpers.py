"""Shared test helpers: tile states from a brute-force dense mask."""

import torch

from compilemask.descriptor import TILE_MASKED, TILE_VISIBLE


def dense_tile_states(dense: torch.Tensor, tile_m: int, tile_n: int) -> torch.Tensor:
    """uint8 [B, n_m, n_n] states of the tiles of a bool [B, Sq, Sk] mask (edges: valid part)."""
    B, Sq, Sk = dense.shape
    n_m, n_n = -(-Sq // tile_m), -(-Sk // tile_n)
    vis = torch.zeros(B, n_m * tile_m, n_n * tile_n, dtype=torch.bool)
    valid = torch.zeros_like(vis)
    vis[:, :Sq, :Sk] = dense
    valid[:, :Sq, :Sk] = True
    v = vis.view(B, n_m, tile_m, n_n, tile_n).any(4).any(2)
    m = (valid & ~vis).view(B, n_m, tile_m, n_n, tile_n).any(4).any(2) & v
    return v.to(torch.uint8) * TILE_VISIBLE + m.to(torch.uint8) * TILE_MASKED
