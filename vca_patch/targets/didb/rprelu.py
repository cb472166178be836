"""Improved RPReLU for the MLP activation of a binary ViT.

ReActNet's RPReLU is PReLU_β(x − γ) + ζ with per-channel γ, β, ζ. DIDB-ViT adds "per-token adjustments" of the
activation distribution (exact form not published). Here the per-token adjustment is a learnable fraction ρ
(per channel) of the token's channel mean μ_t removed before the shift:

    y = PReLU_β(x − γ − ρ ⊙ μ_t) + ζ,   μ_t = mean_c x_tc.

ρ = 0 is ReActNet's RPReLU. The init β = 0.25 keeps the signs GELU gives (GELU(x) < 0 for x < 0), which is what
the following binary fc2 sees.
"""

from __future__ import annotations

import torch
from torch import nn


class ImprovedRPReLU(nn.Module):
    """y = PReLU_β(x − γ − ρ·mean_c(x)) + ζ over the last dimension (`channels`)."""

    def __init__(
        self,
        channels: int,
        *,
        slope_init: float = 0.25,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.channels = channels
        self.shift = nn.Parameter(torch.zeros(channels, **dd))  # γ
        self.slope = nn.Parameter(torch.full((channels,), float(slope_init), **dd))  # β
        self.bias = nn.Parameter(torch.zeros(channels, **dd))  # ζ
        self.token_mix = nn.Parameter(torch.zeros(channels, **dd))  # ρ

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x - self.shift - self.token_mix * x.mean(dim=-1, keepdim=True)
        return torch.where(z >= 0, z, self.slope * z) + self.bias

    def extra_repr(self) -> str:
        return f"channels={self.channels}"
