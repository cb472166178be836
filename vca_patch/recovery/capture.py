"""Teacher side of recovery: run a patched model with its original attention, capture per-layer tensors."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from vca_patch.core.model_io import model_placement
from vca_patch.families.call_shims import attention_output, call_tokens
from vca_patch.layers.layout import TokenLayout
from vca_patch.surgery import PatchError, get_patch_state


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, module)


def patched_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> replacement module (VCA, MANO, ...) of a patched model, in block order."""
    state = get_patch_state(model)
    if state is None:
        raise PatchError("model is not patched by vca_patch; call vca_patch.patch_model(model) first")
    return {path: model.get_submodule(path) for path in state.originals}


@contextmanager
def original_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily put the original softmax attention modules back (they share q/k/v/proj with VCA)."""
    state = get_patch_state(model)
    if state is None:
        raise PatchError("model is not patched by vca_patch")
    patched = patched_modules(model)
    for path, original in state.originals.items():
        patched[path].restore_into(original)  # parameters replaced since patching (assign=True, ...)
        _set(model, path, original)
    try:
        yield model
    finally:
        for path, module in patched.items():
            _set(model, path, module)


@dataclass
class LayerCapture:
    """One attention layer under the original model: its input, output and token layout; `teacher`, where it was
    asked for, is the input of the layer's output projection in the same forward (what calibration fits against)."""

    inputs: torch.Tensor  # [B, N, C]
    outputs: torch.Tensor  # [B, N, C]
    layout: TokenLayout
    teacher: torch.Tensor | None = None  # [B, N, attn_dim]


def batch_images(batch) -> torch.Tensor:
    """The image tensor of a batch given as a tensor, an (images, labels) pair or a dict."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        for key in ("pixel_values", "image", "images", "x"):
            if key in batch:
                return batch[key]
        raise ValueError(f"batch dict has no image key (pixel_values/image/images/x): {sorted(batch)}")
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise TypeError(f"cannot find images in a batch of type {type(batch).__name__}")


def _run_batch(model: nn.Module, images: torch.Tensor, index: int) -> None:
    """The model on calibration batch `index`; a batch it cannot run (a size it does not take) is a DatasetError
    naming the batch's shape and the model's error, not a traceback from inside the model."""
    from vca_patch.data.errors import DatasetError

    try:
        model(images)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, AssertionError) as exc:  # e.g. timm's size assertion, a conv's shape error
        text = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__).rstrip(".")
        raise DatasetError(
            f"the model cannot run calibration batch {index} of shape {tuple(images.shape)}: {text}; give images of "
            "the size the model takes"
        ) from exc


def _teacher_hooks(projections: dict[str, nn.Module], teachers: dict[str, list[torch.Tensor]]) -> list:
    """Forward pre-hooks that record the input of each layer's output projection (shared by the original and the
    replacement layer) while the original attention runs."""
    return [
        proj.register_forward_pre_hook(lambda module, args, path=path: teachers[path].append(args[0].detach()))
        for path, proj in projections.items()
    ]


@torch.no_grad()
def capture_original_layers(
    model: nn.Module, batches: Iterable, device: torch.device | None = None, teachers: Iterable[str] = ()
) -> dict:
    """Inputs/outputs of every patched layer when the model runs with its original attention.

    Returns {path: LayerCapture}, tensors concatenated over batches (on `device`, default the model's). Images
    are moved there and cast to the model's parameter dtype. For the paths in `teachers` the input of the layer's
    output projection (`proj`, which the original shares) is recorded in the same forward, so that calibration
    need not run the original attention (quadratic in the tokens) a second time; it stays None where the layer
    has no such projection or the projection did not run once per layer call.
    """
    state = get_patch_state(model)
    patched = patched_modules(model)
    paths = list(patched)
    inputs: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    outputs: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    projections = {p: patched[p].proj for p in teachers if isinstance(getattr(patched[p], "proj", None), nn.Module)}
    recorded: dict[str, list[torch.Tensor]] = {p: [] for p in projections}
    layouts: dict[str, TokenLayout] = {}
    model_device, dtype = model_placement(model)
    device = device or model_device
    was_training = model.training
    model.eval()
    with original_attention(model):
        handles = _teacher_hooks(projections, recorded)
        for path in paths:

            def hook(module, args, kwargs, output, path=path):
                inputs[path].append(call_tokens(args, kwargs).detach())
                outputs[path].append(attention_output(output).detach())
                layouts[path] = state.tracker.current()

            handles.append(model.get_submodule(path).register_forward_hook(hook, with_kwargs=True))
        try:
            for index, batch in enumerate(batches):
                images = batch_images(batch)
                _run_batch(model, images.to(device=device, dtype=dtype) if images.is_floating_point() else images.to(
                    device), index)  # fmt: skip
        finally:
            for h in handles:
                h.remove()
    model.train(was_training)
    if not all(inputs.values()):
        raise ValueError("no calibration batches were given")
    return {p: LayerCapture(torch.cat(inputs[p]), torch.cat(outputs[p]), layouts[p], _teacher(recorded, inputs, p))
            for p in paths}  # fmt: skip


def _teacher(
    recorded: dict[str, list[torch.Tensor]], inputs: dict[str, list[torch.Tensor]], path: str
) -> torch.Tensor | None:
    """The recorded projection inputs of `path`, concatenated; None where none were asked for or they do not pair
    one to one with the layer's inputs (a projection called more or less often than the layer)."""
    seen = recorded.get(path)
    if not seen or len(seen) != len(inputs[path]):
        return None
    if any(t.shape[:-1] != x.shape[:-1] for t, x in zip(seen, inputs[path], strict=True)):
        return None
    return torch.cat(seen)
