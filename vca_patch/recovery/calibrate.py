"""Closed-form, training-free calibration of a freshly converted model on a few real batches: the driver.

The driver is target-agnostic: it captures the original model's per-layer inputs and outputs (`capture.py`),
computes each layer's teacher (the original attention's input to its output projection), and hands the layer to
its target's handler's `calibrate_layer` hook, which fits it in place and calls back `measure(step)` so that
every step's relative error of the layer's output is recorded. Targets without a closed-form calibration
(`calibrates(layer)` False: MANO, DIDB, ...) start from their own preserving init and are left alone. VCA's steps
(neg_noise, temperature, norm, dwc, magnitude, refit) are described in `vca_patch/targets/vca/calibrate.py`.

* ``inputs="converted"``: calibrate the layers in block order on the inputs the CONVERTED model (earlier layers
  already calibrated) feeds each layer, still against the original's output on the original's input (measured on
  real DINOv2 weights: worse than teacher-forced, CLS cosine 0.84 -> 0.73; kept for models where it may help).
* ``grow_tokens``: layers whose error stays above a threshold are rebuilt with more tokens (the target's
  `grown_tokens` / `with_more_tokens` hooks; VCA: its `layer_contrast_tokens`) and calibrated again.

Cost: the capture (one forward of the original model; each calibrated layer's teacher is recorded in it) and every
layer forward grow with the tokens; the per-step errors are measured on the first images up to `MEASURE_TOKENS`
tokens (the last step's on all images), so that reporting them stays cheap at high resolution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.core.model_io import model_input_size, model_placement
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
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.handler import handler_for

_pre_proj = projection_input  # the name tests and older callers use
MEASURE_TOKENS = 4096  # per-step errors are measured on the first images holding this many tokens (at least one)
Progress = Callable[[int, int, str], None]  # progress(layers done, layers in this pass, path of the layer done)


@dataclass
class LayerCalibration:
    """What calibration did to one layer and the relative error of its output after each step: every step's on
    the first images up to `MEASURE_TOKENS` tokens, the last step's on all calibration images."""

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
    """`calibrate`'s keywords: the driver's own (`grow_tokens`, `inputs`) and the target's per-layer ones
    (`layer`), which the patched target declares and validates (its handler's `calibration_settings`)."""

    grow_tokens: float | None = None
    inputs: str = "original"
    layer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.inputs not in ("original", "converted"):
            raise ConfigError(f"inputs must be 'original' or 'converted', got {self.inputs!r}")

    def layer_settings(self, config: TargetConfig) -> Any:
        """The target's validated calibration options for the layers of `config` (None where it declares none)."""
        return handler_for(config).calibration_settings(type(config), dict(self.layer))


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
    grow_tokens: float | None = None,
    inputs: str = "original",
    captures: dict[str, LayerCapture] | None = None,
    progress: Progress | None = None,
    **options: Any,
) -> CalibrationReport:
    """Calibrate a freshly patched model in place on `batches` (tensors, (images, labels) or dicts).

    `options` are the patched target's calibration options (`TargetConfig.calibration_options`, validated before
    any work; unknown keys are refused). VCA's (`targets/vca/calibrate.py:VCACalibration`, also for a merge plan's
    VCA blocks): norm ("rms", "lstsq" or None), neg_noise (std of e₋ relative to the pooled-query RMS; 0: off),
    temperature (search a per-head Stage-II temperature: True for DEFAULT_TEMPERATURES, or the candidates), dwc
    (least-squares fit of the depthwise conv), dwc_ridge, magnitude (fit the per-token output gain where the
    layers have one: VCA's ``token_magnitude=True``), magnitude_ridge (relative) and magnitude_rounds (> 1:
    norm, conv and gain refitted that many times in all, the "refit" step).
    grow_tokens: rebuild layers whose final relative error exceeds this with more tokens (the target's
    `grown_tokens`; re-patches those blocks, which are calibrated again).
    inputs: "original" (teacher-forced: each layer sees the original model's input) or "converted" (each layer
    sees what the converted model, its earlier layers calibrated, feeds it; one more partial forward per layer).
    captures: the original model's per-layer captures when already taken (`capture_original_layers`).
    progress: called after each calibrated layer as progress(done, total, path): layers done so far, layers to
    calibrate in this pass, the path of the layer just done (a `grow_tokens` pass counts its rebuilt layers anew).
    """
    settings = CalibrationOptions(grow_tokens=grow_tokens, inputs=inputs, layer=options)
    return run_calibration(model, batches, settings, captures, progress)


@torch.no_grad()
def run_calibration(
    model: nn.Module,
    batches: Iterable,
    options: CalibrationOptions,
    captures: dict[str, LayerCapture] | None = None,
    progress: Progress | None = None,
) -> CalibrationReport:
    """`calibrate` with its keywords bundled: capture, calibrate every layer the target calibrates, grow."""
    state = get_patch_state(model)
    if state is None:
        raise PatchError("model is not patched by vca_patch; call vca_patch.patch_model(model) first")
    settings = options.layer_settings(state.config)  # the target's options, refused before any work
    batches = _checked_batches(batches, _channels(model))
    images: list[torch.Tensor] = []
    if options.inputs == "converted":
        batches = list(batches)
        images = _model_images(model, batches)
    if captures is None:
        captures = capture_original_layers(model, batches, teachers=_calibrated_paths(model))
    was_training = model.training
    model.eval()
    try:
        report = _calibrate_layers(model, captures, images, settings, progress)
        if options.grow_tokens is not None:
            _grow_tokens(model, report, captures, options, progress)
    finally:
        model.train(was_training)
    return report


def _channels(model: nn.Module) -> int | None:
    """The image channels the model takes, None when it cannot tell."""
    try:
        return model_input_size(model)[0]
    except ValueError:
        return None


def _checked_batches(batches: Iterable, channels: int | None = None) -> Iterator:
    """`batches`, each checked before the model sees it: images found, not empty, finite, [B, C, H, W] with the
    model's `channels`; a DatasetError (one line, before any torch error) for a batch that is not, or no batch."""
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
        if channels is not None and (images.dim() != 4 or images.shape[1] != channels):
            raise DatasetError(
                f"calibration batch {count} has shape {tuple(images.shape)}, but the model takes images of shape "
                f"[batch, {channels}, height, width]; give images as the model takes them (its channels first)"
            )
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


def _calibrated_paths(model: nn.Module) -> list[str]:
    """The paths of the patched layers the target calibrates, in block order."""
    config = get_patch_state(model).config
    handler = handler_for(config)
    return [path for path, module in patched_modules(model).items() if handler.calibrates(config, module)]


def _calibrate_layers(
    model: nn.Module,
    captures: dict[str, LayerCapture],
    images: list[torch.Tensor],
    settings: Any,
    progress: Progress | None = None,
) -> CalibrationReport:
    """Every captured patched layer the target calibrates, in block order; the others keep their init."""
    paths = [path for path in _calibrated_paths(model) if path in captures]
    layers: list[LayerCalibration] = []
    steps = ["init"]
    for done, path in enumerate(paths, 1):
        layers.append(_calibrate_layer(model, path, captures[path], images, settings, steps))
        if progress is not None:
            progress(done, len(paths), path)
    return CalibrationReport(layers, steps)


def _first_images(cap: LayerCapture, tokens: int) -> LayerCapture:
    """`cap` cut to its first images holding about `tokens` tokens (at least one image): views, no copy."""
    count = max(1, tokens // max(1, cap.inputs.shape[1]))
    if count >= cap.inputs.shape[0]:
        return cap
    teacher = None if cap.teacher is None else cap.teacher[:count]
    return LayerCapture(cap.inputs[:count], cap.outputs[:count], cap.layout, teacher)


def _layer_error(module: nn.Module, cap: LayerCapture) -> float:
    """Relative error of the layer's output on `cap.inputs` against the original's."""
    return _relative_error(attention_output(module(cap.inputs, layout=cap.layout)), cap.outputs)


def _calibrate_layer(
    model: nn.Module,
    path: str,
    cap: LayerCapture,
    images: list[torch.Tensor],
    settings: Any,
    steps: list[str],
) -> LayerCalibration:
    """One layer: its teacher, its inputs (teacher-forced or converted), the target's fit, measured per step."""
    state = get_patch_state(model)
    module = model.get_submodule(path)
    # Keep the tracker on this layer's layout too, for any call below that does not pass `layout=`.
    state.tracker.layout = cap.layout
    teacher = cap.teacher
    if teacher is None:  # not recorded by the capture: run the original attention again
        with original_attention(model):
            teacher, _ = projection_input(model.get_submodule(path), cap.inputs, None, proj=module.proj)
    if images:  # from here on the layer runs on the converted model's input, against the original's output
        cap = LayerCapture(_converted_inputs(model, path, images), cap.outputs, cap.layout, teacher)
    errors: dict[str, float] = {}
    measured = _first_images(cap, MEASURE_TOKENS)
    last: list[str] = []  # the step measured last, measured again on every image at the end

    def measure(step: str) -> None:
        errors[step] = _layer_error(module, measured)
        last[:] = [step]
        if step not in steps:
            steps.append(step)

    facts = handler_for(state.config).calibrate_layer(state.config, module, cap, teacher, measure, settings)
    if measured is not cap and last:  # the final state, on every image
        errors[last[0]] = _layer_error(module, cap)
    return LayerCalibration(path, module.layer_index, facts["contrast_tokens"], errors, facts.get("temperature"))


def _grow_tokens(
    model: nn.Module,
    report: CalibrationReport,
    captures: dict[str, LayerCapture],
    options: CalibrationOptions,
    progress: Progress | None = None,
) -> None:
    """Rebuild the layers whose final error exceeds `grow_tokens` with the target's next token count and
    calibrate them again (teacher-forced, on the same captures); updates `report` in place."""
    config, layers, last = get_patch_state(model).config, report.layers, report.steps[-1]
    handler = handler_for(config)
    grow = {
        r.layer_index: handler.grown_tokens(config, r.contrast_tokens, captures[r.path].layout.num_patches)
        for r in layers
        if r.errors[last] > options.grow_tokens
    }
    grow = {i: n for i, n in grow.items() if n != next(r.contrast_tokens for r in layers if r.layer_index == i)}
    if not grow:
        return
    regrown = _repatch_with_tokens(model, grow)
    again = dataclasses.replace(options, grow_tokens=None, inputs="original")
    sub = run_calibration(model, (), again, captures={p: captures[p] for p in regrown}, progress=progress)
    by_path = {r.path: r for r in sub.layers}
    report.layers = [by_path.get(r.path, r) for r in layers]
    report.grown = grow


def _repatch_with_tokens(model: nn.Module, grow: dict[int, int]) -> list[str]:
    """Re-patch `model` with more tokens in the blocks of `grow` (the target's `with_more_tokens`); keep every
    other layer's state. Returns the paths of the rebuilt layers."""
    config = get_patch_state(model).config
    config = handler_for(config).with_more_tokens(config, grow)  # ConfigError where the target cannot grow
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
