"""Building the model to convert: a timm name, `hf-hub:` id, transformers or diffusers model (or one of an
out-of-tree family); pretrained, local or random weights.

Which library builds a name is asked of the registered families' libraries (`ModelLibrary.claims` / `load`,
families/library.py), in their `load_priority` order: diffusers folders and repos, then transformers folders and
ORG/NAME ids, then timm names (the fallback). Network access is checked up front, so an offline machine gets a
clear error in seconds instead of a long retry loop.
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
from vca_patch.families import libraries

# The built-in loaders, importable from here as before (their home is the family's package).
from vca_patch.families.timm.load import HUB_PREFIX, check_timm_name
from vca_patch.families.transformers.load import load_transformers_model, names_transformers_model


def is_transformers_source(name: str) -> bool:
    """A local transformers model folder, or an ORG/NAME Hub id (timm names have no slash)."""
    folder = Path(name)
    if folder.is_dir():
        from vca_patch.families.diffusers.source import local_transformer_folder

        return (folder / "config.json").is_file() and local_transformer_folder(folder) is None  # not diffusers'
    return names_transformers_model(name)


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
    for library in sorted(libraries().values(), key=lambda library: library.load_priority):
        if library.claims(name):
            return library.load(name, pretrained=pretrained, weights=weights, model_args=model_args)
    raise UnknownModelError(f"unknown model {name!r}: no model family loads it")


__all__ = [
    "HUB_PREFIX",
    "HubUnavailableError",
    "UnknownModelError",
    "check_timm_name",
    "hub_offline_reason",
    "is_transformers_source",
    "load_base_model",
    "load_transformers_model",
]
