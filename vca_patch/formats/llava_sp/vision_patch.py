"""A VCA/MANO patch of a LLaVA's vision tower, carried through save_spatial_tokens / load_spatial_tokens.

transformers' `from_pretrained` rebuilds the plain attention modules and drops the replacement layers' new
tensors (λ, contrast embeddings, ...) as unexpected keys; so the patch is recorded in spatial_tokens.json
(where it was applied, its target config, the per-layer map), those tensors go to vision_patch.safetensors
(model keys), and on load the patch is re-applied around the carried weights and they are read back, strictly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from vca_patch.surgery import get_patch_state, patch_model, patched_layers
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.handler import handler_for
from vca_patch.targets.llava_sp.model import SpatialTokensError


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def vision_patch_records(model: nn.Module) -> list[dict[str, Any]]:
    """One record per vca_patch-patched module inside `model` (the model itself or its vision tower)."""
    records = []
    for path, module in model.named_modules():
        state = get_patch_state(module)
        if state is not None:
            records.append(
                {
                    "path": path,
                    "config": handler_for(state.config).as_built(state.config, module).to_dict(),
                    "layers": _json(patched_layers(module)),
                }
            )
    return records


def new_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The patched layers' own tensors (not the carried q/k/v/proj, which keep their names), by model key."""
    out: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        state = get_patch_state(module)
        if state is None:
            continue
        for layer_path in patched_layers(module):
            original = state.originals.get(layer_path)
            carried = set(original.state_dict()) if isinstance(original, nn.Module) else set()
            prefix = ".".join(p for p in (path, layer_path) if p)
            for key, value in module.get_submodule(layer_path).state_dict().items():
                if key not in carried:
                    out[f"{prefix}.{key}"] = value.detach().contiguous()
    return out


def reapply_vision_patch(model: nn.Module, records: list[dict[str, Any]], weights_file: Path) -> None:
    """Patch `model` as `records` say, then load the patched layers' own tensors from `weights_file` (written
    from `new_tensors` at save). Raises SpatialTokensError naming what does not fit."""
    where = weights_file.parent
    if not isinstance(records, list):
        raise SpatialTokensError(f"{where}: vision_patch in spatial_tokens.json must be a list, got {records!r}")
    for record in records:
        path = record.get("path") if isinstance(record, dict) else None
        if not isinstance(path, str) or not isinstance(record.get("config"), dict):
            raise SpatialTokensError(f"{where}: a vision_patch record lacks its module path or config: {record!r}")
        try:
            root = model.get_submodule(path)
        except AttributeError:
            raise SpatialTokensError(f"{where}: the saved patch names a module {path!r} the model lacks") from None
        patch_model(root, TargetConfig.from_dict(record["config"]))
        layers = _json(patched_layers(root))
        if layers != record.get("layers"):
            raise SpatialTokensError(
                f"{where}: re-applying the saved {record['config'].get('target')} patch to {path or 'the model'} "
                f"gave layers {sorted(layers)}, but the checkpoint has {sorted(record.get('layers') or [])}"
            )
    if not records:
        return
    if not weights_file.is_file():
        raise SpatialTokensError(
            f"{where}: spatial_tokens.json records a vision-tower patch but {weights_file.name} is missing"
        )
    state = load_file(str(weights_file))
    expected = new_tensors(model)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        raise SpatialTokensError(
            f"{weights_file} does not fit the re-patched vision tower: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, shape mismatches {shapes[:4]}"
        )
    model.load_state_dict(state, strict=False)
