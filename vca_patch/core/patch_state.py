"""Where a patched model keeps its patch record: one attribute, read by every layer that needs to know."""

from __future__ import annotations

from typing import Any

from torch import nn

STATE_ATTR = "vca_patch_state"


def get_patch_state(model: nn.Module) -> Any:
    """The `surgery.PatchState` kept on a patched model, or None (a plain attribute: no forward reads it)."""
    return model.__dict__.get(STATE_ATTR)
