"""Tiny timm models with random weights, and the kwargs that rebuild them."""

from __future__ import annotations

import timm
from torch import nn

TINY = {"depth": 2, "img_size": 64}


def tiny(name: str = "deit_tiny_patch16_224", **kwargs) -> tuple[nn.Module, dict]:
    args = {**TINY, **kwargs}
    return timm.create_model(name, pretrained=False, **args).eval(), args
