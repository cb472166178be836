"""Model-family adapters: where attention lives and how to rebuild each family."""

from __future__ import annotations

from torch import nn

from vca_patch.families.base import AttentionSite, LayoutTracker, ModelAdapter, SkippedSite
from vca_patch.families.diffusers.dit import DiffusersDiTAdapter
from vca_patch.families.generic.adapter import GenericAdapter
from vca_patch.families.library import ModelLibrary
from vca_patch.families.timm.pvt import TimmPVTAdapter
from vca_patch.families.timm.swin import TimmSwinAdapter
from vca_patch.families.timm.vit import TimmViTAdapter
from vca_patch.families.transformers.pvt import HFPvtAdapter
from vca_patch.families.transformers.pvt_v1 import HFPvtV1Adapter
from vca_patch.families.transformers.swin import HFSwinAdapter
from vca_patch.families.transformers.vision import HFVisionAdapter

# First match wins: the family adapters before generic detection (`register_family` adds to this order).
_ORDER = (
    TimmViTAdapter, TimmPVTAdapter, TimmSwinAdapter, HFPvtAdapter, HFPvtV1Adapter, HFSwinAdapter, HFVisionAdapter,
    DiffusersDiTAdapter, GenericAdapter,
)  # fmt: skip
ADAPTERS: dict[str, type[ModelAdapter]] = {adapter.name: adapter for adapter in _ORDER}
_FALLBACK = GenericAdapter.name  # structural detection: tried last, after every family adapter


def register_family(adapter_cls: type[ModelAdapter], *, before: str | None = None) -> type[ModelAdapter]:
    """Add an out-of-tree family adapter to `ADAPTERS` (usable as a class decorator); returns `adapter_cls`.

    Priority (`adapter_for` asks adapters in order, first match wins): by default a new adapter goes after every
    family adapter registered so far and before the generic fallback, so built-in families keep their models and
    generic detection cannot take yours; `before="timm-vit"` (any registered name) puts it ahead of that one.
    Its `name` must be new (`unregister_family` it first to replace one).
    """
    name = getattr(adapter_cls, "name", None)
    if not (isinstance(adapter_cls, type) and issubclass(adapter_cls, ModelAdapter)) or not isinstance(name, str):
        raise TypeError(f"register_family takes a ModelAdapter subclass with a str `name`, got {adapter_cls!r}")
    if name in ADAPTERS:
        raise ValueError(f"adapter {name!r} is already registered ({ADAPTERS[name].__qualname__})")
    anchor = _FALLBACK if before is None else before
    if anchor not in ADAPTERS:
        raise ValueError(f"before={before!r} is not a registered adapter; known: {list(ADAPTERS)}")
    items = list(ADAPTERS.items())
    at = [key for key, _ in items].index(anchor)
    ADAPTERS.clear()
    ADAPTERS.update([*items[:at], (name, adapter_cls), *items[at:]])
    return adapter_cls


def unregister_family(name: str) -> type[ModelAdapter]:
    """Remove a registered adapter (e.g. at a test's teardown); the generic fallback cannot be removed."""
    if name == _FALLBACK:
        raise ValueError(f"the {_FALLBACK!r} fallback adapter cannot be unregistered")
    try:
        return ADAPTERS.pop(name)
    except KeyError:
        raise ValueError(f"unknown adapter {name!r}; known: {list(ADAPTERS)}") from None


def libraries() -> dict[str, ModelLibrary]:
    """Library name -> its hooks (families/library.py), from the registered adapters' `library`, in the order
    of `ADAPTERS` (the first adapter naming a library declares it)."""
    out: dict[str, ModelLibrary] = {}
    for adapter_cls in ADAPTERS.values():
        library = adapter_cls.library
        if library is not None:
            out.setdefault(library.name, library)
    return out


def loadable_adapters() -> dict[str, ModelLibrary]:
    """Adapter name -> the library it rebuilds, for every registered adapter that declares one (a checkpoint
    config.json may name only these)."""
    return {name: cls.library for name, cls in ADAPTERS.items() if cls.library is not None}


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
    "ModelLibrary",
    "SkippedSite",
    "adapter_by_name",
    "adapter_for",
    "libraries",
    "loadable_adapters",
    "register_family",
    "unregister_family",
]
