"""Binarisation with straight-through estimators, and `BinaryLinear`.

Weights: W_b = α ⊙ sign(W), α_o = mean_i |W_oi| per output channel (XNOR-Net/BWN); the sign's gradient is the
clipped straight-through estimator 1[|W| ≤ 1], α's flows exactly. Activations: x_b = c·sign(x) with a learnable
clip c (BiT-style elastic binarisation): ∂x_b/∂x ≈ 1[|x| ≤ c] (the STE of clamp(x, −c, c)), ∂x_b/∂c = sign(x).
sign(0) = 0. In PyTorch the ±1 products are emulated in floating point: this is the training path, not a kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.carried_module import CarriesOriginal


class _SignSTE(torch.autograd.Function):
    """sign(w) forward; gradient · 1[|w| ≤ 1] backward."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return torch.sign(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (w,) = ctx.saved_tensors
        return grad * (w.abs() <= 1).to(grad.dtype)


class _ClipSign(torch.autograd.Function):
    """c·sign(x) forward; ∂/∂x = 1[|x| ≤ c], ∂/∂c = sign(x) backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
        sign = torch.sign(x)
        ctx.save_for_backward(x, clip, sign)
        return clip.to(x.dtype) * sign

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, clip, sign = ctx.saved_tensors
        grad_x = grad * (x.abs() <= clip.to(x.dtype)).to(grad.dtype)
        grad_clip = (grad * sign).sum().reshape(clip.shape).to(clip.dtype)
        return grad_x, grad_clip


def binarize_weight(weight: torch.Tensor) -> torch.Tensor:
    """α ⊙ sign(W) with α = mean |W| over each output channel (row); clipped STE for the sign."""
    alpha = weight.abs().mean(dim=1, keepdim=True)
    return alpha * _SignSTE.apply(weight)


def binarize_activation(x: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """c·sign(x) with the learnable clip c (a scalar tensor); STE 1[|x| ≤ c]."""
    return _ClipSign.apply(x, clip)


def binary_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    clip: torch.Tensor | None,
    *,
    weights: bool = True,
) -> torch.Tensor:
    """y = binarize_activation(x, clip) · binarize_weight(W)ᵀ + b; `clip=None` keeps x real, `weights=False` W."""
    if clip is not None:
        x = binarize_activation(x, clip)
    return F.linear(x, binarize_weight(weight) if weights else weight, bias)


class BinaryLinear(CarriesOriginal, nn.Linear):
    """An nn.Linear whose weights and inputs are binarised (each switchable at run time).

    Built with `from_linear` around an existing Linear's own `weight`/`bias` parameters (same state-dict keys,
    the latent real weights the STE trains); adds `act_clip`, the learnable activation clip. The bias stays real.

    Attributes:
        binarize_weights: use α ⊙ sign(W) (else W).
        binarize_activations: use c·sign(x) (else x).
    """

    carried_names = ("weight", "bias")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        binarize_weights: bool = True,
        binarize_activations: bool = True,
        act_clip_init: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.binarize_weights = binarize_weights
        self.binarize_activations = binarize_activations
        self.act_clip = nn.Parameter(torch.full((), float(act_clip_init), device=device, dtype=dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> BinaryLinear:
        """A BinaryLinear sharing `linear`'s weight and bias parameters (no copy)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"BinaryLinear is built from a plain nn.Linear, got {type(linear).__name__}")
        act_clip_init = float(kwargs.get("act_clip_init", 1.0))
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", **kwargs)
        new.weight, new.bias = linear.weight, linear.bias
        dd = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        new.act_clip = nn.Parameter(torch.full((), act_clip_init, **dd))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = self.act_clip if self.binarize_activations else None
        return binary_linear(x, self.weight, self.bias, clip, weights=self.binarize_weights)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, binarize_weights={self.binarize_weights}, "
            f"binarize_activations={self.binarize_activations}"
        )
