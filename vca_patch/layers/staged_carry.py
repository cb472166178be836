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

from vca_patch.layers.carried import CarriedAttention

# The paper's lab (Agent Attention) uses n = 3², 4², 7², 7² in stages 1-4 of PVT and Swin.
DEFAULT_STAGE_CONTRAST_TOKENS = (9, 16, 49, 49)


def default_stage_contrast_tokens(stage: int) -> int:
    return DEFAULT_STAGE_CONTRAST_TOKENS[min(stage, len(DEFAULT_STAGE_CONTRAST_TOKENS) - 1)]


@dataclass
class StagedCarriedAttention(CarriedAttention):
    """Carried weights of one hierarchical-stage attention; a target builds its variant from it
    (VCA: `targets.vca.builders`).

    `settings` are the report's per-layer facts (stage, mode, grid used at the native input size).
    `mode_option` names the VCAConfig field that picks the conversion mode (None: one mode only).
    """

    mode_option: ClassVar[str | None] = None

    stage: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    def instantiate(self, layer_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
        raise TypeError(
            f"{type(self).__name__.removeprefix('Carried')} converts to VCA only (target 'vca'), not "
            f"{layer_cls.__name__}: its attention is not plain softmax attention over one token grid"
        )

    def instantiate_staged(self, layer_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
        """A target's layer built from this carry (the generic `instantiate` is refused), with the stage's facts."""
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
