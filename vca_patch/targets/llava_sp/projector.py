"""The wrapped projector: [spatial tokens; original projected patches], with the original's state-dict names."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vca_patch.targets.llava_sp.config import SpatialTokensConfig

SPATIAL_PREFIX = "spatial_tokens"


class SpatialTokenProjector(nn.Module):
    """Drop-in for a LLaVA `multi_modal_projector`.

    The original projector's children (linear_1, act, linear_2) are registered here under their own names, so
    the model's state-dict keys for them do not change; the original module itself is kept outside the module
    tree (`original`) and runs unchanged on the full input, so positions num_tokens… of the output are
    bit-identical to the original projector's. The new parameters live under `spatial_tokens.`.
    """

    def __init__(
        self,
        original: nn.Module,
        spatial: nn.Module,
        config: SpatialTokensConfig,
        *,
        grid: int,
        num_prefix_tokens: int,
        base_image_seq_length: int | None,
    ) -> None:
        super().__init__()
        self.__dict__["original"] = original  # not a submodule: its children are adopted below, names unchanged
        for name, child in original.named_children():
            self.add_module(name, child)
        self.add_module(SPATIAL_PREFIX, spatial)
        self.spatial_config = config
        self.grid = grid
        self.num_prefix_tokens = num_prefix_tokens
        self.base_image_seq_length = base_image_seq_length

    @property
    def num_tokens(self) -> int:
        return self.spatial_config.num_tokens

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        batch, length, channels = image_features.shape
        expected = self.num_prefix_tokens + self.grid * self.grid
        if length != expected:
            raise ValueError(
                f"spatial tokens expect {expected} vision tokens ({self.num_prefix_tokens} prefix + "
                f"{self.grid}×{self.grid} patches) but the projector got {length}; the vision feature select "
                "strategy or image size differs from the one the spatial tokens were built for"
            )
        patches = image_features[:, self.num_prefix_tokens :]
        grid_map = patches.transpose(1, 2).reshape(batch, channels, self.grid, self.grid)
        projected = self.original(image_features)
        spatial = self.spatial_tokens(grid_map).to(projected.dtype)
        return torch.cat([spatial, projected], dim=1)

    def extra_repr(self) -> str:
        return f"variant={self.spatial_config.variant}, num_tokens={self.num_tokens}, grid={self.grid}"

    def settings(self) -> dict[str, Any]:
        """JSON-safe facts saved next to the checkpoint."""
        return {
            "grid": self.grid,
            "num_prefix_tokens": self.num_prefix_tokens,
            "base_image_seq_length": self.base_image_seq_length,
        }
