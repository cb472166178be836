"""VCA's closed-form calibration of one layer (the `calibrate_layer` hook; recovery/calibrate.py drives it).

Every step is teacher-forced and measured by the driver's `measure(step)` after it ran (vca.md §6.3):
``neg_noise`` (e₋ = small noise), ``temperature`` (per-head Stage-II τ by a 1-D search), ``norm`` (RMSNorm₂ weight,
"rms" or "lstsq"), ``dwc`` (the depthwise 3×3 conv, with a local term jointly with its mix α/β, by ridge least
squares), ``magnitude`` (the per-token output gain by ridge least squares in log space) and ``refit`` (norm, conv
and gain again after the gain changed the scale). `grown_tokens` is the rule for layers that need more contrast
tokens. `capture` is the driver's record of the layer under the original model (`inputs`, `outputs`, `layout`);
`teacher` is the original attention's input to the output projection on `capture.inputs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.layers.layout import TokenLayout, tokens_to_grid
from vca_patch.layers.projection_probe import projection_input
from vca_patch.targets.vca.layer import VisualContrastAttention
from vca_patch.targets.vca.neighbourhood import neighbourhood_attention

DEFAULT_TEMPERATURES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)


@dataclass(frozen=True)
class VCACalibration:
    """VCA's calibration options (`VCAConfig.calibration_options`): `vca_patch.calibrate`'s per-layer keywords for
    VCA layers, their defaults and help written once here; constructing one validates them."""

    norm: str | None = field(default="rms", metadata={"help": 'RMSNorm₂ weight fit: "rms", "lstsq" or None (off)'})
    neg_noise: float = field(default=0.01, metadata={"help": "std of e₋ relative to the pooled-query RMS (0: off)"})
    temperature: bool | Sequence[float] = field(
        default=True,
        metadata={"help": "search a per-head Stage-II temperature (True: DEFAULT_TEMPERATURES, or the candidates)"},
    )
    dwc: bool = field(default=True, metadata={"help": "least-squares fit of the depthwise conv (and local-term mix)"})
    dwc_ridge: float = field(default=1e-3, metadata={"help": "ridge of the conv fit, relative to the Gram diagonal"})
    magnitude: bool = field(default=True, metadata={"help": "fit the per-token output gain, where layers have one"})
    magnitude_ridge: float = field(default=0.1, metadata={"help": "ridge of the gain fit (relative)"})
    magnitude_rounds: int = field(
        default=2, metadata={"help": "fits of norm, conv and gain in all (> 1: the 'refit' step)"}
    )

    def __post_init__(self) -> None:
        if self.norm not in (None, "rms", "lstsq"):
            raise ConfigError(f"norm must be 'rms', 'lstsq' or None, got {self.norm!r}")
        rounds = self.magnitude_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ConfigError(f"magnitude_rounds must be a positive integer, got {rounds!r}")

    @property
    def candidates(self) -> tuple[float, ...]:
        """The temperatures to search (none: no search)."""
        return DEFAULT_TEMPERATURES if self.temperature is True else tuple(self.temperature or ())


def calibrates(layer: nn.Module) -> bool:
    """Whether `layer` is one of VCA's layers (every VCA variant derives from VisualContrastAttention)."""
    return isinstance(layer, VisualContrastAttention)


@torch.no_grad()
def calibrate_layer(
    module: VisualContrastAttention,
    cap: Any,
    target: torch.Tensor,
    measure: Callable[[str], None],
    options: VCACalibration,
) -> dict[str, Any]:
    """Run the steps `options` ask for on one layer, in place; returns the report's facts for it."""
    facts: dict[str, Any] = {"contrast_tokens": module.num_contrast_tokens, "temperature": None}
    measure("init")
    if options.neg_noise > 0:
        _set_neg_noise(module, cap.inputs, cap.layout, options.neg_noise)
        measure("neg_noise")
    if options.candidates and module.stage2_temperature is not None:
        facts["temperature"] = _search_temperature(module, cap, target, options.candidates)
        measure("temperature")
    _fit_norm_and_dwc(module, cap, target, options, measure)
    if options.magnitude and getattr(module, "token_gain", None) is not None:
        _fit_magnitude(module, cap, target, options.magnitude_ridge)
        measure("magnitude")
        for _ in range(options.magnitude_rounds - 1):  # the gain changed the scale: refit norm, conv and gain again
            _fit_norm_and_dwc(module, cap, target, options)
            _fit_magnitude(module, cap, target, options.magnitude_ridge)
            measure("refit")
    return facts


def _fit_norm_and_dwc(
    module: VisualContrastAttention,
    cap: Any,
    target: torch.Tensor,
    options: VCACalibration,
    measure: Callable[[str], None] | None = None,
) -> None:
    if options.norm is not None:
        _fit_norm(module, cap, target, options.norm)
        if measure is not None:
            measure("norm")
    if options.dwc:
        _fit_dwc(module, cap, target, options.dwc_ridge)
        if measure is not None:
            measure("dwc")


def _qkv(module: VisualContrastAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k [B, M, N, d] after q_norm / k_norm, v [B, M, N, d])."""
    B, N, _ = x.shape
    q, k, v = module.qkv(x).view(B, N, 3, module.num_heads, module.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return module.q_norm(q), module.k_norm(k), v


def _rows(module: VisualContrastAttention, layout: TokenLayout) -> slice:
    """Token rows that go through Stage II (all, or only patches under exact prefix read-out)."""
    return slice(layout.num_prefix_tokens, None) if module.prefix_readout == "exact" else slice(None)


def _per_head_cosine(a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    """Cosine per head between two [B, T, M*d] tensors, flattened over batch and tokens."""
    a = a.double().reshape(*a.shape[:2], heads, -1).transpose(0, 2).reshape(heads, -1)
    b = b.double().reshape(*b.shape[:2], heads, -1).transpose(0, 2).reshape(heads, -1)
    return F.cosine_similarity(a, b, dim=1)


@torch.no_grad()
def _set_neg_noise(module: VisualContrastAttention, x: torch.Tensor, layout: TokenLayout, scale: float) -> None:
    q, _, _ = _qkv(module, x)
    pooled = F.adaptive_avg_pool2d(tokens_to_grid(q, layout), module.contrast_grid)
    rms = float(pooled.double().pow(2).mean().sqrt())
    module.contrast_embed_neg.normal_(0.0, scale * rms)


@torch.no_grad()
def _search_temperature(
    module: VisualContrastAttention, cap: Any, target: torch.Tensor, candidates: Sequence[float]
) -> list[float]:
    rows = _rows(module, cap.layout)
    scores = []
    for tau in candidates:
        module.stage2_temperature.fill_(tau)
        got, _ = projection_input(module, cap.inputs, cap.layout)
        scores.append(_per_head_cosine(got[:, rows], target[:, rows], module.num_heads))
    best = torch.stack(scores).argmax(0)  # [M]
    temperature = module.stage2_temperature
    chosen = torch.tensor([candidates[int(i)] for i in best], dtype=temperature.dtype, device=temperature.device)
    temperature.copy_(chosen)
    return chosen.tolist()


@torch.no_grad()
def _fit_norm(module: VisualContrastAttention, cap: Any, target: torch.Tensor, mode: str) -> None:
    rows = _rows(module, cap.layout)
    got, _ = projection_input(module, cap.inputs, cap.layout)
    M, d = module.num_heads, module.head_dim
    r = got[:, rows].double().reshape(-1, M, d)
    o = target[:, rows].double().reshape(-1, M, d)
    if mode == "rms":
        scale = (o.pow(2).sum((0, 1)) / r.pow(2).sum((0, 1)).clamp_min(1e-30)).sqrt()
    else:  # least squares per channel
        scale = (o * r).sum((0, 1)) / r.pow(2).sum((0, 1)).clamp_min(1e-30)
    weight = module.stage2_norm.weight
    weight.copy_((weight.double() * scale).to(weight.dtype))  # the product in float64, written in the param dtype


@torch.no_grad()
def _fit_magnitude(module: VisualContrastAttention, cap: Any, target: torch.Tensor, ridge: float) -> None:
    """Add to the log-gain the ridge fit of log(‖target‖ / ‖output‖) per token and head on [x, 1]."""
    rows = _rows(module, cap.layout)
    got, _ = projection_input(module, cap.inputs, cap.layout)
    M, d = module.num_heads, module.head_dim
    wanted = target[:, rows].double().reshape(-1, M, d).norm(dim=-1)  # [S, M]
    ratio = wanted / got[:, rows].double().reshape(-1, M, d).norm(dim=-1).clamp_min(1e-30)
    keep = ratio.gt(0).all(1)  # rows with a zero norm (padding, dead tokens) carry no magnitude
    y = ratio[keep].clamp_min(1e-30).log()  # [S, M]
    x = cap.inputs[:, rows].double().reshape(-1, cap.inputs.shape[-1])[keep]
    features = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)  # [S, C + 1]
    gram = features.T @ features
    gram.diagonal().add_(ridge * float(gram.diagonal()[:-1].mean().clamp_min(1e-12)))
    w = torch.linalg.solve(gram, features.T @ y).T  # [M, C + 1]
    gain = module.token_gain
    gain.weight.copy_((gain.weight.double() + w[:, :-1]).to(gain.weight.dtype))
    gain.bias.copy_((gain.bias.double() + w[:, -1]).to(gain.bias.dtype))


def _shifted(grid: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, C, H, W, 9]: the 3×3 neighbourhood (zero padding) in conv-weight order."""
    H, W = grid.shape[-2:]
    padded = F.pad(grid, (1, 1, 1, 1))
    return torch.stack([padded[:, :, i : i + H, j : j + W] for i in range(3) for j in range(3)], dim=-1)


@torch.no_grad()
def _fit_dwc(module: VisualContrastAttention, cap: Any, target: torch.Tensor, ridge: float) -> None:
    """Fit the depthwise conv (9 taps + bias per channel) by ridge least squares to what the original attention
    output has beyond VCA's; a layer with a local term (`local_window`) fits, jointly with it, the per-channel
    mix α (Stage II's output) and β (the neighbourhood attention)."""
    if not isinstance(module.norm, nn.Identity) or module.gate is not None:
        return  # the conv term is not additive at the proj input; leave it at zero
    module.dwc.weight.zero_()
    module.dwc.bias.zero_()
    mixed = bool(getattr(module, "local_window", 0))
    if mixed:  # the layer without its local term: α = 1, β = 0
        module.global_scale.fill_(1.0)
        module.local_scale.zero_()
    layout, P = cap.layout, cap.layout.num_prefix_tokens
    got, _ = projection_input(module, cap.inputs, layout)
    C = got.shape[-1]
    q, k, v = _qkv(module, cap.inputs)
    feats = _shifted(tokens_to_grid(v, layout).double())  # [B, C, H, W, 9]
    feats = torch.cat([feats, torch.ones_like(feats[..., :1])], dim=-1)  # + bias
    if mixed:  # + the neighbourhood term
        local = neighbourhood_attention(q, k, v, layout, module.local_window, module.scale)  # [B, M, H·W, d]
        local = local.transpose(-1, -2).reshape(feats.shape[:-1]).double()  # [B, C, H, W]
        feats = torch.cat([feats, local.unsqueeze(-1)], dim=-1)
    if getattr(module, "token_gain", None) is not None:  # the terms are scaled by the token gain too: weight rows
        gain = module.token_gain(cap.inputs[:, P:]).double().exp()  # [B, HW, M]
        gain = gain.repeat_interleave(module.head_dim, dim=-1).transpose(1, 2).reshape(feats.shape[:-1])
        feats = feats * gain.unsqueeze(-1)
    if mixed:  # + Stage II's output as the layer gives it (gain included), whose factor becomes α
        feats = torch.cat([feats, got[:, P:].double().transpose(1, 2).reshape(feats.shape[:-1]).unsqueeze(-1)], -1)
        residual = target[:, P:].double()  # [B, HW, C]
    else:
        residual = (target[:, P:] - got[:, P:]).double()
    T = feats.shape[-1]
    A = feats.permute(1, 0, 2, 3, 4).reshape(C, -1, T)  # [C, S, T]
    R = residual.permute(2, 0, 1).reshape(C, -1, 1)  # [C, S, 1]
    gram = A.transpose(1, 2) @ A
    reg = ridge * gram.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-12)
    gram = gram + reg.view(C, 1, 1) * torch.eye(T, dtype=gram.dtype, device=gram.device)
    w = torch.linalg.solve(gram, A.transpose(1, 2) @ R).squeeze(-1)  # [C, T]
    module.dwc.weight.copy_(w[:, :9].reshape(C, 1, 3, 3).to(module.dwc.weight.dtype))
    module.dwc.bias.copy_(w[:, 9].to(module.dwc.bias.dtype))
    if mixed:
        module.local_scale.copy_(w[:, 10].to(module.local_scale.dtype))
        module.global_scale.copy_(w[:, 11].to(module.global_scale.dtype))


def grown_tokens(n: int, num_patches: int) -> int:
    """The next contrast-token count for a layer that needs more: double the side, at most the grid."""
    side = 2 * math.isqrt(n)
    return min(side * side, math.isqrt(num_patches) ** 2)
