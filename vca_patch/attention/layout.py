"""Token layout of a vision transformer sequence: prefix tokens followed by a patch grid."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLayout:
    """`num_prefix_tokens` tokens (CLS, distillation, registers) then an H×W grid, row-major."""

    num_prefix_tokens: int
    grid: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_patches

    def check(self, num_tokens: int) -> None:
        """Raise a clear error when a sequence of `num_tokens` does not fit this layout."""
        if num_tokens != self.num_tokens:
            raise ValueError(
                f"sequence has {num_tokens} tokens but the layout expects "
                f"{self.num_prefix_tokens} prefix + {self.grid[0]}x{self.grid[1]} patches = "
                f"{self.num_tokens}; token dropping or merging before attention is not supported"
            )


def resolve_layout(
    owner: str,
    num_tokens: int,
    layout: TokenLayout | None,
    source: Callable[[], TokenLayout] | None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> TokenLayout:
    """The layout a grid attention module runs with: the one passed, else its source's; checked against N."""
    if attn_mask is not None or is_causal:
        raise ValueError(f"{owner} supports neither attention masks nor causal attention")
    if layout is None:
        if source is None:
            raise ValueError(
                f"{owner} needs the token layout: pass layout=TokenLayout(...) or patch the model with "
                "vca_patch.patch_model"
            )
        layout = source()
    layout.check(num_tokens)
    return layout


def tokens_to_grid(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[B, M, N, d] per-head tokens -> [B, M*d, H, W] grid of the patch rows (channel = m*d + j)."""
    B, M, _, d = x.shape
    H, W = layout.grid
    patches = x[:, :, layout.num_prefix_tokens :]  # [B, M, H*W, d]
    return patches.transpose(-1, -2).reshape(B, M * d, H, W)


def grid_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H*W, C]."""
    return x.flatten(2).transpose(1, 2)
