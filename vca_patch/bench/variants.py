"""The models a benchmark compares: the original (fused SDPA), the original with explicit softmax, and
one patched copy per target, all with the same weights."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import TargetConfig
from ..io import load_base_model
from ..surgery import patch_model

ORIGINAL = "original"
UNFUSED = "original-unfused"


@dataclass
class Variant:
    """One model under test. `target` is "softmax" for the originals, else the config's target name."""

    name: str
    model: nn.Module
    target: str
    config: TargetConfig | None = None


@contextmanager
def fused_attention(enabled: bool):
    """timm reads `fused_attn` when a module is built: set it for the models built inside, then restore."""
    from timm.layers import config as timm_config

    previous = timm_config._USE_FUSED_ATTN
    timm_config.set_fused_attn(enabled)
    try:
        yield
    finally:
        timm_config._USE_FUSED_ATTN = previous


def _uses_unfused(model: nn.Module) -> bool:
    flags = [m.fused_attn for m in model.modules() if hasattr(m, "fused_attn")]
    return bool(flags) and not any(flags)


def build_variants(
    model_name: str,
    targets: list[TargetConfig],
    *,
    model_args: dict[str, Any] | None = None,
    unfused: bool = True,
) -> list[Variant]:
    """Random-weight `model_name` (dynamic image size) as original, unfused original and patched copies."""
    model_args = {"dynamic_img_size": True, **(model_args or {})}
    with fused_attention(True):
        original = load_base_model(model_name, pretrained=False, model_args=model_args).eval()
    variants = [Variant(ORIGINAL, original, "softmax")]
    if unfused:
        with fused_attention(False):
            explicit = load_base_model(model_name, pretrained=False, model_args=model_args).eval()
        if not _uses_unfused(explicit):
            raise RuntimeError(f"{model_name}: could not build its attention without fused SDPA")
        explicit.load_state_dict(original.state_dict())
        variants.append(Variant(UNFUSED, explicit, "softmax"))
    for config in targets:
        patched = copy.deepcopy(original)
        patch_model(patched, config)
        variants.append(Variant(config.target, patched.eval(), config.target, config))
    return variants
