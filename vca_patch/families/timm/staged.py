"""The timm side of the hierarchical-model adapters (Swin, PVT)."""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.families.staged import StagedAdapter
from vca_patch.families.timm.base import create_timm_base
from vca_patch.families.timm.library import TIMM
from vca_patch.layers.layout import TokenLayout


class TimmStagedAdapter(StagedAdapter):
    """A timm model in stages: its `patch_embed` returns [B, H, W, C] tokens (stage 1's grid); bases rebuilt by
    timm."""

    library = TIMM

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return model.patch_embed

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        return TokenLayout(0, (output.shape[1], output.shape[2]))  # NHWC: stage 1's grid

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        return create_timm_base(description)
