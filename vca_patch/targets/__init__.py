"""Conversion targets, one package each; importing this package registers the built-in ones (the installed
plug-ins' targets are found through their entry points on the registry's first read)."""

from vca_patch.targets.base import CONFIG_TYPES, TargetConfig, register_target, unregister_target
from vca_patch.targets.didb.config import DIDBConfig
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.merge.config import MergeConfig
from vca_patch.targets.vca.config import VCAConfig

DEFAULT_TARGET = "vca"  # what `patch_model(model)` converts to when given no config


def default_config() -> TargetConfig:
    """A fresh config of the default target, with its default fields."""
    return CONFIG_TYPES[DEFAULT_TARGET]()


__all__ = [
    "CONFIG_TYPES",
    "DEFAULT_TARGET",
    "DIDBConfig",
    "MANOConfig",
    "MergeConfig",
    "TargetConfig",
    "VCAConfig",
    "default_config",
    "register_target",
    "unregister_target",
]
