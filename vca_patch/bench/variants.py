"""The models a benchmark compares: the original (fused SDPA), the original with explicit softmax, and
one patched copy per target, all with the same weights."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from vca_patch.bench.errors import BenchError
from vca_patch.bench.flops import model_shape
from vca_patch.checkpoint import load_base_model
from vca_patch.surgery import patch_model
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.handler import handler_for
from vca_patch.targets.protocols import PackedForm

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


def _build(model_name: str, model_args: dict[str, Any]) -> nn.Module:
    """Random weights; a model that takes no `dynamic_img_size` (not a timm ViT) is a BenchError."""
    try:
        return load_base_model(model_name, pretrained=False, model_args=model_args).eval()
    except TypeError as exc:
        if "dynamic_img_size" not in str(exc):
            raise
        raise BenchError(
            f"{model_name} is not a ViT-style timm model that bench can measure (it takes no dynamic image size); "
            "bench needs one with patch_embed and blocks, e.g. deit_small_patch16_224"
        ) from None


def build_variants(
    model_name: str,
    targets: list[TargetConfig],
    *,
    model_args: dict[str, Any] | None = None,
    unfused: bool = True,
) -> list[Variant]:
    """Random-weight `model_name` (dynamic image size) as original, unfused original and patched copies.
    BenchError for a depth below 1 or a model that is not a ViT-style timm model."""
    depth = (model_args or {}).get("depth")
    if depth is not None and depth < 1:
        raise BenchError(f"depth must be at least 1 block, got {depth}")
    model_args = {"dynamic_img_size": True, **(model_args or {})}
    with fused_attention(True):
        original = _build(model_name, model_args)
    model_shape(original)  # a ViT-style model, or BenchError now rather than in the sweep
    variants = [Variant(ORIGINAL, original, "softmax")]
    if unfused:
        with fused_attention(False):
            explicit = _build(model_name, model_args)
        if not _uses_unfused(explicit):
            raise RuntimeError(f"{model_name}: could not build its attention without fused SDPA")
        explicit.load_state_dict(original.state_dict())
        variants.append(Variant(UNFUSED, explicit, "softmax"))
    for config in targets:
        patched = copy.deepcopy(original)
        patch_model(patched, config)
        variants.append(Variant(config.target, patched.eval(), config.target, config))
        packed_form = _packed_copy(patched, config)  # a target with a packed form (DIDB: bits + XNOR kernel)
        if packed_form is not None:
            variants.append(Variant(f"{config.target}-packed", packed_form.eval(), config.target, config))
    return variants


def _packed_copy(patched: nn.Module, config: TargetConfig) -> nn.Module | None:
    """A copy held in the target's packed form (its handler's `pack`); None without one or when it does not
    apply."""
    handler = handler_for(config)
    if not isinstance(handler, PackedForm):
        return None
    try:
        return handler.pack(config, copy.deepcopy(patched))
    except ValueError:  # e.g. DIDB with real weights (weights=False): nothing to pack
        return None
