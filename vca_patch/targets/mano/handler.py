"""`MANOHandler`: what Multipole Attention does with a `MANOConfig` (its layers and model-card text)."""

from __future__ import annotations

from typing import Any

from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.staged_carry import CarriedWindowAttention
from vca_patch.targets.handler import TargetHandler, register_handler
from vca_patch.targets.mano import card
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.mano.layer import MultipoleAttention
from vca_patch.targets.mano.windowed import build_window_mano


@register_handler(MANOConfig)
class MANOHandler(TargetHandler):
    """MANO's hooks: a `MultipoleAttention` per site (Swin: level 0 is the block's window attention)."""

    def build_layer(self, config: MANOConfig, carried: CarriedAttention, layer_index: int) -> MultipoleAttention:
        options = {name: getattr(config, name) for name in ("rate", "levels", "down", "up", "prefix")}
        if isinstance(carried, CarriedWindowAttention):  # Swin: level 0 is the block's window attention (its window)
            mano = build_window_mano(carried, pad=config.pad, **options)
        else:
            mano = MultipoleAttention.from_carried(carried, window=config.window, pad=config.pad, **options)
        mano.reset_mano_parameters(config.init)
        return mano

    def builds_variant(self, config_cls: type[MANOConfig], carried: CarriedAttention) -> bool:
        """MANO builds its own layer for Swin/SwinV2 window attention (level 0 the block's windows) only."""
        return isinstance(carried, CarriedWindowAttention)

    def layer_settings(self, config: MANOConfig, layer: MultipoleAttention) -> dict[str, Any]:
        settings = {
            "window": layer.window,
            "rate": layer.rate,
            "levels": "auto" if layer.levels is None else layer.levels,
            "down": layer.down_mode,
            "up": layer.up_mode,
        }
        return {**settings, **getattr(layer, "hierarchical_settings", {})}  # stage, grid of Swin layers

    def card_section(self, config_cls: type[MANOConfig], data: dict[str, Any]) -> tuple[str, str, str]:
        return card.card_section(data)
