"""LLaVA-SP (arXiv 2507.00505): visual spatial tokens in front of a LLaVA model's projected patch tokens.

Its saved folders (`save_spatial_tokens`, `load_spatial_tokens`, the `--to llava-sp` conversion) are a checkpoint
format that composes these tokens with surgery and loading, so they live a layer up, in `vca_patch.formats.llava_sp`.
"""

from vca_patch.targets.llava_sp.config import SpatialTokensConfig
from vca_patch.targets.llava_sp.io import read_spatial_tokens_config
from vca_patch.targets.llava_sp.layer import CroppingSpatialTokens, PoolingSpatialTokens, crop_windows
from vca_patch.targets.llava_sp.model import (
    SpatialTokensError,
    SpatialTokensReport,
    add_spatial_tokens,
    get_spatial_projector,
    image_token_count,
    remove_spatial_tokens,
)
from vca_patch.targets.llava_sp.plan import plan_spatial_tokens
from vca_patch.targets.llava_sp.projector import SpatialTokenProjector
from vca_patch.targets.llava_sp.train import apply_stage2_lora, caption_batch, stage1_parameters, stage2_param_groups

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
    "plan_spatial_tokens",
    "read_spatial_tokens_config",
    "remove_spatial_tokens",
    "stage1_parameters",
    "stage2_param_groups",
]
