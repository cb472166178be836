"""Carried SwinV2 window attention: cosine attention with a per-head logit scale and a continuous position bias.

As Swin's `CarriedWindowAttention`, plus the logit scale (kept in both modes: the VCA branch stays cosine) and the
CPB MLP with its coordinate table and pair index (kept by the "residual" mode only), under the original names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .staged_carry import CarriedWindowAttention
from .window_vca import WindowedVCA


@dataclass
class CarriedCosineWindowAttention(CarriedWindowAttention):
    """SwinV2 window attention: qkv (a view over q/k/v or qkv + q_bias/v_bias), proj, logit scale and CPB."""

    logit_scale: nn.Parameter | None = None
    position_mlp: nn.Module | None = None
    coords_table: torch.Tensor | None = None
    position_index: torch.Tensor | None = None
    cosine_names: tuple[str, str] = ("logit_scale", "cpb_mlp")  # the original module's names for both

    def build_vca(self, mode: str | None, **kwargs: Any) -> WindowedVCA:
        layer = self._build(WindowedVCA, mode=mode or "residual", **kwargs)
        layer.carry_cosine(
            self.logit_scale, self.position_mlp, self.coords_table, self.position_index, names=self.cosine_names
        )
        layer.hierarchical_settings.update(mode=layer.mode, attention="cosine")
        grid, window = self.settings.get("grid"), layer.hierarchical_settings.pop("window", None)
        if grid is not None:
            text = f"global {grid[0]}x{grid[1]}"
            residual = layer.mode == "residual" and window
            layer.hierarchical_settings["grid"] = f"window {window[0]}x{window[1]} + {text}" if residual else text
        return layer
