"""Exponential moving average of a model's weights."""

from __future__ import annotations

import copy

import torch
from torch import nn


class ModelEma:
    """EMA copy of `model` (floating-point parameters and buffers), updated after each optimizer step."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for ema_v, v in zip(self.module.state_dict().values(), model.state_dict().values(), strict=True):
            if ema_v.is_floating_point():
                ema_v.lerp_(v.detach(), 1.0 - self.decay)
            else:
                ema_v.copy_(v)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
