"""A ViT written outside timm and transformers, for generic detection; `mode="relu"` makes a lookalike."""

from __future__ import annotations

import torch
from torch import nn


class PlainAttention(nn.Module):
    def __init__(self, dim: int, heads: int, mode: str = "softmax") -> None:
        super().__init__()
        self.heads, self.mode = heads, mode
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-1, -2) * (C // self.heads) ** -0.5
        weights = logits.softmax(-1) if self.mode == "softmax" else torch.relu(logits)  # relu: not softmax
        return self.proj((weights @ v).transpose(1, 2).reshape(B, N, C))


class PlainViT(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, depth: int = 2, img_size: int = 32, mode: str = "softmax"):
        super().__init__()
        self.img_size = img_size
        self.stem = nn.Conv2d(3, dim, 8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.layers = nn.ModuleList(PlainAttention(dim, heads, mode) for _ in range(depth))
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x[:, 0])
