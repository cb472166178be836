"""VCA's closed-form calibration of one layer (the `calibrate_layer` hook; recovery/calibrate.py drives it).

Every step is teacher-forced and measured by the driver's `measure(step)` after it ran (vca.md §6.3):
``neg_noise`` (e₋ = small noise), ``temperature`` (per-head Stage-II τ by a 1-D search), ``norm`` (RMSNorm₂ weight,
"rms" or "lstsq"), ``dwc`` (the depthwise 3×3 conv, with a local term jointly with its mix α/β, by ridge least
squares), ``magnitude`` (the per-token output gain by ridge least squares in log space) and ``refit`` (norm, conv
and gain again after the gain changed the scale). `grown_tokens` is the rule for layers that need more contrast
tokens. `capture` is the driver's record of the layer under the original model (`inputs`, `outputs`, `layout`);
`teacher` is the original attention's input to the output projection on `capture.inputs`.

No step changes the qkv projection, so the fits run the layer from q, k, v computed once per layer (`_LayerData`)
and stop at its output projection. The norm, conv and gain fits read every image, in chunks of images
(`CHUNK_TOKENS`) whose float64 sums they add up, so their memory does not grow with the images. The temperature
search, a choice among a few values per head, scores the first images up to `SEARCH_TOKENS` tokens.
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
from vca_patch.targets.vca import fused_cpu
from vca_patch.targets.vca.layer import VisualContrastAttention
from vca_patch.targets.vca.neighbourhood import neighbourhood_attention

DEFAULT_TEMPERATURES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)
SEARCH_TOKENS = 4096  # the temperature search scores the first images holding this many tokens (at least one)
CHUNK_TOKENS = 4096  # the conv fit sums its normal equations over chunks of images of about this many tokens


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
    data = _layer_data(module, cap, target)
    measure("init")
    if options.neg_noise > 0:
        _set_neg_noise(module, data, options.neg_noise)
        measure("neg_noise")
    if options.candidates and module.stage2_temperature is not None:
        facts["temperature"] = _search_temperature(module, data, options.candidates)
        measure("temperature")
    _fit_norm_and_dwc(module, data, options, measure)
    if options.magnitude and getattr(module, "token_gain", None) is not None:
        gram = _gain_gram(module, data)  # the same in every round
        for round_ in range(options.magnitude_rounds):  # > 1: the gain changed the scale, refit norm, conv and gain
            if round_:
                _fit_norm_and_dwc(module, data, options)
            _fit_magnitude(module, data, options.magnitude_ridge, gram)
            measure("refit" if round_ else "magnitude")
    return facts


def _fit_norm_and_dwc(
    module: VisualContrastAttention,
    data: _LayerData,
    options: VCACalibration,
    measure: Callable[[str], None] | None = None,
) -> None:
    if options.norm is not None:
        _fit_norm(module, data, options.norm)
        if measure is not None:
            measure("norm")
    if options.dwc:
        _fit_dwc(module, data, options.dwc_ridge)
        if measure is not None:
            measure("dwc")


@dataclass(frozen=True)
class _LayerData:
    """What the fits of one layer read: its captured inputs x [B, N, C], their layout, the teacher [B, N, C'] and,
    where the layer's forward allows it (`_replays`), q, k, v of x (`project_qkv`): no step changes the qkv
    projection, so it runs once per layer instead of once per fit."""

    x: torch.Tensor
    layout: TokenLayout
    teacher: torch.Tensor
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    def images(self, index: slice) -> _LayerData:
        """The same data for some of the images (views, no copy)."""
        qkv = None if self.qkv is None else (self.qkv[0][index], self.qkv[1][index], self.qkv[2][index])
        return _LayerData(self.x[index], self.layout, self.teacher[index], qkv)

    def chunks(self, tokens: int) -> list[_LayerData]:
        """Consecutive groups of images of about `tokens` tokens each (one image at least)."""
        images, per_image = self.x.shape[:2]
        step = max(1, tokens // max(1, per_image))
        return [self.images(slice(start, start + step)) for start in range(0, images, step)]

    def heads(self, module: VisualContrastAttention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k after q_norm / k_norm, v), each [B, M, N, d] (from the fused projection where none are cached)."""
        if self.qkv is not None:
            q, k, v = self.qkv
        else:
            B, N, _ = self.x.shape
            fused = module.qkv(self.x).view(B, N, 3, module.num_heads, module.head_dim)
            q, k, v = fused.permute(2, 0, 3, 1, 4).unbind(0)
        return module.q_norm(q), module.k_norm(k), v


# VisualContrastAttention's own forward runs project_qkv, then the fused kernel or `attend`, then project_out: a
# layer that keeps all of them is replayed from cached q, k, v; one that changes any runs whole.
_REPLAYED = ("forward", "forward_tokens", "project_qkv", "attend_fused", "project_out", "norm_and_gate")


def _replays(module: VisualContrastAttention) -> bool:
    """Whether `_projection_input` may run `module` from cached q, k, v (its forward is VCA's own)."""
    return all(getattr(type(module), name) is getattr(VisualContrastAttention, name) for name in _REPLAYED)


def _layer_data(module: VisualContrastAttention, cap: Any, target: torch.Tensor) -> _LayerData:
    qkv = module.project_qkv(cap.inputs) if _replays(module) else None
    return _LayerData(cap.inputs, cap.layout, target, qkv)


class _Projected(Exception):
    """Raised by `_stop_at_projection`'s hook: the projection's input is in hand, the rest of the forward is moot."""


def _stop_at_projection(module: VisualContrastAttention, run: Callable[[], object]) -> torch.Tensor:
    """The input of `module.proj` when `run()` calls it; the projection itself (and what follows) does not run."""
    seen: list[torch.Tensor] = []

    def stop(proj: nn.Module, args: tuple) -> None:
        seen.append(args[0])
        raise _Projected

    handle = module.proj.register_forward_pre_hook(stop)
    try:
        run()
    except _Projected:
        pass
    finally:
        handle.remove()
    return seen[0]


def _projection_input(module: VisualContrastAttention, data: _LayerData) -> torch.Tensor:
    """The layer's input to its output projection on `data.x`, as its forward computes it: from the cached q, k, v
    (the fused kernel where the forward would use it, else `attend`) where it `_replays`, else the whole forward."""
    x, layout = data.x, data.layout
    if data.qkv is None:
        return _stop_at_projection(module, lambda: module(x, layout=layout))
    if not module._fused_kernel_usable(x):
        return _stop_at_projection(module, lambda: module.attend(x, *data.qkv, layout))
    q, k, v = data.heads(module)
    P, (H, W) = layout.num_prefix_tokens, layout.grid
    o = fused_cpu.attend_cpu(q, k, v, P, H, W, None, None, *module.kernel_arguments())
    return module.norm_and_gate(x, module.apply_token_gain(x, o, layout))


def _rows(module: VisualContrastAttention, layout: TokenLayout) -> slice:
    """Token rows that go through Stage II (all, or only patches under exact prefix read-out)."""
    return slice(layout.num_prefix_tokens, None) if module.prefix_readout == "exact" else slice(None)


def _per_head_cosine(a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    """Cosine per head between two [B, T, M*d] tensors, flattened over batch and tokens."""
    a = a.double().reshape(*a.shape[:2], heads, -1).transpose(0, 2).reshape(heads, -1)
    b = b.double().reshape(*b.shape[:2], heads, -1).transpose(0, 2).reshape(heads, -1)
    return F.cosine_similarity(a, b, dim=1)


@torch.no_grad()
def _set_neg_noise(module: VisualContrastAttention, data: _LayerData, scale: float) -> None:
    q, _, _ = data.heads(module)
    pooled = F.adaptive_avg_pool2d(tokens_to_grid(q, data.layout), module.contrast_grid)
    rms = float(pooled.double().pow(2).mean().sqrt())
    module.contrast_embed_neg.normal_(0.0, scale * rms)


@torch.no_grad()
def _search_temperature(module: VisualContrastAttention, data: _LayerData, candidates: Sequence[float]) -> list[float]:
    """Per head, the candidate whose Stage-II output is closest in cosine to the teacher's; scored on the first
    images up to `SEARCH_TOKENS` tokens (a choice among a few values, which more images hardly move)."""
    rows = _rows(module, data.layout)
    first = data.chunks(SEARCH_TOKENS)[0]
    scores = []
    for tau in candidates:
        module.stage2_temperature.fill_(tau)
        got = _projection_input(module, first)
        scores.append(_per_head_cosine(got[:, rows], first.teacher[:, rows], module.num_heads))
    best = torch.stack(scores).argmax(0)  # [M]
    temperature = module.stage2_temperature
    chosen = torch.tensor([candidates[int(i)] for i in best], dtype=temperature.dtype, device=temperature.device)
    temperature.copy_(chosen)
    return chosen.tolist()


@torch.no_grad()
def _fit_norm(module: VisualContrastAttention, data: _LayerData, mode: str) -> None:
    """Scale the RMSNorm₂ weight per channel: RMS ratio ("rms") or least squares ("lstsq") of the teacher to the
    layer's output on the Stage-II rows, the sums taken in float64 over chunks of images."""
    rows, M, d = _rows(module, data.layout), module.num_heads, module.head_dim
    sums = torch.zeros(2, d, dtype=torch.float64, device=data.x.device)  # Σ o² (or Σ o·r), Σ r² per channel
    for chunk in data.chunks(CHUNK_TOKENS):
        r = _projection_input(module, chunk)[:, rows].double().reshape(-1, M, d)
        o = chunk.teacher[:, rows].double().reshape(-1, M, d)
        sums[0] += (o.pow(2) if mode == "rms" else o * r).sum((0, 1))
        sums[1] += r.pow(2).sum((0, 1))
    scale = sums[0] / sums[1].clamp_min(1e-30)
    scale = scale.sqrt() if mode == "rms" else scale
    weight = module.stage2_norm.weight
    weight.copy_((weight.double() * scale).to(weight.dtype))  # the product in float64, written in the param dtype


def _gain_features(module: VisualContrastAttention, data: _LayerData) -> torch.Tensor:
    """The gain fit's regressors [x, 1] on the Stage-II rows, [S, C + 1] (float64)."""
    x = data.x[:, _rows(module, data.layout)].double().reshape(-1, data.x.shape[-1])
    return torch.cat([x, torch.ones_like(x[:, :1])], dim=1)


def _gain_gram(module: VisualContrastAttention, data: _LayerData) -> torch.Tensor:
    """The Gram matrix [C + 1, C + 1] of the gain fit's regressors over every Stage-II row: the same in every
    round, so computed once per layer."""
    gram = None
    for chunk in data.chunks(CHUNK_TOKENS):
        features = _gain_features(module, chunk)
        gram = features.T @ features if gram is None else gram.addmm_(features.T, features)
    return gram


@torch.no_grad()
def _fit_magnitude(module: VisualContrastAttention, data: _LayerData, ridge: float, gram: torch.Tensor) -> None:
    """Add to the log-gain the ridge fit of log(‖teacher‖ / ‖output‖) per token and head on [x, 1], whose Gram
    matrix over every row is `gram` (`_gain_gram`); rows with a zero norm are taken out of it."""
    rows, M, d = _rows(module, data.layout), module.num_heads, module.head_dim
    gram, rhs = gram.clone(), None
    for chunk in data.chunks(CHUNK_TOKENS):
        got = _projection_input(module, chunk)
        wanted = chunk.teacher[:, rows].double().reshape(-1, M, d).norm(dim=-1)  # [S, M]
        ratio = wanted / got[:, rows].double().reshape(-1, M, d).norm(dim=-1).clamp_min(1e-30)
        keep = ratio.gt(0).all(1)  # rows with a zero norm (padding, dead tokens) carry no magnitude
        features = _gain_features(module, chunk)
        if not bool(keep.all()):
            gram.addmm_(features[~keep].T, features[~keep], alpha=-1.0)
        part = features[keep].T @ ratio[keep].clamp_min(1e-30).log()  # [C + 1, M]
        rhs = part if rhs is None else rhs.add_(part)
    gram.diagonal().add_(ridge * float(gram.diagonal()[:-1].mean().clamp_min(1e-12)))
    w = torch.linalg.solve(gram, rhs).T  # [M, C + 1]
    gain = module.token_gain
    gain.weight.copy_((gain.weight.double() + w[:, :-1]).to(gain.weight.dtype))
    gain.bias.copy_((gain.bias.double() + w[:, -1]).to(gain.bias.dtype))


def _shifted(grid: torch.Tensor) -> list[torch.Tensor]:
    """[B, C, H, W] -> its 3×3 neighbourhood (zero padding), nine [B, C, H, W] views in conv-weight order."""
    H, W = grid.shape[-2:]
    padded = F.pad(grid, (1, 1, 1, 1))
    return [padded[:, :, i : i + H, j : j + W] for i in range(3) for j in range(3)]


def _dwc_columns(mixed: bool) -> int:
    """Columns of the conv fit: 9 taps and a bias (then β's neighbourhood term and α's Stage-II output)."""
    return 12 if mixed else 10


def _dwc_design(module: VisualContrastAttention, data: _LayerData, mixed: bool, out: torch.Tensor) -> torch.Tensor:
    """The conv fit's per-channel design on the patch rows of `data`, [C, T + 1, S] (float64, in `out`'s memory): T
    columns (the 9 taps of v and a bias, then the neighbourhood term, all scaled by the token gain, then Stage II's
    output as the layer gives it) and, last, the right-hand side."""
    x, layout = data.x, data.layout
    P, (H, W) = layout.num_prefix_tokens, layout.grid
    got = _projection_input(module, data)[:, P:]  # [B, HW, C]
    B, C, M, d = x.shape[0], got.shape[-1], module.num_heads, module.head_dim
    T = _dwc_columns(mixed)
    A = out[: C * (T + 1) * B * H * W].view(C, T + 1, B, H, W)
    q, k, v = data.heads(module)
    for t, tap in enumerate(_shifted(tokens_to_grid(v, layout))):
        A[:, t].copy_(tap.transpose(0, 1))
    A[:, 9].fill_(1.0)
    if mixed:  # + the neighbourhood term
        local = neighbourhood_attention(q, k, v, layout, module.local_window, module.scale)  # [B, M, H·W, d]
        A[:, 10].view(M, d, B, H * W).copy_(local.permute(1, 3, 0, 2))
    if getattr(module, "token_gain", None) is not None:  # the terms are scaled by the token gain too
        gain = module.token_gain(x[:, P:]).double().exp()  # [B, HW, M]
        A.view(M, d, T + 1, B, H * W)[:, :, : T - mixed].mul_(gain.permute(2, 0, 1)[:, None, None])
    residual = A[:, T].view(C, B, H * W)
    if mixed:  # + Stage II's output (gain included); the right-hand side is then the whole teacher
        A[:, T - 1].view(C, B, H * W).copy_(got.permute(2, 0, 1))
        residual.copy_(data.teacher[:, P:].permute(2, 0, 1))
    else:
        residual.copy_((data.teacher[:, P:] - got).permute(2, 0, 1))
    return A.view(C, T + 1, -1)


def _dwc_normal_equations(
    module: VisualContrastAttention, data: _LayerData, mixed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """AAᵀ [C, T, T] and Ar [C, T] of the conv fit (float64): the Gram matrix of [A; r] summed over chunks of
    images, so that the design of all images never exists at once; the chunks share one buffer (a fresh one per
    chunk would fault its pages in again)."""
    chunks = data.chunks(CHUNK_TOKENS)
    T = _dwc_columns(mixed)
    size = module.num_heads * module.head_dim * (T + 1) * chunks[0].x.shape[0] * data.layout.num_patches
    buffer = torch.empty(size, dtype=torch.float64, device=data.x.device)
    total = None
    for chunk in chunks:
        A = _dwc_design(module, chunk, mixed, buffer)
        gram = A @ A.mT
        total = gram if total is None else total.add_(gram)
    return total[:, :T, :T], total[:, :T, T]


def _ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: float) -> torch.Tensor:
    """Per-channel ridge solution [C, T] of the normal equations (ridge relative to the mean Gram diagonal)."""
    C, T, _ = gram.shape
    reg = ridge * gram.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-12)
    gram = gram + reg.view(C, 1, 1) * torch.eye(T, dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram, rhs.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def _fit_dwc(module: VisualContrastAttention, data: _LayerData, ridge: float) -> None:
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
    w = _ridge_solve(*_dwc_normal_equations(module, data, mixed), ridge)  # [C, T]
    C = w.shape[0]
    module.dwc.weight.copy_(w[:, :9].reshape(C, 1, 3, 3).to(module.dwc.weight.dtype))
    module.dwc.bias.copy_(w[:, 9].to(module.dwc.bias.dtype))
    if mixed:
        module.local_scale.copy_(w[:, 10].to(module.local_scale.dtype))
        module.global_scale.copy_(w[:, 11].to(module.global_scale.dtype))


def grown_tokens(n: int, num_patches: int) -> int:
    """The next contrast-token count for a layer that needs more: double the side, at most the grid."""
    side = 2 * math.isqrt(n)
    return min(side * side, math.isqrt(num_patches) ** 2)
