"""Where a patched model keeps its patch record: one attribute, read by every layer that needs to know."""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.core.errors import PatchError

STATE_ATTR = "vca_patch_state"


def get_patch_state(model: nn.Module) -> Any:
    """The `surgery.PatchState` kept on a patched model, or None (a plain attribute: no forward reads it).

    Every API that takes a model reads this first, so anything but a module is refused here, in one line."""
    if not isinstance(model, nn.Module):
        raise PatchError(
            f"expected the model, a torch.nn.Module, but got {type(model).__name__} {_shown(model)}; build or load "
            "it first (e.g. timm.create_model(name) or vca_patch.from_pretrained(folder))"
        )
    return model.__dict__.get(STATE_ATTR)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
