"""timm's library hooks (families/library.py): its guard checks, its config.json keys and loading by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.families.library import ModelLibrary
from vca_patch.families.timm.guard import check_timm_base, check_timm_keys, timm_config_keys


class TimmLibrary(ModelLibrary):
    name = "timm"
    load_priority = 90  # the fallback: every name no other library claims is a timm name (or an unknown one)

    def check_base(self, base: dict[str, Any], where: str) -> None:
        check_timm_base(base, where)

    def check_config_keys(self, meta: dict[str, Any], where: str) -> None:
        check_timm_keys(meta, where)

    def config_keys(self, model: nn.Module, base: dict[str, Any]) -> dict[str, Any]:
        return timm_config_keys(model, base)

    def claims(self, name: str) -> bool:
        return True

    def load(
        self, name: str, *, pretrained: bool = True, weights: Path | None = None, model_args: dict[str, Any] | None
    ) -> nn.Module:
        from vca_patch.families.timm.load import load_timm_model

        return load_timm_model(name, pretrained=pretrained, weights=weights, model_args=model_args)

    def legacy_exports(self) -> dict[str, Any]:
        """timm's checks and name helpers, once re-exported by checkpoint.config_guard / checkpoint.base_model."""
        from vca_patch.families.timm import guard
        from vca_patch.families.timm.load import HUB_PREFIX, check_timm_name

        names = ("TIMM_ARCHITECTURE", "TIMM_CFG_SOURCES", "TIMM_MODEL_ARGS", "check_timm_architecture",
                 "check_timm_base", "check_timm_keys", "check_timm_model_args")  # fmt: skip
        loaders = {"HUB_PREFIX": HUB_PREFIX, "check_timm_name": check_timm_name}
        return {name: getattr(guard, name) for name in names} | loaders


TIMM = TimmLibrary()
