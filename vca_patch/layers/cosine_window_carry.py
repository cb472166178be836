"""Carried SwinV2 window attention: cosine attention with a per-head logit scale and a continuous position bias.

As Swin's `CarriedWindowAttention`, plus the logit scale (a variant keeps it whatever it does with the windows: its
global branch stays cosine) and the CPB MLP with its coordinate table and pair index (kept where the window attention
is), under the original names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from vca_patch.layers.staged_carry import CarriedWindowAttention


@dataclass
class CarriedCosineWindowAttention(CarriedWindowAttention):
    """SwinV2 window attention: qkv (a view over q/k/v or qkv + q_bias/v_bias), proj, logit scale and CPB."""

    kind: ClassVar[str] = "SwinV2 cosine window"

    logit_scale: nn.Parameter | None = None
    position_mlp: nn.Module | None = None
    coords_table: torch.Tensor | None = None
    position_index: torch.Tensor | None = None
    cosine_names: tuple[str, str] = ("logit_scale", "cpb_mlp")  # the original module's names for both
