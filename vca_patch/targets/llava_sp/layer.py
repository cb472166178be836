"""The two LLaVA-SP spatial-token modules (CnFaker/LLaVA-SP `llava_arch.py`, generalised to any patch grid).

Both read a [B, C, G, G] patch map and return [B, num_tokens, D] tokens for the language model.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def crop_windows(grid: int, sizes: list[int]) -> list[tuple[int, int]]:
    """[start, end) of the centred crop of each side on a grid-long axis; each window contains the previous one.

    On 24 with sides 4, 8, ..., 24 these are [10, 14), [8, 16), ..., [0, 24), as in the authors' clip_encoder.
    """
    return [((grid - s) // 2, (grid - s) // 2 + s) for s in sizes]


class PoolingSpatialTokens(nn.Module):
    """Pooling variant ("conv336_pooling_sfe"): view k = AdaptiveAvgPool2d(k) (none at k = G) then a bias-free
    k×k conv to one hidden_dim vector; the tokens go through GELU and a bias-free Linear to the LM width."""

    def __init__(self, in_channels: int, hidden_dim: int, out_dim: int, grid: int, sizes: list[int]) -> None:
        super().__init__()
        self.grid, self.sizes = grid, list(sizes)
        self.views = nn.ModuleList(
            nn.Conv2d(in_channels, hidden_dim, k, bias=False)
            if k == grid
            else nn.Sequential(nn.AdaptiveAvgPool2d(k), nn.Conv2d(in_channels, hidden_dim, k, bias=False))
            for k in self.sizes
        )
        self.out_proj = nn.Sequential(nn.GELU(), nn.Linear(hidden_dim, out_dim, bias=False))

    def forward(self, grid_map: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([view(grid_map).flatten(1).unsqueeze(1) for view in self.views], dim=1)
        return self.out_proj(tokens)


class CroppingSpatialTokens(nn.Module):
    """Cropping variant ("conv336_cropping_sfe_dfi"): nested centre crops of side k, each a bias-free k×k conv
    (tokens c); a detail conv over the whole map gives detail tokens d; single-head cross-attention
    softmax(q kᵀ/√h)·v with q = LN+Linear(c), k, v = LN+Linear(d); [c, attended] → GELU → Linear (with bias)."""

    def __init__(
        self,
        in_channels: int,
        hidden_dim: int,
        out_dim: int,
        grid: int,
        sizes: list[int],
        detail_kernel: int,
        detail_stride: int,
    ) -> None:
        super().__init__()
        self.grid, self.sizes = grid, list(sizes)
        self.windows = crop_windows(grid, self.sizes)
        self.views = nn.ModuleList(nn.Conv2d(in_channels, hidden_dim, k, bias=False) for k in self.sizes)
        self.detail = nn.Conv2d(in_channels, hidden_dim, detail_kernel, stride=detail_stride, bias=False)
        self.query = nn.Sequential(nn.LayerNorm(hidden_dim), nn.Linear(hidden_dim, hidden_dim))
        self.key = nn.Sequential(nn.LayerNorm(hidden_dim), nn.Linear(hidden_dim, hidden_dim))
        self.value = nn.Sequential(nn.LayerNorm(hidden_dim), nn.Linear(hidden_dim, hidden_dim))
        self.out_proj = nn.Sequential(nn.GELU(), nn.Linear(2 * hidden_dim, out_dim))

    def forward(self, grid_map: torch.Tensor) -> torch.Tensor:
        crops = [
            view(grid_map[:, :, a:b, a:b]).flatten(1).unsqueeze(1)
            for view, (a, b) in zip(self.views, self.windows, strict=True)
        ]
        c = torch.cat(crops, dim=1)  # [B, n, h]
        d = self.detail(grid_map).flatten(2).transpose(1, 2)  # [B, m, h]
        q, k, v = self.query(c), self.key(d), self.value(d)
        attn = (q @ k.transpose(1, 2) / math.sqrt(k.shape[-1])).softmax(dim=-1)
        return self.out_proj(torch.cat([c, attn @ v], dim=-1))
