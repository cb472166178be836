"""Conversion targets, one package each; importing this package registers the built-in ones, each config class with
its handler (the installed plug-ins' targets are found through their entry points on the registry's first read)."""

from vca_patch.targets.base import CONFIG_TYPES, TargetConfig, register_target, unregister_target
from vca_patch.targets.didb.config import DIDBConfig
from vca_patch.targets.handler import TargetHandler, handler_for, register_handler, unregister_handler
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
    "TargetHandler",
    "VCAConfig",
    "default_config",
    "handler_for",
    "register_handler",
    "register_target",
    "unregister_handler",
    "unregister_target",
]
