"""The transformers side of the hierarchical-model adapters (Swin, PVT)."""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.families.staged import StagedAdapter
from vca_patch.families.transformers.library import TRANSFORMERS
from vca_patch.families.transformers.vision import HFVisionAdapter


class HFStagedAdapter(StagedAdapter):
    """A transformers model in stages: its base described and rebuilt as `HFVisionAdapter` does."""

    library = TRANSFORMERS

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        return HFVisionAdapter.describe_base(self, model)

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        return HFVisionAdapter.create_base(description)
