"""Non-overlapping 2-D windows over channels-last grids: pad, partition, merge, key mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_grid(x: torch.Tensor, padded: tuple[int, int]) -> torch.Tensor:
    """[..., H, W, d] -> [..., Hp, Wp, d], zeros appended at the bottom and right."""
    H, W = x.shape[-3:-1]
    if tuple(padded) == (H, W):
        return x
    return F.pad(x, (0, 0, 0, padded[1] - W, 0, padded[0] - H))


def window_partition(x: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """[..., Hp, Wp, d] -> [..., nW, kh*kw, d]; windows row-major, tokens row-major inside a window."""
    *lead, Hp, Wp, d = x.shape
    kh, kw = window
    x = x.reshape(*lead, Hp // kh, kh, Wp // kw, kw, d).transpose(-4, -3)  # [..., nh, nw, kh, kw, d]
    return x.reshape(*lead, (Hp // kh) * (Wp // kw), kh * kw, d)


def window_merge(x: torch.Tensor, padded: tuple[int, int], window: tuple[int, int]) -> torch.Tensor:
    """Inverse of `window_partition`: [..., nW, kh*kw, d] -> [..., Hp, Wp, d]."""
    *lead, _, _, d = x.shape
    (Hp, Wp), (kh, kw) = padded, window
    x = x.reshape(*lead, Hp // kh, Wp // kw, kh, kw, d).transpose(-4, -3)  # [..., nh, kh, nw, kw, d]
    return x.reshape(*lead, Hp, Wp, d)


def window_key_mask(
    grid: tuple[int, int],
    padded: tuple[int, int],
    window: tuple[int, int],
    extra_keys: int = 0,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """Boolean SDPA mask [nW, 1, kh*kw + extra_keys] (True = attend) hiding padded keys; None without padding.

    The `extra_keys` (e.g. prefix keys appended after each window's keys) are always visible. Every
    window keeps at least one real key because padding is shorter than a window.
    """
    if tuple(grid) == tuple(padded):
        return None
    real = torch.zeros(*padded, 1, dtype=torch.bool, device=device)
    real[: grid[0], : grid[1]] = True
    mask = window_partition(real, window).squeeze(-1)  # [nW, kh*kw]
    if extra_keys:
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], extra_keys)], dim=1)
    return mask.unsqueeze(1)
