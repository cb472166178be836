"""Add LLaVA-SP spatial tokens to a transformers 5.x LLaVA model, count its image tokens, and take them off again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vca_patch.core.errors import PatchError
from vca_patch.core.install import install_hint
from vca_patch.targets.llava_sp.config import SpatialTokensConfig
from vca_patch.targets.llava_sp.layer import CroppingSpatialTokens, PoolingSpatialTokens
from vca_patch.targets.llava_sp.projector import SpatialTokenProjector

ANYRES_TYPES = ("llava_next", "llava_next_video", "llava_onevision")


class SpatialTokensError(PatchError):
    """The model cannot take (or does not have) spatial tokens; the message says why."""


@dataclass(frozen=True)
class SpatialTokensReport:
    """What add_spatial_tokens did."""

    variant: str
    num_tokens: int
    grid: int
    added_parameters: int
    image_tokens_before: int
    image_tokens_after: int

    def __str__(self) -> str:
        return (
            f"LLaVA-SP ({self.variant}): {self.num_tokens} spatial tokens from the {self.grid}×{self.grid} patch "
            f"grid, +{self.added_parameters:,} parameters; image tokens per image "
            f"{self.image_tokens_before} -> {self.image_tokens_after}"
        )


def llava_core(model: nn.Module) -> nn.Module:
    """The `LlavaModel` inside `model` (itself, a LlavaForConditionalGeneration's `.model`, or under a PEFT
    wrapper), refusing, with the reason, the models whose image features cannot take extra tokens."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in ANYRES_TYPES or hasattr(config, "image_grid_pinpoints"):
        raise SpatialTokensError(
            f"{type(model).__name__} ({model_type}) tiles images at any resolution: its image features are split "
            "and unpadded per tile by patch count (image_sizes), which extra tokens would break. Spatial tokens "
            "serve single-resolution LLaVA-1.5-style models (LlavaForConditionalGeneration)."
        )
    try:
        from transformers.models.llava.modeling_llava import LlavaModel
    except ImportError:
        raise SpatialTokensError(f"spatial tokens need transformers: {install_hint('hf')}") from None
    for module in model.modules():
        if isinstance(module, LlavaModel):
            return module
    raise SpatialTokensError(
        f"{type(model).__name__} is not a transformers LLaVA model (no LlavaModel inside); spatial tokens wrap "
        "the `multi_modal_projector` of LlavaForConditionalGeneration / LlavaModel"
    )


def get_spatial_projector(model: nn.Module) -> SpatialTokenProjector | None:
    """The model's spatial-token projector, or None if it has none."""
    projector = llava_core(model).multi_modal_projector
    return projector if isinstance(projector, SpatialTokenProjector) else None


def _grid(core: nn.Module) -> int:
    vision = core.config.vision_config
    image_size, patch_size = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if not isinstance(image_size, int) or not isinstance(patch_size, int) or image_size < patch_size:
        raise SpatialTokensError(
            f"the vision tower's config gives image_size={image_size!r}, patch_size={patch_size!r}; spatial tokens "
            "need a square patch grid (integer image_size // patch_size)"
        )
    return image_size // patch_size


def _tower_has_cls(core: nn.Module) -> bool:
    return any(name.endswith("class_embedding") for name, _ in core.vision_tower.named_parameters())


def _feature_prefix(core: nn.Module) -> int:
    """Non-patch tokens in front of the patches in what the projector receives (CLS under "full")."""
    strategy = core.config.vision_feature_select_strategy
    has_cls = _tower_has_cls(core)
    if strategy == "default":
        if not has_cls:
            raise SpatialTokensError(
                'vision_feature_select_strategy="default" drops the first token, but this vision tower has no CLS '
                "token, so a patch would be lost and the patch grid broken; use a CLS tower or 'full'"
            )
        return 0
    if strategy == "full":
        return 1 if has_cls else 0
    raise SpatialTokensError(f"unknown vision_feature_select_strategy {strategy!r}")


def _check_projector(projector: nn.Module) -> None:
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    if isinstance(projector, SpatialTokenProjector):
        raise SpatialTokensError("the model already has spatial tokens; remove_spatial_tokens first")
    if not isinstance(projector, LlavaMultiModalProjector):
        raise SpatialTokensError(
            f"unknown projector {type(projector).__name__}: spatial tokens wrap transformers' "
            "LlavaMultiModalProjector (linear_1 → act → linear_2) and read its input and output widths"
        )
    own = [n for n, _ in projector.named_parameters(recurse=False)] + [
        n for n, _ in projector.named_buffers(recurse=False)
    ]
    if own:
        raise SpatialTokensError(f"the projector holds tensors outside its submodules ({own}); cannot keep names")


def _build(config: SpatialTokensConfig, in_channels: int, out_dim: int, grid: int) -> nn.Module:
    hidden = config.hidden_dim or max(1, in_channels // 2)
    sizes = config.view_sizes(grid)
    if config.variant == "pooling":
        return PoolingSpatialTokens(in_channels, hidden, out_dim, grid, sizes)
    kernel, stride = config.detail_geometry(grid)
    return CroppingSpatialTokens(in_channels, hidden, out_dim, grid, sizes, kernel, stride)


def _check_prompt(core: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook on the LlavaModel: a prompt with the wrong <image> count fails with the reason."""
    input_ids, pixel_values = kwargs.get("input_ids"), kwargs.get("pixel_values")
    if input_ids is None and args:
        input_ids = args[0]
    encoded = (kwargs.get("mm_encoder_outputs") or {}).get("image")  # generate() encodes images beforehand
    if isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == 4:
        images = pixel_values.shape[0]
    elif isinstance(getattr(encoded, "pooler_output", None), (list, tuple)):
        images = len(encoded.pooler_output)
    else:
        return
    if input_ids is None:
        return
    projector = core.multi_modal_projector
    if not isinstance(projector, SpatialTokenProjector):
        return
    per_image = projector.num_prefix_tokens + projector.grid**2 + projector.num_tokens
    found = int((input_ids == core.config.image_token_id).sum())
    if found != per_image * images:
        raise SpatialTokensError(
            f"the prompt has {found} <image> tokens for {images} image(s), but with spatial tokens "
            f"each image needs {per_image} ({per_image - projector.num_tokens} patch + {projector.num_tokens} "
            "spatial tokens); update the processor with vca_patch.image_token_count(model, processor)"
        )


def add_spatial_tokens(model: nn.Module, config: SpatialTokensConfig | None = None) -> SpatialTokensReport:
    """Wrap the LLaVA model's projector in place so each image gives [num_tokens spatial tokens; patch tokens].

    The original projector keeps its parameters and state-dict names; the new modules (seeded by config.seed,
    on the projector's device and dtype) live under `multi_modal_projector.spatial_tokens.`. The model's
    `config.image_seq_length` is raised by num_tokens; prompts need that many more image tokens: see
    `image_token_count(model, processor)`.
    """
    config = config or SpatialTokensConfig()
    core = llava_core(model)
    projector = core.multi_modal_projector
    _check_projector(projector)
    grid, prefix = _grid(core), _feature_prefix(core)
    before = image_token_count(model)
    weight = projector.linear_1.weight
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        spatial = _build(config, projector.linear_1.in_features, projector.linear_2.out_features, grid)
    spatial = spatial.to(device=weight.device, dtype=weight.dtype)
    base_length = getattr(core.config, "image_seq_length", None)
    core.multi_modal_projector = SpatialTokenProjector(
        projector, spatial, config, grid=grid, num_prefix_tokens=prefix, base_image_seq_length=base_length
    )
    core.multi_modal_projector.__dict__["prompt_check"] = core.register_forward_pre_hook(
        _check_prompt, with_kwargs=True
    )
    after = image_token_count(model)
    if base_length is not None:
        core.config.image_seq_length = after
    return SpatialTokensReport(
        variant=config.variant,
        num_tokens=config.num_tokens,
        grid=grid,
        added_parameters=sum(p.numel() for p in spatial.parameters()),
        image_tokens_before=before,
        image_tokens_after=after,
    )


def remove_spatial_tokens(model: nn.Module) -> nn.Module:
    """Put the original projector back (the same module objects: outputs are bit-identical to before)."""
    core = llava_core(model)
    projector = core.multi_modal_projector
    if not isinstance(projector, SpatialTokenProjector):
        raise SpatialTokensError("the model has no spatial tokens to remove")
    core.multi_modal_projector = projector.original
    projector.__dict__.pop("prompt_check").remove()
    if projector.base_image_seq_length is not None:
        core.config.image_seq_length = projector.base_image_seq_length
    return model


def image_token_count(model: nn.Module, processor: Any = None) -> int:
    """<image> tokens one image needs in a prompt for `model` as it is now (with or without spatial tokens).

    With a `LlavaProcessor`, also sets its `num_additional_image_tokens` so it expands <image> to that count
    (idempotent; call it again after remove_spatial_tokens).
    """
    core = llava_core(model)
    grid = _grid(core)
    projector = core.multi_modal_projector
    if isinstance(projector, SpatialTokenProjector):
        count = projector.num_prefix_tokens + grid * grid + projector.num_tokens
    else:
        count = _feature_prefix(core) + grid * grid
    if processor is not None:
        if not hasattr(processor, "num_additional_image_tokens"):
            raise SpatialTokensError(
                f"{type(processor).__name__} has no num_additional_image_tokens; pass a transformers LlavaProcessor"
            )
        if getattr(processor, "patch_size", None) is None:
            processor.patch_size = core.config.vision_config.patch_size
        dropped = 1 if getattr(processor, "vision_feature_select_strategy", None) == "default" else 0
        processor.num_additional_image_tokens = count - grid * grid + dropped
    return count
