"""Binarisation with straight-through estimators, and `BinaryLinear`.

Weights: W_b = α ⊙ sign(W), α_o = mean_i |W_oi| per output channel (XNOR-Net/BWN); the sign's gradient is the
clipped straight-through estimator 1[|W| ≤ 1], α's flows exactly. Activations: x_b = c·sign(x) with a learnable
clip c (BiT-style elastic binarisation): ∂x_b/∂x ≈ 1[|x| ≤ c] (the STE of clamp(x, −c, c)), ∂x_b/∂c = sign(x).
sign(0) = 0. In PyTorch the ±1 products are emulated in floating point: this is the training path. With both
binarised, y = (sign(x)·sign(W)ᵀ)·(c·α) + b: the ±1 matmul is an exact integer, so a packed layer's XNOR-popcount
kernel (didb/kernel.py) gives the same numbers bit for bit. `binary_product` returns that integer and the scale c·α
apart, for callers that combine outputs linearly before the next sign (DIDB's attention update): summed as integers
the combination is exact in any order, so an exact 0 stays 0 in every backend (eager, compiled, onnxruntime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.layers.carried_module import CarriesOriginal
from vca_patch.targets.didb import kernel
from vca_patch.targets.didb.bits import all_nonzero_words, unpack_signs


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


class _ScaledSign(torch.autograd.Function):
    """sign(x) forward; gradient · 1[|x| ≤ c] / c backward: the STE of c·sign(x) when c multiplies outside."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, clip)
        return torch.sign(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, clip = ctx.saved_tensors
        clip = clip.to(x.dtype)
        inverse = torch.where(clip != 0, 1 / clip, torch.zeros_like(clip))
        return grad * (x.abs() <= clip).to(grad.dtype) * inverse.to(grad.dtype), None


@dataclass
class BinaryWeight:
    """A binarised weight α ⊙ sign(W): per-output-channel `scale` α [O] and the signs, either dense `[O, K]`
    (from latent weights, with the STE) or packed (`words`, and `nonzero` where W has zeros: int64 [O, ⌈K/64⌉])."""

    scale: torch.Tensor
    in_features: int
    dense_signs: torch.Tensor | None = None
    words: torch.Tensor | None = None
    nonzero: torch.Tensor | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> BinaryWeight:
        """α = mean |W| per row, sign(W) with the clipped STE."""
        return cls(weight.abs().mean(dim=1), weight.shape[1], dense_signs=_SignSTE.apply(weight))

    @property
    def signs(self) -> torch.Tensor:
        """sign(W) [O, K] in the scale's dtype."""
        if self.dense_signs is not None:
            return self.dense_signs

        return unpack_signs(self.words, self.nonzero, self.in_features, dtype=self.scale.dtype)

    def dense(self) -> torch.Tensor:
        """α ⊙ sign(W) [O, K]."""
        return self.scale.unsqueeze(1) * self.signs

    def rows(self, start: int, stop: int) -> BinaryWeight:
        """Output channels start..stop-1."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]

        return BinaryWeight(
            self.scale[start:stop], self.in_features, cut(self.dense_signs), cut(self.words), cut(self.nonzero)
        )

    @classmethod
    def cat(cls, parts: list[BinaryWeight]) -> BinaryWeight:
        """Stacked along the output channels (packed parts only, or dense parts only)."""
        if len(parts) == 1:
            return parts[0]

        def join(name: str) -> torch.Tensor | None:
            tensors = [getattr(p, name) for p in parts]
            return None if all(t is None for t in tensors) else torch.cat(tensors)

        nonzero = None
        if any(p.nonzero is not None for p in parts):  # a part without zeros: every real column is nonzero
            nonzero = torch.cat(
                [
                    p.nonzero
                    if p.nonzero is not None
                    else all_nonzero_words(p.scale.shape[0], p.in_features, p.scale.device)
                    for p in parts
                ]
            )
        return cls(join("scale"), parts[0].in_features, join("dense_signs"), join("words"), nonzero)


def binary_forward(
    x: torch.Tensor,
    weight: torch.Tensor | BinaryWeight,
    bias: torch.Tensor | None,
    clip: torch.Tensor | None,
    *,
    allow_kernel: bool = False,
) -> torch.Tensor:
    """A Linear with optional binarisation: `weight` real or a BinaryWeight, `clip` None (real inputs) or c.

    Both binarised: y = (sign(x)·sign(W)ᵀ)·(c·α) + b, by the XNOR kernel when `allow_kernel`, the weight is
    packed, x is float32 on the CPU, no gradient is recorded and the kernel is built; else in floating point.
    """
    if clip is None:
        return F.linear(x, weight.dense() if isinstance(weight, BinaryWeight) else weight, bias)
    if not isinstance(weight, BinaryWeight):
        return F.linear(binarize_activation(x, clip), weight, bias)
    scale = clip.to(weight.scale.dtype) * weight.scale
    if _use_kernel(x, weight, (x, clip, bias), allow_kernel):
        return kernel.xnor_linear(x, weight.words, weight.nonzero, scale, bias)
    y = F.linear(_ScaledSign.apply(x, clip), weight.signs.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


def binary_product(
    x: torch.Tensor, weight: BinaryWeight, clip: torch.Tensor, *, allow_kernel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sign(x)·sign(W)ᵀ, c·α): the layer's output is their product plus the bias (`binary_forward`'s numbers).

    The first is an exact integer in x's dtype (|value| ≤ in_features), from the XNOR kernel under the same
    conditions as `binary_forward`, else the float emulation with its straight-through gradients; the second is
    the per-output-channel scale [O] in x's dtype.
    """
    scale = (clip.to(weight.scale.dtype) * weight.scale).to(x.dtype)
    if _use_kernel(x, weight, (x, clip), allow_kernel):
        return kernel.xnor_linear(x, weight.words, weight.nonzero, torch.ones_like(scale), None), scale
    return F.linear(_ScaledSign.apply(x, clip), weight.signs.to(x.dtype)), scale


def _use_kernel(
    x: torch.Tensor, weight: BinaryWeight, inputs: tuple[torch.Tensor | None, ...], allow_kernel: bool
) -> bool:
    """The XNOR kernel runs for packed float32 weights and CPU inputs, without autograd, outside traced code
    (compiled or exported graphs take the float emulation: standard ops only), when the kernel is built."""
    if not allow_kernel or weight.words is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    if weight.scale.dtype != torch.float32 or torch.compiler.is_compiling():
        return False
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    return not grads and kernel.kernel_available()


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
    return binary_forward(x, BinaryWeight.from_weight(weight) if weights else weight, bias, clip)


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
        weight = BinaryWeight.from_weight(self.weight) if self.binarize_weights else self.weight
        return binary_forward(x, weight, self.bias, clip)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, binarize_weights={self.binarize_weights}, "
            f"binarize_activations={self.binarize_activations}"
        )
