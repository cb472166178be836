"""Model-family adapters: where attention lives and how to rebuild each family."""

from __future__ import annotations

from torch import nn

from .base import AttentionSite, LayoutTracker, ModelAdapter, SkippedSite
from .diffusers_dit import DiffusersDiTAdapter
from .generic import GenericAdapter
from .hf_pvt import HFPvtAdapter
from .hf_pvt_v1 import HFPvtV1Adapter
from .hf_swin import HFSwinAdapter
from .hf_vision import HFVisionAdapter
from .timm_pvt import TimmPVTAdapter
from .timm_swin import TimmSwinAdapter
from .timm_vit import TimmViTAdapter

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
