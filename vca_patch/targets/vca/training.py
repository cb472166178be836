"""VCA's recovery-training hooks: the λ parameter group and the λ guard that keeps λ in [0, λ_max].

`VCAHandler.parameter_groups` / `guard_parameters` / `parameter_trace` (the handler's recipe hooks) call these;
the recipe engine reaches them only through the patched model's config and its handler.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vca_patch.targets.vca.differential_lambda import DifferentialLambda
from vca_patch.targets.vca.layer import VisualContrastAttention

LAMBDA_ROUNDOFF = 1e-5  # float32 round-off of λ after a clamp: the guard leaves λ within this of its bounds


def vca_layers(model: nn.Module) -> list[VisualContrastAttention]:
    """The VCA layers of `model`: its modules, and the layers diffusers attention processors hold (outside the
    module tree, bound to the attention module's parameters at each call)."""
    found = []
    for m in model.modules():
        layer = m if isinstance(m, VisualContrastAttention) else getattr(getattr(m, "processor", None), "layer", None)
        if isinstance(layer, VisualContrastAttention):
            found.append(layer)
    return found


def lambda_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The λ₁, λ₂ vectors (q1, k1, q2, k2) of every VCA layer of `model`: the recipe's "lambda" group."""
    return [p for m in vca_layers(model) for lam in (m.lambda1, m.lambda2) for p in lam.parameters()]


@torch.no_grad()
def clamp_lambda(lam: DifferentialLambda, low: float = 0.0, high: float = 0.95, value: float | None = None) -> bool:
    """Project λ = exp⟨q1,k1⟩ − exp⟨q2,k2⟩ + λ_init back into [low, high] by moving q2 along k2.

    Returns True when it had to move. The vectors stay non-zero, so λ keeps its gradient. `value`: λ if
    already read.
    """
    value = float(lam()) if value is None else value
    if low - LAMBDA_ROUNDOFF <= value <= high + LAMBDA_ROUNDOFF:  # a previous clamp's round-off is no violation
        return False
    goal = min(max(value, low), high)
    q1, k1, q2, k2 = (p.double() for p in (lam.q1, lam.k1, lam.q2, lam.k2))
    rest = math.exp(float(q1 @ k1)) + lam.lambda_init - goal  # = exp⟨q2, k2⟩ at the goal, > 0 here
    target = math.log(rest)
    norm2 = float(k2 @ k2)
    if norm2 < 1e-20:
        return False
    q2 = q2 + (target - float(q2 @ k2)) * k2 / norm2
    lam.q2.copy_(q2.to(lam.q2.dtype))
    return True


@torch.no_grad()
def guard_lambdas(model: nn.Module, high: float) -> int:
    """Clamp every VCA layer's λ₁, λ₂ into [0, high]; returns how many were moved. Reads all λ in one transfer."""
    lams = [lam for m in vca_layers(model) for lam in (m.lambda1, m.lambda2)]
    if not lams:
        return 0
    values = torch.stack([lam().reshape(()).double() for lam in lams]).tolist()
    return sum(clamp_lambda(lam, 0.0, high, value) for lam, value in zip(lams, values, strict=True))


def lambda_trace(model: nn.Module) -> list[list[float]]:
    """[[λ₁, λ₂] per VCA layer] for health logs."""
    return [list(m.lambdas()) for m in vca_layers(model)]
