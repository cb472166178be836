"""Adaptive average pooling of a token grid as two small matmuls.

`F.adaptive_avg_pool2d` windows are rectangles, so the pooling separates into a [h, H] row average and
a [w, W] column average. Two GEMMs read the grid once at matmul speed, several times faster on CPU than
the pooling kernel on large grids, and they read a batch of token rows with a prefix in front (batch
stride (P + H·W)·C) without first copying it into a dense image.
"""

from __future__ import annotations

import functools

import torch


def _build_window_matrix(size: int, pooled: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row i: 1 / (window length) over adaptive_avg_pool2d's window i = [⌊i·size/pooled⌋, ⌈(i+1)·size/pooled⌉).
    Arithmetic on aranges, no loop or slicing: traced with a symbolic `size`, the windows follow the input's size
    (exporters would otherwise bake the traced size's windows into the graph)."""
    i = torch.arange(pooled, device=device, dtype=torch.int64)[:, None]  # [pooled, 1]
    j = torch.arange(size, device=device, dtype=torch.int64)[None]  # [1, size]
    start = (i * size).div(pooled, rounding_mode="floor")
    end = ((i + 1) * size + pooled - 1).div(pooled, rounding_mode="floor")
    inside = (j >= start) & (j < end)
    return (inside.to(torch.float64) / (end - start).to(torch.float64)).to(dtype)


@functools.lru_cache(maxsize=64)
def _cached_window_matrix(size: int, pooled: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor, so later autograd may save it
        return _build_window_matrix(size, pooled, dtype, device)


def window_matrix(size: int, pooled: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[pooled, size]: row i averages adaptive-pool window i of a length-`size` axis."""
    if torch.compiler.is_compiling():  # traced as constants-building ops; the cache is a Python-side effect
        return _build_window_matrix(size, pooled, dtype, device)
    return _cached_window_matrix(size, pooled, dtype, device)


def adaptive_avg_pool_tokens(tokens: torch.Tensor, grid: tuple[int, int], pooled_grid: tuple[int, int]) -> torch.Tensor:
    """[B, H·W, C] row-major grid tokens (rows may sit inside a longer sequence) -> [B, h·w, C].

    Equals `adaptive_avg_pool2d` on the [B, C, H, W] image, flattened row-major.
    """
    B, _, C = tokens.shape
    (H, W), (h, w) = grid, pooled_grid
    rows = window_matrix(H, h, tokens.dtype, tokens.device).expand(B, h, H)
    cols = window_matrix(W, w, tokens.dtype, tokens.device).expand(B * h, w, W)
    pooled_rows = torch.bmm(rows, tokens.reshape(B, H, W * C))  # [B, h, W·C]; a view for rows of a contiguous sequence
    return torch.bmm(cols, pooled_rows.view(B * h, W, C)).view(B, h * w, C)
