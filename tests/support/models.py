"""Tiny timm models with random weights, and the kwargs that rebuild them."""

from __future__ import annotations

import timm
import torch
from torch import nn

from vca_patch import DIDBConfig, MANOConfig, MergeConfig, VCAConfig

TINY = {"depth": 2, "img_size": 64}

# One config of each single-grid target (VCA with and without its local term): the deployment matrices' rows.
TARGET_CONFIGS = {
    "vca": lambda: VCAConfig(),
    "vca_local3": lambda: VCAConfig(local_window=3),
    "mano": lambda: MANOConfig(),
    "merge": lambda: MergeConfig(r=2),
    "didb": lambda: DIDBConfig(),
}


def tiny(name: str = "deit_tiny_patch16_224", **kwargs) -> tuple[nn.Module, dict]:
    args = {**TINY, **kwargs}
    return timm.create_model(name, pretrained=False, **args).eval(), args


def trained_a_little(model: nn.Module, *name_parts: str) -> nn.Module:
    """Move the parameters whose names contain any of `name_parts` off their init (a reload that
    re-initialised them would then be caught)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in name_parts):
                p.add_(torch.randn_like(p) * 0.05)
    return model
