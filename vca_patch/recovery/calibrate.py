"""Closed-form, training-free calibration of a freshly converted model on a few real batches: the driver.

The driver is target-agnostic: it captures the original model's per-layer inputs and outputs (`capture.py`),
computes each layer's teacher (the original attention's input to its output projection), and hands the layer to
its target's `TargetConfig.calibrate_layer` hook, which fits it in place and calls back `measure(step)` so that
every step's relative error of the layer's output is recorded. Targets without a closed-form calibration
(`calibrates(layer)` False: MANO, DIDB, ...) start from their own preserving init and are left alone. VCA's steps
(neg_noise, temperature, norm, dwc, magnitude, refit) are described in `vca_patch/targets/vca/calibrate.py`.

* ``inputs="converted"``: calibrate the layers in block order on the inputs the CONVERTED model (earlier layers
  already calibrated) feeds each layer, still against the original's output on the original's input (measured on
  real DINOv2 weights: worse than teacher-forced, CLS cosine 0.84 -> 0.73; kept for models where it may help).
* ``grow_tokens``: layers whose error stays above a threshold are rebuilt with more tokens (the target's
  `grown_tokens` / `with_more_tokens` hooks; VCA: `VCAConfig.layer_contrast_tokens`) and calibrated again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vca_patch.core.model_io import model_placement
from vca_patch.families.call_shims import attention_output, call_tokens
from vca_patch.layers.projection_probe import projection_input
from vca_patch.recovery.capture import (
    LayerCapture,
    batch_images,
    capture_original_layers,
    original_attention,
    patched_modules,
)
from vca_patch.surgery import PatchError, get_patch_state, patch_model, unpatch_model

_pre_proj = projection_input  # the name tests and older callers use


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


@dataclass(frozen=True)
class CalibrationOptions:
    """`calibrate`'s keywords (see its docstring); the per-layer ones go to the target's `calibrate_layer`."""

    norm: str | None = "rms"
    neg_noise: float = 0.01
    temperature: bool | Sequence[float] = True
    dwc: bool = True
    dwc_ridge: float = 1e-3
    grow_tokens: float | None = None
    magnitude: bool = True
    magnitude_ridge: float = 0.1
    magnitude_rounds: int = 2
    inputs: str = "original"

    def __post_init__(self) -> None:
        if self.norm not in (None, "rms", "lstsq"):
            raise ValueError(f"norm must be 'rms', 'lstsq' or None, got {self.norm!r}")
        rounds = self.magnitude_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"magnitude_rounds must be a positive integer, got {rounds!r}")
        if self.inputs not in ("original", "converted"):
            raise ValueError(f"inputs must be 'original' or 'converted', got {self.inputs!r}")

    def layer_options(self) -> dict[str, Any]:
        """The keywords a target's `calibrate_layer` gets (all but the driver's own: grow_tokens, inputs)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("grow_tokens", "inputs")}


def _relative_error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    return float((candidate.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30))


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
    captures: the original model's per-layer captures when already taken (`capture_original_layers`).
    """
    options = CalibrationOptions(
        norm=norm,
        neg_noise=neg_noise,
        temperature=temperature,
        dwc=dwc,
        dwc_ridge=dwc_ridge,
        grow_tokens=grow_tokens,
        magnitude=magnitude,
        magnitude_ridge=magnitude_ridge,
        magnitude_rounds=magnitude_rounds,
        inputs=inputs,
    )
    return run_calibration(model, batches, options, captures)


@torch.no_grad()
def run_calibration(
    model: nn.Module,
    batches: Iterable,
    options: CalibrationOptions,
    captures: dict[str, LayerCapture] | None = None,
) -> CalibrationReport:
    """`calibrate` with its keywords bundled: capture, calibrate every layer the target calibrates, grow."""
    if get_patch_state(model) is None:
        raise PatchError("model is not patched by vca_patch; call vca_patch.patch_model(model) first")
    batches = _checked_batches(batches)
    images: list[torch.Tensor] = []
    if options.inputs == "converted":
        batches = list(batches)
        images = _model_images(model, batches)
    if captures is None:
        captures = capture_original_layers(model, batches)
    was_training = model.training
    model.eval()
    try:
        report = _calibrate_layers(model, captures, images, options)
        if options.grow_tokens is not None:
            _grow_tokens(model, report, captures, options)
    finally:
        model.train(was_training)
    return report


def _checked_batches(batches: Iterable) -> Iterator:
    """`batches`, each checked before the model sees it: images found, not empty, finite; a DatasetError (one line,
    before any torch error) for an empty batch, NaN/infinite values, or no batch at all."""
    from vca_patch.data.errors import DatasetError

    if isinstance(batches, torch.Tensor):
        raise DatasetError("calibrate takes an iterable of batches (e.g. a DataLoader, or [images]), not one tensor")
    count = 0
    for batch in batches:
        try:
            images = batch_images(batch)
        except (TypeError, ValueError) as exc:
            raise DatasetError(f"calibration batch {count}: {exc}") from exc
        if images.numel() == 0:
            raise DatasetError(f"calibration batch {count} is empty (shape {tuple(images.shape)}); give images")
        if images.is_floating_point() and not bool(torch.isfinite(images).all()):
            raise DatasetError(
                f"calibration batch {count} holds NaN or infinite values; check the images and their normalisation"
            )
        count += 1
        yield batch
    if count == 0:
        raise DatasetError("calibrate got no batches: the calibration data is empty (give at least one image)")


def _model_images(model: nn.Module, batches: list) -> list[torch.Tensor]:
    """The batches' images on the model's device (floating ones in its dtype), for whole converted forwards."""
    device, dtype = model_placement(model)
    return [(lambda x: x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device))(
        batch_images(b)) for b in batches]  # fmt: skip


def _calibrate_layers(
    model: nn.Module, captures: dict[str, LayerCapture], images: list[torch.Tensor], options: CalibrationOptions
) -> CalibrationReport:
    """Every captured patched layer the target calibrates, in block order; the others keep their init."""
    config = get_patch_state(model).config
    layers: list[LayerCalibration] = []
    steps = ["init"]
    for path, module in patched_modules(model).items():
        if path in captures and config.calibrates(module):
            layers.append(_calibrate_layer(model, path, captures[path], images, options, steps))
    return CalibrationReport(layers, steps)


def _calibrate_layer(
    model: nn.Module,
    path: str,
    cap: LayerCapture,
    images: list[torch.Tensor],
    options: CalibrationOptions,
    steps: list[str],
) -> LayerCalibration:
    """One layer: its teacher, its inputs (teacher-forced or converted), the target's fit, measured per step."""
    state = get_patch_state(model)
    module = model.get_submodule(path)
    # Keep the tracker on this layer's layout too, for any call below that does not pass `layout=`.
    state.tracker.layout = cap.layout
    with original_attention(model):
        teacher, _ = projection_input(model.get_submodule(path), cap.inputs, None, proj=module.proj)
    if images:  # from here on the layer runs on the converted model's input, against the original's output
        cap = LayerCapture(_converted_inputs(model, path, images), cap.outputs, cap.layout)
    errors: dict[str, float] = {}

    def measure(step: str) -> None:
        errors[step] = _relative_error(attention_output(module(cap.inputs, layout=cap.layout)), cap.outputs)
        if step not in steps:
            steps.append(step)

    facts = state.config.calibrate_layer(module, cap, teacher, measure, **options.layer_options())
    return LayerCalibration(path, module.layer_index, facts["contrast_tokens"], errors, facts.get("temperature"))


def _grow_tokens(
    model: nn.Module, report: CalibrationReport, captures: dict[str, LayerCapture], options: CalibrationOptions
) -> None:
    """Rebuild the layers whose final error exceeds `grow_tokens` with the target's next token count and
    calibrate them again (teacher-forced, on the same captures); updates `report` in place."""
    config, layers, last = get_patch_state(model).config, report.layers, report.steps[-1]
    grow = {
        r.layer_index: config.grown_tokens(r.contrast_tokens, captures[r.path].layout.num_patches)
        for r in layers
        if r.errors[last] > options.grow_tokens
    }
    grow = {i: n for i, n in grow.items() if n != next(r.contrast_tokens for r in layers if r.layer_index == i)}
    if not grow:
        return
    regrown = _repatch_with_tokens(model, grow)
    again = dataclasses.replace(options, grow_tokens=None, inputs="original")
    sub = run_calibration(model, (), again, captures={p: captures[p] for p in regrown})
    by_path = {r.path: r for r in sub.layers}
    report.layers = [by_path.get(r.path, r) for r in layers]
    report.grown = grow


def _repatch_with_tokens(model: nn.Module, grow: dict[int, int]) -> list[str]:
    """Re-patch `model` with more tokens in the blocks of `grow` (the target's `with_more_tokens`); keep every
    other layer's state. Returns the paths of the rebuilt layers."""
    config = get_patch_state(model).config.with_more_tokens(grow)  # ConfigError where the target cannot grow
    kept = {path: module.state_dict() for path, module in patched_modules(model).items()}
    unpatch_model(model)
    patch_model(model, config)
    rebuilt = []
    for path, module in patched_modules(model).items():
        if module.layer_index in grow:
            rebuilt.append(path)
        else:
            module.load_state_dict(kept[path])
    return rebuilt
