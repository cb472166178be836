"""What every timm adapter records of its base model, and how it rebuilds it."""

from __future__ import annotations

from typing import Any

from torch import nn


def describe_timm_base(model: nn.Module, model_args: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe description of a timm model: its architecture, pretrained tag, Hub id, licence and `model_args`."""
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    return {
        "library": "timm",
        "architecture": cfg.get("architecture") or type(model).__name__,
        "pretrained_tag": cfg.get("tag"),
        "hf_hub_id": cfg.get("hf_hub_id"),
        "license": cfg.get("license"),
        "model_args": model_args,
    }


def create_timm_base(description: dict[str, Any]) -> nn.Module:
    """The unpatched timm architecture (random weights) that `describe_timm_base` described."""
    import timm

    name = description["architecture"]
    if description.get("pretrained_tag"):
        name = f"{name}.{description['pretrained_tag']}"
    return timm.create_model(name, pretrained=False, **description.get("model_args", {}))
