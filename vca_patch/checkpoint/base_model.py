"""Building the model to convert: a timm name, `hf-hub:` id, transformers or diffusers model (or one of an
out-of-tree family); pretrained, local or random weights.

Which library builds a name is asked of the registered families' libraries (`ModelLibrary.claims` / `load`,
families/library.py), in their `load_priority` order (`vca_patch.families.library_for_name`): diffusers folders and
repos, then transformers folders and ORG/NAME ids, then timm names (the fallback). Network access is checked up
front, so an offline machine gets a clear error in seconds instead of a long retry loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.core.hub_access import (
    HubUnavailableError,
    UnknownModelError,
    hub_offline_reason,
)
from vca_patch.families import legacy_export, libraries_by_priority, library_for_name

# The built-in loaders, importable from here as before; their home is the family's package, reached through the
# registry (`ModelLibrary.legacy_exports`), so this module imports no family.
_LIBRARY_LOADERS = ("HUB_PREFIX", "check_timm_name", "load_transformers_model")


def __getattr__(name: str) -> Any:
    """A built-in library's loader by its old name here (`from vca_patch.checkpoint.base_model import ...`)."""
    if name in _LIBRARY_LOADERS:
        return legacy_export(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sizes_from_config(name: str) -> bool:
    """Whether the model `name` takes its input size from its own config (`ModelLibrary.sizes_from_config`): a
    local folder asks the library that loads it (a diffusers folder also holds a config.json), any other name
    every library, without the Hub checks that claiming a Hub id may make."""
    if Path(name).is_dir():
        library = library_for_name(name)
        return library is not None and library.sizes_from_config(name)
    return any(library.sizes_from_config(name) for library in libraries_by_priority())


def is_transformers_source(name: str) -> bool:
    """`sizes_from_config` by its old name (a transformers folder or ORG/NAME id is such a model)."""
    return sizes_from_config(name)


def load_base_model(
    name: str,
    *,
    pretrained: bool = True,
    weights: Path | None = None,
    model_args: dict[str, Any] | None = None,
) -> nn.Module:
    """A timm model by name (or `hf-hub:` id), a transformers model (ORG/NAME or a local folder) or a diffusers
    transformer (a local pipeline folder or Hub repo), with Hub, local (`weights`) or random weights.

    `model_args` are timm constructor options (e.g. `{"img_size": 224}`), limited to the plain options a
    checkpoint can record (config_guard.TIMM_MODEL_ARGS): weights come from `weights`, never from a
    `checkpoint_path` or `pretrained_cfg_overlay`.
    """
    library = library_for_name(name)
    if library is None:
        raise UnknownModelError(f"unknown model {name!r}: no model family loads it")
    return library.load(name, pretrained=pretrained, weights=weights, model_args=model_args)


__all__ = [
    "HubUnavailableError",
    "UnknownModelError",
    "hub_offline_reason",
    "is_transformers_source",
    "load_base_model",
    "sizes_from_config",
    *_LIBRARY_LOADERS,
]
