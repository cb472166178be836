"""Carried attention of one stage of a hierarchical ViT (PVT, Swin), and the VCA variant each converts to.

A hierarchical family's attention is not plain softmax self-attention over one token layout (a spatial
reduction, shifted windows), so its carry names the stage, the family's default contrast tokens for it, and
builds its own VCA variant; other targets (MANO) are refused rather than built around half the computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .carried import CarriedAttention
from .reduced_vca import SpatialReductionVCA
from .vca import VisualContrastAttention
from .window_vca import WindowedVCA

# The paper's lab (Agent Attention) uses n = 3², 4², 7², 7² in stages 1-4 of PVT and Swin.
DEFAULT_STAGE_CONTRAST_TOKENS = (9, 16, 49, 49)


def default_stage_contrast_tokens(stage: int) -> int:
    return DEFAULT_STAGE_CONTRAST_TOKENS[min(stage, len(DEFAULT_STAGE_CONTRAST_TOKENS) - 1)]


@dataclass
class StagedCarriedAttention(CarriedAttention):
    """Carried weights of one hierarchical-stage attention; `build_vca` makes its VCA variant.

    `settings` are the report's per-layer facts (stage, mode, grid used at the native input size).
    `mode_option` names the VCAConfig field that picks the conversion mode (None: one mode only).
    """

    mode_option: ClassVar[str | None] = None

    stage: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    def build_vca(self, mode: str | None, **kwargs: Any) -> VisualContrastAttention:
        raise NotImplementedError

    def instantiate(self, layer_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
        raise TypeError(
            f"{type(self).__name__.removeprefix('Carried')} converts to VCA only (target 'vca'), not "
            f"{layer_cls.__name__}: its attention is not plain softmax attention over one token grid"
        )

    def _build(self, layer_cls: type[VisualContrastAttention], **kwargs: Any) -> VisualContrastAttention:
        layer = CarriedAttention.instantiate(self, layer_cls, **kwargs)
        layer.hierarchical_settings = dict(self.settings)
        return layer


@dataclass
class CarriedReductionAttention(StagedCarriedAttention):
    """PVT spatial-reduction attention: q/kv (as a `QAndKV` view), proj and the reduction `sr` + `norm`.

    Modes (`VCAConfig.pvt_mode`): "carry" keeps the reduction (exact carry: Stage I over the reduced keys);
    "paper" drops it (the paper's placement: global VCA over the full-resolution keys, `kv` then reads the block
    input instead of the reduced grid it was trained on: approximate, `PAPER_MODE_NOTE`).
    """

    mode_option: ClassVar[str | None] = "pvt_mode"

    sr: nn.Module | None = None
    reduction_norm: nn.Module | None = None
    reduction_names: tuple[str, str] = ("sr", "norm")  # the original module's names for sr and its norm

    def build_vca(self, mode: str | None, **kwargs: Any) -> SpatialReductionVCA:
        if mode not in (None, "carry", "paper"):
            raise ValueError(f"pvt_mode must be 'carry' or 'paper', got {mode!r}")
        layer = self._build(SpatialReductionVCA, **kwargs)
        if mode == "paper" and self.sr is not None:
            layer.hierarchical_settings["mode"] = "reduction-dropped"
            grid = layer.hierarchical_settings.get("grid", "").split(",")[0]  # "56x56, keys 7x7 (sr 8)" -> "56x56"
            layer.hierarchical_settings["grid"] = f"{grid}, keys {grid} (sr dropped)"
            return layer
        layer.carry_reduction(self.sr, self.reduction_norm, self.reduction_names)
        layer.hierarchical_settings["mode"] = "reduction-kept"
        return layer


PAPER_MODE_NOTE = (
    "pvt_mode='paper': spatial reduction (conv + LayerNorm) dropped, global VCA over the full-resolution keys "
    "(kv reads the block input, not the reduced grid it was trained on: fine-tune)"
)


@dataclass
class CarriedWindowAttention(StagedCarriedAttention):
    """Swin window attention: fused qkv, proj, the relative-position bias table and its index (or their module)."""

    mode_option: ClassVar[str | None] = "swin_mode"

    bias_table: nn.Parameter | None = None
    bias_index: torch.Tensor | None = None
    # Or the module holding both (`relative_position_bias_table`, `relative_position_index`), carried whole
    # under its original name (transformers' `relative_position_bias`).
    bias_module: nn.Module | None = None
    bias_module_name: str | None = None

    def build_vca(self, mode: str | None, **kwargs: Any) -> WindowedVCA:
        layer = self._build(WindowedVCA, mode=mode or "residual", **kwargs)
        if layer.mode == "residual" and self.bias_module is not None:
            layer.carry_window_bias_module(self.bias_module_name, self.bias_module)
        elif layer.mode == "residual":
            layer.carry_window_bias(self.bias_table, self.bias_index)
        layer.hierarchical_settings["mode"] = layer.mode
        grid = self.settings.get("grid")
        window = self.settings.get("window")
        if grid is not None:
            text = f"global {grid[0]}x{grid[1]}"
            layer.hierarchical_settings["grid"] = (
                f"window {window[0]}x{window[1]} + {text}" if layer.mode == "residual" and window else text
            )
        layer.hierarchical_settings.pop("window", None)
        return layer
