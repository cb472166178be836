"""LLaVA-SP (arXiv 2507.00505): visual spatial tokens in front of a LLaVA model's projected patch tokens."""

from .config import SpatialTokensConfig
from .io import load_spatial_tokens, read_spatial_tokens_config, save_spatial_tokens
from .layer import CroppingSpatialTokens, PoolingSpatialTokens, crop_windows
from .model import (
    SpatialTokensError,
    SpatialTokensReport,
    add_spatial_tokens,
    get_spatial_projector,
    image_token_count,
    remove_spatial_tokens,
)
from .plan import plan_spatial_tokens
from .projector import SpatialTokenProjector
from .train import apply_stage2_lora, caption_batch, stage1_parameters, stage2_param_groups

__all__ = [
    "CroppingSpatialTokens",
    "PoolingSpatialTokens",
    "SpatialTokenProjector",
    "SpatialTokensConfig",
    "SpatialTokensError",
    "SpatialTokensReport",
    "add_spatial_tokens",
    "apply_stage2_lora",
    "caption_batch",
    "crop_windows",
    "get_spatial_projector",
    "image_token_count",
    "load_spatial_tokens",
    "plan_spatial_tokens",
    "read_spatial_tokens_config",
    "remove_spatial_tokens",
    "save_spatial_tokens",
    "stage1_parameters",
    "stage2_param_groups",
]
