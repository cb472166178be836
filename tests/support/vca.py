"""VCA layers moved off their function-preserving init, so that every term of the equations matters."""

from __future__ import annotations

import torch

from vca_patch.targets.vca.layer import VisualContrastAttention


def randomised(module: VisualContrastAttention) -> VisualContrastAttention:
    """Every parameter random, λ away from 0, so each term of the equations matters."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
        module.stage1_norm.weight.uniform_(0.5, 1.5)
        module.stage2_norm.weight.uniform_(0.5, 1.5)
    return module


def perturbed(module: VisualContrastAttention) -> VisualContrastAttention:
    """Move the new parameters off the preserving init, so that λ₁, λ₂, e± and the conv all matter."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("lambda"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "contrast_embed" in name or name.startswith("dwc"):
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.2)
    return module
