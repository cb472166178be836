"""Model-family adapters: where attention lives and how to rebuild each family."""

from __future__ import annotations

from torch import nn

from vca_patch.families.base import AttentionSite, LayoutTracker, ModelAdapter, SkippedSite
from vca_patch.families.diffusers.dit import DiffusersDiTAdapter
from vca_patch.families.generic.adapter import GenericAdapter
from vca_patch.families.timm.pvt import TimmPVTAdapter
from vca_patch.families.timm.swin import TimmSwinAdapter
from vca_patch.families.timm.vit import TimmViTAdapter
from vca_patch.families.transformers.pvt import HFPvtAdapter
from vca_patch.families.transformers.pvt_v1 import HFPvtV1Adapter
from vca_patch.families.transformers.swin import HFSwinAdapter
from vca_patch.families.transformers.vision import HFVisionAdapter

# First match wins: the family adapters before generic detection.
_ORDER = (
    TimmViTAdapter, TimmPVTAdapter, TimmSwinAdapter, HFPvtAdapter, HFPvtV1Adapter, HFSwinAdapter, HFVisionAdapter,
    DiffusersDiTAdapter, GenericAdapter,
)  # fmt: skip
ADAPTERS: dict[str, type[ModelAdapter]] = {adapter.name: adapter for adapter in _ORDER}


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The first adapter that knows this model's family, or None."""
    for adapter_cls in ADAPTERS.values():
        if adapter_cls.applies_to(model):
            return adapter_cls()
    return None


def adapter_by_name(name: str) -> ModelAdapter:
    try:
        return ADAPTERS[name]()
    except KeyError:
        raise ValueError(f"unknown adapter {name!r}; known: {sorted(ADAPTERS)}") from None


__all__ = [
    "ADAPTERS",
    "AttentionSite",
    "LayoutTracker",
    "ModelAdapter",
    "SkippedSite",
    "adapter_by_name",
    "adapter_for",
]
