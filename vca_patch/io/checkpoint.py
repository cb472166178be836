"""`save_pretrained` / `from_pretrained`: a folder with model.safetensors, config.json and README.md.

config.json stores how to rebuild the base model and re-apply the patch; loading rebuilds the
base architecture, patches it with the stored config, checks the per-layer map and loads weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .. import __version__
from ..adapters import adapter_by_name
from ..config import TargetConfig
from ..surgery import PatchError, get_patch_state, patch_model, patched_layers
from .atomic import atomic_write_text, staged_directory
from .model_card import render_model_card
from .weights import WeightsMismatchError, load_state_dict_checked

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"


class CheckpointError(ValueError):
    """A folder is not a loadable vca-patch checkpoint."""


def _on_meta(fn, *args):
    with torch.device("meta"):
        return fn(*args)


def _check_rebuildable(model: nn.Module, meta: dict[str, Any]) -> None:
    """Rebuild the checkpoint's architecture on the meta device; its state-dict layout must match."""
    state = get_patch_state(model)
    base = _on_meta(state.adapter.create_base, meta["base"])
    _on_meta(patch_model, base, TargetConfig.from_dict(meta["config"]))
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    rebuilt = {k: tuple(v.shape) for k, v in base.state_dict().items()}
    if ours != rebuilt:
        diff = sorted(set(ours.items()) ^ set(rebuilt.items()))[:6]
        raise PatchError(
            f"{meta['base']['architecture']} rebuilt from its name and model_args "
            f"{meta['base']['model_args']} does not match this model (differs at {diff}); pass "
            "model_args= with the keyword arguments the model was created with"
        )


def checkpoint_metadata(
    model: nn.Module, *, model_args: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config.json content for a patched model."""
    state = get_patch_state(model)
    if state is None:
        raise PatchError("model is not patched by vca_patch; call vca_patch.patch_model(model) first")
    base = state.adapter.describe_base(model)
    if model_args is not None:
        base["model_args"] = dict(model_args)
    return {
        "vca_patch_version": __version__,
        "format_version": FORMAT_VERSION,
        "adapter": state.adapter.name,
        "base": base,
        "config": state.config.to_dict(),
        "layers": patched_layers(model),
        "params": {"before": state.report.params_before, "after": state.report.params_after},
        "metadata": dict(metadata or {}),
    }


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    *,
    overwrite: bool = False,
    model_args: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a patched model to `directory` (model.safetensors, config.json, README.md), atomically.

    `model_args` are the keyword arguments the base model was created with, when they cannot be
    read back from the model; `metadata` (e.g. base_weights, probe metrics) goes into config.json
    and the model card.
    """
    meta = checkpoint_metadata(model, model_args=model_args, metadata=metadata)
    _check_rebuildable(model, meta)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    with staged_directory(Path(directory), overwrite=overwrite) as stage:
        save_file(tensors, str(stage / WEIGHTS_NAME), metadata={"format": "pt", "vca_patch": __version__})
        atomic_write_text(stage / CONFIG_NAME, json.dumps(meta, indent=2) + "\n")
        atomic_write_text(stage / CARD_NAME, render_model_card(meta))
    return Path(directory)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def read_checkpoint_config(directory: Path) -> dict[str, Any]:
    """config.json of a checkpoint folder, checked for completeness and version."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a folder")
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"{directory} is not a vca-patch checkpoint: missing {', '.join(missing)}")
    try:
        meta = json.loads((directory / CONFIG_NAME).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{directory / CONFIG_NAME} is not valid JSON: {exc}") from exc
    required = ("format_version", "adapter", "base", "config", "layers")
    absent = [key for key in required if key not in meta]
    if absent:
        raise CheckpointError(f"{directory / CONFIG_NAME} is not a vca-patch config: missing {', '.join(absent)}")
    if meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{directory} was written by vca-patch {meta.get('vca_patch_version', '?')} (format "
            f"{meta['format_version']}); this is vca-patch {__version__} (format {FORMAT_VERSION}): "
            f"upgrade with pip install -U 'vca-patch>={meta.get('vca_patch_version', '')}'"
        )
    return meta


def from_pretrained(directory: str | Path, *, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a converted model from a `save_pretrained` folder, in eval mode."""
    directory = Path(directory)
    meta = read_checkpoint_config(directory)
    adapter = adapter_by_name(meta["adapter"])
    model = adapter.create_base(meta["base"])
    patch_model(model, TargetConfig.from_dict(meta["config"]))
    if patched_layers(model) != meta["layers"]:
        raise CheckpointError(
            f"re-applying the stored patch gave layers {sorted(patched_layers(model))}, but the checkpoint "
            f"has {sorted(meta['layers'])}"
        )
    try:
        load_state_dict_checked(model, load_file(str(directory / WEIGHTS_NAME)), str(directory / WEIGHTS_NAME))
    except WeightsMismatchError as exc:
        raise CheckpointError(str(exc)) from exc
    return model.to(device).eval()
