"""Undecimated (stationary) one-level 2-D Haar split of patch-grid tokens into a low and a high band.

Per axis the analysis filters are h = [1, 1]/2 and g = [1, −1]/2 at full resolution (no downsampling), with
circular boundaries: then h∗x + g∗x = x and |H(ω)|² + |G(ω)|² = 1, so the four sub-bands LL, LH, HL, HH sum to the
input exactly and their energies sum to its energy. low = LL, high = LH + HL + HH (= x − LL).
"""

from __future__ import annotations

import torch


def haar_subbands(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., H, W, C] -> (LL, LH, HL, HH), each [..., H, W, C] (first letter: the filter along H)."""
    down_h = torch.roll(grid, shifts=-1, dims=-3)  # x[i+1, j] (circular)
    low_h, high_h = (grid + down_h) / 2, (grid - down_h) / 2

    def along_w(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        right = torch.roll(t, shifts=-1, dims=-2)  # t[i, j+1]
        return (t + right) / 2, (t - right) / 2

    ll, lh = along_w(low_h)
    hl, hh = along_w(high_h)
    return ll, lh, hl, hh


def haar_split(x: torch.Tensor, num_prefix_tokens: int, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, P + H·W, C] -> (low, high), each [B, P + H·W, C], low + high = x.

    Prefix tokens (CLS, registers) have no spatial frequency: they are all low band (high = 0).
    """
    B, _, C = x.shape
    P, (H, W) = num_prefix_tokens, grid
    ll, lh, hl, hh = haar_subbands(x[:, P:].reshape(B, H, W, C))
    low, high = ll.reshape(B, H * W, C), (lh + hl + hh).reshape(B, H * W, C)
    prefix = x[:, :P]
    return torch.cat([prefix, low], dim=1), torch.cat([torch.zeros_like(prefix), high], dim=1)
