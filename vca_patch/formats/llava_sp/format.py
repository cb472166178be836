"""LLaVA-SP's checkpoint format, registered with `core.formats`: `vca_patch.push_to_hub` and
`vca_patch.from_pretrained` reach its folders through the registry, never by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.core.formats import CheckpointFormat, register_format
from vca_patch.formats.llava_sp.folder import load_spatial_tokens, save_spatial_tokens
from vca_patch.targets.llava_sp.card import render_card
from vca_patch.targets.llava_sp.io import CONFIG_FILE, read_spatial_tokens_config
from vca_patch.targets.llava_sp.model import SpatialTokensError, get_spatial_projector


def has_spatial_tokens(model: Any) -> bool:
    """True for a LLaVA model with spatial tokens; False for anything else (never raises)."""
    if not isinstance(model, nn.Module):
        return False
    try:
        return get_spatial_projector(model) is not None
    except SpatialTokensError:
        return False


def _save(model: nn.Module, folder: Path, metadata: dict[str, Any] | None) -> Path:
    return save_spatial_tokens(model, folder, metadata=metadata)


def _load(folder: Path, device: str | torch.device) -> nn.Module:
    """A LLaVA-SP folder as `from_pretrained` returns models: on `device`, in eval mode."""
    return load_spatial_tokens(folder).to(device).eval()


def _commit_message(meta: dict[str, Any]) -> str:
    config = meta["config"]
    return (
        f"Upload LLaVA-SP ({config['variant']}, {config['num_tokens']} spatial tokens, "
        f"+{meta['parameters']:,} parameters)"
    )


LLAVA_SP_FORMAT = register_format(
    CheckpointFormat(
        name="LLaVA-SP",
        marker=CONFIG_FILE,
        # save_spatial_tokens' model, spatial tokens, processor and tokenizer files, card: never pickles
        patterns=("*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "README.md"),
        owns=has_spatial_tokens,
        save=_save,
        read=read_spatial_tokens_config,
        load=_load,
        card=render_card,
        commit_message=_commit_message,
        push_options=("form", "base_weights", "base_state_dict", "model_args"),
    )
)
