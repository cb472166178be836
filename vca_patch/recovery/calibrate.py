"""Closed-form, training-free calibration of a freshly converted model on a few real batches.

Every step is teacher-forced (each VCA layer sees the original model's input to that layer) and
measured (relative error of the layer's attention output, after each step):

* ``neg_noise``: e₋ = small noise (a fraction of the pooled-query RMS), so λ and e₋ get a gradient
  from step 0 while the output stays preserved (vca.md §6.3.3).
* ``temperature``: per-head Stage-II temperature τ chosen by a 1-D search (needs a model patched with
  ``VCAConfig(stage2_temperature=True)``).
* ``norm``: RMSNorm₂ weight per channel so the output matches the original attention's scale ("rms")
  or its least-squares fit ("lstsq").
* ``dwc``: the depthwise 3×3 conv fitted by (ridge) least squares to the residual between the
  original attention output and VCA's (per channel, 9 taps + bias); with a local term (``VCAConfig(local_window=k)``)
  jointly with its per-channel mix (Stage II's output α, the neighbourhood attention β).
* ``magnitude``: the per-token output gain exp(W·x + b) (``VCAConfig(token_magnitude=True)``) fitted by ridge
  least squares in log space to the ratio of the original's per-token, per-head output norm to VCA's, from the
  layer input x (RMSNorm₂ gives every token the same magnitude; the original's varies).
* ``inputs="converted"``: calibrate the layers in block order on the inputs the CONVERTED model (earlier layers
  already calibrated) feeds each layer, still against the original's output on the original's input (measured on
  real DINOv2 weights: worse than teacher-forced, CLS cosine 0.84 -> 0.73; kept for models where it may help).
* ``grow_tokens``: layers whose error stays above a threshold are rebuilt with more contrast tokens
  (``VCAConfig.layer_contrast_tokens``) and calibrated again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.core.model_io import model_placement
from vca_patch.families.call_shims import attention_output, call_tokens
from vca_patch.layers.layout import TokenLayout, tokens_to_grid
from vca_patch.recovery.capture import (
    LayerCapture,
    batch_images,
    capture_original_layers,
    original_attention,
    patched_modules,
)
from vca_patch.surgery import PatchError, get_patch_state, patch_model, unpatch_model
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.layer import VisualContrastAttention
from vca_patch.targets.vca.neighbourhood import neighbourhood_attention

DEFAULT_TEMPERATURES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)


@dataclass
class LayerCalibration:
    """What calibration did to one layer and the relative error of its output after each step."""

    path: str
    layer_index: int
    contrast_tokens: int
    errors: dict[str, float] = field(default_factory=dict)
    temperature: list[float] | None = None


@dataclass
class CalibrationReport:
    """Per-layer calibration record; `errors` keys are the steps in the order they ran."""

    layers: list[LayerCalibration]
    steps: list[str]
    grown: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def mean_error(self, step: str | None = None) -> float:
        step = step or self.steps[-1]
        return sum(layer.errors[step] for layer in self.layers) / max(1, len(self.layers))


def _relative_error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    return float((candidate.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30))


def _pre_proj(
    module: nn.Module, x: torch.Tensor, layout: TokenLayout | None, proj: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input of the output projection `proj` (default module.proj), module output) for input x.

    `proj` is passed when `module` is an original attention module whose output projection has another name
    (transformers' o_proj/out_proj): it is the same Linear the VCA layer carries.
    """
    seen: list[torch.Tensor] = []
    handle = (proj or module.proj).register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        out = module(x) if layout is None else module(x, layout=layout)
    finally:
        handle.remove()
    return seen[0], attention_output(out)


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
    module: VisualContrastAttention, cap: LayerCapture, target: torch.Tensor, candidates: Sequence[float]
) -> list[float]:
    rows = _rows(module, cap.layout)
    scores = []
    for tau in candidates:
        module.stage2_temperature.fill_(tau)
        got, _ = _pre_proj(module, cap.inputs, cap.layout)
        scores.append(_per_head_cosine(got[:, rows], target[:, rows], module.num_heads))
    best = torch.stack(scores).argmax(0)  # [M]
    temperature = module.stage2_temperature
    chosen = torch.tensor([candidates[int(i)] for i in best], dtype=temperature.dtype, device=temperature.device)
    temperature.copy_(chosen)
    return chosen.tolist()


@torch.no_grad()
def _fit_norm(module: VisualContrastAttention, cap: LayerCapture, target: torch.Tensor, mode: str) -> None:
    rows = _rows(module, cap.layout)
    got, _ = _pre_proj(module, cap.inputs, cap.layout)
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
def _fit_magnitude(module: VisualContrastAttention, cap: LayerCapture, target: torch.Tensor, ridge: float) -> None:
    """Add to the log-gain the ridge fit of log(‖target‖ / ‖output‖) per token and head on [x, 1]."""
    rows = _rows(module, cap.layout)
    got, _ = _pre_proj(module, cap.inputs, cap.layout)
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


def _converted_inputs(model: nn.Module, path: str, batches: list[torch.Tensor]) -> torch.Tensor:
    """The input the patched model (as it is now) feeds the layer at `path`, over `batches` (whole forwards, so
    that the model's layout scopes open and close as usual)."""
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        seen.append(call_tokens(args, kwargs).detach())

    handle = model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for images in batches:
            model(images)
    finally:
        handle.remove()
    return torch.cat(seen)


def _shifted(grid: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, C, H, W, 9]: the 3×3 neighbourhood (zero padding) in conv-weight order."""
    H, W = grid.shape[-2:]
    padded = F.pad(grid, (1, 1, 1, 1))
    return torch.stack([padded[:, :, i : i + H, j : j + W] for i in range(3) for j in range(3)], dim=-1)


@torch.no_grad()
def _fit_dwc(module: VisualContrastAttention, cap: LayerCapture, target: torch.Tensor, ridge: float) -> None:
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
    got, _ = _pre_proj(module, cap.inputs, layout)
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


def _grown_tokens(n: int, num_patches: int) -> int:
    """The next contrast-token count for a layer that needs more: double the side, at most the grid."""
    side = 2 * math.isqrt(n)
    return min(side * side, math.isqrt(num_patches) ** 2)


@torch.no_grad()
def calibrate(
    model: nn.Module,
    batches: Iterable,
    *,
    norm: str | None = "rms",
    neg_noise: float = 0.01,
    temperature: bool | Sequence[float] = True,
    dwc: bool = True,
    dwc_ridge: float = 1e-3,
    grow_tokens: float | None = None,
    magnitude: bool = True,
    magnitude_ridge: float = 0.1,
    magnitude_rounds: int = 2,
    inputs: str = "original",
    captures: dict[str, LayerCapture] | None = None,
) -> CalibrationReport:
    """Calibrate a freshly patched model in place on `batches` (tensors, (images, labels) or dicts).

    norm: "rms", "lstsq" or None. neg_noise: std of e₋ relative to the pooled-query RMS (0: off).
    temperature: search a per-head Stage-II temperature (True: DEFAULT_TEMPERATURES, or a list of
    candidates) where the layers have one. dwc: least-squares fit of the depthwise conv.
    grow_tokens: rebuild layers whose final relative error exceeds this with more contrast tokens
    (re-patches those blocks; the rebuilt layers are calibrated again). magnitude: fit the per-token output gain
    where the layers have one (``VCAConfig(token_magnitude=True)``), ridge `magnitude_ridge` (relative); with
    `magnitude_rounds` > 1 the norm, conv and gain are refitted that many times in all (the "refit" step).
    inputs: "original" (teacher-forced: each layer sees the original model's input) or "converted" (each layer
    sees what the converted model, its earlier layers calibrated, feeds it; one more partial forward per layer).
    """
    if norm not in (None, "rms", "lstsq"):
        raise ValueError(f"norm must be 'rms', 'lstsq' or None, got {norm!r}")
    if isinstance(magnitude_rounds, bool) or not isinstance(magnitude_rounds, int) or magnitude_rounds < 1:
        raise ValueError(f"magnitude_rounds must be a positive integer, got {magnitude_rounds!r}")
    if inputs not in ("original", "converted"):
        raise ValueError(f"inputs must be 'original' or 'converted', got {inputs!r}")
    state = get_patch_state(model)
    if state is None:
        raise PatchError("model is not patched by vca_patch; call vca_patch.patch_model(model) first")
    images: list[torch.Tensor] = []
    if inputs == "converted":
        batches = list(batches)
        device, dtype = model_placement(model)
        images = [(lambda x: x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device))(
            batch_images(b)) for b in batches]  # fmt: skip
    if captures is None:
        captures = capture_original_layers(model, batches)
    candidates = DEFAULT_TEMPERATURES if temperature is True else tuple(temperature or ())
    was_training = model.training
    model.eval()
    layers: list[LayerCalibration] = []
    steps = ["init"]
    for path, module in patched_modules(model).items():
        if path not in captures or not isinstance(module, VisualContrastAttention):
            continue  # calibration is VCA's; other targets (MANO) start from their own preserving init
        cap = captures[path]
        # Keep the tracker on this layer's layout too, for any call below that does not pass `layout=`.
        get_patch_state(model).tracker.layout = cap.layout
        with original_attention(model):
            target, _ = _pre_proj(model.get_submodule(path), cap.inputs, None, proj=module.proj)
        if images:  # from here on the layer runs on the converted model's input, against the original's output
            cap = LayerCapture(_converted_inputs(model, path, images), cap.outputs, cap.layout)
        record = LayerCalibration(path, module.layer_index, module.num_contrast_tokens)

        def measure(step: str, module=module, cap=cap, record=record) -> None:
            record.errors[step] = _relative_error(attention_output(module(cap.inputs, layout=cap.layout)), cap.outputs)
            if step not in steps:
                steps.append(step)

        measure("init")
        if neg_noise > 0:
            _set_neg_noise(module, cap.inputs, cap.layout, neg_noise)
            measure("neg_noise")
        if candidates and module.stage2_temperature is not None:
            record.temperature = _search_temperature(module, cap, target, candidates)
            measure("temperature")
        if norm is not None:
            _fit_norm(module, cap, target, norm)
            measure("norm")
        if dwc:
            _fit_dwc(module, cap, target, dwc_ridge)
            measure("dwc")
        if magnitude and getattr(module, "token_gain", None) is not None:
            _fit_magnitude(module, cap, target, magnitude_ridge)
            measure("magnitude")
            for _ in range(magnitude_rounds - 1):  # the gain changed the scale: refit norm, conv and gain again
                if norm is not None:
                    _fit_norm(module, cap, target, norm)
                if dwc:
                    _fit_dwc(module, cap, target, dwc_ridge)
                _fit_magnitude(module, cap, target, magnitude_ridge)
                measure("refit")
        layers.append(record)
    report = CalibrationReport(layers, steps)

    if grow_tokens is not None:
        grow = {
            r.layer_index: _grown_tokens(r.contrast_tokens, captures[r.path].layout.num_patches)
            for r in layers
            if r.errors[steps[-1]] > grow_tokens
        }
        grow = {i: n for i, n in grow.items() if n != next(r.contrast_tokens for r in layers if r.layer_index == i)}
        if grow:
            regrown = _repatch_with_tokens(model, grow)
            sub = calibrate(
                model,
                (),
                norm=norm,
                neg_noise=neg_noise,
                temperature=temperature,
                dwc=dwc,
                dwc_ridge=dwc_ridge,
                magnitude=magnitude,
                magnitude_ridge=magnitude_ridge,
                magnitude_rounds=magnitude_rounds,
                captures={p: captures[p] for p in regrown},
            )
            by_path = {r.path: r for r in sub.layers}
            report.layers = [by_path.get(r.path, r) for r in layers]
            report.grown = grow
    model.train(was_training)
    return report


def _repatch_with_tokens(model: nn.Module, grow: dict[int, int]) -> list[str]:
    """Re-patch `model` with more contrast tokens in the blocks of `grow`; keep every other layer's state.

    Returns the paths of the rebuilt layers.
    """
    state = get_patch_state(model)
    if not isinstance(state.config, VCAConfig):
        raise PatchError("growing contrast tokens needs a VCAConfig-patched model")
    kept = {path: module.state_dict() for path, module in patched_modules(model).items()}
    overrides = dict(state.config.layer_contrast_tokens or {})
    overrides.update(grow)
    config = dataclasses.replace(state.config, layer_contrast_tokens=overrides)
    unpatch_model(model)
    patch_model(model, config)
    rebuilt = []
    for path, module in patched_modules(model).items():
        if module.layer_index in grow:
            rebuilt.append(path)
        else:
            module.load_state_dict(kept[path])
    return rebuilt
