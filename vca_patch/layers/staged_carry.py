"""Carried attention of one stage of a hierarchical ViT (PVT, Swin).

A hierarchical family's attention is not plain softmax self-attention over one token layout (a spatial
reduction, shifted windows), so its carry names the stage and refuses a generic replacement: a target that takes
it builds its own variant (and may offer modes for it, e.g. keeping or dropping the reduction); other targets are
refused (`VariantRequired`) rather than built around half the computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from vca_patch.layers.carried import CarriedAttention, VariantRequired


@dataclass
class StagedCarriedAttention(CarriedAttention):
    """Carried weights of one hierarchical-stage attention; a target that takes it builds its variant from it.

    `settings` are the report's per-layer facts (stage, mode, grid used at the native input size); `grid` is the
    stage's token grid (H, W) at the model's input size, where the family knows it, so a target can check what it
    pools there (e.g. VCA's contrast tokens); `kind` is how errors name this attention.
    """

    kind: ClassVar[str] = "hierarchical-stage"

    stage: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    grid: tuple[int, int] | None = None

    def instantiate(self, layer_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
        """Refused (`VariantRequired`): only a target's own variant (`instantiate_staged`) takes a stage."""
        raise VariantRequired(self.kind, layer_cls, self)

    def instantiate_staged(self, layer_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
        """A target's layer built from this carry (the generic `instantiate` is refused), with the stage's facts."""
        layer = CarriedAttention.instantiate(self, layer_cls, **kwargs)
        layer.hierarchical_settings = dict(self.settings)
        return layer


@dataclass
class CarriedReductionAttention(StagedCarriedAttention):
    """PVT spatial-reduction attention: q/kv (as a `QAndKV` view), proj and the reduction `sr` + `norm`.

    A target's variant may keep the reduction (an exact carry: its keys read the reduced grid) or drop it (keys at
    full resolution, where `kv` then reads the block input instead of the reduced grid it was trained on:
    approximate).
    """

    kind: ClassVar[str] = "PVT spatial-reduction"

    sr: nn.Module | None = None
    reduction_norm: nn.Module | None = None
    reduction_names: tuple[str, str] = ("sr", "norm")  # the original module's names for sr and its norm


@dataclass
class CarriedWindowAttention(StagedCarriedAttention):
    """Swin window attention: fused qkv, proj, the relative-position bias table and its index (or their module)."""

    kind: ClassVar[str] = "Swin window"

    bias_table: nn.Parameter | None = None
    bias_index: torch.Tensor | None = None
    # Or the module holding both (`relative_position_bias_table`, `relative_position_index`), carried whole
    # under its original name (transformers' `relative_position_bias`).
    bias_module: nn.Module | None = None
    bias_module_name: str | None = None
