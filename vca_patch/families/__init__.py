"""Model-family adapters: where attention lives and how to rebuild each family."""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.core.patch_state import get_patch_state
from vca_patch.core.registry import Registry, RegistryError
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

FAMILY_GROUP = "vca_patch.families"  # entry-point group: NAME = "module:AdapterClass", NAME the adapter's `name`
_FALLBACK = GenericAdapter.name  # structural detection: tried last, after every family adapter


def _check_adapter(name: str, adapter_cls: Any) -> None:
    if not (isinstance(adapter_cls, type) and issubclass(adapter_cls, ModelAdapter)):
        raise TypeError(f"register_family takes a ModelAdapter subclass with a str `name`, got {adapter_cls!r}")
    if adapter_cls.__dict__.get("name") != name:  # its own name: a subclass does not inherit its parent's
        raise RegistryError(
            f"adapter {name!r}: {adapter_cls.__qualname__} must declare `name = {name!r}` itself, "
            f"got {adapter_cls.__dict__.get('name')!r}"
        )


# First match wins (`adapter_for`): the family adapters, then the plug-ins' (registered before the fallback), then
# generic detection.
ADAPTERS: Registry[type[ModelAdapter]] = Registry(
    "adapter", group=FAMILY_GROUP, check=_check_adapter, default_before=_FALLBACK
)
_BUILT_IN = (
    TimmViTAdapter, TimmPVTAdapter, TimmSwinAdapter, HFPvtAdapter, HFPvtV1Adapter, HFSwinAdapter, HFVisionAdapter,
    DiffusersDiTAdapter, GenericAdapter,
)  # fmt: skip
for _adapter in _BUILT_IN:
    ADAPTERS.register(_adapter.name, _adapter)
_BUILT_IN_LIBRARIES = tuple({id(a.library): a.library for a in _BUILT_IN if a.library is not None}.values())


def register_family(adapter_cls: type[ModelAdapter], *, before: str | None = None) -> type[ModelAdapter]:
    """Add an out-of-tree family adapter to `ADAPTERS` (usable as a class decorator); returns `adapter_cls`.

    Priority (`adapter_for` asks adapters in order, first match wins): by default a new adapter goes after every
    family adapter registered so far and before the generic fallback, so built-in families keep their models and
    generic detection cannot take yours; `before="timm-vit"` (any registered name) puts it ahead of that one.
    Its `name` must be its own and new (another class's is refused: `unregister_family` it first to replace it);
    registering the same class again is a no-op. An installed plug-in declares it as an entry point of the group
    `vca_patch.families` instead, found on the registry's first read.
    """
    name = getattr(adapter_cls, "name", None)
    if not (isinstance(adapter_cls, type) and issubclass(adapter_cls, ModelAdapter)) or not isinstance(name, str):
        raise TypeError(f"register_family takes a ModelAdapter subclass with a str `name`, got {adapter_cls!r}")
    return ADAPTERS.register(name, adapter_cls, before=before)


def unregister_family(name: str) -> type[ModelAdapter]:
    """Remove a registered adapter (e.g. at a test's teardown); the generic fallback cannot be removed."""
    if name == _FALLBACK:
        raise ValueError(f"the {_FALLBACK!r} fallback adapter cannot be unregistered")
    return ADAPTERS.unregister(name)


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


def hooks_for(model: nn.Module) -> type[ModelAdapter]:
    """The class whose hooks answer for `model` in shared code (how to probe and call it, what `inspect` shows):
    the adapter that patched it, else the first registered adapter that applies, else `ModelAdapter` itself,
    whose hooks are the defaults."""
    state = get_patch_state(model)
    adapter = state.adapter if state is not None else adapter_for(model)
    return type(adapter) if adapter is not None else ModelAdapter


def libraries_by_priority() -> list[ModelLibrary]:
    """The registered libraries in `load_priority` order (ties: registration order), as names are claimed."""
    return sorted(libraries().values(), key=lambda library: library.load_priority)


def library_for_name(name: str) -> ModelLibrary | None:
    """The first library by `load_priority` that claims the model name, Hub id or folder `name`, or None."""
    return next((library for library in libraries_by_priority() if library.claims(name)), None)


def legacy_export(module: str, name: str) -> Any:
    """`name` from a built-in library's `legacy_exports`, for a module-level `__getattr__` of `module` (old imports
    of the family checks and loaders shared modules re-exported). Only the built-in families are asked: this runs
    while modules are imported, when no registry with entry points may be read."""
    for library in _BUILT_IN_LIBRARIES:
        exports = library.legacy_exports()
        if name in exports:
            return exports[name]
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def adapter_by_name(name: str) -> ModelAdapter:
    """An instance of the registered adapter `name` (built in, registered, or an installed plug-in's)."""
    if name not in ADAPTERS:
        raise ValueError(ADAPTERS.unknown(name))
    return ADAPTERS[name]()


__all__ = [
    "ADAPTERS",
    "FAMILY_GROUP",
    "AttentionSite",
    "LayoutTracker",
    "ModelAdapter",
    "ModelLibrary",
    "SkippedSite",
    "adapter_by_name",
    "adapter_for",
    "hooks_for",
    "legacy_export",
    "libraries",
    "libraries_by_priority",
    "library_for_name",
    "loadable_adapters",
    "register_family",
    "unregister_family",
]
